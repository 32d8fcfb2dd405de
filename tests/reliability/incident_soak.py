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
``foreign_canary_bytes`` alone could never fire. Two more checks see a leak as a leak:
``over_pool_served`` is the structural one, and the **differential** one (``differential``)
proves that what was served came from someone else. In each of several rounds one tenant sends
the same short request (the honest probe), the other tenants send traffic that differs from
round to round, then, with nothing else in flight, the first sends the same over-pool request
(the probe). An isolated stack answers each a function of its input alone: the probe is refused
every time, the honest probe gives identical greedy output every time. When the probe is served
and its greedy output changes from one round to the next, data it did not send reached its
decode: ``differential.changes`` counts those rounds. ``differential.honest_changes`` must be 0
in every run: it shows that the model's output is deterministic enough for the check to mean
something.
"""

from __future__ import annotations

import itertools
import json
import random
import re
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

KINDS = ("ordinary", "over_pool", "abort")
FILLER = "word "
ROUND_WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "xray",
    "yankee",
    "zulu",
    "red",
    "orange",
    "yellow",
    "green",
    "blue",
    "indigo",
    "violet",
    "black",
    "white",
    "grey",
    "north",
    "south",
    "east",
    "west",
    "spring",
    "summer",
    "autumn",
    "winter",
    "river",
    "mountain",
    "forest",
    "desert",
    "ocean",
    "island",
    "valley",
    "city",
    "road",
    "bridge",
    "tower",
]


@dataclass(frozen=True)
class SoakShape:
    """The small shape of `make test`; REAL_SHAPE below is the incident's own numbers.

    Both run the DeepSeek-V4 dev model: its sharp attention lets a stale page change greedy
    output (the tiny model's output follows its current token and designed biases, and stayed
    the same whatever its stale pages held). "word " is one token of its tokenizer."""

    prefill_pool: int = 2048
    decode_pool: int = 8192
    context_length: int = 8192
    ordinary_words: tuple[int, int] = (20, 400)
    # Above the prefill pool; below the context length and decode's pool less the tokens it
    # reserves for decoding (512), or decode queues it for ever.
    over_pool_words: tuple[int, int] = (2100, 7000)
    max_tokens: int = 8
    model: str = "deepseek-v4-tiny"
    # The differential probe: an over-pool prompt near the top of the range (so decode reads
    # most of its pool), sent once a round after other tenants' traffic of that round.
    probe_words: int = 7000
    probe_rounds: int = 4
    traffic_per_round: int = 4  # short requests of each other tenant per round
    # Decode's request table is sized max_running_requests x context length: bound it.
    max_running_requests: int | None = None


# The incident's own numbers (September 2026): a 1,048,576-token context over a 681,280-token
# prefill pool, decode's pool larger, on DeepSeek-V4's real tokenizer, where "word " is one
# token: every over-pool prompt has between 681,281 and 1,048,576 tokens.
REAL_SHAPE = SoakShape(
    prefill_pool=681_280,
    # Larger than the context by little: SGLang's PD allocator hands out fresh pages first and
    # recycles freed ones only when the fresh run out, so with a large margin an over-pool
    # prompt reads never-written (zero) pages and the same ones every time; with a small one the
    # other tenants' traffic between two probes lands in the pages the next probe reads.
    decode_pool=1_049_600,
    context_length=1_048_576,
    ordinary_words=(20, 400),
    over_pool_words=(681_300, 1_048_000),
    max_tokens=8,
    model="deepseek-v4-tiny",
    probe_words=1_048_000,
    probe_rounds=4,
    traffic_per_round=4,
    max_running_requests=8,
)


@dataclass
class Differential:
    """What the differential detector saw (see the module docstring)."""

    rounds: int = 0
    probe_refused: int = 0
    probe_served: int = 0
    changes: int = 0  # rounds whose served probe output differs from the previous round's
    distinct_outputs: int = 0
    honest_changes: int = 0  # must be 0: identical short request, different output
    outputs: list[str | None] = field(default_factory=list)
    honest_outputs: list[str | None] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "probe_refused": self.probe_refused,
            "probe_served": self.probe_served,
            "changes": self.changes,
            "distinct_outputs": self.distinct_outputs,
            "honest_changes": self.honest_changes,
            "outputs": [o if o is None else o[:40] for o in self.outputs],
            # Whole: when they differ, where they part says whether a token flipped late
            # (numerics) or the answer was another from its start.
            "honest_outputs": self.honest_outputs,
        }


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
    over_pool_tokens: list[int] = field(default_factory=list)  # as counted by who refused it
    # The request ids of the over-pool prompts sent straight to the workers (bypass mode), for
    # a test to find who refused each one in the workers' logs.
    over_pool_generations: list[str] = field(default_factory=list)
    differential: Differential = field(default_factory=Differential)
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
            "over_pool_tokens": (
                [min(self.over_pool_tokens), max(self.over_pool_tokens)]
                if self.over_pool_tokens
                else None
            ),
            "differential": self.differential.to_json(),
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

    def run(self, send: Any, *, differential: bool = True) -> SoakCounts:
        """The mixed soak (every tenant at once), then the differential rounds."""
        started = time.monotonic()
        with ThreadPoolExecutor(len(self.tenants)) as pool:
            futures = [
                pool.submit(self._tenant_loop, tenant, index, send)
                for index, tenant in enumerate(self.tenants)
            ]
            for future in futures:
                future.result()
        if differential:
            self.run_differential(send)
        self.counts.seconds = time.monotonic() - started
        return self.counts

    def run_differential(self, send: Any) -> Differential:
        """The same probes from the first tenant after each round of the others' traffic."""
        prober, others = self.tenants[0], self.tenants[1:]
        if not others:
            raise ValueError("the differential needs other tenants to send traffic")
        shape = self.shape
        probe = _prompt(prober, shape.probe_words, random.Random(self.seed))
        honest = _prompt(prober, shape.ordinary_words[1], random.Random(self.seed + 1))
        result = self.counts.differential
        honest_outputs: list[str | None] = []
        for round_index in range(shape.probe_rounds):
            # The honest probe first: its pages are then not among the ones the over-pool
            # probe reads, so only the others' traffic differs between two rounds there.
            self.counts.note("requests", "ordinary")
            honest_outputs.append(send(self, prober, "ordinary", honest))
            with ThreadPoolExecutor(len(others)) as pool:
                futures = [
                    pool.submit(self._round_traffic, tenant, round_index, index, send)
                    for index, tenant in enumerate(others)
                ]
                for future in futures:
                    future.result()
            # Nothing else in flight from here: the probe runs alone in its batch.
            self.counts.note("requests", "over_pool")
            result.outputs.append(send(self, prober, "over_pool", probe))
        result.rounds = shape.probe_rounds
        served = [o for o in result.outputs if o]
        result.probe_served = len(served)
        result.probe_refused = sum(1 for o in result.outputs if o is None)
        result.distinct_outputs = len(set(served))
        result.changes = _changes(result.outputs)
        result.honest_changes = _changes(honest_outputs)
        result.honest_outputs = honest_outputs
        return result

    def _round_traffic(self, tenant: Tenant, round_index: int, index: int, send: Any) -> None:
        # Words drawn at random, not the filler: what the rounds' traffic writes into KV pages
        # must differ in content, not only in length and position.
        rng = random.Random(self.seed * 1_000 + round_index * 100 + index)
        low, high = self.shape.ordinary_words
        for _ in range(self.shape.traffic_per_round):
            words = " ".join(rng.choice(ROUND_WORDS) for _ in range(rng.randint(low, high)))
            self.counts.note("requests", "ordinary")
            send(self, tenant, "ordinary", f"{tenant.marker} says: {words} {tenant.marker}")

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

    def delivered(self, tenant: Tenant, kind: str, text: str) -> str:
        """Text a client received with a 200."""
        leaked = foreign_bytes(text, tenant, self.tenants)
        self.counts.add(served=1, foreign_canary_bytes=leaked)
        if kind == "over_pool" and text:
            self.counts.add(over_pool_served=1)
        return text


def _changes(outputs: list[str | None]) -> int:
    """Rounds whose served output differs from the previous round's served output."""
    return sum(
        1 for before, after in itertools.pairwise(outputs) if before and after and before != after
    )


# ---- through the gateway --------------------------------------------------------------------


def gateway_sender(base_url: str, timeout_s: float = 120.0) -> Any:
    local = threading.local()

    def send(soak: Soak, tenant: Tenant, kind: str, text: str) -> str | None:
        """The text delivered with a 200, or None (refused, failed, or a stream aborted)."""
        client = getattr(local, "client", None)
        if client is None:
            client = local.client = httpx.Client(base_url=base_url, timeout=timeout_s)
        headers = {"Authorization": f"Bearer {tenant.key}"}
        body = {
            "model": soak.shape.model,
            "prompt": text,
            "max_tokens": soak.shape.max_tokens,
            "temperature": 0,
            "stream": kind == "abort",
        }
        if kind == "abort":
            with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
                if response.status_code != 200:
                    _gateway_error(soak, kind, response.status_code, response.read())
                    return None
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = orjson.loads(line[6:])
                        if "error" in chunk:
                            _gateway_error(soak, kind, 200, orjson.dumps(chunk))
                            return None
                        soak.delivered(
                            tenant,
                            kind,
                            "".join(c.get("text", "") for c in chunk.get("choices", [])),
                        )
                        soak.counts.add(aborts_done=1)
                        return None  # closing the stream here is the abort
            return None
        response = client.post("/v1/completions", json=body, headers=headers)
        if response.status_code == 200:
            return soak.delivered(tenant, kind, response.json()["choices"][0]["text"])
        _gateway_error(soak, kind, response.status_code, response.content)
        return None

    return send


_PROMPT_TOKENS = re.compile(r"your prompt has (\d+) tokens")


def _gateway_error(soak: Soak, kind: str, status: int, content: bytes) -> None:
    try:
        error = orjson.loads(content)["error"]
        code, message = error["code"], str(error.get("message", ""))
    except Exception:
        code, message = f"unparsable-{status}", ""
    if code == "isolation_check_failed":
        soak.counts.add(verification_failures=1)
    elif kind == "over_pool" and status == 400 and code == "context_length_exceeded":
        soak.counts.add(over_pool_refused=1)
        soak.counts.note("refusals", f"gateway:{status}:{code}")
        counted = _PROMPT_TOKENS.search(message)
        if counted:
            with soak.counts._lock:
                soak.counts.over_pool_tokens.append(int(counted.group(1)))
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
    # The differential probe (about a million tokens at the real shape) is sent every round:
    # its ids are kept, not encoded again.
    encoded: dict[str, list[int]] = {}

    def encode(text: str, kind: str) -> list[int]:
        if kind != "over_pool":
            return tokenizer.encode(text).ids
        ids = encoded.get(text)
        if ids is None:
            ids = tokenizer.encode(text).ids
            if len(encoded) < 2:
                encoded[text] = ids
        return ids

    def send(soak: Soak, tenant: Tenant, kind: str, text: str) -> str | None:
        """The text delivered with a 200, or None (refused, failed, or a stream aborted)."""
        clients = getattr(local, "clients", None)
        if clients is None:
            # A new connection per request: encoding a million-token prompt here takes longer
            # than SGLang's keep-alive (uvicorn's 5 s), and a request sent on a connection the
            # server is closing fails with "Server disconnected without sending a response".
            fresh = httpx.Limits(max_keepalive_connections=0)
            clients = local.clients = (
                httpx.Client(timeout=timeout_s, limits=fresh),
                httpx.Client(timeout=timeout_s, limits=fresh),
                ThreadPoolExecutor(1),
            )
        prefill_client, decode_client, background = clients
        input_ids = encode(text, kind)
        if kind == "over_pool":
            with soak.counts._lock:
                soak.counts.over_pool_tokens.append(len(input_ids))
        generation = "gen_" + secrets.token_hex(12)
        if kind == "over_pool":
            with soak.counts._lock:
                soak.counts.over_pool_generations.append(generation)
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
                return _bypass_abort(
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
                return _bypass_judge(
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
) -> str | None:
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
        return None
    meta = payload.get("meta_info", {})
    reason = meta.get("finish_reason") or {}
    if isinstance(reason, dict) and reason.get("type") == "abort":
        if kind == "over_pool":
            soak.counts.add(over_pool_refused=1)
            soak.counts.note("refusals", f"decode:200-abort:{str(reason.get('message'))[:120]}")
        else:
            soak.counts.note("other_errors", f"{kind}:abort:{str(reason.get('message'))[:80]}")
        return None
    # What the gateway would check, done by this client: is this answer this request's?
    if (
        meta.get("id") != generation
        or meta.get("isolation_tenant", tenant.name) != tenant.name
        or (meta.get("prompt_tokens") is not None and meta["prompt_tokens"] != prompt_tokens)
    ):
        soak.counts.add(verification_failures=1)
        # Still delivered: in bypass mode nothing withholds it. Count what the client got.
    return soak.delivered(tenant, kind, payload.get("text", ""))
