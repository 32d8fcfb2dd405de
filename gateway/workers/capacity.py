"""Live KV pool capacity of every worker, polled from SGLang and shared between replicas.

Each worker is polled every ``capacity_poll_interval_s`` on ``/v1/loads`` (pool size and
tokens in use, read from shared memory: cheap even on a busy worker), and every ten seconds or
after an error on ``/server_info`` and ``/v1/models`` (``max_req_input_len``, page size, context
length, whether ``engine_patch`` is loaded). An observation older than
``capacity_stale_after_s`` is no observation: ``CapacityRegistry.get`` returns ``None`` and the
worker is not routed to, with one exception: slow is not dead.

Capacity and liveness are two signals. Liveness is the worker answering: a capacity poll, a
generation (``seen_serving``, from dispatch) or, for a worker whose polls fail, SGLang's
``/health`` (a one-token generation on an idle worker, so it is asked only then). A busy
worker's ``/server_info`` can take many seconds while it serves at full speed, and taking it
out for that turned load into an outage. So while a worker is alive, its last capacity record
keeps being used up to ``max_age_if_alive_s`` old: the claims ledger (``gateway.core.admission``)
still bounds what is routed to it, on top of the use that record saw. A worker whose polls
fail and whose ``/health`` fails too is taken out at once, however young its record.
Numbers are never guessed.

With Redis configured, one replica per interval polls each worker (a short Redis lease),
writes what it observed under one key per worker (with the staleness TTL), and every replica
decides on what Redis holds: all replicas decide on the same observation. Without Redis (or
while it does not answer), each replica decides on its own observations.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any, Literal

import orjson

from gateway.workers.upstream import UpstreamClient, UpstreamError

log = logging.getLogger(__name__)

Role = Literal["prefill", "decode"]
ENGINE_PATCH_MARKER = "isogate_engine_patch"


@dataclass(frozen=True, slots=True)
class WorkerCapacity:
    url: str
    role: Role
    observed_at: float  # wall-clock seconds of the poll that produced it
    max_total_num_tokens: int
    max_req_input_len: int | None
    context_length: int | None
    page_size: int
    used_tokens: int
    # Version string of engine_patch when the worker runs it, else None.
    engine_patch: str | None
    # The most requests the engine runs at once (its smallest DP rank's), when it says.
    max_running_requests: int | None = None
    # Requests waiting in the engine's own queues (the least loaded rank's).
    waiting_requests: int = 0
    # Started with ``--incremental-streaming-output``: each stream chunk carries only what it
    # adds (without it, every chunk repeats the whole output so far).
    incremental_streams: bool = False

    @property
    def available_tokens(self) -> int:
        return max(0, self.max_total_num_tokens - self.used_tokens)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> WorkerCapacity:
        return cls(**orjson.loads(raw))


def parse_worker_state(
    url: str,
    role: Role,
    server_info: dict[str, Any],
    loads: dict[str, Any],
    observed_at: float,
    models: dict[str, Any] | None = None,
) -> WorkerCapacity:
    """Build a capacity record from SGLang's ``/server_info`` and ``/v1/loads`` bodies.

    With several DP ranks a request lands on one of them: the pool is the smallest rank's
    and the use is the least loaded rank's.
    """
    internal = server_info.get("internal_states") or [{}]
    ranks = loads.get("loads") or []
    pools = [int(r["max_total_num_tokens"]) for r in ranks if r.get("max_total_num_tokens")]
    if not pools:
        pools = [int(s["max_total_num_tokens"]) for s in internal if s.get("max_total_num_tokens")]
    if not pools:
        raise ValueError("worker reports no max_total_num_tokens")
    used = min((int(r.get("num_used_tokens", 0)) for r in ranks), default=0)
    running = [int(r["max_running_requests"]) for r in ranks if r.get("max_running_requests")]
    if not running:
        running = [
            int(s["effective_max_running_requests_per_dp"])
            for s in internal
            if s.get("effective_max_running_requests_per_dp")
        ]
    waiting = min((int(r.get("num_waiting_reqs", 0)) for r in ranks), default=0)
    max_req_input_len = _first_int(server_info, internal, "max_req_input_len")
    # The advertised context length: the flag when set, else what /v1/models reports.
    context_length = _first_int(server_info, internal, "context_length")
    if context_length is None and models:
        context_length = next(
            (
                int(card["max_model_len"])
                for card in models.get("data", [])
                if isinstance(card.get("max_model_len"), int)
            ),
            None,
        )
    page_size = _first_int(server_info, internal, "page_size") or 1
    marker = server_info.get(ENGINE_PATCH_MARKER) or next(
        (s.get(ENGINE_PATCH_MARKER) for s in internal if s.get(ENGINE_PATCH_MARKER)), None
    )
    return WorkerCapacity(
        url=url,
        role=role,
        observed_at=observed_at,
        max_total_num_tokens=min(pools),
        max_req_input_len=max_req_input_len,
        context_length=context_length,
        page_size=page_size,
        used_tokens=used,
        engine_patch=str(marker) if marker else None,
        max_running_requests=min(running) if running else None,
        waiting_requests=waiting,
        incremental_streams=server_info.get("incremental_streaming_output") is True,
    )


def _first_int(top: dict[str, Any], internal: list[dict[str, Any]], key: str) -> int | None:
    for source in (*internal, top):
        value = source.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


# A worker endpoint's JSON answer, by URL; raises unless the worker answered 200.
GetJSON = Callable[[str], Awaitable[Any]]


def json_getter(client: UpstreamClient) -> GetJSON:
    """``GetJSON`` over the gateway's lean HTTP client: httpx cost several times as much CPU per
    poll, every second for every worker."""

    async def get_json(url: str) -> Any:
        status, body = await client.get(url)
        if status != 200:
            raise UpstreamError(f"{url} answered {status}")
        return orjson.loads(body)

    return get_json


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """What a worker says about itself that changes only when it restarts."""

    server_info: dict[str, Any]
    models: dict[str, Any]
    fetched_at: float


async def fetch_config(get_json: GetJSON, url: str) -> WorkerConfig:
    info, models = await asyncio.gather(
        get_json(f"{url}/server_info"), get_json(f"{url}/v1/models")
    )
    return WorkerConfig(info, models, time.monotonic())


async def poll_worker(
    get_json: GetJSON, url: str, role: Role, config: WorkerConfig | None = None
) -> tuple[WorkerCapacity, WorkerConfig]:
    """One observation: ``/v1/loads`` always (cheap, live), the configuration when not given.

    Stamped when the answer arrives: the age of a record is how long ago the worker spoke,
    not how long another, slower worker's poll kept the batch waiting.
    """
    loads_url = f"{url}/v1/loads?include=core"
    if config is None:
        fetched, loads = await asyncio.gather(fetch_config(get_json, url), get_json(loads_url))
        config = fetched
    else:
        loads = await get_json(loads_url)
    observed_at = time.time()
    state = parse_worker_state(url, role, config.server_info, loads, observed_at, config.models)
    return state, config


class CapacityRegistry:
    """The newest fresh observation of each worker; ``run`` keeps it current."""

    def __init__(
        self,
        *,
        poll_interval_s: float,
        stale_after_s: float,
        redis: Any | None = None,
        key_prefix: str = "isogate",
        config_refresh_s: float = 10.0,
        max_age_if_alive_s: float | None = None,
        liveness_timeout_s: float = 10.0,
    ) -> None:
        self._poll_interval_s = poll_interval_s
        self._stale_after_s = stale_after_s
        self._max_age_if_alive_s = max(stale_after_s, max_age_if_alive_s or stale_after_s)
        self._liveness_timeout_s = liveness_timeout_s
        # Wall-clock time each worker last showed it serves (``/health`` or a capacity poll).
        self._alive_at: dict[str, float] = {}
        self._liveness_errors: dict[str, str] = {}
        self._redis = redis
        self._key_prefix = key_prefix
        self._workers: dict[str, Role] = {}
        self._observed: dict[str, WorkerCapacity] = {}
        self._errors: dict[str, str] = {}
        # Decode workers seen repeating their whole output in every stream chunk (warned once).
        self._repeating: set[str] = set()
        self._configs: dict[str, WorkerConfig] = {}
        self._config_refresh_s = config_refresh_s
        # A poll slower than half the staleness window would make a busy worker look dead.
        # Its connections stay open between polls, and their deadlines are swept while they
        # are: a coarse sweep, since a poll's timeout may fire that much late.
        timeout_s = max(0.5, stale_after_s / 2)
        self._client = UpstreamClient(
            connect_timeout_s=timeout_s, timeout_s=timeout_s, deadline_resolution_s=0.5
        )
        self._get_json = json_getter(self._client)
        self._refreshed = asyncio.Event()
        # Set when a poll fails: the liveness prober asks that worker's /health now, not at its
        # next tick, so a slow worker's liveness is renewed before its record goes stale.
        self._poll_failed = asyncio.Event()
        # Set, and replaced, at the end of every refresh: what a waiter for the next poll awaits.
        self._next_refresh = asyncio.Event()
        # Bumped whenever an observation is adopted or dropped: what was derived from the
        # observations (gateway.core.routing.RoutingCache) is valid while it is unchanged.
        self.version = 0

    @property
    def stale_after_s(self) -> float:
        return self._stale_after_s

    @property
    def poll_interval_s(self) -> float:
        return self._poll_interval_s

    def set_workers(self, workers: Iterable[tuple[str, Role]]) -> None:
        self._workers = dict(workers)
        for url in list(self._observed):
            if url not in self._workers:
                del self._observed[url]
        for known in (self._alive_at, self._liveness_errors):
            for url in list(known):
                if url not in self._workers:
                    del known[url]
        self.version += 1

    def adopt(self, state: WorkerCapacity) -> None:
        """Make ``state`` the worker's current observation."""
        self._observed[state.url] = state
        self.version += 1

    def get(self, url: str) -> WorkerCapacity | None:
        """The capacity record to route on: fresh, or older (to ``max_age_if_alive_s``) while
        the worker is alive; None if there is none, or the worker is dead."""
        state = self._observed.get(url)
        if state is None or url in self._liveness_errors:
            return None
        age = time.time() - state.observed_at
        if age <= self._stale_after_s or (age <= self._max_age_if_alive_s and self.alive(url)):
            return state
        return None

    def usable_until(self, state: WorkerCapacity) -> float:
        """Wall-clock time after which ``get`` may no longer return ``state``."""
        fresh_until = state.observed_at + self._stale_after_s
        alive_at = self._alive_at.get(state.url)
        if alive_at is None or state.url in self._liveness_errors:
            return fresh_until
        return max(
            fresh_until,
            min(state.observed_at + self._max_age_if_alive_s, alive_at + self._stale_after_s),
        )

    def fresh(self, url: str) -> bool:
        """The worker's capacity record is fresh (its last poll is recent)."""
        state = self._observed.get(url)
        return state is not None and time.time() - state.observed_at <= self._stale_after_s

    def alive(self, url: str) -> bool:
        """The worker showed recently that it serves, and its last liveness probe passed."""
        alive_at = self._alive_at.get(url)
        return (
            alive_at is not None
            and url not in self._liveness_errors
            and time.time() - alive_at <= self._stale_after_s
        )

    def error(self, url: str) -> str | None:
        return self._errors.get(url)

    def liveness_error(self, url: str) -> str | None:
        return self._liveness_errors.get(url)

    def seen_serving(self, urls: Iterable[str]) -> None:
        """The workers answered (a poll, a probe, or a generation through dispatch: its pair
        at once)."""
        now = time.time()
        for url in urls:
            self._alive_at[url] = now
            if self._liveness_errors and self._liveness_errors.pop(url, None) is not None:
                log.info("capacity: worker %s serves again", url)
                self.version += 1

    async def probe_liveness(self) -> None:
        """Ask ``/health`` of every worker whose capacity poll failed, together (the others'
        polls answered: that is liveness enough, and costs the worker no generation)."""
        await asyncio.gather(*(self._probe(url) for url in self._workers if url in self._errors))

    async def _probe(self, url: str) -> None:
        try:
            status, _ = await self._client.get(f"{url}/health", self._liveness_timeout_s)
            if status >= 400:
                raise UpstreamError(f"/health answered {status}")
        except Exception as exc:
            if url not in self._liveness_errors:
                log.warning("capacity: worker %s failed its liveness probe: %s", url, exc)
                self.version += 1  # taken out now: what was derived from it is invalid
            self._liveness_errors[url] = f"{type(exc).__name__}: {exc}"
            return
        self.seen_serving((url,))

    async def run_liveness(self) -> None:
        while True:
            started = time.monotonic()
            self._poll_failed.clear()
            try:
                await self.probe_liveness()
            except Exception:  # never let the prober die
                log.exception("capacity: liveness probe failed")
            remaining = max(0.0, self._poll_interval_s - (time.monotonic() - started))
            # Woken early by a failed poll: waiting for the tick could let the worker's last
            # sign of life pass the staleness window while it is only slow.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poll_failed.wait(), remaining)

    async def wait_refreshed(self) -> None:
        await self._refreshed.wait()

    async def next_refresh(self, timeout_s: float) -> bool:
        """Wait until the refresh after this moment has ended; False if none ended within
        ``timeout_s``."""
        try:
            await asyncio.wait_for(self._next_refresh.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def refresh(self) -> None:
        """Poll the workers this replica is responsible for, publish, then adopt the shared view.

        Each answer is adopted as it arrives: a worker whose endpoints hang must not age
        the records of the healthy ones while the batch waits for it.
        """
        workers = list(self._workers.items())
        if self._redis is not None:
            workers = await self._claim_polls(self._redis, workers)
        await asyncio.gather(*(self._observe(url, role) for url, role in workers))
        if self._redis is not None:
            await self._adopt_shared(self._redis)
        self._refreshed.set()
        ended, self._next_refresh = self._next_refresh, asyncio.Event()
        ended.set()

    async def _observe(self, url: str, role: Role) -> None:
        try:
            state, config = await poll_worker(self._get_json, url, role, self._config_for(url))
        except Exception as exc:
            if url not in self._errors:
                log.warning("capacity: %s worker %s stopped answering polls: %s", role, url, exc)
            self._errors[url] = f"{type(exc).__name__}: {exc}"
            self._poll_failed.set()
            kept = self._configs.get(url)
            if kept is not None and self.alive(url):
                # Slow, not gone: keep its configuration (a restart fails liveness) and try
                # the cheap poll next time rather than /server_info, which is what is slow.
                self._configs[url] = WorkerConfig(kept.server_info, kept.models, time.monotonic())
            else:
                self._configs.pop(url, None)  # it may come back with another configuration
            return
        if self._errors.pop(url, None) is not None:
            log.info("capacity: %s worker %s answers polls again", role, url)
        self.seen_serving((url,))
        self._configs[url] = config
        self._note_stream_mode(state)
        self.adopt(state)
        if self._redis is not None:
            try:
                await self._redis.set(
                    self._key(url), state.to_json(), px=max(1, int(self._stale_after_s * 1000))
                )
            except Exception as exc:  # Redis down: our own observations are still real ones.
                log.warning("capacity: redis unavailable, deciding on local observations: %s", exc)

    def _note_stream_mode(self, state: WorkerCapacity) -> None:
        if state.role != "decode" or state.incremental_streams:
            self._repeating.discard(state.url)
        elif state.url not in self._repeating:
            self._repeating.add(state.url)
            log.warning(
                "capacity: decode worker %s repeats its whole output in every stream chunk, "
                "which the gateway parses at every token; start it with "
                "--incremental-streaming-output (docs/operations.md, section 1)",
                state.url,
            )

    def _config_for(self, url: str) -> WorkerConfig | None:
        config = self._configs.get(url)
        if config is None or time.monotonic() - config.fetched_at > self._config_refresh_s:
            return None
        return config

    # ``redis`` is the client (redis.asyncio.Redis) as Any: redis-py types its async replies as
    # ``Awaitable[Any] | Any``, which cannot be awaited type-safely.
    async def _claim_polls(
        self, redis: Any, workers: list[tuple[str, Role]]
    ) -> list[tuple[str, Role]]:
        """One replica polls each worker per interval (a Redis lease); the others read its record.

        So every replica decides on the same observation instead of each on its own. If Redis
        does not answer, this replica polls everything itself.
        """
        lease_ms = max(1, int(self._poll_interval_s * 900))
        try:
            async with redis.pipeline(transaction=False) as pipe:
                for url, _ in workers:
                    pipe.set(f"{self._key(url)}:poller", "1", nx=True, px=lease_ms)
                won = await pipe.execute()
        except Exception:
            return workers
        return [worker for worker, mine in zip(workers, won, strict=False) if mine]

    async def _adopt_shared(self, redis: Any) -> None:
        """Adopt the newest observation of every worker that Redis holds."""
        keys = [self._key(url) for url in self._workers]
        try:
            replies = await redis.mget(keys)
        except Exception as exc:
            log.warning("capacity: redis unavailable, deciding on local observations: %s", exc)
            return
        for url, raw in zip(self._workers, replies, strict=False):
            if raw is None:
                continue
            state = WorkerCapacity.from_json(raw)
            mine = self._observed.get(url)
            if mine is None or state.observed_at > mine.observed_at:
                self.adopt(state)

    def _key(self, url: str) -> str:
        return f"{self._key_prefix}:capacity:{url}"

    async def run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.refresh()
            except Exception:  # never let the poller die; staleness takes workers out
                log.exception("capacity: refresh failed")
            await asyncio.sleep(max(0.0, self._poll_interval_s - (time.monotonic() - started)))

    async def close(self) -> None:
        await self._client.aclose()
