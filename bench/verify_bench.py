"""Verification bench: the gateway's response-path checks in process, each the fastest of five
loops of about 0.2 s: ``check_meta`` of a recorded ``meta_info``, ``check_text`` of a 1 KB
answer, and a stream in SGLang's cumulative shape checked per chunk as the gateway does, beside
``orjson.loads`` of the same chunks; texts ascii, cjk, replacement (U+FFFD) and adversarial
(made of the marker prefix), with 0, 100 and 10,000 live markers."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from gateway.verification.scanner import MARKER_PREFIX, CanaryScanner, new_marker
from gateway.verification.verify import Expectation, StreamGuard, check_meta, check_text

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
GENERATION_ID = "gen_01KB0000000000000000000000"
TENANT = "tenant-a"
TOKEN_CHARS = 4

TEXTS: dict[str, str] = {
    "ascii": "The quick brown fox jumps over the lazy dog. ",
    "cjk": "敏捷的棕色狐狸跳过了懒狗。",
    "replacement": "V\ufffdV\ufffd ",
    "adversarial": MARKER_PREFIX,
}


def text_of(kind: str, chars: int) -> str:
    unit = TEXTS[kind]
    return (unit * (chars // len(unit) + 1))[:chars]


def recorded_meta(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    meta = json.loads((DATA / "generate_decode.json").read_text())["meta_info"]
    ids = {"id": GENERATION_ID, "isolation_generation": GENERATION_ID, "isolation_tenant": TENANT}
    return meta | ids | {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}


def scanner_with(markers: int) -> CanaryScanner:
    scanner = CanaryScanner()

    async def register() -> None:
        for _ in range(markers):
            await scanner.register_marker(new_marker(), "__canary__", 3600)

    asyncio.run(register())
    return scanner


def best_ns(run: Callable[[], object], budget_s: float, repeats: int = 5) -> float:
    """Nanoseconds per call: the fastest of ``repeats`` timed loops of about ``budget_s`` each."""
    start = time.perf_counter_ns()
    run()
    once_ns = max(1, time.perf_counter_ns() - start)
    iterations = max(1, int(budget_s * 1e9 / once_ns))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(iterations):
            run()
        best = min(best, (time.perf_counter_ns() - start) / iterations)
    return best


def bench_check_text(scanner: CanaryScanner, kind: str, budget_s: float) -> float:
    text = text_of(kind, 1024)  # a whole non-streamed answer of 1 KB
    return best_ns(lambda: check_text(scanner, text, TENANT), budget_s)


def bench_stream(
    scanner: CanaryScanner, kind: str, chars: int, budget_s: float
) -> dict[str, float]:
    """SGLang's cumulative chunks, one per token: (text so far, meta_info, the SSE payload)."""
    text, tokens = text_of(kind, chars), max(1, chars // TOKEN_CHARS)
    chunks = []
    for n in range(1, tokens + 1):
        so_far, meta = text[: n * TOKEN_CHARS] if n < tokens else text, recorded_meta(11, n)
        chunks.append((so_far, meta, orjson.dumps({"text": so_far, "meta_info": meta})))
    expected = Expectation(GENERATION_ID, TENANT, 11, len(chunks), True)

    def verify_stream() -> None:
        guard = StreamGuard(scanner, TENANT)
        for so_far, meta, _ in chunks:
            check_meta(meta, expected)
            guard.feed(so_far)
        guard.finish()

    def parse_stream() -> None:
        for _, _, payload in chunks:
            orjson.loads(payload)

    verify_ns = best_ns(verify_stream, budget_s)
    parse_ns = best_ns(parse_stream, budget_s)
    kb = len(chunks[-1][0].encode()) / 1024
    us = verify_ns / 1000
    return {
        "chunks": len(chunks), "kb": kb, "verify_us": us, "verify_us_per_kb": us / kb,
        "verify_us_per_chunk": us / len(chunks), "parse_us_per_kb": parse_ns / 1000 / kb,
    }  # fmt: skip


def run(quick: bool) -> dict[str, Any]:
    budget_s = 0.02 if quick else 0.2
    meta, expected = recorded_meta(11, 8), Expectation(GENERATION_ID, TENANT, 11, 16, True)
    results: dict[str, Any] = {
        "check_meta_ns": best_ns(lambda: check_meta(meta, expected), budget_s)
    }
    scanners = {markers: scanner_with(markers) for markers in (0, 100, 10_000)}
    results["check_text_1kb_ns"] = {
        f"{kind}/{markers}": bench_check_text(scanner, kind, budget_s)
        for markers, scanner in scanners.items()
        for kind in TEXTS
    }
    results["stream"] = {
        f"{kind}/{chars // 1024}KB": bench_stream(scanners[100], kind, chars, budget_s)
        for kind in TEXTS
        for chars in (1024, 16 * 1024, 64 * 1024)
    }
    return results
