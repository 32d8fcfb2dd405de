"""Canary markers and the scanner that finds another tenant's marker in any output.

Tags and token counts prove that the engine answered *this* request; they cannot prove that
decode attended only over pages written for it. A canary can: the prober (``service.canary``)
sends prompts carrying unique markers from a reserved tenant, and if stale KV pages of such a
prompt are ever read for another request, the marker is the most likely text to surface in the
other tenant's output, where this scanner finds it and the response is withheld
(``verify.IsolationFailure``).

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
from typing import Any

import orjson

from gateway.observability.metrics import Metrics

log = logging.getLogger("isogate.canary")

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
                # The hash outlives its newest marker by a little; expired fields are pruned on
                # refresh.
                pipe.pexpire(self._redis_key, int((ttl_s + 60) * 1000), gt=True)
                pipe.pexpire(self._redis_key, int((ttl_s + 60) * 1000), nx=True)
                await pipe.execute()
        except Exception as exc:  # Redis down: this replica still scans for its own markers
            log.warning("could not share canary marker through Redis: %s", exc)

    async def refresh(self) -> None:
        """Rebuild the snapshot: own markers plus, with Redis, every replica's; drop the expired."""
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


def alert_on_hit(metrics: Metrics) -> Callable[[CanaryHit], None]:
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
