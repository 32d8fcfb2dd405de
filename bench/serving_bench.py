"""SGLang's own load generator, ``sglang.bench_serving`` (0.5.23), through the gateway and
through ``sglang_router``, in front of the same real CPU PD pair, in one run.

Each of ``--backend sglang-oai`` (``/v1/completions``) and ``--backend sglang-oai-chat``
(``/v1/chat/completions``) runs once per target with the same arguments and seed, so both
targets get the same prompts at the same Poisson arrival times: a fixed number of prompts at a
modest rate (streaming, ``ignore_eos``, ``best_of``: bench_serving's own request bodies, as it
sends them to any SGLang server). The targets alternate (router, gateway) per backend and both
workers' prefix caches are flushed before every run, so no run reads another's cache. Reported
side by side: success count, request throughput and TTFT/ITL/E2E medians, as bench_serving
wrote them with ``--output-file``.

Offline: bench_serving runs in ``.venv-engine`` (``datasets``, its one import missing there,
is in ``engine/requirements.txt``) with ``HF_HUB_OFFLINE=1``; ``--dataset-name random`` samples
its prompts from a small ShareGPT-format file written here, deterministically
(``write_sharegpt_file``), and ``--model``/``--tokenizer`` name the tiny model's local directory
(``--served-model-name`` is the model name the gateway's policy knows). The gateway's tenant key
goes in ``OPENAI_API_KEY``, which bench_serving sends as ``Authorization: Bearer``.

Run alone (starts the PD pair, sglang_router and the gateway, stops them)::

    .venv/bin/python -m bench.serving_bench [--prompts 40] [--rate 4]

In ``make bench`` it runs inside the real-engine section (``bench/real_engine_bench.py``) on
the pair, router and gateway that section started.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from bench.processes import ENGINE_PYTHON, REPO_ROOT, boost

BACKENDS = ("sglang-oai", "sglang-oai-chat")
MODEL = "tiny-llama"  # as the bench policies name it; the router forwards any name
NUM_PROMPTS = 40
REQUEST_RATE = 4.0  # requests per second, Poisson arrivals (bench_serving's own scheduler)
MAX_CONCURRENCY = 8
INPUT_LEN = 128  # tokens, sampled in [INPUT_LEN * RANGE_RATIO, INPUT_LEN]
OUTPUT_LEN = 16
RANGE_RATIO = 0.5
SEED = 42
RUN_TIMEOUT_S = 600.0
DATASET_CONVERSATIONS = 200
DATASET_SEED = 20261201
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

_TEXT = (
    "the gateway routes every request to a prefill and a decode worker and checks what comes "
    "back tenant isolation means no answer carries another tenant's text a cache salt keeps "
    "prefix entries apart the pool holds tokens the scheduler batches requests decode streams "
    "one token at a time while prefill computes the whole prompt at once an operator reads the "
    "audit log limits refill each second a canary marker is scanned in every chunk please "
    "summarise explain compare describe list why how when which what short long simple careful "
    "table chair river mountain city garden window letter music number colour morning evening"
)
_WORDS = tuple(_TEXT.split())


@dataclass(frozen=True)
class ServingTarget:
    name: str  # sglang_router | gateway
    base_url: str
    api_key: str | None = None


@dataclass
class ServingCell:
    backend: str
    target: str
    prompts: int
    completed: int
    duration_s: float | None
    request_throughput: float | None  # completed requests / s
    output_throughput: float | None  # output tokens / s
    median_ttft_ms: float | None
    median_itl_ms: float | None
    median_e2e_ms: float | None
    p99_e2e_ms: float | None
    error: str | None  # the first failed request's error, or why the run gave no result


def write_sharegpt_file(
    path: Path, conversations: int = DATASET_CONVERSATIONS, seed: int = DATASET_SEED
) -> Path:
    """A ShareGPT-format JSON file (``[{"conversations": [{"from", "value"}, ...]}]``) of
    made-up English-like text, the same bytes for the same arguments. bench_serving's
    ``random`` dataset takes its prompt token ids from the first turn of each conversation
    (repeated or cut to each sampled length), so its content only has to tokenize."""
    rng = random.Random(seed)

    def text(low: int, high: int) -> str:
        words = [rng.choice(_WORDS) for _ in range(rng.randint(low, high))]
        return " ".join(words).capitalize() + "."

    rows = [
        {
            "id": f"isogate-bench-{i}",
            "conversations": [
                {"from": "human", "value": text(40, 160)},
                {"from": "gpt", "value": text(20, 80)},
            ],
        }
        for i in range(conversations)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=0))
    return path


def bench_serving_command(
    backend: str,
    base_url: str,
    *,
    model_dir: Path,
    dataset: Path,
    output_file: Path,
    prompts: int,
    rate: float,
) -> list[str]:
    return [
        str(ENGINE_PYTHON), "-m", "sglang.bench_serving",
        "--backend", backend,
        "--base-url", base_url,
        "--model", str(model_dir),  # local: bench_serving reads its tokenizer config
        "--served-model-name", MODEL,  # what the request bodies name
        "--tokenizer", str(model_dir),
        "--dataset-name", "random",
        "--dataset-path", str(dataset),
        "--num-prompts", str(prompts),
        "--random-input-len", str(INPUT_LEN),
        "--random-output-len", str(OUTPUT_LEN),
        "--random-range-ratio", str(RANGE_RATIO),
        "--request-rate", str(rate),
        "--max-concurrency", str(MAX_CONCURRENCY),
        "--seed", str(SEED),
        "--ready-check-timeout-sec", "0",
        "--disable-tqdm",
        "--output-file", str(output_file),
        "--output-details",
    ]  # fmt: skip


def _environment(api_key: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "API_KEY")}
    env.pop("SGLANG_IS_IN_CI", None)  # it would make bench_serving flush through the target
    env.update(OFFLINE_ENV)
    if api_key:
        env["OPENAI_API_KEY"] = api_key  # sent as Authorization: Bearer <key>
    return env


def _why_no_result(log_path: Path, returncode: int | None) -> str:
    lines = log_path.read_text(errors="replace").splitlines() if log_path.exists() else []
    for line in reversed(lines):
        if "Error" in line or "error" in line:
            return line.strip()[:500]
    return f"bench_serving exited with {returncode} and wrote no result"


def _cell(backend: str, target: str, prompts: int, result: dict | None, error: str | None):
    if result is None:
        return ServingCell(backend, target, prompts, 0, *([None] * 7), error)
    errors = [e for e in result.get("errors") or [] if e]
    return ServingCell(
        backend,
        target,
        prompts,
        int(result["completed"]),
        result.get("duration"),
        result.get("request_throughput"),
        result.get("output_throughput"),
        result.get("median_ttft_ms"),
        result.get("median_itl_ms"),
        result.get("median_e2e_latency_ms"),
        result.get("p99_e2e_latency_ms"),
        errors[0].strip()[-500:] if errors else None,
    )


def run_bench_serving(
    target: ServingTarget,
    backend: str,
    *,
    model_dir: Path,
    dataset: Path,
    work_dir: Path,
    prompts: int,
    rate: float,
    priority: int = 0,
) -> ServingCell:
    """One bench_serving run against one target; its figures, or why it gave none."""
    stem = f"{target.name}-{backend}"
    output_file = work_dir / f"{stem}.jsonl"
    log_path = work_dir / f"{stem}.log"
    output_file.unlink(missing_ok=True)  # bench_serving appends
    command = bench_serving_command(
        backend,
        target.base_url,
        model_dir=model_dir,
        dataset=dataset,
        output_file=output_file,
        prompts=prompts,
        rate=rate,
    )
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_environment(target.api_key),
            cwd=work_dir,
            start_new_session=True,
        )
    boost(process.pid, priority)
    try:
        returncode = process.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return _cell(backend, target.name, prompts, None, f"timed out after {RUN_TIMEOUT_S:.0f} s")
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # stragglers of its group
        except ProcessLookupError:
            pass
    lines = output_file.read_text().splitlines() if output_file.exists() else []
    if not lines:
        return _cell(backend, target.name, prompts, None, _why_no_result(log_path, returncode))
    return _cell(backend, target.name, prompts, json.loads(lines[-1]), None)


def flush_caches(worker_urls: tuple[str, ...]) -> bool:
    """Empty every worker's prefix cache (SGLang's ``/flush_cache``, refused while busy)."""
    flushed = True
    for url in worker_urls:
        for _ in range(20):
            try:
                if httpx.post(f"{url}/flush_cache", timeout=10).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            flushed = False
    return flushed


def run_serving_bench(
    targets: list[ServingTarget],
    *,
    worker_urls: tuple[str, ...],
    model_dir: Path,
    work_dir: Path,
    prompts: int = NUM_PROMPTS,
    rate: float = REQUEST_RATE,
    priority: int = 0,
    log: Callable[[str], None] = print,
) -> dict:
    """bench_serving with each backend against each target (alternating), same arguments."""
    work_dir.mkdir(parents=True, exist_ok=True)
    dataset = write_sharegpt_file(work_dir / "sharegpt-local.json")
    cells: list[ServingCell] = []
    flushed = True
    for backend in BACKENDS:
        for target in targets:
            flushed &= flush_caches(worker_urls)
            cell = run_bench_serving(
                target,
                backend,
                model_dir=model_dir,
                dataset=dataset,
                work_dir=work_dir,
                prompts=prompts,
                rate=rate,
                priority=priority,
            )
            cells.append(cell)
            log(
                f"  bench_serving {backend:15} {target.name:14} "
                f"ok {cell.completed}/{cell.prompts}  {_fmt(cell.request_throughput)} req/s  "
                f"TTFT p50 {_fmt(cell.median_ttft_ms)} ms  ITL p50 {_fmt(cell.median_itl_ms)} ms"
                f"  E2E p50 {_fmt(cell.median_e2e_ms)} ms"
                + (f"  first error: {cell.error[:200]}" if cell.error else "")
            )
    return {
        "prompts": prompts,
        "request_rate": rate,
        "max_concurrency": MAX_CONCURRENCY,
        "input_len": INPUT_LEN,
        "output_len": OUTPUT_LEN,
        "range_ratio": RANGE_RATIO,
        "caches_flushed": flushed,
        "cells": [asdict(c) for c in cells],
    }


def run_serving_bench_from_env(
    targets: list[ServingTarget], *, log: Callable[[str], None] = print, **kwargs
) -> dict:
    """``run_serving_bench`` as the real-engine section runs it: BENCH_SERVING=0 skips it,
    BENCH_SERVING_PROMPTS and BENCH_SERVING_RATE override the defaults; a failure is
    reported, not raised, so the section's other figures stay."""
    if os.environ.get("BENCH_SERVING", "1").strip().lower() in ("0", "false", "no"):
        return {"skipped": "BENCH_SERVING=0"}
    try:
        return run_serving_bench(
            targets,
            prompts=int(os.environ.get("BENCH_SERVING_PROMPTS", NUM_PROMPTS)),
            rate=float(os.environ.get("BENCH_SERVING_RATE", REQUEST_RATE)),
            log=log,
            **kwargs,
        )
    except Exception as exc:
        log(f"  bench_serving failed: {type(exc).__name__}: {exc}")
        return {"failed": f"{type(exc).__name__}: {str(exc)[:2000]}"}


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def serving_tables(section: dict) -> list[str]:
    """Markdown for the report (bench/report.py): one row per backend and target."""
    if not section.get("cells"):
        return [f"bench_serving: not run: {section.get('failed') or section.get('skipped')}", ""]

    def low(full: int) -> int:  # bench_serving's lower bound for a sampled length
        return max(int(full * section["range_ratio"]), 1)

    out = [
        f"`sglang.bench_serving` (SGLang 0.5.23's own client), {section['prompts']} prompts "
        f"per run at {section['request_rate']:g} req/s (Poisson, at most "
        f"{section['max_concurrency']} in flight), {low(section['input_len'])}-"
        f"{section['input_len']} prompt and {low(section['output_len'])}-"
        f"{section['output_len']} output tokens (ignore_eos), streaming; the same prompts "
        "and arrival times for both targets; prefix caches "
        + ("flushed before each run." if section.get("caches_flushed") else "NOT all flushed."),
        "",
        "| backend | target | succeeded | req/s | TTFT p50 ms | ITL p50 ms | E2E p50 ms "
        "| E2E p99 ms | first error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in section["cells"]:
        error = (c["error"] or "").replace("|", "/").replace("\n", " ")[:160] or "-"
        out.append(
            f"| {c['backend']} | {c['target']} | {c['completed']}/{c['prompts']} "
            f"| {_fmt(c['request_throughput'], 2)} | {_fmt(c['median_ttft_ms'])} "
            f"| {_fmt(c['median_itl_ms'])} | {_fmt(c['median_e2e_ms'])} "
            f"| {_fmt(c['p99_e2e_ms'])} | {error} |"
        )
    return [*out, ""]


def main() -> int:
    # Started here only when run alone; make bench runs it from bench/real_engine_bench.py.
    from bench.config import BenchConfig
    from bench.processes import free_ports, peers_in_front
    from gateway.dev.cluster import PDCluster, default_cluster_spec

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=NUM_PROMPTS)
    parser.add_argument("--rate", type=float, default=REQUEST_RATE)
    parser.add_argument("--work-dir", type=Path, default=REPO_ROOT / ".run" / "serving-bench")
    args = parser.parse_args()
    config = BenchConfig.from_env()
    ports, work = config.ports, args.work_dir
    spec = default_cluster_spec(
        prefill_port=free_ports(ports.real_prefill),
        decode_port=free_ports(ports.real_decode),
        bootstrap_port=free_ports(ports.real_bootstrap),
        log_dir=work / "sglang",
    )
    cluster = PDCluster(spec)
    try:
        started = time.monotonic()
        cluster.start()
        print(f"PD pair ready in {time.monotonic() - started:.0f} s", flush=True)
        peers = peers_in_front(
            cluster,
            work,
            router_port=ports.real_router,
            gateway_port=ports.real_gateway,
            root=config.gateway_root,
        )
        with peers as (router, gateway, key, _):
            section = run_serving_bench(
                [
                    ServingTarget("sglang_router", f"http://127.0.0.1:{router.port}"),
                    ServingTarget("gateway", gateway.url, key),
                ],
                worker_urls=(cluster.prefill_url, cluster.decode_url),
                model_dir=spec.model_dir,
                work_dir=work / "bench-serving",
                prompts=args.prompts,
                rate=args.rate,
                priority=config.priority,
                log=lambda m: print(m, flush=True),
            )
    finally:
        cluster.stop()
    (work / "serving-bench.json").write_text(json.dumps(section, indent=1))
    print("\n".join(["", *serving_tables(section)]))
    print(f"written: {work / 'serving-bench.json'}; bench_serving logs in {work / 'bench-serving'}")
    return 0 if all(c["completed"] == c["prompts"] for c in section["cells"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
