"""Verification bench: what checking every response costs, per request and per KB streamed.

Measures the gateway's own response-path code, in-process, with ``time.perf_counter_ns``
in loops of about 0.2 s (the fastest of five, so scheduler noise on a shared machine counts
as little as it can):

- ``check_meta``: one engine ``meta_info`` (the shape recorded from real SGLang 0.5.23,
  ``tests/data/generate_decode.json``) against the request's expectation.
- ``check_text``: the canary scan of a whole non-streamed answer.
- a stream: SGLang sends the whole text so far in every chunk (one chunk per token here,
  4 characters each); per chunk the gateway runs ``check_meta`` and ``StreamGuard.feed``
  (prefix check + canary scan of the new part), then ``finish``. Reported per KB of text.
- for scale, ``orjson.loads`` of the same chunks: parsing SGLang's SSE payloads, which the
  gateway must do anyway.

Text kinds: ``ascii`` (CPython's ``str.find`` rejects the non-Latin-1 marker prefix without
reading such text), ``cjk`` (wide text: a real search), ``replacement`` (the tiny model's
output, full of U+FFFD), and ``adversarial`` (text made of the marker prefix itself, so every
few characters is a dictionary lookup). The number of live markers does not enter the cost
(one ``find`` of the common prefix, then a set lookup); 0, 100 and 10,000 are measured.

    .venv/bin/python -m bench.verify_bench [--quick]

Writes ``bench/results/verify.json`` and prints a table.
"""

from __future__ import annotations

import argparse
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
RESULTS = Path(__file__).resolve().parent / "results" / "verify.json"
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
    meta.update(
        id=GENERATION_ID,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        isolation_generation=GENERATION_ID,
        isolation_tenant=TENANT,
    )
    return meta


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


def bench_check_meta(budget_s: float) -> float:
    meta = recorded_meta(11, 8)
    expected = Expectation(GENERATION_ID, TENANT, 11, 16, True)
    return best_ns(lambda: check_meta(meta, expected), budget_s)


def bench_check_text(scanner: CanaryScanner, kind: str, chars: int, budget_s: float) -> float:
    text = text_of(kind, chars)
    return best_ns(lambda: check_text(scanner, text, TENANT), budget_s)


def stream_chunks(kind: str, chars: int) -> list[tuple[str, dict[str, Any], bytes]]:
    """SGLang's cumulative chunks: (text so far, meta_info, the SSE payload as sent)."""
    text = text_of(kind, chars)
    tokens = max(1, chars // TOKEN_CHARS)
    chunks = []
    for n in range(1, tokens + 1):
        so_far = text[: n * TOKEN_CHARS] if n < tokens else text
        meta = recorded_meta(11, n)
        chunks.append((so_far, meta, orjson.dumps({"text": so_far, "meta_info": meta})))
    return chunks


def bench_stream(
    scanner: CanaryScanner, kind: str, chars: int, budget_s: float
) -> dict[str, float]:
    chunks = stream_chunks(kind, chars)
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
    return {
        "chunks": len(chunks),
        "kb": kb,
        "verify_us": verify_ns / 1000,
        "verify_us_per_kb": verify_ns / 1000 / kb,
        "verify_us_per_chunk": verify_ns / 1000 / len(chunks),
        "parse_us_per_kb": parse_ns / 1000 / kb,
    }


def run(quick: bool) -> dict[str, Any]:
    budget_s = 0.02 if quick else 0.2
    results: dict[str, Any] = {"check_meta_ns": bench_check_meta(budget_s)}
    results["check_text_1kb_ns"] = {
        f"{kind}/{markers}": bench_check_text(scanner_with(markers), kind, 1024, budget_s)
        for markers in (0, 100, 10_000)
        for kind in TEXTS
    }
    scanner = scanner_with(100)
    results["stream"] = {
        f"{kind}/{chars // 1024}KB": bench_stream(scanner, kind, chars, budget_s)
        for kind in TEXTS
        for chars in (1024, 16 * 1024, 64 * 1024)
    }
    return results


def print_table(results: dict[str, Any]) -> None:
    print(f"check_meta per response/chunk: {results['check_meta_ns']:.0f} ns")
    print("\ncheck_text, 1 KB answer (ns)    " + "".join(f"{k:>13}" for k in TEXTS))
    for markers in (0, 100, 10_000):
        row = "".join(f"{results['check_text_1kb_ns'][f'{k}/{markers}']:>13.0f}" for k in TEXTS)
        print(f"  {markers:>6} live markers            {row}")
    print("\nstream (1 chunk per 4-char token, 100 live markers)")
    print(
        f"  {'text/length':<22}{'chunks':>8}{'verify µs':>12}{'µs/KB':>10}"
        f"{'µs/chunk':>10}{'parse µs/KB':>13}"
    )
    for name, row in results["stream"].items():
        print(
            f"  {name:<22}{row['chunks']:>8}{row['verify_us']:>12.1f}"
            f"{row['verify_us_per_kb']:>10.1f}"
            f"{row['verify_us_per_chunk']:>10.2f}{row['parse_us_per_kb']:>13.1f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10x shorter loops (a smoke run)")
    args = parser.parse_args(argv)
    results = run(args.quick)
    print_table(results)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwritten to {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
