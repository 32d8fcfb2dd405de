"""Section 2: tokenization and admission against prompt length (in process and through the
gateway), refusing over-limit prompts, and whether a 1M-token prompt holds other requests up
(the gateway on every CPU for that part: tokenizing off the loop only helps with another core)."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import statistics
import threading
import time
from urllib.parse import urlsplit

import httpx
import orjson

from bench.processes import BenchModel, free_ports, pin, start_gateway, write_bench_policies
from bench.rig import DEEPSEEK_MODEL, INSTANT_GATEWAY_ENV, LONG_MODEL, MODEL, Rig
from bench.routing_bench import request_body
from bench.stream_client import Target, described, percentile, run_load
from gateway.dev.deepseek_model import ensure_deepseek_model
from gateway.dev.model import ensure_tiny_model
from gateway.openai.tokenize import ModelTokenizer

PARAGRAPH = (
    "The quick brown fox jumps over the lazy dog while the gateway counts every token exactly; "
    "prefill and decode pools hold what admission lets through, and nothing more. "
)
# The second gateway's body cap: a size a platform team might set (1M tokens of English text
# is about 4.5 MB of JSON).
CAPPED_BODY_BYTES = 8 * 1024 * 1024


def text_of_tokens(tokenizer: ModelTokenizer, tokens: int) -> str:
    """Text that encodes to about ``tokens`` tokens (calibrated on the paragraph)."""
    per_paragraph = len(tokenizer._tokenizer.encode(PARAGRAPH * 8, add_special_tokens=False).ids)
    return PARAGRAPH * max(1, round(tokens * 8 / per_paragraph))


def raw_post(url: str, body: bytes, headers: dict[str, str]) -> tuple[float, int, bytes]:
    """POST ``body`` over a plain socket (httpx took 180-200 ms more to upload 50 MB): ms from the
    first byte sent to the whole answer, the status and the body. Head and body in two ``sendall``
    calls (no 50 MB copy), a new keep-alive connection (uvicorn closes a ``Connection: close``
    request's socket once answered, body read or not)."""
    parts = urlsplit(url)
    fields = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    request_head = (
        f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Length: {len(body)}\r\n"
        f"{fields}\r\n"
    ).encode("latin-1")
    with socket.create_connection((parts.hostname, parts.port), timeout=300) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        started = time.perf_counter()
        sock.sendall(request_head)
        sock.sendall(body)
        answer = b""
        while b"\r\n\r\n" not in answer:
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("the server closed the connection before answering")
            answer += data
        answer_head, _, answer_body = answer.partition(b"\r\n\r\n")
        length = re.search(rb"(?im)^content-length:\s*(\d+)", answer_head)
        while length and len(answer_body) < int(length[1]) and (data := sock.recv(65536)):
            answer_body += data
        elapsed_ms = (time.perf_counter() - started) * 1000
    return elapsed_ms, int(answer_head.split(b" ", 2)[1]), answer_body


def _gateway_post(gateway_url: str, key: str, body: bytes) -> tuple[float, int, str | None]:
    """``raw_post`` to a gateway's completions: milliseconds, status and the error's code."""
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    ms, status, answer = raw_post(gateway_url + "/v1/completions", body, headers)
    try:
        code = orjson.loads(answer).get("error", {}).get("code") if status != 200 else None
    except (orjson.JSONDecodeError, AttributeError):
        code = None
    return ms, status, code


def _httpx_post(client: httpx.Client, rig: Rig, body: bytes) -> tuple[float, int, str | None]:
    """Through httpx (one keep-alive client with TCP_NODELAY: httpx writes head and body apart,
    and without it a small body waits ~40 ms for the server's delayed ACK)."""
    headers = {"Authorization": f"Bearer {rig.gateway_key}", "Content-Type": "application/json"}
    started = time.perf_counter()
    response = client.post(rig.gateway_url + "/v1/completions", content=body, headers=headers)
    code = response.json().get("error", {}).get("code") if response.status_code != 200 else None
    return (time.perf_counter() - started) * 1000, response.status_code, code


def _client() -> httpx.Client:
    options = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
    return httpx.Client(timeout=300, transport=httpx.HTTPTransport(socket_options=options))


def tokenize_rows(rig: Rig, log=print) -> list[dict]:
    tokenizer = ModelTokenizer(ensure_tiny_model())
    client = _client()
    rows = []
    for target in rig.config.prompt_tokens:
        text = text_of_tokens(tokenizer, target)
        repeats = 3 if target <= 100_000 else 1
        encode_ms = []
        for _ in range(repeats):
            started = time.perf_counter()
            ids = tokenizer._tokenizer.encode(text, add_special_tokens=True).ids
            encode_ms.append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        for _ in range(1000):
            bound = tokenizer.min_tokens_for_bytes(len(text.encode("utf-8")))
            _ = bound > 4_194_304 or len(ids) > 4_194_304
        admission_us = (time.perf_counter() - started) * 1000  # per call, in µs (1000 calls)
        body = orjson.dumps({"model": LONG_MODEL, "prompt": text, "max_tokens": 4})
        http = [_httpx_post(client, rig, body) for _ in range(repeats)]
        # encode: ModelTokenizer's, synchronous; admission: byte-length bound + limit comparison;
        # http: admitted and served.
        row = {
            "tokens": len(ids), "megabytes": len(text) / 1e6, "encode_ms": min(encode_ms),
            "admission_us": admission_us, "http_ms": statistics.median(ms for ms, _, _ in http),
            "http_status": http[-1][1],
        }  # fmt: skip
        rows.append(row)
        log("  " + described(row))
    client.close()
    return rows


def _over_limit_body(megabytes: int) -> bytes:
    prompt = (PARAGRAPH * (megabytes * 1_000_000 // len(PARAGRAPH) + 1))[: megabytes * 1_000_000]
    return orjson.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4})


def _refused(gateway_url: str, key: str, megabytes: int, repeats: int) -> dict:
    """An over-limit prompt POSTed ``repeats`` times: the times, the last status and code."""
    body = _over_limit_body(megabytes)
    answers = [_gateway_post(gateway_url, key, body) for _ in range(repeats)]
    times = [ms for ms, _, _ in answers]
    _, status, code = answers[-1]
    return {
        "megabytes": megabytes, "status": status, "code": code,
        "p50_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
    }  # fmt: skip


def refusal_rows(rig: Rig, log=print) -> list[dict]:
    rows = []
    repeats = rig.config.refusal_repeats
    for megabytes in rig.config.refusal_megabytes:
        row = _refused(rig.gateway_url, rig.gateway_key, megabytes, repeats)
        body, json_type = _over_limit_body(megabytes), {"Content-Type": "application/json"}
        floor = [
            raw_post(rig.direct_url + "/v1/completions", body, json_type)[0] for _ in range(repeats)
        ]
        row["floor_p50_ms"] = statistics.median(floor)
        rows.append(row)
        log("  refused: " + described(row))
    return rows


def capped_refusal(rig: Rig, megabytes: int = 50, log=print) -> dict:
    """The over-limit prompt to a second gateway with ``ISOGATE_MAX_BODY_BYTES``: 413 from the
    declared Content-Length, before reading the body (the default has no cap below 64 MiB)."""
    # Its own policies, the model alone: the rig's also name the slow backend, stopped by now.
    policies = write_bench_policies(
        rig.work_dir / "policies-capped",
        tokenizer_dir=ensure_tiny_model(),
        models=[BenchModel(MODEL, 65_536, rig.pool)],
    )
    config = rig.config
    gateway, key = start_gateway(
        policies, rig.work_dir / "gateway-capped", free_ports(config.ports.gateway + 20),
        cpus=config.router_cpus, priority=config.priority, root=config.gateway_root,
        env={**INSTANT_GATEWAY_ENV, "ISOGATE_MAX_BODY_BYTES": str(CAPPED_BODY_BYTES)},
    )  # fmt: skip
    try:
        row = _refused(gateway.url, key, megabytes, rig.config.refusal_repeats)
    finally:
        gateway.stop()
    log(f"  refused with a {CAPPED_BODY_BYTES} bytes body cap: " + described(row))
    return row


def blocking(rig: Rig, model: str, tokenizer: ModelTokenizer, log=print) -> dict:
    """Small requests before and while a 1M-token prompt of ``model`` is in flight."""
    big_text = text_of_tokens(tokenizer, 1_000_000)
    counted = len(tokenizer._tokenizer.encode(big_text, add_special_tokens=False).ids)
    big_body = orjson.dumps({"model": model, "prompt": big_text, "max_tokens": 4})
    auth = (("Authorization", f"Bearer {rig.gateway_key}"),)
    small = Target(rig.gateway_url + "/v1/completions", request_body(False), auth)
    baseline = asyncio.run(run_load(small, concurrency=1, duration_s=1.5, warmup_requests=3))
    big: list[tuple[float, int, str | None]] = []

    def send_big() -> None:
        with _client() as client:
            big.append(_httpx_post(client, rig, big_body))

    async def small_while_big() -> list[float]:
        latencies: list[float] = []
        thread = threading.Thread(target=send_big)
        thread.start()
        while thread.is_alive():
            result = await run_load(small, concurrency=1, total_requests=1)
            latencies += [s.total_s * 1000 for s in result.ok()]
        thread.join()
        return latencies

    during = sorted(asyncio.run(small_while_big()))
    base = sorted(s.total_s * 1000 for s in baseline.ok())
    (big_ms, big_status, big_code), *_ = big
    result = {  # big_tokens: counted here with the model's tokenizer
        "big_tokens": counted, "big_ms": big_ms, "big_status": big_status, "big_code": big_code,
        "baseline_p50_ms": percentile(base, 0.5), "baseline_p99_ms": percentile(base, 0.99),
        "during_requests": len(during), "during_p50_ms": percentile(during, 0.5),
        "during_p99_ms": percentile(during, 0.99), "during_max_ms": max(during, default=0.0),
    }  # fmt: skip
    log(f"  {model}: {described(result)}")
    return result


def run_prompt_bench(rig: Rig, log=print) -> dict:
    log(" tokenization and admission vs prompt length")
    tokenize = tokenize_rows(rig, log)
    log(" refusing over-limit prompts (HTTP, end to end)")
    refusals = refusal_rows(rig, log)
    capped = capped_refusal(rig, log=log)
    log(" does tokenizing 1M tokens block other requests? (gateway on every CPU for this part)")
    pin(rig.gateway_pid, set(range(os.cpu_count() or 1)))
    try:
        block = blocking(rig, LONG_MODEL, ModelTokenizer(ensure_tiny_model()), log)
        log(" refusing a 1M-token prompt of DeepSeek-V4's tokenizer (limit 681,280 tokens)")
        deepseek = ModelTokenizer(ensure_deepseek_model())
        refuse_real = blocking(rig, DEEPSEEK_MODEL, deepseek, log)
    finally:
        pin(rig.gateway_pid, rig.config.router_cpus)
    return {
        "tokenize": tokenize, "refusal": refusals, "refusal_capped": capped,
        "capped_body_bytes": CAPPED_BODY_BYTES, "blocking": block,
        "refusal_real_tokenizer": refuse_real,
    }  # fmt: skip
