"""Canaries: known markers sent from a reserved tenant, searched for in every other tenant's output.

Tags and token counts prove that the engine answered *this* request; they cannot prove that
decode attended only over pages written for it. A canary can: the prober sends, on an
interval and to every worker pair, a prompt carrying a unique marker from the reserved
tenant ``__canary__``. If stale KV pages of that prompt are ever read for another request,
the marker is the most likely text to surface in the other tenant's output, where the
scanner finds it and the response is withheld (``verify.IsolationFailure``).

Markers share one fixed prefix (``⟦cny:``) followed by a random body of fixed length, so a
scan is one ``str.find`` per occurrence of the prefix plus a dict lookup, O(len(text)) with
no automaton, whatever the number of live markers. The prefix holds a character outside
Latin-1, so on ASCII or Latin-1 text CPython's ``find`` answers without reading the text.

Live markers expire after a TTL. With Redis they are shared between gateway replicas (one
hash, field = marker, value = owner/expiry/origin); each replica's scanner keeps a local
snapshot refreshed every ``canary_refresh_s``, so the request path never waits on Redis.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import orjson
from prometheus_client import Counter, Gauge

from .audit import AuditEvent
from .auth import Principal
from .dispatch import EngineRequest
from .errors import APIError
from .ids import new_generation_id, tenant_cache_salt
from .logs import current_generation_id
from .routing import WorkerPair
from .verify import Expectation, IsolationFailure, check_meta

if TYPE_CHECKING:
    from .components import Components
    from .policies import ModelPolicy

log = logging.getLogger("isogate.canary")

# Not a valid tenant ID for the admin API (TENANT_ID_PATTERN starts with [a-z0-9]), so no key
# can ever authenticate as it; the prober is its only principal.
CANARY_TENANT_ID = "__canary__"
CANARY_PRINCIPAL = Principal(CANARY_TENANT_ID, "canary-prober", False)

MARKER_PREFIX = "⟦cny:"
MARKER_SUFFIX = "⟧"
_BODY_ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"
_BODY_CHARS = 20  # 100 random bits
MARKER_LENGTH = len(MARKER_PREFIX) + _BODY_CHARS + len(MARKER_SUFFIX)


def new_marker() -> str:
    body = "".join(secrets.choice(_BODY_ALPHABET) for _ in range(_BODY_CHARS))
    return MARKER_PREFIX + body + MARKER_SUFFIX


def is_marker(text: str) -> bool:
    return (
        len(text) == MARKER_LENGTH
        and text.startswith(MARKER_PREFIX)
        and text.endswith(MARKER_SUFFIX)
        and all(c in _BODY_ALPHABET for c in text[len(MARKER_PREFIX) : -len(MARKER_SUFFIX)])
    )


@dataclass(frozen=True, slots=True)
class LiveMarker:
    owner: str  # the tenant whose request carried it
    expires_at: float  # Unix time
    origin: str  # where it was sent (probe generation ID and pair), for the alert


@dataclass(frozen=True, slots=True)
class CanaryHit:
    marker: str
    owner: str
    origin: str
    tenant_id: str  # the tenant whose output carried it


class CanaryScanner:
    """Implements ``verify.ContentScanner`` over the live markers of every replica."""

    holdback_chars = MARKER_LENGTH - 1
    marker_start = MARKER_PREFIX[0]

    def __init__(
        self,
        redis: Any | None = None,
        redis_key: str = "isogate:canary:markers",
        on_hit: Callable[[CanaryHit], None] | None = None,
    ) -> None:
        self._redis = redis
        self._redis_key = redis_key
        self._on_hit = on_hit
        self._own: dict[str, LiveMarker] = {}  # registered here; kept even when Redis is away
        self._live: dict[
            str, LiveMarker
        ] = {}  # own ∪ the last Redis snapshot; replaced, never mutated in place

    @property
    def live_count(self) -> int:
        return len(self._live)

    # -- the request path (synchronous, no I/O) -------------------------------------------

    def foreign_marker(self, text: str, tenant_id: str) -> str | None:
        """The first live marker in ``text`` that another tenant's request carried, else None."""
        live = self._live
        if not live:
            return None
        find = text.find
        index = find(MARKER_PREFIX)
        while index != -1:
            found = live.get(text[index : index + MARKER_LENGTH])
            if found is not None and found.owner != tenant_id and found.expires_at > time.time():
                marker = text[index : index + MARKER_LENGTH]
                if self._on_hit is not None:
                    self._on_hit(CanaryHit(marker, found.owner, found.origin, tenant_id))
                return marker
            index = find(MARKER_PREFIX, index + 1)
        return None

    def markers_in(self, text: str) -> list[str]:
        """Every live marker in ``text``, whoever owns it (the prober checks its own output)."""
        live, now, found = self._live, time.time(), []
        index = text.find(MARKER_PREFIX)
        while index != -1:
            entry = live.get(text[index : index + MARKER_LENGTH])
            if entry is not None and entry.expires_at > now:
                found.append(text[index : index + MARKER_LENGTH])
            index = text.find(MARKER_PREFIX, index + 1)
        return found

    # -- registration and sharing ----------------------------------------------------------

    async def register_marker(
        self, marker: str, tenant_id: str, ttl_s: float, origin: str = ""
    ) -> None:
        """Make ``marker`` live for ``ttl_s`` as ``tenant_id``'s, here at once and, with Redis,
        on every replica at its next refresh."""
        if not is_marker(marker):
            raise ValueError(f"not a canary marker: {marker!r}")
        entry = LiveMarker(tenant_id, time.time() + ttl_s, origin)
        self._own[marker] = entry
        self._live = {**self._live, marker: entry}
        if self._redis is None:
            return
        value = orjson.dumps(
            {"owner": entry.owner, "expires_at": entry.expires_at, "origin": origin}
        )
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hset(self._redis_key, marker, value)
                # The hash outlives its newest marker by a little; expired fields are pruned on refresh.
                pipe.pexpire(self._redis_key, int((ttl_s + 60) * 1000), gt=True)
                pipe.pexpire(self._redis_key, int((ttl_s + 60) * 1000), nx=True)
                await pipe.execute()
        except Exception as exc:  # Redis down: this replica still scans for its own markers
            log.warning("could not share canary marker through Redis: %s", exc)

    async def refresh(self) -> None:
        """Rebuild the snapshot: own markers plus, with Redis, every replica's; drop expired ones."""
        now = time.time()
        self._own = {m: e for m, e in self._own.items() if e.expires_at > now}
        live = dict(self._own)
        if self._redis is not None:
            try:
                shared = await self._redis.hgetall(self._redis_key)
            except Exception as exc:
                log.warning("could not read shared canary markers from Redis: %s", exc)
                shared = None
            if shared is None:  # keep the shared markers we knew, until they expire
                live.update({m: e for m, e in self._live.items() if e.expires_at > now})
            else:
                expired = []
                for raw_marker, raw_value in shared.items():
                    marker = raw_marker.decode() if isinstance(raw_marker, bytes) else raw_marker
                    try:
                        value = orjson.loads(raw_value)
                        entry = LiveMarker(
                            str(value["owner"]),
                            float(value["expires_at"]),
                            str(value.get("origin", "")),
                        )
                    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                        continue
                    if entry.expires_at <= now:
                        expired.append(raw_marker)
                    elif is_marker(marker):
                        live.setdefault(marker, entry)
                if expired:
                    try:
                        await self._redis.hdel(self._redis_key, *expired)
                    except Exception:
                        pass  # another replica will prune them
        self._live = live

    async def run_refresh(self, interval_s: float) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:
                log.exception("canary marker refresh failed")
            await asyncio.sleep(interval_s)


@dataclass(frozen=True, slots=True)
class ProbeResult:
    pair: tuple[str, str]
    generation_id: str
    marker: str
    outcome: str  # "passed", "verification_failed", "error", "skipped"
    detail: str | None = None


class CanaryMetrics:
    """The canary's own series, on the gateway's registry."""

    def __init__(self, registry: Any, scanner: CanaryScanner) -> None:
        self.probes = Counter(
            "isogate_canary_probes",
            "Canary probes sent, by outcome.",
            ["outcome"],
            registry=registry,
        )
        self.live_markers = Gauge(
            "isogate_canary_live_markers",
            "Canary markers this replica scans for.",
            registry=registry,
        )
        self.live_markers.set_function(lambda: scanner.live_count)


class CanaryProber:
    """Sends one canary request to every (prefill, decode) pair of every model each interval.

    It goes through the dispatcher like any request, with a minted generation ID, the canary
    tenant's tags and cache salt, and checks its own answer with ``check_meta``; an answer
    that carries a marker other than its own is a leak between requests.
    """

    def __init__(
        self,
        components: Components,
        scanner: CanaryScanner,
        *,
        ttl_s: float,
        max_tokens: int,
        metrics: CanaryMetrics | None = None,
    ) -> None:
        self._components = components
        self._scanner = scanner
        self._ttl_s = ttl_s
        self._max_tokens = max_tokens
        self._metrics = metrics

    async def run(self, interval_s: float) -> None:
        while True:
            try:
                await self.probe_all()
            except Exception:
                log.exception("canary probe round failed")
            await asyncio.sleep(interval_s)

    async def probe_all(self) -> list[ProbeResult]:
        components = self._components
        pairs = [
            (model, pair)
            for model in components.policies.models.values()
            for pair in self.pairs(model)
        ]
        results = await asyncio.gather(*(self.probe(model, pair) for model, pair in pairs))
        return list(results)

    def pairs(self, model: ModelPolicy) -> list[WorkerPair]:
        """Every pair a request of this model could be routed to, dedicated pools included."""
        registry = self._components.capacity
        pairs = []
        for pool in model.pools:
            for prefill in pool.prefill:
                for decode in pool.decode:
                    prefill_state, decode_state = (
                        registry.get(prefill.url),
                        registry.get(decode.url),
                    )
                    if prefill_state is None or decode_state is None:
                        continue
                    if model.require_engine_tags and not (
                        prefill_state.engine_patch and decode_state.engine_patch
                    ):
                        continue
                    pairs.append(
                        WorkerPair(pool.name, prefill, decode, prefill_state, decode_state)
                    )
        return pairs

    async def probe(self, model: ModelPolicy, pair: WorkerPair) -> ProbeResult:

        components = self._components
        generation_id, marker = new_generation_id(), new_marker()
        started = time.perf_counter()
        token = current_generation_id.set(generation_id)
        try:
            origin = f"{generation_id} {pair.prefill.url} -> {pair.decode.url}"
            prompt = f"Canary {marker}. Repeat the canary exactly: {marker}"
            input_ids = await components.tokenizers[model.name].encode_text(prompt)
            need = (
                len(input_ids)
                + self._max_tokens
                + components.settings.admission_safety_margin_tokens
            )
            ledger = components.ledger
            if (
                ledger.free_now(pair.prefill_state) < need
                or ledger.free_now(pair.decode_state) < need
            ):
                return self._count(
                    ProbeResult(pair.urls, generation_id, marker, "skipped", "pair is full")
                )
            # Live before it is sent: its pages may be read by someone else from the first step on.
            await self._scanner.register_marker(marker, CANARY_TENANT_ID, self._ttl_s, origin)
            request = EngineRequest(
                generation_id=generation_id,
                tenant_id=CANARY_TENANT_ID,
                input_ids=input_ids,
                sampling_params={"max_new_tokens": self._max_tokens, "temperature": 0.0},
                cache_salt=tenant_cache_salt(
                    components.settings.cache_salt_secret, CANARY_TENANT_ID
                ),
            )
            expected = Expectation(
                generation_id,
                CANARY_TENANT_ID,
                len(input_ids),
                self._max_tokens,
                model.require_engine_tags,
            )
            with ledger.claim(pair.urls, need):
                try:
                    output = await components.dispatcher.generate(pair, request)
                    check_meta(output.get("meta_info"), expected)
                    self._check_own_output(output, marker)
                except IsolationFailure as failure:
                    self._failed(
                        model, pair, generation_id, len(input_ids), failure.reason, started
                    )
                    return self._count(
                        ProbeResult(
                            pair.urls, generation_id, marker, "verification_failed", failure.reason
                        )
                    )
                except APIError as error:
                    log.warning(
                        "canary probe got no answer",
                        extra={
                            "pair": list(pair.urls),
                            "code": error.code,
                            "reason": error.message[:200],
                        },
                    )
                    return self._count(
                        ProbeResult(pair.urls, generation_id, marker, "error", error.message[:200])
                    )
            return self._count(ProbeResult(pair.urls, generation_id, marker, "passed"))
        finally:
            current_generation_id.reset(token)

    def _check_own_output(self, output: dict[str, Any], marker: str) -> None:
        meta = output.get("meta_info") or {}
        reason = meta.get("finish_reason")
        if isinstance(reason, dict) and reason.get("type") == "abort":
            raise IsolationFailure(
                f"engine aborted the canary: {reason.get('message') or 'no reason given'}"
            )
        others = [m for m in self._scanner.markers_in(output.get("text") or "") if m != marker]
        if others:
            raise IsolationFailure("canary output carries another canary's marker")

    def _failed(
        self,
        model: ModelPolicy,
        pair: WorkerPair,
        generation_id: str,
        prompt_tokens: int,
        reason: str,
        started: float,
    ) -> None:
        components = self._components
        log.error(
            "canary probe failed an isolation check",
            extra={"alert": "canary_probe_failed", "reason": reason, "pair": list(pair.urls)},
        )
        components.metrics.verification_failed(model.name, "canary probe: " + reason)
        components.audit.record(
            AuditEvent(
                generation_id=generation_id,
                tenant_id=CANARY_TENANT_ID,
                key_id=CANARY_PRINCIPAL.key_id,
                model=model.name,
                outcome="verification_failed",
                status=502,
                code="isolation_check_failed",
                prefill_worker=pair.prefill.url,
                decode_worker=pair.decode.url,
                prompt_tokens=prompt_tokens,
                completion_tokens=None,
                stream=False,
                latency_ms=(time.perf_counter() - started) * 1000.0,
                created_at=datetime.now(UTC),
                detail=reason[:300],
            )
        )

    def _count(self, result: ProbeResult) -> ProbeResult:
        if self._metrics is not None:
            self._metrics.probes.labels(result.outcome).inc()
        return result


def alert_on_hit(metrics: Any) -> Callable[[CanaryHit], None]:
    """The scanner's hit handler: one alert log line and the ``isogate_canary_hits`` counter."""

    def on_hit(hit: CanaryHit) -> None:
        metrics.canary_hits.labels(hit.tenant_id).inc()
        log.critical(
            "CANARY HIT: another tenant's canary marker appeared in an output; response withheld",
            extra={
                "alert": "canary_hit",
                "tenant_id": hit.tenant_id,
                "marker_owner": hit.owner,
                "marker": hit.marker,
                "marker_origin": hit.origin,
            },
        )

    return on_hit
