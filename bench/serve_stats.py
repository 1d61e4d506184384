"""The serving benchmark's pure parts: per-level statistics, ours/mlx_lm ratios and the
Markdown report (``python -m bench.serve`` runs the servers, :mod:`bench.serve`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from appliance.percentiles import percentile
from bench.client import RequestTiming
from bench.report import mean, run_facts, safe_ratio

OURS = "ours"
MLX_LM = "mlx_lm"
LLAMA_CPP = "llama_cpp"


# --------------------------------------------------------------------------------------
# aggregation (pure)
# --------------------------------------------------------------------------------------


@dataclass
class LevelStats:
    """One server at one concurrency level."""

    concurrency: int
    requests: int
    errors: int
    output_tokens: int
    wall_s: float
    tokens_per_s: float | None
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    itl_p50_s: float | None
    itl_p95_s: float | None
    tpot_mean_s: float | None
    token_source: str
    first_error: str | None = None
    itl_max_s: float | None = None


@dataclass
class LevelRatio:
    """ours / reference at one concurrency level (throughput: higher is better for ours;
    latencies: lower is better for ours)."""

    concurrency: int
    tokens_per_s: float | None
    ttft_p95: float | None
    itl_p95: float | None


def token_source(timings: Sequence[RequestTiming]) -> str:
    """`usage` when every request's count came from the server, `chunks` when none did."""
    with_usage = sum(1 for t in timings if t.usage_tokens is not None)
    if with_usage == len(timings):
        return "usage"
    return "chunks" if with_usage == 0 else "mixed"


def time_per_output_token(timing: RequestTiming) -> float | None:
    """(last text chunk - first text chunk) / (tokens - 1): decode pace of one request."""
    if len(timing.chunk_times) < 2 or timing.output_tokens < 2:
        return None
    return (timing.chunk_times[-1] - timing.chunk_times[0]) / (timing.output_tokens - 1)


def summarize_level(
    concurrency: int, timings: Sequence[RequestTiming], wall_s: float
) -> LevelStats:
    """Aggregate per-request timings of one level. Failed requests count as errors only."""
    ok = [t for t in timings if t.ok]
    tokens = sum(t.output_tokens for t in ok)
    ttfts = [t.ttft_s for t in ok if t.ttft_s is not None]
    itls = [gap for t in ok for gap in t.inter_token_latencies]
    tpots = [v for v in (time_per_output_token(t) for t in ok) if v is not None]
    errors = [t for t in timings if not t.ok]
    return LevelStats(
        concurrency=concurrency,
        requests=len(timings),
        errors=len(errors),
        output_tokens=tokens,
        wall_s=wall_s,
        tokens_per_s=safe_ratio(float(tokens), wall_s) if ok else None,
        ttft_p50_s=percentile(ttfts, 50, "linear"),
        ttft_p95_s=percentile(ttfts, 95, "linear"),
        itl_p50_s=percentile(itls, 50, "linear"),
        itl_p95_s=percentile(itls, 95, "linear"),
        tpot_mean_s=mean(tpots),
        token_source=token_source(ok) if ok else "none",
        first_error=errors[0].error if errors else None,
        itl_max_s=max(itls) if itls else None,
    )


def compute_ratios(ours: Sequence[LevelStats], reference: Sequence[LevelStats]) -> list[LevelRatio]:
    """ours / reference for every concurrency level both servers measured."""
    by_level = {s.concurrency: s for s in reference}
    ratios: list[LevelRatio] = []
    for mine in ours:
        ref = by_level.get(mine.concurrency)
        if ref is None:
            continue
        ratios.append(
            LevelRatio(
                concurrency=mine.concurrency,
                tokens_per_s=safe_ratio(mine.tokens_per_s, ref.tokens_per_s),
                ttft_p95=safe_ratio(mine.ttft_p95_s, ref.ttft_p95_s),
                itl_p95=safe_ratio(mine.itl_p95_s, ref.itl_p95_s),
            )
        )
    return ratios


# --------------------------------------------------------------------------------------
# rendering (pure)
# --------------------------------------------------------------------------------------


def fmt_ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1000:.0f}"


def fmt_rate(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def fmt_ratio(value: float | None) -> str:
    return "–" if value is None else f"**{value:.2f}×**"


TABLE_HEADER = (
    "| C | server | ok/req | out tok | tok/s | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | ITL p95 ms "
    "| ITL max ms |",
    "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
)


def level_row(name: str, stats: LevelStats) -> str:
    ok = stats.requests - stats.errors
    cells = (
        str(stats.concurrency),
        name,
        f"{ok}/{stats.requests}",
        str(stats.output_tokens),
        fmt_rate(stats.tokens_per_s),
        fmt_ms(stats.ttft_p50_s),
        fmt_ms(stats.ttft_p95_s),
        fmt_ms(stats.itl_p50_s),
        fmt_ms(stats.itl_p95_s),
        fmt_ms(stats.itl_max_s),
    )
    return "| " + " | ".join(cells) + " |"


def ratio_row(label: str, ratio: LevelRatio) -> str:
    cells = (
        str(ratio.concurrency),
        label,
        "",
        "",
        fmt_ratio(ratio.tokens_per_s),
        "",
        fmt_ratio(ratio.ttft_p95),
        "",
        fmt_ratio(ratio.itl_p95),
        "",
    )
    return "| " + " | ".join(cells) + " |"


def render_table(results: Mapping[str, Sequence[LevelStats]], ratios: Sequence[LevelRatio],
                 more: Mapping[str, Sequence[LevelRatio]] | None = None) -> str:
    """Markdown: one row per (level, server), then the ours/mlx_lm ratio row of that level
    and ours/NAME for each other reference in `more`."""
    levels = sorted({s.concurrency for stats in results.values() for s in stats})
    by_reference = {MLX_LM: ratios, **(more or {})}
    lines = list(TABLE_HEADER)
    for level in levels:
        for name, stats in results.items():
            lines += [level_row(name, s) for s in stats if s.concurrency == level]
        for reference, refs in by_reference.items():
            lines += [ratio_row(f"{OURS}/{reference}", r) for r in refs if r.concurrency == level]
    return "\n".join(lines)


def render_stagger(report: Mapping[str, Any], stagger_ms: float) -> str:
    """Markdown: each level again with clients starting `stagger_ms` apart; ITL p95 of the
    running streams against the steady run of the same level."""
    lines = [f"Staggered arrivals (clients start {stagger_ms:g} ms apart; goal: ITL p95 "
             "≤ 1.5× steady):", "",
             "| C | server | ITL p95 steady ms | ITL p95 staggered ms | ITL max staggered ms "
             "| staggered/steady |", "|---:|---|---:|---:|---:|---:|"]
    for name, server in report["servers"].items():
        for row in server.get("staggered", []):
            lines.append(f"| {row['concurrency']} | {name} | {fmt_ms(row['itl_p95_steady_s'])} "
                         f"| {fmt_ms(row['itl_p95_staggered_s'])} "
                         f"| {fmt_ms(row['itl_max_staggered_s'])} | {fmt_ratio(row['ratio'])} |")
    return "\n".join(lines)


def resident_text(server: Mapping[str, Any]) -> str:
    """"; resident ..." for a server whose memory was read after its levels, else ""."""
    rss, peak = server.get("resident_bytes"), server.get("resident_peak_bytes")
    if rss is None:
        return ""
    return f"; resident after the levels {rss / 1e9:.2f} GB (peak {(peak or rss) / 1e9:.2f} GB)"


def resident_ratios(report: Mapping[str, Any]) -> list[str]:
    """Ours' resident memory against each other server's, where both were read."""
    servers = report["servers"]
    mine = servers.get(OURS, {}).get("resident_bytes")
    return [f"- resident memory {OURS}/{name}: {fmt_ratio(mine / other)}"
            for name, server in servers.items()
            if name != OURS and mine and (other := server.get("resident_bytes"))]


def render_report(report: Mapping[str, Any]) -> str:
    """The whole Markdown report: facts about the run, the table, notes."""
    meta = report["meta"]
    results = {
        name: [LevelStats(**level) for level in server["levels"]]
        for name, server in report["servers"].items()
    }
    ratios = [LevelRatio(**r) for r in report["ratios"]]
    more = {LLAMA_CPP: [LevelRatio(**r) for r in report[f"ratios_{LLAMA_CPP}"]]
            } if report.get(f"ratios_{LLAMA_CPP}") else None
    lines = [
        f"### Serving benchmark: {', '.join(report['servers'])} ({meta['date']})",
        "",
        *run_facts(meta),
        f"- machine: {meta['machine']}; auth for ours: {meta.get('auth', 'none')}",
        f"- workload: {meta.get('rounds', 1)} round(s) × {meta['requests_per_client']} "
        "requests per client back to back, "
        f"max_tokens {meta['max_tokens']}, prompt = a ~40-token question + "
        f"{meta.get('prompt_words', 0)} filler words, temperature 0, distinct prompts; "
        f"max batch {meta['max_batch_size']}",
    ]
    if meta.get("ranks", 1) > 1:
        lines.append(f"- {meta['ranks']} ranks per server on this machine (ring backend over "
                     f"loopback), {'each rank pinned to a core of its own' if meta.get('pinned') else 'not pinned'}")
    for name, server in report["servers"].items():
        lines.append(f"- {name}: `{server['command']}` (log `{server['log']}`)"
                     f"{resident_text(server)}")
        for rank in (server.get("ranks") or [])[1:]:
            lines.append(f"  - rank {rank['rank']}: `{rank['command']}`")
    lines += resident_ratios(report)
    lines += ["", render_table(results, ratios, more), ""]
    if meta.get("stagger_ms"):
        lines += [render_stagger(report, meta["stagger_ms"]), ""]
    lines += [
        "tok/s: output tokens of all clients / wall time of the level. TTFT: request sent → "
        "first text chunk. ITL: gaps between text chunks. Ratios are ours/reference: above 1 is "
        "better for tok/s, below 1 is better for TTFT and ITL.",
    ]
    for name, server in report["servers"].items():
        sources = sorted({lv["token_source"] for lv in server["levels"]})
        if sources and sources != ["usage"]:
            lines.append(f"- {name}: output tokens counted from {'/'.join(sources)}.")
        if server.get("error"):
            lines.append(f"- {name} FAILED: {server['error']}")
        for lv in server["levels"]:
            if lv["first_error"]:
                lines.append(
                    f"- {name} C={lv['concurrency']}: {lv['errors']} errors, first: "
                    f"{lv['first_error']}"
                )
    return "\n".join(lines)
