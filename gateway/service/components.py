"""Everything a request needs, built once per process and closed on shutdown.

``Components`` is the one object the routes reach for (``request.app.state.components``);
nothing in the gateway is a module-level global. Policies and tokenizers are swapped
together on reload, so a request sees one consistent version of both.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.metrics_core import Metric

from gateway.common.redis_pipeline import RedisPipeline
from gateway.config.policies import Policies, load_policies
from gateway.config.settings import Settings
from gateway.core.admission import ClaimLedger
from gateway.core.generation import GenerationCore
from gateway.core.pair_queues import PairQueues, QueueSettings
from gateway.core.routing import RoutingCache
from gateway.core.shared_claims import SharedClaims
from gateway.observability.loop_lag import LoopLagProbe, StallReport
from gateway.observability.metrics import GAUGE_RULES, Metrics
from gateway.observability.multiprocess import ProcessMetrics
from gateway.openai.tokenize import ModelTokenizer
from gateway.server.intake import BodyParser
from gateway.service.canary import CanaryMetrics, CanaryProber
from gateway.tenancy.audit import AuditLog
from gateway.tenancy.auth import Authenticator, UnauthenticatedClients
from gateway.tenancy.budgets import TokenBudgets
from gateway.tenancy.limits import TenantLimiter
from gateway.tenancy.revocations import Revocations
from gateway.tenancy.store import Store, create_store
from gateway.tenancy.stored_responses import ResponseStore
from gateway.verification.scanner import CanaryScanner, alert_on_hit
from gateway.verification.verify import ContentScanner, NoScanner
from gateway.workers.capacity import CapacityRegistry, Role
from gateway.workers.dispatch import PDDispatcher
from gateway.workers.upstream import UpstreamClient

log = logging.getLogger(__name__)


@dataclass
class Components:
    settings: Settings
    policies: Policies
    tokenizers: dict[str, ModelTokenizer]
    capacity: CapacityRegistry
    routes: RoutingCache
    ledger: ClaimLedger
    dispatcher: PDDispatcher
    store: Store
    authenticator: Authenticator
    audit: AuditLog
    limiter: TenantLimiter
    metrics: Metrics
    queues: PairQueues
    unauthenticated: UnauthenticatedClients
    parser: BodyParser
    scanner: ContentScanner = field(default_factory=NoScanner)
    redis: Any | None = None
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    # With ``serve --workers``: this process's part of the one ``/metrics`` of all of them.
    process_metrics: ProcessMetrics | None = None
    core: GenerationCore = field(init=False)
    revocations: Revocations = field(init=False)
    # The Responses API's stored responses (in the store's database).
    responses: ResponseStore = field(init=False)
    # Token budgets: counted in Redis (or here), rebuilt from the audit log.
    budgets: TokenBudgets = field(init=False)

    def __post_init__(self) -> None:
        self.responses = ResponseStore(self.store)
        self.revocations = Revocations(
            self.authenticator,
            self.redis,
            self.settings.redis_key_prefix,
            self.metrics.auth_invalidations,
        )
        self.budgets = TokenBudgets(
            self.redis, self.settings.redis_key_prefix, self.store.token_usage, self.metrics
        )
        self.core = GenerationCore(
            catalog=self,
            routes=self.routes,
            ledger=self.ledger,
            limiter=self.limiter,
            dispatcher=self.dispatcher,
            scanner=self.scanner,
            audit=self.audit,
            metrics=self.metrics,
            queues=self.queues,
            margin_tokens=self.settings.admission_safety_margin_tokens,
            cache_salt_secret=self.settings.cache_salt_secret,
            budgets=self.budgets,
        )

    def workers(self) -> list[tuple[str, Role]]:
        return workers_of(self.policies)

    def metrics_exposition(self) -> bytes:
        """What ``/metrics`` answers: this process's series, or every process's as one (off
        the loop: it walks every series)."""
        if self.process_metrics is None:
            return self.metrics.export(self.capacity, self.workers())
        return self.process_metrics.scrape(self.own_metric_families)

    def own_metric_families(self) -> list[Metric]:
        return self.metrics.families(self.capacity, self.workers())

    def apply_policies(self, policies: Policies) -> None:
        """Adopt new policies (already validated) together with their tokenizers."""
        tokenizers = load_tokenizers(policies, self.settings, self.tokenizers, self.policies)
        self.policies, self.tokenizers = policies, tokenizers
        self.capacity.set_workers(self.workers())


def workers_of(policies: Policies) -> list[tuple[str, Role]]:
    seen: dict[str, Role] = {}
    for model in policies.models.values():
        for pool in model.pools:
            for prefill in pool.prefill:
                seen.setdefault(prefill.url, "prefill")
            for decode in pool.decode:
                seen.setdefault(decode.url, "decode")
    return list(seen.items())


def load_tokenizers(
    policies: Policies,
    settings: Settings,
    previous: dict[str, ModelTokenizer] | None = None,
    previous_policies: Policies | None = None,
) -> dict[str, ModelTokenizer]:
    tokenizers: dict[str, ModelTokenizer] = {}
    for name, model in policies.models.items():
        old = previous_policies.models.get(name) if previous_policies else None
        if previous and old is not None and old.tokenizer == model.tokenizer and name in previous:
            tokenizers[name] = previous[name]
        else:
            tokenizers[name] = ModelTokenizer(
                model.tokenizer, thread_min_chars=settings.tokenize_in_thread_min_chars
            )
    return tokenizers


def connect_redis(url: str) -> Any:
    """The Redis client every component shares. A command past the pool's connections waits
    for one (up to a second) instead of failing at once: with shared claims every admission
    asks Redis, and a burst of them must not read as Redis being unreachable (which fails
    admission closed)."""
    import redis.asyncio as redis_asyncio

    return redis_asyncio.Redis.from_pool(  # the pool is closed with the client
        redis_asyncio.BlockingConnectionPool.from_url(url, max_connections=100, timeout=1.0)
    )


async def build_components(settings: Settings) -> Components:
    policies = load_policies(settings.policies_dir)
    tokenizers = load_tokenizers(policies, settings)
    redis_client = connect_redis(settings.redis_url) if settings.redis_url else None
    # The limits' and the claims' commands of every request in flight, sent together.
    redis_commands = RedisPipeline(redis_client) if redis_client is not None else None
    capacity = CapacityRegistry(
        poll_interval_s=settings.capacity_poll_interval_s,
        stale_after_s=settings.capacity_stale_after_s,
        max_age_if_alive_s=settings.capacity_max_age_if_alive_s,
        liveness_timeout_s=settings.worker_liveness_timeout_s,
        redis=redis_client,
        key_prefix=settings.redis_key_prefix,
    )
    capacity.set_workers(workers_of(policies))
    store = create_store(settings.database_url)
    process_metrics = None
    if settings.metrics_dir is not None:
        process_metrics = ProcessMetrics(settings.metrics_dir, GAUGE_RULES)
    metrics = Metrics(process_metrics.last_file_read if process_metrics else None)
    # With Redis, KV claims are counted across every process that shares it (gate 1 holds
    # across --workers and replicas); without it, per process as before.
    shared_claims = None
    if redis_client is not None:
        shared_claims = SharedClaims(
            redis_client,
            settings.redis_key_prefix,
            heartbeat_s=settings.claim_heartbeat_s,
            commands=redis_commands,
            lease_block=settings.claim_lease_block,
        )
    scanner: ContentScanner = NoScanner()
    if settings.canary_scan:
        scanner = CanaryScanner(redis_client, settings.canary_redis_key, alert_on_hit(metrics))
    components = Components(
        settings=settings,
        policies=policies,
        tokenizers=tokenizers,
        capacity=capacity,
        routes=RoutingCache(capacity),
        ledger=ClaimLedger(shared=shared_claims),
        dispatcher=PDDispatcher(
            UpstreamClient(
                connect_timeout_s=settings.upstream_connect_timeout_s,
                timeout_s=settings.upstream_timeout_s,
                deadline_resolution_s=settings.deadline_resolution_s,
            ),
            seen_serving=capacity.seen_serving,
        ),
        store=store,
        authenticator=Authenticator(store, settings),
        audit=AuditLog(store, settings),
        limiter=TenantLimiter(
            redis_client,
            settings.redis_key_prefix,
            commands=redis_commands,
            spare_fraction=settings.limits_spare_fraction,
            heartbeat_s=settings.claim_heartbeat_s,
        ),
        metrics=metrics,
        queues=PairQueues(
            QueueSettings(
                default_in_flight=settings.queue_in_flight_per_pair,
                max_wait_s=settings.queue_max_wait_s,
                max_queued_per_tenant=settings.queue_max_per_tenant,
                replicas=settings.queue_replicas,
                default_in_flight_contended=settings.queue_in_flight_per_pair_contended,
                contention_linger_s=settings.queue_contention_linger_s,
                kv_shared=shared_claims is not None,
            ),
            metrics,
        ),
        unauthenticated=UnauthenticatedClients(
            metrics, per_minute=settings.unauthenticated_per_address_per_minute
        ),
        parser=BodyParser(
            off_loop_min_bytes=settings.parse_off_loop_min_bytes,
            processes=settings.parse_processes,
        ),
        scanner=scanner,
        redis=redis_client,
        process_metrics=process_metrics,
    )
    components.parser.start()
    await components.audit.start()
    components.tasks.append(asyncio.create_task(capacity.run(), name="capacity-poller"))
    components.tasks.append(asyncio.create_task(capacity.run_liveness(), name="liveness-prober"))
    if shared_claims is not None:
        components.tasks.append(asyncio.create_task(shared_claims.run(), name="claims-heartbeat"))
    if redis_client is not None:
        components.tasks.append(
            asyncio.create_task(components.limiter.run(), name="limits-heartbeat")
        )
    components.tasks.append(
        asyncio.create_task(components.revocations.run(), name="auth-invalidations")
    )
    stall_report = None
    if settings.loop_stall_report_dir is not None:
        stall_report = StallReport(
            settings.loop_stall_report_dir, settings.loop_stall_report_after_s
        )
    components.tasks.append(
        asyncio.create_task(
            LoopLagProbe(metrics.loop_lag.observe, stall_report=stall_report).run(),
            name="loop-lag-probe",
        )
    )
    components.tasks.append(
        asyncio.create_task(
            components.responses.run_sweeper(
                settings.response_sweep_interval_s, metrics.stored_response_counts
            ),
            name="stored-responses-sweeper",
        )
    )
    if process_metrics is not None:
        components.tasks.append(
            asyncio.create_task(
                process_metrics.run(
                    components.own_metric_families, settings.metrics_write_interval_s
                ),
                name="process-metrics-writer",
            )
        )
    start_canaries(components)
    return components


def start_canaries(components: Components) -> None:
    """The canary scanner's refresh and, when an interval is set, the prober."""
    settings, scanner = components.settings, components.scanner
    if not isinstance(scanner, CanaryScanner):
        return  # canary scanning is off
    canary_metrics = CanaryMetrics(components.metrics.registry, scanner)
    # Drops expired markers and, with Redis, adopts the other replicas'.
    components.tasks.append(
        asyncio.create_task(scanner.run_refresh(settings.canary_refresh_s), name="canary-refresh")
    )
    if settings.canary_interval_s > 0:
        prober = CanaryProber(
            components.core,
            components,
            components.capacity,
            scanner,
            ttl_s=settings.canary_marker_ttl_s,
            max_tokens=settings.canary_max_tokens,
            metrics=canary_metrics,
        )
        components.tasks.append(
            asyncio.create_task(prober.run(settings.canary_interval_s), name="canary-prober")
        )


async def close_components(components: Components) -> None:
    for task in components.tasks:
        task.cancel()
    await asyncio.gather(*components.tasks, return_exceptions=True)
    if components.process_metrics is not None:
        components.process_metrics.close(components.own_metric_families)  # its counts outlive it
    components.parser.close()
    await components.budgets.drain()  # charges under way reach their counters
    await components.limiter.close()  # so do settles, and shares go back
    if components.ledger.shared is not None:
        await components.ledger.shared.drain()  # leased KV room goes back (or expires)
    await components.audit.close()
    await components.capacity.close()
    await components.dispatcher.aclose()
    if components.redis is not None:
        await components.redis.aclose()
    components.store.dispose()
