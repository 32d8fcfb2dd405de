"""Process settings, read from the environment (prefix ``ISOGATE_``) and ``.env``.

Per-model and per-tenant rules live in ``policies/`` (see ``gateway.config.policies``); this module
holds only what differs between deployments of the same policies.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gateway.common.deadlines import DEFAULT_RESOLUTION_S

REPO_ROOT = Path(__file__).resolve().parents[2]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ISOGATE_", env_file=".env", extra="ignore")

    # Serving
    host: str = "127.0.0.1"
    port: int = 8080
    policies_dir: Path = REPO_ROOT / "policies"
    log_level: str = "info"
    log_json: bool = True
    # Set by ``serve --workers N`` (N > 1), not by hand: the run's directory where each process
    # leaves its metrics for the scrapes the others answer (observability.multiprocess), and
    # how often each rewrites its file there (how far a scrape may lag a process's counts).
    metrics_dir: Path | None = None
    metrics_write_interval_s: float = Field(default=1.0, gt=0)
    # A diagnostic, off unless set (the real-engine fuzzing sets it): the directory where each
    # process writes the stacks of all its threads whenever its event loop has not woken its
    # lag probe for loop_stall_report_after_s (observability.loop_lag.StallReport).
    loop_stall_report_dir: Path | None = None
    loop_stall_report_after_s: float = Field(default=0.05, gt=0)

    # Client bounds (server.http_server, api.pipeline.read_body): how long a client may
    # take to send a request's headers and its body, how large its headers may be, how many
    # connections may be open at once, and how long an idle keep-alive connection stays open.
    header_timeout_s: float = Field(default=10.0, gt=0)
    body_timeout_s: float = Field(default=30.0, gt=0)
    max_header_bytes: int = Field(default=32 * 1024, gt=0)
    max_connections: int = Field(default=4096, gt=0)
    keep_alive_timeout_s: int = Field(default=5, gt=0)
    # Connections one client address may hold open at once (its next is answered 503 and
    # closed as it opens), so that one address cannot fill max_connections; the trusted
    # proxies (forwarded_allow_ips) are not capped. Per server process.
    max_connections_per_address: int = Field(default=256, gt=0)
    # A new connection that has not sent its first byte within this long is closed (silently):
    # an idle socket is held this long, not header_timeout_s.
    first_byte_timeout_s: float = Field(default=2.0, gt=0)
    # How late one of these timeouts, or an upstream one, may fire: how often each sweep of
    # deadlines runs (gateway.common.deadlines) while connections are open.
    deadline_resolution_s: float = Field(default=DEFAULT_RESOLUTION_S, gt=0, le=1.0)

    # Request bounds. The body limit sits above the largest prompt we want to refuse
    # *cheaply* (by byte length, without tokenizing) rather than with a bare 413.
    max_body_bytes: int = 64 * 1024 * 1024
    # Bodies at least this long are parsed and validated in a child process (gateway.server.intake),
    # in at most this many at once.
    parse_off_loop_min_bytes: int = Field(default=256 * 1024, ge=0)
    parse_processes: int = Field(default=1, gt=0)
    # Prompts whose text is at least this long are tokenized off the event loop.
    tokenize_in_thread_min_chars: int = 16_384

    # Upstream (SGLang workers)
    upstream_connect_timeout_s: float = 2.0
    upstream_timeout_s: float = 120.0
    # A worker that has not answered a capacity poll for this long is not routed to.
    capacity_poll_interval_s: float = Field(default=1.0, gt=0)
    # Keep it above twice the poll interval plus a second: a slow worker's failed poll (which
    # times out at half of it) must be seen, and its /health asked, before it runs out. Twice
    # the interval or less is refused (``_polls_renew_capacity_before_it_goes_stale``).
    capacity_stale_after_s: float = Field(default=5.0, gt=0)
    # Slow is not dead: while a worker passes its liveness probe (SGLang's /health), its last
    # capacity record is routed on up to this old (claims still bound what is sent to it).
    capacity_max_age_if_alive_s: float = Field(default=30.0, gt=0)
    # A worker whose capacity polls fail and whose /health does not answer 200 within this
    # long is taken out at once.
    worker_liveness_timeout_s: float = Field(default=10.0, gt=0)
    # Tokens kept free in every pool on top of prompt + max_tokens (the dev decode workers'
    # --num-reserved-decode-tokens is no larger: gateway/dev/cluster.py).
    admission_safety_margin_tokens: int = 16

    # Fair queueing per worker pair (gateway.core.pair_queues). Requests in flight per pair before
    # the rest queue, where neither the pool's policy nor the engine's own
    # max_running_requests sets a lower cap: where the CPU dev pair's throughput stopped
    # growing with concurrency (docs/operations.md, section 9).
    queue_in_flight_per_pair: int = Field(default=24, gt=0)
    # The same while more than one tenant holds or wants slots of a pair, and for
    # queue_contention_linger_s after (a tenant within its share still starts at once): the
    # cap that met most of the noisy-neighbour targets measured on a CPU pair (a quiet
    # tenant's p50 within 2.5x of alone, the pair's throughput within 80 % of no queue), and a
    # linger longer than such a tenant's pause between requests (docs/operations.md,
    # section 9). Unset: no lower cap.
    queue_in_flight_per_pair_contended: int | None = Field(default=8, gt=0)
    queue_contention_linger_s: float = Field(default=10.0, ge=0)
    # The longest a request waits for its turn before 429 (its tenant is over its share) or
    # 503 (the pair is full), with Retry-After.
    queue_max_wait_s: float = Field(default=10.0, gt=0)
    # Requests one tenant may have waiting per pair; past it, refused at once.
    queue_max_per_tenant: int = Field(default=256, ge=0)
    # Gateway replicas sharing the workers: each replica's cap is its share of the pair's
    # (ceil(cap / replicas)), so all of them together stay within the cap.
    queue_replicas: int = Field(default=1, gt=0)

    # State
    database_url: str = f"sqlite:///{REPO_ROOT / '.run' / 'isogate.db'}"
    # Empty (ISOGATE_REDIS_URL=) is no Redis, for every part alike: one process by default.
    redis_url: str | None = None
    # Prefix of every Redis key this deployment uses (capacity, limits, canaries).
    redis_key_prefix: str = "isogate"
    # With Redis, every process renews its KV leases this often; a lease not renewed for three
    # heartbeats (a process killed while holding it) is free again.
    claim_heartbeat_s: float = Field(default=1.0, gt=0)
    # With Redis, each process admits within KV room it leases from Redis per worker, and asks
    # Redis only for a request its lease cannot hold: then for what that request lacks plus
    # this fraction of the worker's pool spare, so the next requests fit locally. Each
    # heartbeat shrinks a lease to what is in use plus this block (none once idle): what one
    # idle process withholds from the others, for one heartbeat (gateway.core.shared_claims).
    # 0: every growth is exactly what a request lacks.
    claim_lease_block: float = Field(default=1 / 16, ge=0, le=1)
    # With Redis, each process takes its tenants' limits from Redis in shares and spends them
    # without asking Redis: at most this fraction of each limit unspent (gateway.tenancy.
    # limit_shares), given back at once past it and every heartbeat once idle. 0: every
    # request's count, slot and tokens are taken and given back in Redis one by one.
    limits_spare_fraction: float = Field(default=1 / 64, ge=0, le=1)
    # The admin key (raw). Requests bearing it may administer tenants and read every audit event.
    admin_key: str | None = None
    # Secret from which per-tenant cache salts (SGLang ``extra_key``) are derived.
    cache_salt_secret: str = Field(default="dev-insecure-cache-salt-secret", min_length=16)
    audit_spool_dir: Path = REPO_ROOT / ".run" / "audit-spool"
    audit_batch_size: int = 500
    # How often expired stored responses are deleted (each is unreadable from its expiry on).
    response_sweep_interval_s: float = Field(default=300.0, gt=0)
    # Short on purpose: a batch is inserted on the event loop's core (SQLite: on the loop, 64
    # rows per turn), so a long interval means a long burst (260 rows, ~4 ms at 1,300 req/s)
    # that requests arriving meanwhile wait out. 20 ms keeps bursts under ~0.5 ms; a hard kill
    # loses less.
    audit_flush_interval_s: float = 0.02
    # Failed authentications a client address may make per minute (per replica) before its
    # failures are answered 429 and its unknown keys looked up one at a time (a valid key from
    # it is still served: gateway.tenancy.auth.UnauthenticatedClients).
    unauthenticated_per_address_per_minute: int = Field(default=600, gt=0)
    # Peers whose X-Forwarded-For names the client (the proxies in front: IPs or networks,
    # comma-separated, "*" for any; uvicorn's forwarded_allow_ips): behind them, the address
    # failed authentications count against is the one they forward, and their own connections
    # are not capped per address. Empty: no proxy; the header is ignored.
    forwarded_allow_ips: str = ""
    auth_cache_ttl_s: float = 5.0
    # While the key store cannot be reached, a key this process saw valid within this long
    # keeps working (a database outage must not take the gateway down); 0 turns it off.
    auth_stale_if_error_s: float = 600.0

    # Canary prober (gateway.service.canary): 0 disables it.
    canary_interval_s: float = 0.0
    # Outputs are scanned for other tenants' live canary markers (also those of other replicas).
    canary_scan: bool = True
    # How long a marker stays live after its probe: as long as its KV pages may linger.
    canary_marker_ttl_s: float = Field(default=900.0, gt=0)
    # How often the scanner re-reads the markers shared through Redis.
    canary_refresh_s: float = Field(default=1.0, gt=0)
    canary_max_tokens: int = Field(default=8, gt=0)
    canary_redis_key: str = "isogate:canary:markers"

    @model_validator(mode="after")
    def _polls_renew_capacity_before_it_goes_stale(self) -> Settings:
        # Otherwise a record goes stale between two polls (a poll may take half the window),
        # and requests to a worker with a stale record may be refused (503 no_worker_available)
        # until the next poll: measured with a 30 s interval and the default window, every
        # request for seconds at a time.
        if self.capacity_stale_after_s <= 2 * self.capacity_poll_interval_s:
            raise ValueError(
                f"ISOGATE_CAPACITY_STALE_AFTER_S ({self.capacity_stale_after_s:g} s) must be more "
                f"than twice ISOGATE_CAPACITY_POLL_INTERVAL_S "
                f"({self.capacity_poll_interval_s:g} s): a worker's capacity record would go "
                "stale between two polls, and requests be refused until the next one"
            )
        return self

    @field_validator("redis_url", mode="before")
    @classmethod
    def _empty_redis_url_is_none(cls, value: object) -> object:
        return None if value == "" else value
