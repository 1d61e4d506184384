"""The Markdown of `python -m bench.fairness`: the table of each policy's figures and the
goals (fairness_stats.py computes them), and the report around it (pure)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from bench.fairness_stats import (
    GOAL_LIGHT,
    GOAL_SD_AVG,
    GOAL_SD_MAX,
    GOAL_THROUGHPUT,
    GOAL_THROUGHPUT_SAME_MIX,
    GOAL_VOICE,
    GOAL_WEIGHTED,
    LIGHT_TTFT_GOAL,
    LOADED_PHASES,
    SAME_MIX_PHASES,
    SERVICE_DIFF_GOAL,
    THROUGHPUT_GOAL,
    VOICE_TTFT_GOAL,
    WEIGHT,
    WEIGHTED,
    WEIGHTED_GOAL,
    WEIGHTED_USER,
    Goal,
    PolicySummary,
    ServiceDifference,
    TtftStats,
)
from bench.report import run_facts
from bench.serve_stats import fmt_ms, fmt_rate

# --------------------------------------------------------------------------------------
# rendering (pure)
# --------------------------------------------------------------------------------------


def fmt_x(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def fmt_tokens(value: float | None) -> str:
    return "–" if value is None else f"{value:,.0f}"


def fmt_pair(stats: TtftStats | None) -> str:
    """`p50 / p95 (n)` in ms."""
    if stats is None:
        return "–"
    ok = stats.requests - stats.errors
    errors = f", {stats.errors} failed" if stats.errors else ""
    return f"{fmt_ms(stats.p50_s)} / {fmt_ms(stats.p95_s)} (n={ok}{errors})"


def fmt_service(sd: ServiceDifference | None, pick: Callable[[ServiceDifference], float | None]
                ) -> str:
    if sd is None:
        return "–"
    return f"{fmt_tokens(pick(sd))} ({sd.windows}/{sd.windows_total} windows)"


def fmt_goal(goal: Goal) -> str:
    met = {True: "**yes**", False: "**no**", None: "–"}[goal.met]
    return f"{met} ({fmt_x(goal.value)})" if goal.value is not None else met


def fmt_share(totals: Mapping[str, float]) -> str:
    if not totals:
        return "–"
    return " : ".join(f"{u} {fmt_tokens(v)}" for u, v in totals.items())


def fmt_percent(shares: Mapping[str, float | None]) -> str:
    if not shares:
        return "–"
    return " : ".join(f"{u} {'–' if v is None else f'{v:.0%}'}" for u, v in shares.items())


def phase_rate(phase: str) -> Callable[[PolicySummary], str]:
    return lambda s: fmt_rate(s.phase_tokens_per_s.get(phase))


def render_table(summaries: Mapping[str, PolicySummary], goals: Sequence[Goal],
                 window_s: float) -> str:
    """Markdown: one row per figure, one column per policy, then the goal and whether fair
    met it."""
    names = list(summaries)
    by_goal = {g.name: g for g in goals}
    win = f"{window_s:g} s"

    def row(label: str, cell: Callable[[PolicySummary], str], goal: str = "",
            goal_key: str | None = None) -> str:
        cells = [cell(summaries[n]) for n in names]
        met = fmt_goal(by_goal[goal_key]) if goal_key else ""
        return "| " + " | ".join([label, *cells, goal, met]) + " |"

    lines = [
        "| figure | " + " | ".join(names) + " | goal | met |",
        "|---|" + "---:|" * len(names) + "---|---|",
        row("light user (bob) TTFT p50 / p95 ms, solo on this server",
            lambda s: fmt_pair(s.light_solo_own)),
        row("light user TTFT p50 / p95 ms, solo, all servers pooled (baseline)",
            lambda s: fmt_pair(s.light_solo)),
        row("light user TTFT p50 / p95 ms, heavy user backlogged",
            lambda s: fmt_pair(s.light_loaded)),
        row("light-user TTFT p95 relative to solo", lambda s: fmt_x(s.light_ratio),
            f"fair ≤ {LIGHT_TTFT_GOAL:g}×", GOAL_LIGHT),
        row("voice (dave) TTFT p50 / p95 ms, solo on this server",
            lambda s: fmt_pair(s.voice_solo_own)),
        row("voice TTFT p50 / p95 ms, solo, all servers pooled (baseline)",
            lambda s: fmt_pair(s.voice_solo)),
        row("voice TTFT p50 / p95 ms, background backlog", lambda s: fmt_pair(s.voice_loaded)),
        row("voice TTFT p95 relative to solo", lambda s: fmt_x(s.voice_ratio),
            f"fair ≤ {VOICE_TTFT_GOAL:g}×", GOAL_VOICE),
        row(f"service difference heavy vs light per {win} window, avg",
            lambda s: fmt_service(s.service, lambda d: d.avg),
            f"fair ≤ {SERVICE_DIFF_GOAL:g}× fcfs", GOAL_SD_AVG),
        row(f"service difference per {win} window, max",
            lambda s: fmt_service(s.service, lambda d: d.max),
            f"fair ≤ {SERVICE_DIFF_GOAL:g}× fcfs", GOAL_SD_MAX),
        row("weighted service in those windows", lambda s: fmt_share(s.service_totals)),
        *(row(f"output tok/s, {p}", phase_rate(p)) for p in LOADED_PHASES),
        row("output tok/s, loaded phases together", lambda s: fmt_rate(s.tokens_per_s),
            f"fair ≥ {THROUGHPUT_GOAL:g}× fcfs", GOAL_THROUGHPUT),
        row(f"output tok/s, {' + '.join(SAME_MIX_PHASES)} (same mix under both)",
            lambda s: fmt_rate(s.same_mix_tokens_per_s),
            f"fair ≥ {THROUGHPUT_GOAL:g}× fcfs", GOAL_THROUGHPUT_SAME_MIX),
        row(f"{WEIGHTED} phase: weighted service", lambda s: fmt_share(s.weighted_totals)),
        row(f"{WEIGHTED} phase: time with a request waiting",
            lambda s: fmt_percent(s.weighted_waiting)),
        row(f"{WEIGHTED} phase: {WEIGHTED_USER} (weight {WEIGHT:g}) / alice (weight 1)",
            lambda s: fmt_x(s.weighted_ratio),
            f"fair {WEIGHT:g}× ± {WEIGHTED_GOAL:.0%}", GOAL_WEIGHTED),
    ]
    return "\n".join(lines)


def render_report(meta: Mapping[str, Any], summaries: Mapping[str, PolicySummary],
                  goals: Sequence[Goal], servers: Mapping[str, Mapping[str, Any]]) -> str:
    """The whole Markdown report: facts about the run, the table, notes."""
    wl = meta["workload"]
    lines = [
        f"### Fairness benchmark: {', '.join(summaries)} ({meta['date']})",
        "",
        *run_facts(meta),
        f"- machine: {meta['machine']}; max batch {meta['max_batch_size']}; "
        f"w_in {meta['w_in']:g}, w_out {meta['w_out']:g}; run took {meta['duration_s']:.0f} s",
        f"- workload: {wl}",
    ]
    if meta.get("rounds", 1) > 1:
        lines.append(f"- rounds: {meta['rounds']}, servers in the order below; each policy's "
                     "figures are pooled over its rounds (TTFTs together, every counted "
                     "service window, all tokens over all measured spans)")
    for name, server in servers.items():
        lines.append(f"- {name}: `{server['command']}` (log `{server['log']}`)")
    lines += ["", render_table(summaries, goals, meta["window_s"]), ""]
    lines += [
        "TTFT: request sent → first text chunk, from the client. Each server ran the solo "
        "baselines just before its loaded phases; the ratios divide by the p95 of all servers' "
        "solo requests pooled (one request at a time, so the policy cannot matter). Service: w_in × prompt tokens computed + w_out × output tokens, per user "
        f"per {meta['window_s']:g} s window (60 s in the VTC paper; shorter here to get several "
        "windows from a short run), counted only in windows where both users had a request "
        "waiting throughout. Goals apply to fair; fcfs is the reference.",
    ]
    for name, s in summaries.items():
        if s.error:
            lines.append(f"- {name} FAILED: {s.error}")
        elif s.request_errors:
            lines.append(f"- {name}: {s.request_errors} requests failed (see the JSON).")
    return "\n".join(lines)
