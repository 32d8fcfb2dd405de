"""``sglang.bench_serving`` (SGLang 0.5.23's own load generator) through ``sglang_router``, SMG
and the gateway, in front of the same real CPU PD pair (in the real-engine section). Each backend
runs once per target with the same arguments and seed (same prompts, same Poisson arrivals),
targets alternating, prefix caches flushed before each run; offline, prompts sampled from a
ShareGPT-format file written here, the gateway's key in ``OPENAI_API_KEY``."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.config import env_flag
from bench.processes import ENGINE_PYTHON, boost
from bench.stream_client import described, gap_spread

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
_TURNS = (("human", 40, 160), ("gpt", 20, 80))  # (who, fewest words, most words)


@dataclass(frozen=True)
class ServingTarget:
    name: str  # sglang_router | smg | gateway
    base_url: str
    api_key: str | None = None


# What is kept of each run, as bench_serving wrote it (its --output-file JSON).
FIGURES = (
    "duration request_throughput output_throughput median_ttft_ms median_itl_ms "
    "median_e2e_latency_ms p99_e2e_latency_ms"
)


def write_sharegpt_file(
    path: Path, conversations: int = DATASET_CONVERSATIONS, seed: int = DATASET_SEED
) -> Path:
    """Made-up English-like conversations, the same bytes for the same arguments: bench_serving's
    ``random`` dataset only tokenizes each first turn (repeated or cut to each sampled length)."""
    rng = random.Random(seed)

    def text(low: int, high: int) -> str:
        words = [rng.choice(_WORDS) for _ in range(rng.randint(low, high))]
        return " ".join(words).capitalize() + "."

    def turns() -> list[dict[str, str]]:
        return [{"from": who, "value": text(lo, hi)} for who, lo, hi in _TURNS]

    rows = [{"id": f"isogate-bench-{i}", "conversations": turns()} for i in range(conversations)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=0))
    return path


def _environment(api_key: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "API_KEY")}
    env.pop("SGLANG_IS_IN_CI", None)  # it would make bench_serving flush through the target
    env.update(OFFLINE_ENV)
    if api_key:
        env["OPENAI_API_KEY"] = api_key  # sent as Authorization: Bearer <key>
    return env


def _why_no_result(log_path: Path, returncode: int | None) -> str:
    lines = log_path.read_text(errors="replace").splitlines() if log_path.exists() else []
    errors = [line.strip()[:500] for line in lines if "error" in line.lower()]
    return errors[-1] if errors else f"bench_serving exited with {returncode} and wrote no result"


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
) -> dict:
    """One bench_serving run against one target: its figures, or why it gave none."""
    stem = f"{target.name}-{backend}"
    output_file, log_path = work_dir / f"{stem}.jsonl", work_dir / f"{stem}.log"
    output_file.unlink(missing_ok=True)  # bench_serving appends
    # --model: the local directory (bench_serving reads its tokenizer config there);
    # --served-model-name: what the request bodies name.
    command = [
        str(ENGINE_PYTHON), "-m", "sglang.bench_serving", "--backend", backend,
        "--base-url", target.base_url, "--model", str(model_dir), "--served-model-name", MODEL,
        "--tokenizer", str(model_dir), "--dataset-name", "random", "--dataset-path", str(dataset),
        "--num-prompts", str(prompts), "--random-input-len", str(INPUT_LEN),
        "--random-output-len", str(OUTPUT_LEN), "--random-range-ratio", str(RANGE_RATIO),
        "--request-rate", str(rate), "--max-concurrency", str(MAX_CONCURRENCY),
        "--seed", str(SEED), "--ready-check-timeout-sec", "0", "--disable-tqdm",
        "--output-file", str(output_file), "--output-details",
    ]  # fmt: skip
    if backend == "sglang-oai":  # SMG refuses its "best_of": 1 on a stream; null means 1
        command += ["--extra-request-body", '{"best_of": null}']
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            env=_environment(target.api_key), cwd=work_dir, start_new_session=True,
        )  # fmt: skip
    boost(process.pid, priority)
    result: dict = {}
    try:
        returncode = process.wait(timeout=RUN_TIMEOUT_S)
        lines = output_file.read_text().splitlines() if output_file.exists() else []
        if lines:
            result = json.loads(lines[-1])
            errors = [e for e in result.get("errors") or [] if e]
            error = errors[0].strip()[-500:] if errors else None
        else:
            error = _why_no_result(log_path, returncode)
    except subprocess.TimeoutExpired:
        error = f"timed out after {RUN_TIMEOUT_S:.0f} s"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # it, if it ran too long, or stragglers
        process.wait()
    return {
        "backend": backend,
        "target": target.name,
        "prompts": prompts,
        "completed": int(result.get("completed", 0)),
        **{key: result.get(key) for key in FIGURES.split()},
        **itl_spread(result.get("itls") or []),
        "error": error,  # the first failed request's error, or why the run gave no result
    }


def itl_spread(itls: list[list[float]]) -> dict[str, float | None]:
    """``gap_spread`` of bench_serving's gaps of every request (seconds)."""
    gaps = [gap for request in itls for gap in request]
    if not gaps:
        return {"mean_itl_ms": None, "itl_together_pct": None}
    mean_ms, together_pct = gap_spread(gaps)
    return {"mean_itl_ms": mean_ms, "itl_together_pct": together_pct}


def flush_caches(worker_urls: tuple[str, ...]) -> bool:
    """Empty every worker's prefix cache (SGLang's ``/flush_cache``, refused while busy)."""
    flushed = True
    for url in worker_urls:
        for _ in range(20):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.post(f"{url}/flush_cache", timeout=10).status_code == 200:
                    break
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
    priority: int = 0,
    log: Callable[[str], None] = print,
) -> dict:
    """Each backend against each target, alternating; a failure is reported, not raised, so
    that the real section's other figures stay."""
    if not env_flag("BENCH_SERVING", True):
        return {"skipped": "BENCH_SERVING=0"}
    prompts = int(os.environ.get("BENCH_SERVING_PROMPTS", NUM_PROMPTS))
    rate = float(os.environ.get("BENCH_SERVING_RATE", REQUEST_RATE))
    cells: list[dict] = []
    flushed = True
    try:
        work_dir.mkdir(parents=True, exist_ok=True)
        dataset = write_sharegpt_file(work_dir / "sharegpt-local.json")
        for backend in BACKENDS:
            for target in targets:
                flushed &= flush_caches(worker_urls)
                cell = run_bench_serving(
                    target, backend, model_dir=model_dir, dataset=dataset, work_dir=work_dir,
                    prompts=prompts, rate=rate, priority=priority,
                )  # fmt: skip
                cells.append(cell)
                log("  bench_serving: " + described(cell))
    except Exception as exc:
        log(f"  bench_serving failed: {type(exc).__name__}: {exc}")
        return {"failed": f"{type(exc).__name__}: {str(exc)[:2000]}"}
    return {
        "prompts": prompts, "request_rate": rate, "max_concurrency": MAX_CONCURRENCY,
        "input_len": INPUT_LEN, "output_len": OUTPUT_LEN, "range_ratio": RANGE_RATIO,
        "caches_flushed": flushed, "cells": cells,
    }  # fmt: skip
