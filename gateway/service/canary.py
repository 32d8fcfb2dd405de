"""The canary prober: known markers sent from a reserved tenant to every worker pair.

Each interval, every (prefill, decode) pair of every model gets one request from the tenant
``__canary__`` whose prompt carries a fresh marker (``verification.scanner``). The request goes
through the same generation core as a tenant's (admission, claims, dispatch, every check),
pinned to the pair; its marker is live, for every replica's scanner, before it is sent. If
stale KV pages of a probe are ever read for another request, the marker is the text most
likely to surface in that tenant's output, where the scanner withholds it. The prober checks
its own answers the other way round: an answer carrying any live marker but its own is a leak
between requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.common.errors import APIError
from gateway.common.ids import new_generation_id
from gateway.config.policies import ModelPolicy
from gateway.core.generation import (
    SERVED,
    Catalog,
    GenerationAsk,
    GenerationCore,
    Outcome,
    TextPrompt,
    Trace,
)
from gateway.core.held import Held
from gateway.core.routing import pairs_of
from gateway.observability.logs import current_generation_id
from gateway.tenancy.auth import Principal
from gateway.verification.scanner import CanaryScanner, new_marker
from gateway.verification.verify import IsolationFailure
from gateway.workers.capacity import CapacityRegistry
from gateway.workers.pairs import WorkerPair

log = logging.getLogger("isogate.canary")

# Not a valid tenant ID for the admin API (TENANT_ID_PATTERN starts with [a-z0-9]), so no key
# can ever authenticate as it; the prober is its only principal.
CANARY_TENANT_ID = "__canary__"
CANARY_PRINCIPAL = Principal(CANARY_TENANT_ID, "canary-prober", False)


@dataclass(frozen=True, slots=True)
class ProbeResult:
    pair: tuple[str, str]
    generation_id: str
    marker: str
    outcome: str  # "passed", "verification_failed", "error", "skipped"
    detail: str | None = None


class CanaryMetrics:
    """The canary's own series, on the gateway's registry."""

    def __init__(self, registry: CollectorRegistry, scanner: CanaryScanner) -> None:
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


class OwnMarkerOnly:
    """The content check of a probe's own answer: any live marker but its own is foreign,
    whoever owns it (every probe is the canary tenant's, so the tenant test cannot tell)."""

    def __init__(self, scanner: CanaryScanner, marker: str) -> None:
        self._scanner = scanner
        self._marker = marker
        self.holdback_chars = scanner.holdback_chars
        self.marker_start = scanner.marker_start

    def foreign_marker(self, text: str, tenant_id: str) -> str | None:
        return next((m for m in self._scanner.markers_in(text) if m != self._marker), None)


class CanaryProber:
    """Sends one canary request to every (prefill, decode) pair of every model each interval."""

    def __init__(
        self,
        core: GenerationCore,
        catalog: Catalog,
        capacity: CapacityRegistry,
        scanner: CanaryScanner,
        *,
        ttl_s: float,
        max_tokens: int,
        metrics: CanaryMetrics | None = None,
    ) -> None:
        self._core = core
        self._catalog = catalog
        self._capacity = capacity
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
        # Every pair a request of the model could be routed to, dedicated pools included.
        probes = [
            (model, pair)
            for model in self._catalog.policies.models.values()
            for pair in pairs_of(model.pools, model, self._capacity)
        ]
        return list(await asyncio.gather(*(self.probe(model, pair) for model, pair in probes)))

    async def probe(self, model: ModelPolicy, pair: WorkerPair) -> ProbeResult:
        trace = Trace(new_generation_id(), datetime.now(UTC), time.perf_counter())
        trace.principal, trace.model = CANARY_PRINCIPAL, model.name
        generation_id = trace.generation_id
        marker = new_marker()
        token = current_generation_id.set(generation_id)
        # Until the answer has passed: a probe cut short (shutdown, a bug) is not a pass.
        outcome = Outcome("upstream_error", 500, "internal_error", "the probe did not finish")
        result = ProbeResult(pair.urls, generation_id, marker, "passed")
        try:
            ask = GenerationAsk(
                tenant_id=CANARY_TENANT_ID,
                model=model,
                prompts=[TextPrompt(f"Canary {marker}. Repeat the canary exactly: {marker}")],
                max_tokens=self._max_tokens,
                sampling_params={"max_new_tokens": self._max_tokens, "temperature": 0.0},
                limits=None,
                pair=pair,
                scanner=OwnMarkerOnly(self._scanner, marker),
            )
            async with Held() as held:
                admitted = await self._core.admit(ask, trace, held)
                # Live before it is sent: its pages may be read by someone else from the first
                # step on.
                origin = f"{generation_id} {pair.prefill.url} -> {pair.decode.url}"
                await self._scanner.register_marker(marker, CANARY_TENANT_ID, self._ttl_s, origin)
                await self._core.complete(admitted, trace)
            outcome = SERVED
        except IsolationFailure as failure:
            log.error(
                "canary probe failed an isolation check",
                extra={
                    "alert": "canary_probe_failed",
                    "reason": failure.reason,
                    "pair": list(pair.urls),
                },
            )
            outcome = Outcome.of_failure(failure)
            result = ProbeResult(
                pair.urls, generation_id, marker, "verification_failed", failure.reason
            )
        except APIError as error:
            outcome = Outcome.of_error(error)
            if error.code == "capacity_busy":
                result = ProbeResult(pair.urls, generation_id, marker, "skipped", "pair is full")
            else:
                log.warning(
                    "canary probe got no answer",
                    extra={
                        "pair": list(pair.urls),
                        "code": error.code,
                        "reason": error.message[:200],
                    },
                )
                detail = error.message[:200]
                result = ProbeResult(pair.urls, generation_id, marker, "error", detail)
        finally:
            self._core.record(trace, outcome)
            current_generation_id.reset(token)
        if self._metrics is not None:
            self._metrics.probes.labels(result.outcome).inc()
        return result
