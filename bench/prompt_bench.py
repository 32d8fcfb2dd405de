"""Section 2: tokenization and admission against prompt length, refusing over-limit prompts,
and whether tokenizing a 1M-token prompt blocks other requests.

- In process: ``ModelTokenizer`` of the tiny model, the encode the gateway runs (sync, as in
  its thread) and the admission arithmetic (byte-length lower bound, limit).
- Through the running gateway (HTTP, end to end): a prompt of N tokens admitted and served
  by the instant backend (model ``tiny-llama-long``, policy limit 4M tokens), and an
  over-limit prompt of 1 to 50 MB refused (model ``tiny-llama``, 65,536 tokens): the gateway
  refuses it from its byte length, before tokenizing.
- Blocking: small requests, one in flight, before and while one 1M-token prompt is being
  tokenized and served. For this part the gateway may use every CPU (tokenizing off the
  event loop only helps when there is another core to run on).
- Refusal on a real tokenizer: a 1,000,000-token prompt of DeepSeek-V4's tokenizer (model
  ``deepseek-v4-tiny``, limit 681,280 tokens, the incident's prefill pool). Its bytes alone do
  not prove it too long, so the gateway tokenizes it whole before it refuses with 400
  ``context_length_exceeded``: the time to decide, and small requests beside it, as above.
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

import httpx
import orjson

from bench.processes import BenchModel, free_ports, pin, start_gateway, write_bench_policies
from bench.rig import DEEPSEEK_MODEL, INSTANT_GATEWAY_ENV, LONG_MODEL, MODEL, Rig
from bench.routing_bench import request_body
from bench.stream_client import Target, percentile, run_load
from gateway.dev.deepseek_model import ensure_deepseek_model
from gateway.dev.model import ensure_tiny_model
from gateway.openai.tokenize import ModelTokenizer

PARAGRAPH = (
    "The quick brown fox jumps over the lazy dog while the gateway counts every token exactly; "
    "prefill and decode pools hold what admission lets through, and nothing more. "
)


def text_of_tokens(tokenizer: ModelTokenizer, tokens: int) -> str:
    """Text that encodes to about ``tokens`` tokens (calibrated on the paragraph)."""
    per_paragraph = (
        len(tokenizer._tokenizer.encode(PARAGRAPH * 8, add_special_tokens=False).ids) / 8
    )
    return PARAGRAPH * max(1, round(tokens / per_paragraph))


def text_of_bytes(size: int) -> str:
    return (PARAGRAPH * (size // len(PARAGRAPH) + 1))[:size]


@dataclass
class TokenizeRow:
    target_tokens: int
    tokens: int
    megabytes: float
    encode_ms: float  # ModelTokenizer's encode, synchronous
    admission_us: float  # byte-length bound + limit comparison
    http_ms: float | None  # end to end through the gateway, admitted and served
    http_status: int | None


@dataclass
class RefusalRow:
    megabytes: int
    status: int
    code: str | None
    p50_ms: float
    min_ms: float
    max_ms: float
    floor_p50_ms: (
        float | None
    )  # the same body POSTed to the instant backend: loopback upload + JSON parse


@dataclass
class BlockingResult:
    big_tokens: int  # counted here with the model's tokenizer
    big_ms: float
    big_status: int
    big_code: str | None
    baseline_p50_ms: float
    baseline_p99_ms: float
    during_requests: int
    during_p50_ms: float
    during_p99_ms: float
    during_max_ms: float


def _client(timeout_s: float) -> httpx.Client:
    """httpx writes head and body separately: without TCP_NODELAY a small body waits ~40 ms
    for the server's delayed ACK (Nagle), which would be counted as the gateway's time."""
    transport = httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
    return httpx.Client(timeout=timeout_s, transport=transport)


def _post(client: httpx.Client, rig: Rig, body: bytes) -> tuple[float, httpx.Response]:
    started = time.perf_counter()
    response = client.post(
        rig.gateway_url + "/v1/completions",
        content=body,
        headers={"Authorization": f"Bearer {rig.gateway_key}", "Content-Type": "application/json"},
    )
    return (time.perf_counter() - started) * 1000, response


def raw_post(
    url: str, body: bytes, headers: dict[str, str], timeout_s: float = 120.0
) -> tuple[float, int, bytes]:
    """POST ``body`` over a plain socket: milliseconds from the first byte sent to the whole
    answer, the status and the answer's body.

    Why not httpx for big bodies: measured here, it took 180-200 ms more than ``sendall`` to
    upload 50 MB over loopback, so the client, not the server, set the time (the issue asks
    for a load generator that is not the bottleneck). Head and body go out in two
    ``sendall`` calls (no 50 MB copy), with TCP_NODELAY; a new connection per request, which
    asks for keep-alive as every HTTP/1.1 client does (uvicorn closes a ``Connection: close``
    request's socket as soon as it has answered, unread body or not).
    """
    parts = urlsplit(url)
    head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    request_head = (
        f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Length: {len(body)}\r\n"
        f"{head}\r\n"
    ).encode("latin-1")
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout_s) as sock:
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
        length = next(
            (
                int(line.split(b":", 1)[1])
                for line in answer_head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            ),
            None,
        )
        while length is not None and len(answer_body) < length:
            data = sock.recv(65536)
            if not data:
                break
            answer_body += data
        elapsed_ms = (time.perf_counter() - started) * 1000
    status = int(answer_head.split(b" ", 2)[1])
    return elapsed_ms, status, answer_body


def tokenize_rows(rig: Rig, log=print) -> list[TokenizeRow]:
    tokenizer = ModelTokenizer(ensure_tiny_model())
    rows = []
    with _client(300) as client:
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
            http = [_post(client, rig, body) for _ in range(repeats)]
            row = TokenizeRow(
                target,
                len(ids),
                len(text) / 1e6,
                min(encode_ms),
                admission_us,
                statistics.median(ms for ms, _ in http),
                http[-1][1].status_code,
            )
            rows.append(row)
            log(
                f"  {row.tokens:>9,} tokens ({row.megabytes:6.2f} MB): "
                f"encode {row.encode_ms:8.1f} ms  admission {row.admission_us:6.1f} us  "
                f"via gateway {row.http_ms:8.1f} ms (HTTP {row.http_status})"
            )
    return rows


def refusal_rows(rig: Rig, log=print) -> list[RefusalRow]:
    """Over-limit prompts of 1 to 50 MB, each POSTed ``refusal_repeats`` times with ``raw_post``
    to the gateway and to the instant backend (the floor: the same upload, one JSON parse)."""
    rows = []
    for megabytes in rig.config.refusal_megabytes:
        body = _over_limit_body(megabytes)
        row = _refused(
            rig.gateway_url, rig.gateway_key, megabytes, body, rig.config.refusal_repeats
        )
        floor = [
            raw_post(
                rig.direct_url + "/v1/completions", body, {"Content-Type": "application/json"}
            )[0]
            for _ in range(rig.config.refusal_repeats)
        ]
        row.floor_p50_ms = statistics.median(floor)
        rows.append(row)
        log(
            f"  refuse {megabytes:>3} MB: HTTP {row.status} {row.code}  p50 {row.p50_ms:7.1f} ms  "
            f"min {row.min_ms:7.1f} ms  max {row.max_ms:7.1f} ms  "
            f"(floor: upload + parse at the instant backend {row.floor_p50_ms:.1f} ms)"
        )
    return rows


def _over_limit_body(megabytes: int) -> bytes:
    return orjson.dumps(
        {"model": MODEL, "prompt": text_of_bytes(megabytes * 1_000_000), "max_tokens": 4}
    )


def _refused(gateway_url: str, key: str, megabytes: int, body: bytes, repeats: int) -> RefusalRow:
    """``body`` POSTed ``repeats`` times to a gateway: the times, the last status and code."""
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    times, status, answer = [], 0, b""
    for _ in range(repeats):
        ms, status, answer = raw_post(gateway_url + "/v1/completions", body, headers)
        times.append(ms)
    try:
        code = orjson.loads(answer).get("error", {}).get("code")
    except (orjson.JSONDecodeError, AttributeError):
        code = None
    return RefusalRow(
        megabytes, status, code, statistics.median(times), min(times), max(times), None
    )


# The body cap of the second gateway in ``capped_refusal``: a size a platform team might set
# (1M tokens of English text is about 4.5 MB of JSON).
CAPPED_BODY_BYTES = 8 * 1024 * 1024


def capped_refusal(rig: Rig, megabytes: int = 50, log=print) -> RefusalRow:
    """The same over-limit prompt sent to a second gateway started with
    ``ISOGATE_MAX_BODY_BYTES`` set: it answers 413 from the declared Content-Length, before
    reading the body, and uvicorn discards the upload. The default gateway has no such cap
    below 64 MiB, because a cap refuses bodies padded with anything, not only long prompts."""
    port = free_ports(rig.config.ports.gateway + 20)
    # Its own policies, the model alone: the rig's also name the slow backend, stopped by now.
    policies = write_bench_policies(
        rig.work_dir / "policies-capped",
        tokenizer_dir=ensure_tiny_model(),
        models=[BenchModel(MODEL, 65_536, rig.pool)],
    )
    gateway, key = start_gateway(
        policies,
        rig.work_dir / "gateway-capped",
        port,
        cpus=rig.config.router_cpus,
        priority=rig.config.priority,
        root=rig.config.gateway_root,
        env={**INSTANT_GATEWAY_ENV, "ISOGATE_MAX_BODY_BYTES": str(CAPPED_BODY_BYTES)},
    )
    try:
        row = _refused(
            gateway.url, key, megabytes, _over_limit_body(megabytes), rig.config.refusal_repeats
        )
    finally:
        gateway.stop()
    log(
        f"  refuse {megabytes:>3} MB with a {CAPPED_BODY_BYTES / 2**20:.0f} MiB body cap: "
        f"HTTP {row.status} {row.code}  "
        f"p50 {row.p50_ms:7.1f} ms  min {row.min_ms:7.1f} ms  max {row.max_ms:7.1f} ms"
    )
    return row


def blocking(
    rig: Rig,
    big_tokens: int = 1_000_000,
    log=print,
    *,
    model: str = LONG_MODEL,
    tokenizer: ModelTokenizer | None = None,
) -> BlockingResult:
    tokenizer = tokenizer or ModelTokenizer(ensure_tiny_model())
    big_text = text_of_tokens(tokenizer, big_tokens)
    counted = len(tokenizer._tokenizer.encode(big_text, add_special_tokens=False).ids)
    big_body = orjson.dumps({"model": model, "prompt": big_text, "max_tokens": 4})
    small = Target(
        rig.gateway_url + "/v1/completions",
        request_body(False),
        (("Authorization", f"Bearer {rig.gateway_key}"),),
    )
    baseline = asyncio.run(run_load(small, concurrency=1, duration_s=1.5, warmup_requests=3)).ok()
    big: dict = {}

    def send_big() -> None:
        with _client(300) as client:
            big["ms"], response = _post(client, rig, big_body)
            big["status"] = response.status_code
            big["code"] = (
                response.json().get("error", {}).get("code")
                if response.status_code != 200
                else None
            )

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
    base = sorted(s.total_s * 1000 for s in baseline)
    result = BlockingResult(
        counted,
        big["ms"],
        big["status"],
        big["code"],
        percentile(base, 0.5),
        percentile(base, 0.99),
        len(during),
        percentile(during, 0.5),
        percentile(during, 0.99),
        max(during, default=0.0),
    )
    log(
        f"  {model}: {counted:,}-token prompt in flight {result.big_ms:.0f} ms "
        f"(HTTP {result.big_status} {result.big_code or ''}); "
        f"small requests: baseline p50 {result.baseline_p50_ms:.2f} ms "
        f"p99 {result.baseline_p99_ms:.2f} ms; during n={result.during_requests} "
        f"p50 {result.during_p50_ms:.2f} ms p99 {result.during_p99_ms:.2f} ms "
        f"max {result.during_max_ms:.1f} ms"
    )
    return result


def run_prompt_bench(rig: Rig, log=print) -> dict:
    log(" tokenization and admission vs prompt length")
    tokenize = tokenize_rows(rig, log)
    log(" refusing over-limit prompts (HTTP, end to end)")
    refusals = refusal_rows(rig, log)
    capped = capped_refusal(rig, log=log)
    log(" does tokenizing 1M tokens block other requests? (gateway on every CPU for this part)")
    all_cpus = set(range(__import__("os").cpu_count() or 1))
    pin(rig.gateway_pid, all_cpus)
    try:
        block = blocking(rig, log=log)
        log(" refusing a 1M-token prompt of DeepSeek-V4's tokenizer (limit 681,280 tokens)")
        refuse_real = blocking(
            rig, log=log, model=DEEPSEEK_MODEL, tokenizer=ModelTokenizer(ensure_deepseek_model())
        )
    finally:
        pin(rig.gateway_pid, rig.config.router_cpus)
    return {
        "tokenize": [asdict(r) for r in tokenize],
        "refusal": [asdict(r) for r in refusals],
        "refusal_capped": asdict(capped),
        "capped_body_bytes": CAPPED_BODY_BYTES,
        "blocking": asdict(block),
        "refusal_real_tokenizer": asdict(refuse_real),
    }
