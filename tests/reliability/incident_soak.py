"""The incident soak: several tenants, each with its own canary marker, against a PD pair in the
incident's shape.

Shape (as in September 2026): the prefill KV pool is smaller than the context length, the
decode pool larger, and some prompts fall between the two. Every tenant thread sends, in a
fixed pseudo-random mix, ordinary requests carrying its canary marker, over-pool prompts
(longer than the prefill pool, shorter than the context length) and aborts (a stream closed
after its first chunk). Counted:

- ``requests``: sent, of each kind;
- ``over_pool_refused``: over-pool prompts that got no content (400 from the gateway, or an
  engine refusal);
- ``over_pool_served``: over-pool prompts answered 200 WITH content: by construction that
  content was decoded over KV pages prefill never wrote for it (the incident's leak);
- ``verification_failures``: answers withheld because a check failed (the gateway's 502
  ``isolation_check_failed`` or stream error event; in bypass mode, engine_patch's 500s
  and this client's own meta checks);
- ``foreign_canary_bytes``: bytes of another tenant's marker in any text delivered to a client.

Two ways in: ``gateway`` sends through the gateway's OpenAI API; ``bypass`` sends straight
to the workers the way a router does (same body to prefill and decode, rid, extra_key,
bootstrap triple, isolation headers), so only the engine's own layer stands in the way.

With a random-weight model a stale read does not copy a marker verbatim, so
``foreign_canary_bytes`` is the literal check and ``over_pool_served`` the structural one:
both must be zero.
"""

from __future__ import annotations

import json
import random
import secrets
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
from tokenizers import Tokenizer

MODEL = "tiny-llama"
KINDS = ("ordinary", "over_pool", "abort")
FILLER = "word "


@dataclass(frozen=True)
class SoakShape:
    prefill_pool: int = 2048
    decode_pool: int = 8192
    context_length: int = 8192
    # "word " is two tokens of the tiny model's tokenizer.
    ordinary_words: tuple[int, int] = (20, 200)
    over_pool_words: tuple[int, int] = (
        1100,
        3500,
    )  # above the prefill pool, below the context length
    max_tokens: int = 8


@dataclass
class SoakCounts:
    requests: Counter[str] = field(default_factory=Counter)
    served: int = 0
    over_pool_refused: int = 0
    over_pool_served: int = 0
    aborts_done: int = 0
    verification_failures: int = 0
    foreign_canary_bytes: int = 0
    other_errors: Counter[str] = field(default_factory=Counter)
    refusals: Counter[str] = field(default_factory=Counter)  # how over-pool prompts were refused
    seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, value in deltas.items():
                setattr(self, name, getattr(self, name) + value)

    def note(self, counter: str, key: str) -> None:
        with self._lock:
            getattr(self, counter)[key] += 1

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": sum(self.requests.values()),
            "by_kind": dict(self.requests),
            "served": self.served,
            "over_pool_refused": self.over_pool_refused,
            "over_pool_served": self.over_pool_served,
            "aborts_done": self.aborts_done,
            "verification_failures": self.verification_failures,
            "foreign_canary_bytes": self.foreign_canary_bytes,
            "other_errors": dict(self.other_errors),
            "refusals": dict(self.refusals),
            "seconds": round(self.seconds, 1),
        }


@dataclass(frozen=True)
class Tenant:
    name: str
    marker: str  # this tenant's canary: appears in every prompt it sends
    key: str | None = None  # API key (gateway mode)


def make_tenants(names: list[str]) -> list[Tenant]:
    return [Tenant(name, f"CANARY-{name}-{secrets.token_hex(6)}") for name in names]


def foreign_bytes(text: str, me: Tenant, tenants: list[Tenant]) -> int:
    """Bytes of other tenants' markers (or of their random bodies alone) in ``text``."""
    found = 0
    for other in tenants:
        if other.name == me.name:
            continue
        body = other.marker.rsplit("-", 1)[1]
        found += text.count(other.marker) * len(other.marker.encode())
        found += (text.count(body) - text.count(other.marker)) * len(body.encode())
    return found


def _prompt(tenant: Tenant, words: int, rng: random.Random) -> str:
    return f"{tenant.marker} says: " + FILLER * words + f" {tenant.marker} {rng.randrange(10**9)}"


@dataclass
class Soak:
    shape: SoakShape
    tenants: list[Tenant]
    requests_per_tenant: int
    mix: tuple[float, float, float] = (0.7, 0.15, 0.15)  # ordinary, over_pool, abort
    seed: int = 20260929
    counts: SoakCounts = field(default_factory=SoakCounts)

    def run(self, send: Any) -> SoakCounts:
        started = time.monotonic()
        with ThreadPoolExecutor(len(self.tenants)) as pool:
            futures = [
                pool.submit(self._tenant_loop, tenant, index, send)
                for index, tenant in enumerate(self.tenants)
            ]
            for future in futures:
                future.result()
        self.counts.seconds = time.monotonic() - started
        return self.counts

    def _tenant_loop(self, tenant: Tenant, index: int, send: Any) -> None:
        rng = random.Random(self.seed + index)
        for _ in range(self.requests_per_tenant):
            kind = rng.choices(KINDS, weights=self.mix)[0]
            low, high = (
                self.shape.over_pool_words if kind == "over_pool" else self.shape.ordinary_words
            )
            text = _prompt(tenant, rng.randint(low, high), rng)
            self.counts.note("requests", kind)
            send(self, tenant, kind, text)

    def delivered(self, tenant: Tenant, kind: str, text: str) -> None:
        """Text a client received with a 200."""
        leaked = foreign_bytes(text, tenant, self.tenants)
        self.counts.add(served=1, foreign_canary_bytes=leaked)
        if kind == "over_pool" and text:
            self.counts.add(over_pool_served=1)


# ---- through the gateway --------------------------------------------------------------------


def gateway_sender(base_url: str, timeout_s: float = 120.0) -> Any:
    local = threading.local()

    def send(soak: Soak, tenant: Tenant, kind: str, text: str) -> None:
        client = getattr(local, "client", None)
        if client is None:
            client = local.client = httpx.Client(base_url=base_url, timeout=timeout_s)
        headers = {"Authorization": f"Bearer {tenant.key}"}
        body = {
            "model": MODEL,
            "prompt": text,
            "max_tokens": soak.shape.max_tokens,
            "temperature": 0,
            "stream": kind == "abort",
        }
        if kind == "abort":
            with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
                if response.status_code != 200:
                    _gateway_error(soak, kind, response.status_code, response.read())
                    return
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = orjson.loads(line[6:])
                        if "error" in chunk:
                            _gateway_error(soak, kind, 200, orjson.dumps(chunk))
                            return
                        soak.delivered(
                            tenant,
                            kind,
                            "".join(c.get("text", "") for c in chunk.get("choices", [])),
                        )
                        soak.counts.add(aborts_done=1)
                        return  # closing the stream here is the abort
            return
        response = client.post("/v1/completions", json=body, headers=headers)
        if response.status_code == 200:
            soak.delivered(tenant, kind, response.json()["choices"][0]["text"])
            return
        _gateway_error(soak, kind, response.status_code, response.content)

    return send


def _gateway_error(soak: Soak, kind: str, status: int, content: bytes) -> None:
    try:
        code = orjson.loads(content)["error"]["code"]
    except Exception:
        code = f"unparsable-{status}"
    if code == "isolation_check_failed":
        soak.counts.add(verification_failures=1)
    elif kind == "over_pool" and status == 400 and code == "context_length_exceeded":
        soak.counts.add(over_pool_refused=1)
        soak.counts.note("refusals", f"gateway:{status}:{code}")
    else:
        soak.counts.note("other_errors", f"{kind}:{status}:{code}")


# ---- straight to the workers (gateway bypassed) ------------------------------------------------


def bypass_sender(
    prefill_url: str,
    decode_url: str,
    bootstrap_port: int,
    tokenizer_path: Path,
    timeout_s: float = 120.0,
) -> Any:
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    local = threading.local()

    def send(soak: Soak, tenant: Tenant, kind: str, text: str) -> None:
        clients = getattr(local, "clients", None)
        if clients is None:
            clients = local.clients = (
                httpx.Client(timeout=timeout_s),
                httpx.Client(timeout=timeout_s),
                ThreadPoolExecutor(1),
            )
        prefill_client, decode_client, background = clients
        input_ids = tokenizer.encode(text).ids
        generation = "gen_" + secrets.token_hex(12)
        body = {
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": soak.shape.max_tokens, "temperature": 0},
            "rid": generation,
            "extra_key": f"salt-{tenant.name}",
            "stream": kind == "abort",
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": bootstrap_port,
            "bootstrap_room": secrets.randbits(62),
        }
        headers = {
            "X-Isolation-Tenant": tenant.name,
            "X-Isolation-Generation": generation,
            "Content-Type": "application/json",
        }
        prefill = background.submit(
            prefill_client.post,
            f"{prefill_url}/generate",
            content=orjson.dumps({**body, "stream": False}),
            headers=headers,
        )
        try:
            if kind == "abort":
                _bypass_abort(
                    soak,
                    tenant,
                    kind,
                    decode_client,
                    decode_url,
                    body,
                    headers,
                    generation,
                    len(input_ids),
                )
            else:
                response = decode_client.post(
                    f"{decode_url}/generate", content=orjson.dumps(body), headers=headers
                )
                _bypass_judge(
                    soak,
                    tenant,
                    kind,
                    response.status_code,
                    response.content,
                    generation,
                    len(input_ids),
                )
        finally:
            try:
                prefill.result(timeout=timeout_s)
            except Exception as exc:
                soak.counts.note("other_errors", f"prefill:{type(exc).__name__}")

    return send


def _bypass_abort(
    soak: Soak,
    tenant: Tenant,
    kind: str,
    client: httpx.Client,
    decode_url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    generation: str,
    prompt_tokens: int,
) -> None:
    with client.stream(
        "POST", f"{decode_url}/generate", content=orjson.dumps(body), headers=headers
    ) as response:
        if response.status_code != 200:
            _bypass_judge(
                soak, tenant, kind, response.status_code, response.read(), generation, prompt_tokens
            )
            return
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                _bypass_judge(soak, tenant, kind, 200, line[6:].encode(), generation, prompt_tokens)
                soak.counts.add(aborts_done=1)
                return  # closing the stream is the abort


def _bypass_judge(
    soak: Soak,
    tenant: Tenant,
    kind: str,
    status: int,
    content: bytes,
    generation: str,
    prompt_tokens: int,
) -> None:
    try:
        payload = orjson.loads(content)
    except orjson.JSONDecodeError:
        payload = {}
    if status != 200 or "error" in payload or not isinstance(payload, dict):
        message = json.dumps(payload)[:200] if payload else content[:200].decode("utf-8", "replace")
        if any(
            reason in message for reason in ("coverage_mismatch", "foreign_page", "tag_mismatch")
        ):
            soak.counts.add(verification_failures=1)
        elif kind == "over_pool":
            soak.counts.add(over_pool_refused=1)
            soak.counts.note("refusals", f"decode:{status}:{message[:120]}")
        else:
            soak.counts.note("other_errors", f"{kind}:{status}:{message[:80]}")
        return
    meta = payload.get("meta_info", {})
    reason = meta.get("finish_reason") or {}
    if isinstance(reason, dict) and reason.get("type") == "abort":
        if kind == "over_pool":
            soak.counts.add(over_pool_refused=1)
            soak.counts.note("refusals", f"decode:200-abort:{str(reason.get('message'))[:120]}")
        else:
            soak.counts.note("other_errors", f"{kind}:abort:{str(reason.get('message'))[:80]}")
        return
    # What the gateway would check, done by this client: is this answer this request's?
    if (
        meta.get("id") != generation
        or meta.get("isolation_tenant", tenant.name) != tenant.name
        or (meta.get("prompt_tokens") is not None and meta["prompt_tokens"] != prompt_tokens)
    ):
        soak.counts.add(verification_failures=1)
        # Still delivered: in bypass mode nothing withholds it. Count what the client got.
    soak.delivered(tenant, kind, payload.get("text", ""))
