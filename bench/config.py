"""What one ``make bench`` run measures and for how long, from its environment
(``bench/README.md``), on which ports and CPUs: the router under test gets the last CPU to
itself, so that every router is measured on one core, like for like."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

SECTIONS = frozenset({"routing", "memory", "prompt", "peers", "real", "fair", "hostile"})


def env_flag(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    return default if value is None else value.strip().lower() not in ("", "0", "false", "no")


@dataclass(frozen=True)
class Ports:
    prefill: int = 34010
    decode: int = 34011
    bootstrap: int = 34012
    slow_decode: int = 34013  # streams slowly: holds streams open for the memory bench
    python_relay: int = 34015  # section 1's floor: the gateway's HTTP stack, none of its checks
    router: int = 34020  # and router + 1 for its Prometheus endpoint; unpinned: + 4
    smg: int = 34022  # and smg + 1 for its Prometheus endpoint; unpinned: + 4
    gateway: int = 34030  # and the scale-out and granian gateways' from + 2
    # Spaced out: SGLang takes ports above its own for internal use (as gateway.dev.cluster does).
    real_prefill: int = 34100
    real_decode: int = 34120
    real_bootstrap: int = 34140
    real_router: int = 34160  # and + 1 for its Prometheus endpoint
    real_gateway: int = 34170


@dataclass(frozen=True)
class BenchConfig:
    quick: bool
    concurrencies: tuple[int, ...]
    wrk_duration_s: float
    ttft_duration_s: float
    routing_rounds: int  # runs per section-1 cell (one run moves by a third on a shared host)
    prompt_tokens: tuple[int, ...]  # tokenization/admission sizes
    refusal_megabytes: tuple[int, ...]
    refusal_repeats: int
    streams: tuple[int, ...]  # concurrent streams held open for the memory bench
    real_engine: bool
    real_requests: int  # per target and mode at one in flight on real SGLang
    peer_benches: bool
    audit_rows: int
    router_cpus: set[int] | None
    helper_cpus: set[int] | None
    all_cpus: set[int]  # what the runner may use before it pins itself to the helper CPUs
    priority: int  # autogroup nice of the bench's processes (0: none)
    gateway_root: Path | None  # run the gateway package of this checkout instead of ours
    scale: bool  # section 1 also unpinned: the Rust routers and ``serve --workers 2``
    sections: frozenset[str] = SECTIONS
    ports: Ports = field(default_factory=Ports)

    def runs(self, section: str) -> bool:
        return section in self.sections

    @classmethod
    def from_env(cls) -> BenchConfig:
        quick = env_flag("BENCH_QUICK")
        cpus = sorted(os.sched_getaffinity(0))
        pinned = len(cpus) >= 2 and env_flag("BENCH_PIN", True)
        sections = os.environ.get("BENCH_SECTIONS", ",".join(sorted(SECTIONS))).split(",")
        root = os.environ.get("BENCH_GATEWAY_ROOT")
        return cls(
            quick=quick,
            concurrencies=(1, 16, 64),
            wrk_duration_s=float(os.environ.get("BENCH_DURATION_S", 2 if quick else 4)),
            ttft_duration_s=1.5 if quick else 3.0,
            routing_rounds=int(os.environ.get("BENCH_ROUNDS", 1 if quick else 3)),
            prompt_tokens=(1_000, 10_000, 100_000, 1_000_000)
            if quick
            else (1_000, 4_000, 16_000, 64_000, 256_000, 1_000_000),
            refusal_megabytes=(1, 10, 50) if quick else (1, 5, 10, 25, 50),
            refusal_repeats=2 if quick else 5,
            streams=(1000,) if quick else (1000, 2000),
            real_engine=env_flag("BENCH_REAL_ENGINE", not quick),
            real_requests=int(os.environ.get("BENCH_REAL_REQUESTS", 6 if quick else 20)),
            peer_benches=env_flag("BENCH_PEERS", True),
            audit_rows=int(os.environ.get("BENCH_AUDIT_ROWS", 100_000 if quick else 1_000_000)),
            router_cpus={cpus[-1]} if pinned else None,
            helper_cpus=set(cpus[:-1]) if pinned else None,
            all_cpus=set(cpus),
            priority=int(os.environ.get("BENCH_PRIORITY", "0")),
            gateway_root=Path(root) if root else None,
            scale=pinned and env_flag("BENCH_SCALE", True),
            sections=frozenset(sections) & SECTIONS,
        )
