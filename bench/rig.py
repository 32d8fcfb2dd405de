"""The instant-backend rig: two instant backends (prefill, decode), a slow-streaming decode,
``sglang_router``, SMG (where ``.venv-smg`` is installed) and the gateway in front of them,
started once for the sections that use it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench.config import BenchConfig
from bench.processes import (
    SMG_BINARY,
    BenchModel,
    BenchPool,
    Managed,
    instant_backend,
    sglang_router,
    smg_router,
    start_gateway,
    write_bench_policies,
)
from gateway.dev.deepseek_model import ensure_deepseek_model
from gateway.dev.harness import GatewayProcess
from gateway.dev.model import ensure_tiny_model

POOL_TOKENS = 8_388_608  # the instant backends' advertised KV pool: admission never binds on it
MODEL = "tiny-llama"  # everyday limit: the 65,536-token policy of the dev model
LONG_MODEL = "tiny-llama-long"  # admits the 1M-token prompts of the tokenization bench
SLOW_MODEL = "tiny-llama-slow"  # its decode streams slowly: the memory bench's held streams
# DeepSeek-V4's real tokenizer under the incident's limit (its prefill pool, 681,280 tokens):
# the 1M-token refusal of the prompt bench.
DEEPSEEK_MODEL = "deepseek-v4-tiny"
INCIDENT_LIMIT_TOKENS = 681_280
SLOW_STREAM_INTERVAL_S = 2.0
SLOW_STREAM_CHUNKS = 600
# For every gateway in front of the instant backends but the hostile bench's (which keeps the
# product's defaults). The backends never saturate; the gateway's default cap on requests in
# flight per pair (a CPU pair's knee, gateway.core.pair_queues) would hold the bench's load in the
# fair queue (1,000 held streams: 12 flowing, the rest refused after their wait) instead of
# measuring the gateway passing it on. Lifted, the cap is what the backends report
# (max_running_requests 2048), as for a pool whose workers scale. A setting, not the pool's
# field: checkouts from before the queue read the same policies, and their schema forbids
# unknown keys, while they ignore an unknown setting.
INSTANT_GATEWAY_ENV = {"ISOGATE_QUEUE_IN_FLIGHT_PER_PAIR": "1000000"}


@dataclass
class Rig:
    config: BenchConfig
    work_dir: Path
    direct_url: str
    router_url: str
    router: Managed
    gateway: GatewayProcess
    gateway_key: str
    slow_decode: Managed
    pool: BenchPool  # the instant prefill and decode every model but the slow one routes to
    smg: Managed | None = None  # None where .venv-smg is not installed

    @property
    def gateway_url(self) -> str:
        return self.gateway.url

    @property
    def gateway_pid(self) -> int:
        assert self.gateway.process is not None
        return self.gateway.process.pid


@contextlib.contextmanager
def instant_rig(config: BenchConfig, work_dir: Path) -> Iterator[Rig]:
    ports = config.ports
    started: list[Managed] = []
    gateway: GatewayProcess | None = None
    try:
        backends = {}
        for name, role, port, kwargs in (
            ("prefill", "prefill", ports.prefill, {}),
            ("decode", "decode", ports.decode, {}),
            (
                "slow",
                "decode",
                ports.slow_decode,
                {"chunks": SLOW_STREAM_CHUNKS, "stream_interval_s": SLOW_STREAM_INTERVAL_S},
            ),
        ):
            backends[name] = instant_backend(
                role,
                port,
                work_dir,
                cpus=config.helper_cpus,
                pool_tokens=POOL_TOKENS,
                priority=config.priority,
                **kwargs,
            )
            started.append(backends[name])
        prefill_url, decode_url = (
            f"http://127.0.0.1:{backends[n].port}" for n in ("prefill", "decode")
        )
        slow_url = f"http://127.0.0.1:{backends['slow'].port}"
        router = sglang_router(
            prefill_url,
            ports.bootstrap,
            decode_url,
            ports.router,
            work_dir,
            cpus=config.router_cpus,
            priority=config.priority,
        )
        started.append(router)
        smg = None
        if SMG_BINARY.exists():
            smg = smg_router(
                prefill_url,
                ports.bootstrap,
                decode_url,
                ports.smg,
                work_dir,
                models=[MODEL],
                cpus=config.router_cpus,
                priority=config.priority,
            )
            started.append(smg)
        pool = BenchPool(prefill_url, ports.bootstrap, decode_url)
        slow_pool = BenchPool(prefill_url, ports.bootstrap, slow_url)
        policies = write_bench_policies(
            work_dir / "policies",
            tokenizer_dir=ensure_tiny_model(),
            models=[
                BenchModel(MODEL, 65_536, pool),
                BenchModel(LONG_MODEL, 4_194_304, pool),
                BenchModel(SLOW_MODEL, 65_536, slow_pool),
                BenchModel(
                    DEEPSEEK_MODEL,
                    INCIDENT_LIMIT_TOKENS,
                    pool,
                    tokenizer_dir=ensure_deepseek_model(),
                ),
            ],
        )
        gateway, key = start_gateway(
            policies,
            work_dir / "gateway",
            ports.gateway,
            cpus=config.router_cpus,
            priority=config.priority,
            root=config.gateway_root,
            env=INSTANT_GATEWAY_ENV,
        )
        yield Rig(
            config,
            work_dir,
            decode_url,
            f"http://127.0.0.1:{router.port}",
            router,
            gateway,
            key,
            backends["slow"],
            pool,
            smg,
        )
    finally:
        if gateway is not None:
            gateway.stop()
        for process in reversed(started):
            process.stop()


@contextlib.contextmanager
def instant_pair(config: BenchConfig, work: Path) -> Iterator[Path]:
    """The two instant backends as one PD pair behind ``MODEL`` (65,536-token limit), for the
    benches that run their own gateways; yields the policies directory; stops both backends."""
    ports = config.ports
    backends: list[Managed] = []
    try:
        for role, port in (("prefill", ports.prefill), ("decode", ports.decode)):
            backends.append(
                instant_backend(
                    role,
                    port,
                    work,
                    cpus=config.helper_cpus,
                    pool_tokens=POOL_TOKENS,
                    priority=config.priority,
                )
            )
        pool = BenchPool(
            f"http://127.0.0.1:{backends[0].port}",
            ports.bootstrap,
            f"http://127.0.0.1:{backends[1].port}",
        )
        yield write_bench_policies(
            work / "policies",
            tokenizer_dir=ensure_tiny_model(),
            models=[BenchModel(MODEL, 65_536, pool)],
        )
    finally:
        for backend in backends:
            backend.stop()
