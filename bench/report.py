"""Render one bench run as Markdown: the machine, one table per section, and the targets."""

from __future__ import annotations

import json
from typing import Any

from bench.fair_share_bench import render as render_fair
from bench.hostile_bench import render as render_hostile
from bench.serving_bench import serving_tables

TARGET_ADDED_P50_MS = 0.5
TARGET_ADDED_P99_MS = 1.0
TARGET_REFUSE_50MB_MS = 50.0
TARGET_STREAMS_MB = 500.0
TARGET_AUDIT_EVENTS_PER_S = 10_000
TARGET_AUDIT_QUERY_P99_MS = 20.0


def _f(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += [
        "| " + " | ".join(_f(c) if not isinstance(c, str) else c for c in row) + " |"
        for row in rows
    ]
    return [*lines, ""]


def _cells(routing: list[dict], mode: str) -> dict[tuple[int, str], dict]:
    return {(c["concurrency"], c["target"]): c for c in routing if c["mode"] == mode}


def routing_tables(routing: list[dict]) -> list[str]:
    out: list[str] = []
    titles = {
        "plain": "Non-streaming (wrk; latency of the whole response)",
        "stream": "Streaming, whole stream of 4 chunks (wrk)",
        "ttft": "Streaming, time to first token (bench.stream_client; first body bytes)",
    }
    for mode, title in titles.items():
        cells = _cells(routing, mode)
        if not cells:
            continue
        out += [f"#### {title}", ""]
        rows = []
        for (concurrency, target), cell in sorted(
            cells.items(), key=lambda kv: (kv[0][0], kv[1]["target"] != "direct", kv[0][1])
        ):
            direct = cells.get((concurrency, "direct"))
            added50 = cell["p50_ms"] - direct["p50_ms"] if direct and target != "direct" else None
            added99 = cell["p99_ms"] - direct["p99_ms"] if direct and target != "direct" else None
            util = (
                f"{cell['cpu_utilisation']:.0%}" if cell.get("cpu_utilisation") is not None else "-"
            )
            cpu = cell.get("cpu_us_per_request")
            rows.append(
                [
                    concurrency,
                    target,
                    round(cell["rps"]),
                    cell["p50_ms"],
                    cell["p99_ms"],
                    added50,
                    added99,
                    round(cpu) if cpu is not None else None,
                    util,
                    cell["errors"],
                ]
            )
        out += _table(
            [
                "in flight",
                "target",
                "req/s",
                "p50 ms",
                "p99 ms",
                "added p50 ms",
                "added p99 ms",
                "CPU µs/req",
                "router CPU",
                "errors",
            ],
            rows,
        )
    return out


def target_lines(results: dict[str, Any]) -> list[str]:
    lines = ["| target | measured | verdict |", "|---|---|---|"]

    def verdict(ok: bool | None) -> str:
        return "-" if ok is None else ("met" if ok else "**missed**")

    routing = results.get("routing") or []
    plain = _cells(routing, "plain")
    if plain:
        d, r, g = (plain.get((1, t)) for t in ("direct", "sglang_router", "gateway"))
        if d and g and r:
            g50, g99 = g["p50_ms"] - d["p50_ms"], g["p99_ms"] - d["p99_ms"]
            r50, r99 = r["p50_ms"] - d["p50_ms"], r["p99_ms"] - d["p99_ms"]
            lines.append(
                f"| 1 in flight: added p50 ≤ {TARGET_ADDED_P50_MS} ms | gateway {g50:.3f} ms "
                f"(sglang_router {r50:.3f} ms) | {verdict(g50 <= TARGET_ADDED_P50_MS)} |"
            )
            lines.append(
                f"| 1 in flight: added p99 ≤ {TARGET_ADDED_P99_MS} ms | gateway {g99:.3f} ms "
                f"(sglang_router {r99:.3f} ms) | {verdict(g99 <= TARGET_ADDED_P99_MS)} |"
            )
            # The issue states the absolute bounds as "within 2× of sglang_router": on a slower
            # machine the peer itself misses them, so the relative form is reported beside them.
            if r50 > 0 and r99 > 0:
                lines.append(
                    f"| 1 in flight: added p50 and p99 within 2× of sglang_router's, same run | "
                    f"p50 ×{g50 / r50:.2f}, p99 ×{g99 / r99:.2f} | "
                    f"p50 {verdict(g50 <= 2 * r50)}, p99 {verdict(g99 <= 2 * r99)} |"
                )
        best = {
            t: max((c["rps"] for (n, tt), c in plain.items() if tt == t and n > 1), default=0.0)
            for t in ("sglang_router", "smg", "gateway")
        }
        if best["sglang_router"]:
            ratio = best["gateway"] / best["sglang_router"]
            lines.append(
                f"| saturation throughput ≥ ½ sglang_router's | "
                f"gateway {best['gateway']:,.0f} req/s, "
                f"sglang_router {best['sglang_router']:,.0f} req/s (×{ratio:.2f}) | "
                f"{verdict(ratio >= 0.5)} |"
            )
        cpu = {
            t: min(
                (
                    c["cpu_us_per_request"]
                    for (n, tt), c in plain.items()
                    if tt == t and n > 1 and c.get("cpu_us_per_request")
                ),
                default=None,
            )
            for t in ("sglang_router", "smg", "gateway")
        }
        if cpu["sglang_router"] and cpu["gateway"]:
            ratio = cpu["gateway"] / cpu["sglang_router"]
            lines.append(
                f"| CPU per request ≤ 2× sglang_router's | gateway {cpu['gateway']:,.0f} µs, "
                f"sglang_router {cpu['sglang_router']:,.0f} µs (×{ratio:.1f}) | "
                f"{verdict(ratio <= 2)} |"
            )
        # SMG, where it ran: no target of its own (issue 7 names sglang_router), but the peer
        # users compare with on speed.
        if best["smg"] and cpu["smg"] and cpu["gateway"]:
            lines.append(
                f"| (context) against SMG, same run: saturation throughput and CPU per request | "
                f"gateway {best['gateway']:,.0f} req/s and {cpu['gateway']:,.0f} µs, "
                f"SMG {best['smg']:,.0f} req/s and {cpu['smg']:,.0f} µs "
                f"(×{best['gateway'] / best['smg']:.2f}, ×{cpu['gateway'] / cpu['smg']:.1f}) | - |"
            )
    prompt = results.get("prompt") or {}
    refusal = {r["megabytes"]: r for r in prompt.get("refusal", [])}
    if 50 in refusal:
        r = refusal[50]
        lines.append(
            f"| refuse a 50 MB prompt ≤ {TARGET_REFUSE_50MB_MS:.0f} ms | p50 {r['p50_ms']:.1f} ms, "
            f"min {r['min_ms']:.1f} ms (HTTP {r['status']} {r['code']}) | "
            f"{verdict(r['p50_ms'] <= TARGET_REFUSE_50MB_MS and r['status'] == 400)} |"
        )
    capped = prompt.get("refusal_capped")
    if capped:
        cap_mib = prompt["capped_body_bytes"] / 2**20
        lines.append(
            f"| refuse a 50 MB prompt ≤ {TARGET_REFUSE_50MB_MS:.0f} ms, "
            f"with a {cap_mib:.0f} MiB body cap (`ISOGATE_MAX_BODY_BYTES`) | "
            f"p50 {capped['p50_ms']:.1f} ms, min {capped['min_ms']:.1f} ms "
            f"(HTTP {capped['status']} {capped['code']}, before reading the body) | "
            f"{verdict(capped['p50_ms'] <= TARGET_REFUSE_50MB_MS and capped['status'] == 413)} |"
        )
    block = prompt.get("blocking")
    if block:
        ok = block["during_max_ms"] < block["big_ms"] / 4 and block["during_requests"] > 1
        lines.append(
            f"| tokenizing 1M tokens does not block | "
            f"small requests while it ran ({block['big_ms']:.0f} ms): "
            f"n={block['during_requests']}, p50 {block['during_p50_ms']:.1f} ms, max "
            f"{block['during_max_ms']:.1f} ms (before: p50 {block['baseline_p50_ms']:.1f} ms) | "
            f"{verdict(ok)} |"
        )
    real = prompt.get("refusal_real_tokenizer")
    if real:
        ok = (
            real["big_status"] == 400
            and real["big_code"] == "context_length_exceeded"
            and real["during_requests"] > 1
            and real["during_max_ms"] < real["big_ms"] / 4
        )
        lines.append(
            f"| refuse a {real['big_tokens']:,}-token prompt of DeepSeek-V4's tokenizer, "
            "others not held up | "
            f"decided in {real['big_ms']:.0f} ms (HTTP {real['big_status']} {real['big_code']}); "
            f"small requests meanwhile n={real['during_requests']}, "
            f"p50 {real['during_p50_ms']:.1f} ms, p99 {real['during_p99_ms']:.1f} ms "
            f"(before: p50 {real['baseline_p50_ms']:.1f}, p99 {real['baseline_p99_ms']:.1f}) | "
            f"{verdict(ok)} |"
        )
    memory = results.get("memory")
    if memory and memory.get("streams"):
        row = next((r for r in memory["streams"] if r["streams"] == 1000), memory["streams"][0])
        met = row["rss_mb"] <= TARGET_STREAMS_MB and row["opened"] >= 0.99 * row["streams"]
        lines.append(
            f"| 1,000 streams ≤ {TARGET_STREAMS_MB:.0f} MB RSS | {row['rss_mb']:.0f} MB with "
            f"{row['opened']} streams flowing (idle {memory['idle_before_mb']:.0f} MB) | "
            f"{verdict(met)} |"
        )
    floor = next(
        (
            run.get("results")
            for run in results.get("peers") or []
            if run.get("name") == "python_floor"
        ),
        None,
    )
    floor16 = (
        next((row for row in floor if row.get("in_flight") == 16), None)
        if isinstance(floor, list)
        else None
    )
    if floor16:
        lines.append(
            "| (context) a bare Python PD proxy on the same stack, 16 in flight "
            "(`bench/python_floor.py`) | "
            f"{floor16['cpu_us_per_request']:,.0f} µs CPU per request, "
            f"{floor16['rps']:,.0f} req/s | - |"
        )
    audit = next(
        (run.get("results") for run in results.get("peers") or [] if run.get("name") == "audit"),
        None,
    )
    for row in audit if isinstance(audit, list) else []:
        if row.get("database") != "postgresql":
            continue
        rate = row.get("audit_log_events_per_s")
        if rate is not None:
            lines.append(
                f"| audit: ≥ {TARGET_AUDIT_EVENTS_PER_S:,} events/s into PostgreSQL | "
                f"{rate:,.0f} events/s through the audit log "
                f"({row.get('store_insert_events_per_s', 0):,.0f} by the store alone) | "
                f"{verdict(rate >= TARGET_AUDIT_EVENTS_PER_S)} |"
            )
        p99 = row.get("query_tenant_newest_100_p99_ms")
        if p99 is not None:
            lines.append(
                f"| audit: a tenant's newest 100 among {row.get('stored_rows', 0):,} in ≤ "
                f"{TARGET_AUDIT_QUERY_P99_MS:.0f} ms p99 (PostgreSQL) | p99 {p99:.2f} ms, "
                f"p50 {row.get('query_tenant_newest_100_p50_ms', 0):.2f} ms | "
                f"{verdict(p99 <= TARGET_AUDIT_QUERY_P99_MS)} |"
            )
    return [*lines, ""]


def render(results: dict[str, Any]) -> str:
    out = ["# isogate benchmark results", ""]
    config = results.get("config", {})
    out += [
        f"Run: {results.get('started_at')} "
        f"({'BENCH_QUICK smoke run' if config.get('quick') else 'full run'}, "
        f"{results.get('seconds', 0):.0f} s). Produced by `make bench` (`scripts/bench`); "
        "how to read it: `bench/README.md`.",
        "",
    ]
    out += [
        "## Machine",
        "",
        *_table(["", ""], [[k, str(v)] for k, v in results.get("machine", {}).items()]),
    ]
    out += ["## Targets (issue 7)", "", *target_lines(results)]
    if results.get("routing"):
        out += [
            "## 1. Routing cost: direct vs sglang_router 0.3.2 (PD) vs SMG (PD, where installed) "
            "vs isogate gateway, instant backend",
            "",
            "Same client request to all of them (`POST /v1/completions`, short prompt, "
            "4 output tokens). "
            "`direct` = straight to the decode instant backend (the floor). "
            "Added = target − direct at the "
            "same concurrency. CPU µs/req = the router process's CPU time ÷ requests served. "
            f"Each figure is the median of {config.get('routing_rounds', 1)} runs of "
            f"{config.get('wrk_duration_s')} s "
            "(wrk; the targets interleaved in every round). "
            f"Pinning: {config.get('pinning')}",
            "",
        ]
        out += routing_tables(results["routing"])
    prompt = results.get("prompt")
    if prompt:
        out += ["## 2. Tokenization and admission vs prompt length", ""]
        out += _table(
            [
                "prompt tokens",
                "MB",
                "encode ms (in process)",
                "admission µs",
                "via gateway ms (HTTP 200, served)",
                "status",
            ],
            [
                [
                    r["tokens"],
                    r["megabytes"],
                    r["encode_ms"],
                    r["admission_us"],
                    r["http_ms"],
                    r["http_status"],
                ]
                for r in prompt["tokenize"]
            ],
        )
        out += ["Refusing an over-limit prompt (model limit 65,536 tokens), HTTP end to end:", ""]
        out += _table(
            [
                "prompt MB",
                "status",
                "code",
                "p50 ms",
                "min ms",
                "max ms",
                "floor p50 ms (same body to the instant backend: upload + orjson parse)",
            ],
            [
                [
                    r["megabytes"],
                    r["status"],
                    str(r["code"]),
                    r["p50_ms"],
                    r["min_ms"],
                    r["max_ms"],
                    r.get("floor_p50_ms"),
                ]
                for r in prompt["refusal"]
            ],
        )
        capped = prompt.get("refusal_capped")
        if capped:
            out += [
                f"With a body cap (`ISOGATE_MAX_BODY_BYTES={prompt['capped_body_bytes']}`, "
                "a second gateway): "
                f"the 50 MB prompt got HTTP {capped['status']} {capped['code']} "
                "from its declared length, "
                f"p50 {capped['p50_ms']:.1f} ms, min {capped['min_ms']:.1f} ms, "
                f"max {capped['max_ms']:.1f} ms. "
                "Client: one plain socket, head and body in two `sendall` calls "
                "(`bench.prompt_bench.raw_post`).",
                "",
            ]
        b = prompt["blocking"]
        out += [
            "Small requests (1 in flight) while one 1M-token prompt is tokenized and served "
            "(gateway allowed every CPU for this part):",
            "",
        ]
        out += _table(
            ["", "requests", "p50 ms", "p99 ms", "max ms"],
            [
                ["before", "-", b["baseline_p50_ms"], b["baseline_p99_ms"], "-"],
                [
                    f"during ({b['big_ms']:.0f} ms, HTTP {b['big_status']})",
                    b["during_requests"],
                    b["during_p50_ms"],
                    b["during_p99_ms"],
                    b["during_max_ms"],
                ],
            ],
        )
        r = prompt.get("refusal_real_tokenizer")
        if r:
            out += [
                "",
                f"Small requests (1 in flight) while the gateway tokenizes and refuses a "
                f"{r['big_tokens']:,}-token prompt of DeepSeek-V4's tokenizer "
                f"(model `deepseek-v4-tiny`, limit 681,280 tokens):",
                "",
            ]
            out += _table(
                ["", "requests", "p50 ms", "p99 ms", "max ms"],
                [
                    ["before", "-", r["baseline_p50_ms"], r["baseline_p99_ms"], "-"],
                    [
                        f"during (decided in {r['big_ms']:.0f} ms, HTTP {r['big_status']} "
                        f"{r['big_code']})",
                        r["during_requests"],
                        r["during_p50_ms"],
                        r["during_p99_ms"],
                        r["during_max_ms"],
                    ],
                ],
            )
    peers = results.get("peers")
    if peers:
        out += [
            "## 3. Other benches (audit, verification/canary, engine plugin, floor, step costs)",
            "",
        ]
        for run in peers:
            out += [f"### {run['name']}: {run['status']} ({run['seconds']:.0f} s)", ""]
            if run["name"] == "pipeline_costs" and run.get("results"):
                out += [
                    "What each step costs, by taking it out "
                    "(`bench/pipeline_costs.py`: in process, no "
                    "uvicorn, 16 in flight, A/B alternating; medians):",
                    "",
                ]
                out += _table(
                    ["variant", "as shipped µs/req", "variant µs/req", "difference µs/req"],
                    [
                        [
                            r["variant"],
                            r["shipped_us"],
                            r["variant_us"],
                            f"{r['difference_us']:+.0f}",
                        ]
                        for r in run["results"]
                    ],
                )
                continue
            if run.get("results") is not None:
                out += [
                    "```json",
                    json.dumps(run["results"], indent=1, default=str)[:6000],
                    "```",
                    "",
                ]
            elif run.get("output_tail"):
                out += ["```", run["output_tail"][-1500:], "```", ""]
    memory = results.get("memory")
    if memory:
        out += ["## 4. Gateway memory", ""]
        rows = [
            ["idle, just started", memory["idle_fresh_mb"], "-"],
            ["idle, before opening streams", memory["idle_before_mb"], "-"],
        ]
        rows += [
            [
                f"{r['streams']:,} streams held open",
                r["rss_mb"],
                f"{r['opened']} flowing, opened in {r['open_s']:.1f} s",
            ]
            for r in memory["streams"]
        ]
        rows.append(["streams closed", memory["idle_after_mb"], "-"])
        out += _table(["state", "RSS MB", "note"], rows)
        if memory.get("per_1000_streams_mb") is not None:
            out += [f"Per 1,000 streams: {memory['per_1000_streams_mb']:.0f} MB.", ""]
        if memory.get("upstream_open_after_close") is not None:
            out += [
                f"Engine streams the gateway still held open to the decode backend "
                f"{memory.get('upstream_release_s', 3.0):.1f} s "
                "after every client had closed its stream: "
                f"{memory['upstream_open_after_close']} "
                "(about 0 when client disconnects are noticed).",
                "",
            ]
    hostile = results.get("hostile")
    if hostile:
        out += ["## Hostile clients (issue 17)", "", *render_hostile(hostile)]
    fair = results.get("fair_share")
    if fair:
        out += ["## Fair share on a real SGLang CPU PD pair (issue 18)", "", *render_fair(fair)]
    real = results.get("real_engine")
    if real:
        out += ["## Real SGLang 0.5.23 CPU PD pair (tiny model, small n)", ""]
        if real.get("cells"):
            out += [
                f"engine_patch tags verified: {real.get('engine_tags')}. "
                "Latency is dominated by the model "
                "on the CPU; compare the three paths, not the absolute numbers.",
                "",
            ]
            out += _table(
                ["mode", "in flight", "target", "n", "p50 ms", "p99 ms", "TTFT p50 ms", "errors"],
                [
                    [
                        c["mode"],
                        c["concurrency"],
                        c["target"],
                        c["requests"],
                        c["p50_ms"],
                        c["p99_ms"],
                        c["ttft_p50_ms"],
                        c["errors"],
                    ]
                    for c in real["cells"]
                ],
            )
            if real.get("serving"):
                out += ["### `sglang.bench_serving` through each router", ""]
                out += serving_tables(real["serving"])
        else:
            out += [f"Not run: {real.get('skipped') or real.get('failed')}", ""]
    if results.get("errors"):
        out += ["## Sections that failed", ""] + [f"- {e}" for e in results["errors"]] + [""]
    return "\n".join(out)
