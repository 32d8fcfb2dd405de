"""The instant-backend rig: instant backends (prefill, decode, a slow-streaming decode),
``sglang_router``, SMG (where ``.venv-smg`` is installed) and the gateway in front of them,
started once for sections 1, 2 and 4."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench.config import BenchConfig
from bench.processes import (
    SMG_BINARY,
    BenchModel,
    BenchPool,
    Server,
    instant_backend,
    pd_router,
    python_relay,
    start_gateway,
    write_bench_policies,
)
from gateway.dev.deepseek_model import ensure_deepseek_model
from gateway.dev.harness import GatewayProcess
from gateway.dev.model import ensure_tiny_model

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
POOL_TOKENS = 8_388_608  # the instant backends' advertised KV pool: admission never binds on it
MODEL = "tiny-llama"  # everyday limit: the 65,536-token policy of the dev model
LONG_MODEL = "tiny-llama-long"  # admits the 1M-token prompts of the tokenization bench
SLOW_MODEL = "tiny-llama-slow"  # its decode streams slowly: the memory bench's held streams
# DeepSeek-V4's real tokenizer under the incident's limit: the prompt bench's 1M-token refusal.
DEEPSEEK_MODEL = "deepseek-v4-tiny"
INCIDENT_LIMIT_TOKENS = 681_280
# Every gateway in front of the instant backends but the hostile bench's: the backends never
# saturate, yet the default per-pair cap (a CPU pair's knee) would hold the load in the fair
# queue, and the per-address connection cap would refuse the memory bench's streams (all from
# one address). Lifted, the pair's cap is what the backends report. Settings, not policy
# fields: older checkouts (BENCH_GATEWAY_ROOT) ignore an unknown setting.
INSTANT_GATEWAY_ENV = {
    "ISOGATE_QUEUE_IN_FLIGHT_PER_PAIR": "1000000",
    "ISOGATE_MAX_CONNECTIONS_PER_ADDRESS": "1000000",
}


@dataclass
class Rig:
    config: BenchConfig
    work_dir: Path
    direct_url: str
    routers: dict[str, Server]  # "sglang_router" and, where installed, "smg"
    gateway: GatewayProcess
    gateway_key: str
    slow_decode: Server
    pool: BenchPool  # the instant prefill and decode every model but the slow one routes to
    # Section 1's plain-mode extras (``BENCH_SCALE``): name, url, process group, tenant key
    # (scale-out, the HTTP layer, the floor).
    scale_out: list[tuple[str, str, int, str]] = field(default_factory=list)

    @property
    def gateway_url(self) -> str:
        return self.gateway.url

    @property
    def gateway_pid(self) -> int:
        assert self.gateway.process is not None
        return self.gateway.process.pid


def _backend(
    config: BenchConfig, work: Path, up: contextlib.ExitStack, role: str, port: int, **slow
) -> Server:
    """An instant backend, stopped when ``up`` closes."""
    cpus, priority = config.helper_cpus, config.priority
    server = instant_backend(
        role, port, work, cpus=cpus, pool_tokens=POOL_TOKENS, priority=priority, **slow
    )
    up.callback(server.stop)
    return server


@contextlib.contextmanager
def instant_rig(config: BenchConfig, work_dir: Path) -> Iterator[Rig]:
    ports = config.ports
    with contextlib.ExitStack() as up:
        prefill = _backend(config, work_dir, up, "prefill", ports.prefill)
        decode = _backend(config, work_dir, up, "decode", ports.decode)
        slow = {"chunks": 600, "stream_interval_s": 2.0}
        slow_decode = _backend(config, work_dir, up, "decode", ports.slow_decode, **slow)
        pool = BenchPool(prefill.url, ports.bootstrap, decode.url)
        routers: dict[str, Server] = {}
        scale, unpinned = config.scale and config.runs("routing"), []
        for kind, port in (("sglang-router", ports.router), ("smg", ports.smg)):
            for both in (False, True) if scale else (False,):
                if kind == "smg" and not SMG_BINARY.exists():
                    continue  # section 1 runs without it
                # Every CPU given explicitly: left unset, a router would inherit the runner's
                # own pinning to the helper CPUs.
                cpus = config.all_cpus if both else config.router_cpus
                placed = {"cpus": cpus, "priority": config.priority, "models": [MODEL]}
                server = pd_router(kind, pool, port + 4 * both, work_dir, **placed)
                up.callback(server.stop)
                name = kind.replace("-", "_")
                if both:  # both cores: section 1's scale-out cells
                    unpinned.append((name + "_unpinned", server.url, server.pid, ""))
                else:
                    routers[name] = server
        slow_pool = BenchPool(prefill.url, ports.bootstrap, slow_decode.url)
        deepseek = ensure_deepseek_model()
        models = [
            BenchModel(MODEL, 65_536, pool), BenchModel(LONG_MODEL, 4_194_304, pool),
            BenchModel(SLOW_MODEL, 65_536, slow_pool),
            BenchModel(DEEPSEEK_MODEL, INCIDENT_LIMIT_TOKENS, pool, tokenizer_dir=deepseek),
        ]  # fmt: skip
        tiny = ensure_tiny_model()
        policies = write_bench_policies(work_dir / "policies", tokenizer_dir=tiny, models=models)
        gateway, key = start_gateway(
            policies, work_dir / "gateway", ports.gateway, cpus=config.router_cpus,
            priority=config.priority, root=config.gateway_root, env=INSTANT_GATEWAY_ENV,
        )  # fmt: skip
        up.callback(gateway.stop)
        rig = Rig(config, work_dir, decode.url, routers, gateway, key, slow_decode, pool, unpinned)
        # Scale-out: ``serve --workers 2`` on both cores, and one process pinned, claims in
        # Redis; the HTTP layer: the same app under granian, where installed, pinned too.
        prefix = {"ISOGATE_REDIS_KEY_PREFIX": "isogate-bench-" + secrets.token_hex(4)}
        redis = INSTANT_GATEWAY_ENV | prefix | {"ISOGATE_REDIS_URL": REDIS_URL}
        variants = [("gateway_workers2", config.all_cpus, {"workers": 2, "env": redis})]
        variants.append(("gateway_redis", config.router_cpus, {"workers": 1, "env": redis}))
        if importlib.util.find_spec("granian"):
            variants.append(("gateway_granian", config.router_cpus, {"granian": True}))
        for offset, (name, cpus, options) in enumerate(variants if scale else [], start=1):
            extra, extra_key = start_gateway(
                policies, work_dir / name, ports.gateway + 2 * offset, cpus=cpus,
                priority=config.priority, root=config.gateway_root,
                **{"env": INSTANT_GATEWAY_ENV} | options,
            )  # fmt: skip
            up.callback(extra.stop)
            assert extra.process is not None
            rig.scale_out.append((name, extra.url, extra.process.pid, extra_key))
        if scale:  # the floor: what of the gateway's cost is its HTTP stack, pinned like it
            relay = python_relay(
                pool, ports.python_relay, work_dir, cpus=config.router_cpus,
                priority=config.priority,
            )  # fmt: skip
            up.callback(relay.stop)
            rig.scale_out.append(("python_relay", relay.url, relay.pid, key))
        yield rig


@contextlib.contextmanager
def instant_pair(
    config: BenchConfig, work: Path, offset: int = 0
) -> Iterator[tuple[Path, BenchPool]]:
    """The two instant backends as one PD pair behind ``MODEL``, for benches with their own
    gateways: the policies directory and the pair (ports: the defaults + ``offset``)."""
    ports = config.ports
    with contextlib.ExitStack() as up:
        prefill = _backend(config, work, up, "prefill", ports.prefill + offset)
        decode = _backend(config, work, up, "decode", ports.decode + offset)
        pool = BenchPool(prefill.url, ports.bootstrap + offset, decode.url)
        model = BenchModel(MODEL, 65_536, pool)
        tokenizer = ensure_tiny_model()
        yield write_bench_policies(work / "policies", tokenizer_dir=tokenizer, models=[model]), pool
