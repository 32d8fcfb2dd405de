"""Render one bench run as Markdown: the machine, the targets, one part per section."""

from __future__ import annotations

from typing import Any

from bench.fair_share_bench import B_RATIO_TARGET, KNEE_FRACTION, MAX_TOKENS, THROUGHPUT_TARGET
from bench.real_engine_bench import STREAM_TOKENS

TARGET_ADDED_P50_MS = 0.5
TARGET_ADDED_P99_MS = 1.0
TARGET_REFUSE_50MB_MS = 50.0
TARGET_STREAMS_MB = 500.0
TARGET_AUDIT_EVENTS_PER_S = 10_000
TARGET_AUDIT_QUERY_P99_MS = 20.0
ROUTERS = ("sglang_router", "smg", "gateway")


def _f(value: Any) -> str:
    if value is None or value != value:  # None or NaN
        return "-"
    if isinstance(value, float):
        return f"{value:,.2f}"
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


def _table(header: str, rows: list[list[Any]]) -> list[str]:  # header: "a | b | c"
    lines = [f"| {header} |", "|---" * (header.count("|") + 1) + "|"]
    return [*lines, *("| " + " | ".join(_f(c) for c in row) + " |" for row in rows), ""]


def _rows(records: list[dict], fields: str) -> list[list[Any]]:  # fields: "a b c"
    return [[record.get(field) for field in fields.split()] for record in records]


def _verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("met" if ok else "**missed**")


def _cells(routing: list[dict], mode: str) -> dict[tuple[int, str], dict]:
    return {(c["concurrency"], c["target"]): c for c in routing if c["mode"] == mode}


def routing_tables(routing: list[dict]) -> list[str]:
    out: list[str] = []
    titles = {
        "plain": "Non-streaming (wrk; latency of the whole response)",
        "stream": "Streaming, whole stream of 4 chunks (wrk)",
        "ttft": "Streaming, time to first token (bench.stream_client; first body bytes)",
    }
    header = "in flight | target | req/s | p50 ms | p99 ms | added p50 ms | added p99 ms | "
    header += "CPU µs/req | router CPU | errors"
    for mode, title in titles.items():
        cells = _cells(routing, mode)
        rows = []
        for n, target in sorted(cells, key=lambda key: (key[0], key[1] != "direct", key[1])):
            c, direct = cells[(n, target)], cells.get((n, "direct")) if target != "direct" else None
            cpu, share = c.get("cpu_us_per_request"), c.get("cpu_utilisation")
            added = [c[p] - direct[p] for p in ("p50_ms", "p99_ms")] if direct else [None, None]
            cpu_cells = [round(cpu) if cpu is not None else None, f"{share:.0%}" if share else None]
            row = [n, target, round(c["rps"]), c["p50_ms"], c["p99_ms"]]
            rows.append([*row, *added, *cpu_cells, c["errors"]])
        out += [f"#### {title}", "", *_table(header, rows)] if rows else []
    return out


def _scale_out(routing: list[dict]) -> list[str]:
    """Issue 44's targets: ``serve --workers 2`` against SMG, both unpinned; and, pinned like
    the gateway: the same app under granian (the choice of HTTP layer), with Redis (what
    sharing costs), and the bare relay (what of its cost is the HTTP stack)."""
    plain, fig = _cells(routing, "plain"), {}
    targets = (
        "gateway", "gateway_workers2", "smg_unpinned", "gateway_granian", "gateway_redis",
        "python_relay",
    )  # fmt: skip
    for t in targets:
        at = {n: plain.get((n, t)) for n in (1, 16, 64)}
        if all(at.values()) and (d := plain.get((1, "direct"))):
            cpu = min(at[n]["cpu_us_per_request"] or 0.0 for n in (16, 64))
            fig[t] = {"rps": max(at[16]["rps"], at[64]["rps"]), "cpu": cpu, "at": at}
            fig[t]["p99"] = at[1]["p99_ms"] - d["p99_ms"]
    rows = []
    if (w := fig.get("gateway_workers2")) and (s := fig.get("smg_unpinned")):
        for what, key, bound, unit in (
            ("saturation throughput ≥ SMG's", "rps", 1, "req/s"),
            ("CPU per request ≤ 1.5× SMG's", "cpu", 1.5, "µs"),
            ("added p99 at 1 in flight ≤ 2× SMG's", "p99", 2.0, "ms"),
        ):
            ok = w[key] >= s[key] if key == "rps" else w[key] <= bound * s[key]
            places, ratio = 2 if key == "p99" else 0, w[key] / s[key] if s[key] > 0 else None
            got = f"gateway {w[key]:,.{places}f}, SMG {s[key]:,.{places}f} {unit}"
            got += f" (×{ratio:.2f})" if ratio else ""
            rows.append([f"`--workers 2` vs SMG, both cores: {what}", got, _verdict(ok)])
    others = {
        "gateway_granian": "(HTTP layer) granian ÷ uvicorn, same app",
        "gateway_redis": "(sharing) with Redis ÷ without",
        "python_relay": "(floor) the HTTP stack and the relay alone, no checks ÷ the gateway",
    }
    for other, what in others.items():
        if (g := fig.get(other)) and (u := fig.get("gateway")):
            rps = ", ".join(f"×{g['at'][n]['rps'] / u['at'][n]['rps']:.2f}" for n in (1, 16, 64))
            cpu = f"CPU ×{g['cpu'] / u['cpu']:.2f} ({g['cpu']:,.0f} / {u['cpu']:,.0f} µs)"
            got = f"req/s at 1/16/64 {rps}; {cpu}; added p99 at 1 "
            p99 = f"×{g['p99'] / u['p99']:.2f}" if u["p99"] > 0 else "-"
            rows.append([what + ", one core", got + p99, "-"])
    note = (
        "Targets (issue 44). `*_unpinned` and `gateway_workers2` (`serve --workers 2`, claims "
        "in Redis, whose own CPU is not counted) run on both cores, shared with wrk and the "
        "instant backends (on CPU 0); `gateway_granian`: the same app under granian, pinned "
        "like `gateway`; `python_relay` (`bench/python_relay.py`): the gateway's HTTP stack "
        "and upstream client relaying to the pair with none of its checks, pinned like it. "
        "CPU µs/req: the whole process group, every worker."
    )
    return [note, "", *_table("target | measured | verdict", rows)] if rows else []


def _routing_targets(routing: list[dict]) -> list[str]:
    plain = _cells(routing, "plain")
    lines = []
    d, r, g = (plain.get((1, t)) for t in ("direct", "sglang_router", "gateway"))
    if d and r and g:
        (g50, r50), (g99, r99) = ([c[p] - d[p] for c in (g, r)] for p in ("p50_ms", "p99_ms"))
        lines += [
            f"| 1 in flight: added p50 ≤ {TARGET_ADDED_P50_MS} ms | gateway {g50:.3f} ms "
            f"(sglang_router {r50:.3f} ms) | {_verdict(g50 <= TARGET_ADDED_P50_MS)} |",
            f"| 1 in flight: added p99 ≤ {TARGET_ADDED_P99_MS} ms | gateway {g99:.3f} ms "
            f"(sglang_router {r99:.3f} ms) | {_verdict(g99 <= TARGET_ADDED_P99_MS)} |",
        ]
        # The issue states the absolute bounds as "within 2× of sglang_router": on a slower
        # machine the peer itself misses them, so the relative form is reported beside them.
        if r50 > 0 and r99 > 0:
            lines.append(
                "| 1 in flight: added p50 and p99 within 2× of sglang_router's, same run | "
                f"p50 ×{g50 / r50:.2f}, p99 ×{g99 / r99:.2f} | "
                f"p50 {_verdict(g50 <= 2 * r50)}, p99 {_verdict(g99 <= 2 * r99)} |"
            )
    loaded = [(t, c) for (n, t), c in plain.items() if n > 1]
    best = {t: max((c["rps"] for tt, c in loaded if tt == t), default=0.0) for t in ROUTERS}
    cpus = {t: [c["cpu_us_per_request"] for tt, c in loaded if tt == t] for t in ROUTERS}
    cpu = {t: min((v for v in values if v), default=None) for t, values in cpus.items()}
    if best["sglang_router"]:
        ratio = best["gateway"] / best["sglang_router"]
        lines.append(
            f"| saturation throughput ≥ ½ sglang_router's | gateway {best['gateway']:,.0f} req/s, "
            f"sglang_router {best['sglang_router']:,.0f} req/s (×{ratio:.2f}) | "
            f"{_verdict(ratio >= 0.5)} |"
        )
    if cpu["sglang_router"] and cpu["gateway"]:
        ratio = cpu["gateway"] / cpu["sglang_router"]
        lines.append(
            f"| CPU per request ≤ 2× sglang_router's | gateway {cpu['gateway']:,.0f} µs, "
            f"sglang_router {cpu['sglang_router']:,.0f} µs (×{ratio:.1f}) | "
            f"{_verdict(ratio <= 2)} |"
        )
    return lines


def _prompt_targets(prompt: dict) -> list[str]:
    lines = []
    refusal = next((r for r in prompt.get("refusal", []) if r["megabytes"] == 50), None)
    refusals = [(refusal, "", 400)]
    if capped := prompt.get("refusal_capped"):
        cap_mib = prompt["capped_body_bytes"] / 2**20
        refusals.append((capped, f", {cap_mib:.0f} MiB body cap (`ISOGATE_MAX_BODY_BYTES`)", 413))
    for row, cap, status in refusals:
        if row:
            ok = row["p50_ms"] <= TARGET_REFUSE_50MB_MS and row["status"] == status
            lines.append(
                f"| refuse a 50 MB prompt ≤ {TARGET_REFUSE_50MB_MS:.0f} ms{cap} | "
                f"p50 {row['p50_ms']:.1f} ms, min {row['min_ms']:.1f} ms "
                f"(HTTP {row['status']} {row['code']}) | {_verdict(ok)} |"
            )
    for key, what in (
        ("blocking", "tokenizing a 1M-token prompt does not hold others up"),
        ("refusal_real_tokenizer", "refusing a 1M-token prompt of DeepSeek-V4's tokenizer"),
    ):
        if b := prompt.get(key):
            ok = b["during_requests"] > 1 and b["during_max_ms"] < b["big_ms"] / 4
            if key == "refusal_real_tokenizer":
                ok = ok and b["big_status"] == 400 and b["big_code"] == "context_length_exceeded"
            lines.append(
                f"| {what} | {b['big_tokens']:,} tokens decided in {b['big_ms']:.0f} ms "
                f"(HTTP {b['big_status']}); small requests meanwhile n={b['during_requests']}, "
                f"p50 {b['during_p50_ms']:.1f} ms, max {b['during_max_ms']:.1f} ms "
                f"(before: p50 {b['baseline_p50_ms']:.1f} ms) | {_verdict(ok)} |"
            )
    return lines


def target_lines(results: dict[str, Any]) -> list[str]:
    lines = ["| target | measured | verdict |", "|---|---|---|"]
    lines += _routing_targets(results.get("routing") or [])
    lines += _prompt_targets(results.get("prompt") or {})
    memory = results.get("memory")
    if memory and memory.get("streams"):
        row = next((r for r in memory["streams"] if r["streams"] == 1000), memory["streams"][0])
        met = row["rss_mb"] <= TARGET_STREAMS_MB and row["opened"] >= 0.99 * row["streams"]
        lines.append(
            f"| 1,000 streams ≤ {TARGET_STREAMS_MB:.0f} MB RSS | {row['rss_mb']:.0f} MB with "
            f"{row['opened']} streams flowing (idle {memory['idle_before_mb']:.0f} MB) | "
            f"{_verdict(met)} |"
        )
    audit = next((r["results"] for r in results.get("peers") or [] if r["name"] == "audit"), None)
    for row in audit or []:
        if row.get("database") != "postgresql":
            continue
        rate, p99 = row["audit_log_events_per_s"], row["query_tenant_newest_100_p99_ms"]
        lines += [
            f"| audit: ≥ {TARGET_AUDIT_EVENTS_PER_S:,} events/s into PostgreSQL | "
            f"{rate:,.0f} events/s through the audit log "
            f"({row['store_insert_events_per_s']:,.0f} by the store alone) | "
            f"{_verdict(rate >= TARGET_AUDIT_EVENTS_PER_S)} |",
            f"| audit: a tenant's newest 100 among {row['stored_rows']:,} in ≤ "
            f"{TARGET_AUDIT_QUERY_P99_MS:.0f} ms p99 (PostgreSQL) | p99 {p99:.2f} ms, "
            f"p50 {row['query_tenant_newest_100_p50_ms']:.2f} ms | "
            f"{_verdict(p99 <= TARGET_AUDIT_QUERY_P99_MS)} |",
        ]
    return [*lines, ""]


def result_tables(value: Any) -> list[str]:
    """A section-3 bench's JSON as tables: records side by side (one column each), plain fields
    as two columns, each field that is a set of records as a table of its own."""
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        first, *keys = list(dict.fromkeys(k for v in value for k in v))
        header = " | ".join([first, *(str(v.get(first)) for v in value)])
        return _table(header, [[k, *(v.get(k) for v in value)] for k in keys])
    if not isinstance(value, dict):
        return ["```", str(value)[:3000], "```", ""]
    plain, out = [], []
    for key, inner in value.items():
        if not isinstance(inner, dict):
            plain.append([key, inner])
        elif inner and all(isinstance(v, dict) for v in inner.values()):
            fields = list(next(iter(inner.values())))
            rows = [[k, *v.values()] for k, v in inner.items()]
            out += [f"`{key}`:", "", *_table(" | ".join(["", *fields]), rows)]
        else:
            plain += [[f"{key} {k}", v] for k, v in inner.items()]
    return [*(_table(" | ", plain) if plain else []), *out]


def _prompt_section(prompt: dict) -> list[str]:
    out = ["## 2. Tokenization and admission vs prompt length", ""]
    header = "prompt tokens | MB | encode ms (in process) | admission µs | "
    header += "via gateway ms (admitted, served) | status"
    fields = "tokens megabytes encode_ms admission_us http_ms http_status"
    out += _table(header, _rows(prompt["tokenize"], fields))
    out += ["Refusing an over-limit prompt (model limit 65,536 tokens), HTTP end to end:", ""]
    header = "prompt MB | status | code | p50 ms | min ms | max ms | "
    header += "floor p50 ms (same body to the instant backend: upload + orjson parse)"
    fields = "megabytes status code p50_ms min_ms max_ms floor_p50_ms"
    out += _table(header, _rows(prompt["refusal"], fields))
    if capped := prompt.get("refusal_capped"):
        out += [
            f"With a body cap (`ISOGATE_MAX_BODY_BYTES={prompt['capped_body_bytes']}`, a second "
            f"gateway) the 50 MB prompt got HTTP {capped['status']} {capped['code']} from its "
            f"declared length: p50 {capped['p50_ms']:.1f} ms, min {capped['min_ms']:.1f} ms, "
            f"max {capped['max_ms']:.1f} ms. Client: one plain socket, head and body in two "
            "`sendall` calls (`bench.prompt_bench.raw_post`).",
            "",
        ]
    real = "the gateway tokenizes and refuses a 1M-token prompt of DeepSeek-V4's tokenizer "
    real += "(model `deepseek-v4-tiny`, limit 681,280 tokens)"
    titles = {"blocking": "one 1M-token prompt is tokenized and served"}
    for key, title in (titles | {"refusal_real_tokenizer": real}).items():
        if b := prompt.get(key):
            answer = " ".join(str(part) for part in (b["big_status"], b["big_code"]) if part)
            during = f"during ({b['big_ms']:.0f} ms, HTTP {answer})"
            out += [f"Small requests (1 in flight; the gateway on every CPU) while {title}:", ""]
            before = ["before", "-", b["baseline_p50_ms"], b["baseline_p99_ms"], "-"]
            fields = "during_requests during_p50_ms during_p99_ms during_max_ms"
            rows = [before, [during, *_rows([b], fields)[0]]]
            out += _table(" | requests | p50 ms | p99 ms | max ms", rows)
    return out


def _memory_section(memory: dict) -> list[str]:
    rows = [["idle, just started", memory["idle_fresh_mb"], "-"]]
    rows.append(["idle, before opening streams", memory["idle_before_mb"], "-"])
    for r in memory["streams"]:
        note = f"{r['opened']} flowing, opened in {r['open_s']:.1f} s"
        rows.append([f"{r['streams']:,} streams held open", r["rss_mb"], note])
    rows.append(["streams closed", memory["idle_after_mb"], "-"])
    out = ["## 4. Gateway memory", "", *_table("state | RSS MB | note", rows)]
    if memory.get("per_1000_streams_mb") is not None:
        out += [f"Per 1,000 streams: {memory['per_1000_streams_mb']:.0f} MB.", ""]
    out += [
        "Engine streams the gateway still held open to the decode backend "
        f"{memory['upstream_release_s']:.1f} s after every client had closed its stream: "
        f"{memory['upstream_open_after_close']} (about 0 when client disconnects are noticed).",
        "",
    ]
    return out


def _real_section(real: dict) -> list[str]:
    out = ["## Real SGLang 0.5.23 CPU PD pair (tiny model, small n)", ""]
    if not real.get("cells"):
        return [*out, f"Not run: {real.get('skipped') or real.get('failed')}", ""]
    out += [
        f"engine_patch tags verified: {real.get('engine_tags')}. Latency is dominated by the "
        "model on the CPU; compare the paths, not the absolute numbers. Streamed: "
        f"{STREAM_TOKENS} tokens each (ignore_eos); a gap is the time between two events with "
        "text as the client reads them, and gaps under 0.1 ms are text that arrived in one read "
        "with the text before it (held back, then written together).",
        "",
    ]
    header = "mode | in flight | target | n | p50 ms | p99 ms | TTFT p50 ms | gap p50 ms "
    header += "| gap mean ms | gaps < 0.1 ms % | errors"
    fields = "mode concurrency target requests p50_ms p99_ms ttft_p50_ms gap_p50_ms gap_mean_ms "
    fields += "gaps_together_pct errors"
    out += _table(header, _rows(real["cells"], fields))
    if real.get("serving"):
        out += ["### `sglang.bench_serving` through each router", ""]
        out += _serving_section(real["serving"])
    return out


def _hostile_section(results: dict) -> list[str]:
    base = results["baseline"]
    rows = [["nothing (baseline)", base, {}]]
    rows += [[p["pattern"], p, p["hostile_answers"]] for p in results["patterns"]]
    rows.append(["nothing, after all patterns", results["after"], {}])
    for row in rows:
        cell, answers = row[1], row.pop()
        ratio = cell["p99_ms"] / base["p99_ms"] if cell["p99_ms"] and base["p99_ms"] else None
        got = ", ".join(f"{k}: {v}" for k, v in sorted(answers.items())) or "-"
        fields = "requests p50_ms p99_ms max_ms healthz_p99_ms"
        row[1:] = [*_rows([cell], fields)[0], ratio, cell["failed"], got]
    header = "while | requests | p50 ms | p99 ms | max ms | /healthz p99 ms | p99 / baseline p99 "
    header += "| failed | what the hostile client got"
    return [
        "A well-behaved tenant's small chat requests, one at a time, each followed by a "
        "/healthz, on the instant backends, "
        f"{results['seconds_per_pattern']:.0f} s per pattern, while another client sends it "
        f"(`bench/hostile_bench.py`; target p99 ≤ {results['target_p99_ms_60mb']:.0f} ms "
        "during the 60 MB body).",
        "",
        *_table(header, rows),
    ]


def _fair_section(result: dict) -> list[str]:
    if "sweep" not in result:
        return [f"Not run: {result.get('skipped') or result.get('failed')}", ""]
    out = [f"Saturation sweep not run (BENCH_FAIR_SWEEP=0); queue cap {result['cap']}.", ""]
    if result["sweep"]:
        out = [
            f"Saturation of the pair (straight to the workers, closed loop, {MAX_TOKENS} tokens "
            f"out): knee = {result['knee']} in flight (smallest within {KNEE_FRACTION:.0%} of "
            f"the best throughput); gateway queue cap {result['cap']}.",
            "",
            *_table(
                "in flight | req/s | p50 ms | errors",
                _rows(result["sweep"], "concurrency rps p50_ms errors"),
            ),
        ]
    header = (
        "gateway | B max_tokens | A | B requests | B p50 ms | B p90 ms | B x alone | B refused "
        "| A done | A refused | pair tok/s | vs no queue"
    )
    fields = (
        "gateway b_max_tokens a b_requests b_p50_ms b_p90_ms b_ratio b_refused a_completed "
        "a_refused tokens_per_s vs_no_queue"
    )
    short = "gateway a b_p50_ms b_ratio b_refused tokens_per_s vs_no_queue"
    weights = [
        [name, f"{w['served']['heavy']:.0f} : {w['served']['light']:.0f}", w["ratio"],
         f"{w['completed']['heavy']} : {w['completed']['light']}"]
        for name, w in result.get("weights", {}).items()
    ]  # fmt: skip
    met = result.get("targets", {})
    columns = list(dict.fromkeys(what for row in met.values() for what in row))
    verdicts = [
        [case, *("-" if c not in row else "met" if row[c] else "MISSED" for c in columns)]
        for case, row in met.items()
    ]
    return [
        *out,
        f"Noisy neighbour: tenant B at one request at a time for {result['seconds']:.0f} s, "
        f"alone and while tenant A floods (from {result['ramp_s']:.0f} s before B's window); "
        + (f"**the pair died: {result['pair_died']}**; " if result.get("pair_died") else "")
        + "B x alone against B alone through the same gateway, the pair's generated tokens/s "
        f"(what decode logs as gen throughput) against the same case without a queue. Targets: B "
        f"x alone <= {B_RATIO_TARGET:g}, never refused, >= {THROUGHPUT_TARGET:.0%} of no queue.",
        "",
        *_table(header, _rows(result.get("neighbour", []), fields)),
        "The curve (B at 16 tokens, A at 24 in flight x 64 tokens) by contended cap:",
        "",
        *_table("gateway | A | B p50 ms | B x alone | B refused | tok/s | vs no queue",
                _rows(result.get("curve", []), short)),
        f"The linger: B pausing {result['think_s']:g} s between its requests, A at 24 in flight "
        "x 1,024 tokens:",
        "",
        *_table("gateway | A | B p50 ms | B x alone | B refused | tok/s | vs no queue",
                _rows(result.get("linger", []), short)),
        "Weights 2 : 1, both tenants at 24 in flight: served by the queue in the steady part of "
        "the run, and completed over the whole run.",
        "",
        *_table("gateway | served heavy : light | ratio | completed heavy : light", weights),
        *_table(" | ".join(["targets", *columns]), verdicts),
    ]  # fmt: skip


def _serving_section(section: dict) -> list[str]:
    if not section.get("cells"):
        return [f"bench_serving: not run: {section.get('failed') or section.get('skipped')}", ""]
    low = {k: max(int(section[k] * section["range_ratio"]), 1) for k in ("input_len", "output_len")}
    rows = _rows(section["cells"], "backend target completed prompts request_throughput")
    rows = [[b, t, f"{done}/{sent}", rate] for b, t, done, sent, rate in rows]
    fields = "median_ttft_ms median_itl_ms mean_itl_ms itl_together_pct median_e2e_latency_ms "
    fields += "p99_e2e_latency_ms"
    figures = _rows(section["cells"], fields)
    errors = [
        (c["error"] or "-").replace("|", "/").replace("\n", " ")[:160] for c in section["cells"]
    ]
    header = "backend | target | succeeded | req/s | TTFT p50 ms | ITL p50 ms | ITL mean ms | "
    header += "ITL < 0.1 ms % | E2E p50 ms | E2E p99 ms | first error"
    return [
        f"`sglang.bench_serving` (SGLang 0.5.23's own client), {section['prompts']} prompts "
        f"per run at {section['request_rate']:g} req/s (Poisson, at most "
        f"{section['max_concurrency']} in flight), {low['input_len']}-{section['input_len']} "
        f"prompt and {low['output_len']}-{section['output_len']} output tokens (ignore_eos), "
        "streaming; the same prompts and arrival times for every target; prefix caches "
        + ("flushed before each run." if section.get("caches_flushed") else "NOT all flushed."),
        "",
        *_table(header, [[*r, *f, e] for r, f, e in zip(rows, figures, errors, strict=True)]),
    ]


def render(results: dict[str, Any]) -> str:
    config = results.get("config", {})
    out = [
        "# isogate benchmark results",
        "",
        f"Run: {results.get('started_at')} "
        f"({'BENCH_QUICK smoke run' if config.get('quick') else 'full run'}, "
        f"{results.get('seconds', 0):.0f} s). Produced by `make bench` (`scripts/bench`); "
        "how to read it: `bench/README.md`.",
        "",
        "## Machine",
        "",
        *_table(" | ", [[k, str(v)] for k, v in results.get("machine", {}).items()]),
        "## Targets (issue 7)",
        "",
        *target_lines(results),
    ]
    if results.get("routing"):
        out += [
            "## 1. Routing cost: direct vs sglang_router 0.3.2 (PD) vs SMG (PD, where installed) "
            "vs isogate gateway, instant backend",
            "",
            "Same client request to all of them (`POST /v1/completions`, short prompt, 4 output "
            "tokens). `direct` = straight to the decode instant backend (the floor). Added = "
            "target − direct at the same concurrency. CPU µs/req = the router process's CPU "
            f"time ÷ requests served. Each figure is the median of {config.get('routing_rounds')} "
            f"runs of {config.get('wrk_duration_s')} s (the targets interleaved in every round). "
            f"Pinning: {config.get('pinning')}",
            "",
            *routing_tables(results["routing"]),
            *_scale_out(results["routing"]),
        ]
    if results.get("prompt"):
        out += _prompt_section(results["prompt"])
    if results.get("peers"):
        out += ["## 3. Audit log, verification, engine plugin", ""]
        for run in results["peers"]:
            out += [f"### {run['name']}: {run['status']} ({run['seconds']:.0f} s)", ""]
            if run.get("results") is not None:
                out += result_tables(run["results"])
            elif run.get("output_tail"):
                out += ["```", run["output_tail"][-1500:], "```", ""]
    if results.get("memory"):
        out += _memory_section(results["memory"])
    if results.get("hostile"):
        out += ["## Hostile clients (issue 17)", "", *_hostile_section(results["hostile"])]
    if results.get("fair_share"):
        out += ["## Fair share on a real SGLang CPU PD pair (issue 18)", ""]
        out += _fair_section(results["fair_share"])
    if results.get("real_engine"):
        out += _real_section(results["real_engine"])
    if results.get("errors"):
        out += ["## Sections that failed", "", *(f"- {e}" for e in results["errors"]), ""]
    return "\n".join(out)
