"""Pure parts of the fairness benchmark: service per window, ratios to solo, goals, the table."""

from __future__ import annotations

import json
import math

import pytest

from bench.client import RequestTiming
from bench.fairness import report_json, summarize_all
from bench.fairness_config import run_order
from bench.fairness_report import render_report, render_table
from bench.fairness_stats import (
    BACKGROUND,
    BACKLOGGED,
    GOAL_LIGHT,
    GOAL_SD_AVG,
    GOAL_SD_MAX,
    GOAL_THROUGHPUT,
    GOAL_THROUGHPUT_SAME_MIX,
    GOAL_VOICE,
    GOAL_WEIGHTED,
    HEAVY,
    HEAVY_LIGHT,
    LIGHT,
    LOADED_PHASES,
    SOLO_LIGHT,
    SOLO_VOICE,
    VOICE,
    VOICE_BACKGROUND,
    WEIGHTED,
    WEIGHTED_USER,
    CumulativeService,
    Goal,
    PhaseWindow,
    PolicySummary,
    Record,
    ServiceDifference,
    TtftStats,
    combined_rate,
    evaluate_goals,
    output_tokens_between,
    pool_service,
    pool_solo,
    ratio_of_p95,
    service_between,
    service_difference,
    summarize_policy,
    ttft_stats,
    waiting_share,
)
from bench.tests.test_bench_fairness_config import config


def rec(user: str, sent: float, chunks: list[float], *, usage: int | None = None,
        prompt: int | None = None, cached: int | None = None, error: str | None = None,
        duration: float | None = None) -> Record:
    """A request sent at `sent` whose text chunks came `chunks` seconds after it was sent."""
    timing = RequestTiming(client=0, index=0,
                           duration_s=duration if duration is not None else
                           (chunks[-1] if chunks else 1.0),
                           chunk_times=chunks, usage_tokens=usage, prompt_tokens=prompt,
                           cached_tokens=cached, error=error)
    return Record(user=user, lane=0, sent_s=sent, timing=timing)


def waiter(user: str, until: float = 100.0) -> Record:
    """A request that waits (no first token) from 0 until `until`: keeps `user` backlogged."""
    return rec(user, 0.0, [until], usage=1, duration=until + 1)


# ---- one request ------------------------------------------------------------------------


def test_record_times_and_computed_prompt() -> None:
    r = rec(HEAVY, 2.0, [0.5, 0.7, 1.0], usage=6, prompt=100, cached=40)
    assert r.first_token_s == pytest.approx(2.5)
    assert r.end_s == pytest.approx(3.0)
    assert r.computed_prompt_tokens == 60
    assert rec(HEAVY, 0.0, [1.0], prompt=10).computed_prompt_tokens == 10
    assert rec(HEAVY, 0.0, [1.0]).computed_prompt_tokens is None
    assert rec(HEAVY, 0.0, [1.0], prompt=5, cached=9).computed_prompt_tokens == 0


def test_waiting_is_sent_until_first_chunk_or_end() -> None:
    r = rec(LIGHT, 1.0, [2.0, 3.0])
    assert not r.waiting_at(0.99)
    assert r.waiting_at(1.0) and r.waiting_at(2.99)
    assert not r.waiting_at(3.0)  # first token at 3.0
    failed = rec(LIGHT, 1.0, [], error="HTTP 500", duration=4.0)
    assert failed.waiting_at(4.9) and not failed.waiting_at(5.0)


def test_output_tokens_are_spread_over_chunks_by_usage() -> None:
    r = rec(HEAVY, 10.0, [1.0, 2.0], usage=6)
    assert r.output_events() == [(11.0, 3.0), (12.0, 3.0)]
    assert rec(HEAVY, 0.0, [1.0, 2.0]).output_events() == [(1.0, 1.0), (2.0, 1.0)]
    assert rec(HEAVY, 0.0, []).output_events() == []


def test_service_events_weigh_prompt_at_first_chunk_and_output_per_chunk() -> None:
    r = rec(HEAVY, 0.0, [1.0, 3.0], usage=4, prompt=50, cached=10)
    assert r.service_events(w_in=1.0, w_out=2.0) == [(1.0, 4.0), (1.0, 40.0), (3.0, 4.0)]
    assert r.service_events(w_in=0.5, w_out=1.0) == [(1.0, 2.0), (1.0, 20.0), (3.0, 2.0)]


# ---- statistics -------------------------------------------------------------------------


def test_ttft_stats_filter_user_and_span_and_count_errors() -> None:
    records = [
        rec(LIGHT, 0.5, [0.9]),  # before the span
        rec(LIGHT, 1.0, [0.1]),
        rec(LIGHT, 2.0, [0.3]),
        rec(LIGHT, 3.0, [], error="HTTP 503: busy"),
        rec(HEAVY, 2.0, [5.0]),  # another user
        rec(LIGHT, 9.0, [0.2]),  # after the span
    ]
    stats = ttft_stats(records, LIGHT, since_s=1.0, until_s=5.0)
    assert (stats.requests, stats.errors) == (3, 1)
    assert stats.p50_s == pytest.approx(0.2)
    assert stats.p95_s == pytest.approx(0.29)
    assert stats.first_error == "HTTP 503: busy"
    empty = ttft_stats(records, VOICE)
    assert (empty.requests, empty.p50_s, empty.p95_s) == (0, None, None)


def test_ratio_of_p95_relative_to_solo() -> None:
    solo = TtftStats(10, 0, 0.04, 0.05)
    loaded = TtftStats(10, 0, 0.06, 0.09)
    assert ratio_of_p95(loaded, solo) == pytest.approx(1.8)
    assert ratio_of_p95(TtftStats(0, 0, None, None), solo) is None
    assert ratio_of_p95(loaded, TtftStats(0, 0, None, None)) is None


def test_output_tokens_between_counts_chunks_inside_the_span() -> None:
    records = [rec(HEAVY, 0.0, [1.0, 2.0, 3.0, 4.0], usage=8), rec(LIGHT, 2.5, [0.1])]
    assert output_tokens_between(records, 2.0, 4.0) == pytest.approx(2 + 2 + 1)
    assert output_tokens_between(records, 10.0, 20.0) == 0


def test_cumulative_service_includes_events_at_the_instant() -> None:
    cum = CumulativeService([(2.0, 5.0), (1.0, 1.0), (2.0, 1.0)])
    assert cum.at(0.5) == 0.0
    assert cum.at(1.0) == 1.0
    assert cum.at(2.0) == 7.0
    assert cum.at(99.0) == 7.0
    assert CumulativeService([]).at(1.0) == 0.0


# ---- service difference per window ------------------------------------------------------


def two_windows() -> list[Record]:
    """alice: 110 in [0, 10), 10 in [10, 20); bob: 24, then 4 (w_in 1, w_out 2)."""
    return [
        waiter(HEAVY),
        waiter(LIGHT),
        rec(HEAVY, 0.0, [2.0, 12.0], usage=10, prompt=100),
        rec(LIGHT, 0.0, [3.0, 13.0], usage=4, prompt=20),
    ]


def test_service_difference_average_and_max_over_backlogged_windows() -> None:
    sd = service_difference(two_windows(), (HEAVY, LIGHT), 0.0, 10.0, 2, 1.0, 2.0)
    assert (sd.windows, sd.windows_total, sd.window_s) == (2, 2, 10.0)
    assert sd.max == pytest.approx(110 - 24)
    assert sd.avg == pytest.approx(((110 - 24) + (10 - 4)) / 2)


def test_service_difference_matches_per_window_sums() -> None:
    records = two_windows()
    sd = service_difference(records, (HEAVY, LIGHT), 0.0, 10.0, 2, 1.0, 2.0)
    gaps = [abs(service_between(records, HEAVY, a, a + 10, 1.0, 2.0)
                - service_between(records, LIGHT, a, a + 10, 1.0, 2.0)) for a in (0.0, 10.0)]
    assert sd.avg == pytest.approx(sum(gaps) / 2)
    assert sd.max == pytest.approx(max(gaps))


def test_windows_where_a_user_was_not_backlogged_throughout_are_skipped() -> None:
    records = [r for r in two_windows() if r.user != LIGHT or r.timing.usage_tokens != 1]
    records.append(waiter(LIGHT, until=15.0))  # bob waits only until 15 s
    sd = service_difference(records, (HEAVY, LIGHT), 0.0, 10.0, 2, 1.0, 2.0)
    assert (sd.windows, sd.windows_total) == (1, 2)
    assert sd.avg == sd.max == pytest.approx(110 - 24)


def test_service_difference_without_any_counted_window_is_none() -> None:
    records = [waiter(HEAVY), rec(LIGHT, 0.0, [1.0], usage=1, prompt=5)]
    sd = service_difference(records, (HEAVY, LIGHT), 0.0, 10.0, 3, 1.0, 2.0)
    assert (sd.windows, sd.windows_total, sd.avg, sd.max) == (0, 3, None, None)
    assert service_difference(records, (HEAVY, LIGHT), 0.0, 10.0, 0, 1.0, 2.0).avg is None


def test_service_difference_windows_start_at_the_measured_start() -> None:
    shifted = [Record(r.user, r.lane, r.sent_s + 5.0, r.timing) for r in two_windows()]
    sd = service_difference(shifted, (HEAVY, LIGHT), 5.0, 10.0, 2, 1.0, 2.0)
    assert sd.windows == 2
    assert sd.max == pytest.approx(86.0)


# ---- one policy, goals -----------------------------------------------------------------


def spans() -> dict[str, PhaseWindow]:
    return {SOLO_LIGHT: PhaseWindow(0.0, math.inf), SOLO_VOICE: PhaseWindow(0.0, math.inf),
            HEAVY_LIGHT: PhaseWindow(0.0, 10.0), BACKLOGGED: PhaseWindow(0.0, 20.0),
            VOICE_BACKGROUND: PhaseWindow(0.0, 10.0)}


def phases(light_ttft: float = 0.1, voice_ttft: float = 0.05) -> dict[str, list[Record]]:
    return {
        SOLO_LIGHT: [rec(LIGHT, float(i), [0.05]) for i in range(5)],
        SOLO_VOICE: [rec(VOICE, float(i), [0.04]) for i in range(5)],
        HEAVY_LIGHT: [rec(LIGHT, float(i), [light_ttft]) for i in range(5)]
        + [rec(HEAVY, 0.0, [1.0 + i for i in range(8)], usage=100, prompt=800)],
        BACKLOGGED: two_windows(),
        VOICE_BACKGROUND: [rec(VOICE, float(i), [voice_ttft]) for i in range(5)]
        + [rec(BACKGROUND, 0.0, [1.0, 2.0], usage=50, prompt=300)],
    }


def summary(light_ttft: float = 0.1, voice_ttft: float = 0.05, policy: str = "fair"
            ) -> PolicySummary:
    return summarize_policy(policy, [phases(light_ttft, voice_ttft)], spans(), 10.0, 2, 1.0, 2.0)


def test_summarize_policy_collects_ratios_service_and_throughput() -> None:
    s = summary()
    assert s.light_ratio == pytest.approx(0.1 / 0.05)
    assert s.voice_ratio == pytest.approx(0.05 / 0.04)
    assert s.service is not None and s.service.windows == 2
    assert s.service_totals == {HEAVY: pytest.approx(120.0), LIGHT: pytest.approx(28.0)}
    # heavy-light: 100 tokens over 8 chunks in [0, 10) + bob's 5 chunks; backlogged: waiter
    # chunks at 100 s fall outside; voice-background: 50 background + 5 voice chunks.
    assert s.phase_tokens_per_s[HEAVY_LIGHT] == pytest.approx(105 / 10)
    assert s.phase_tokens_per_s[BACKLOGGED] == pytest.approx((10 + 4) / 20)
    assert s.phase_tokens_per_s[VOICE_BACKGROUND] == pytest.approx(55 / 10)
    assert s.tokens_per_s == pytest.approx((105 + 14 + 55) / 40)
    assert s.same_mix_tokens_per_s == pytest.approx((105 + 55) / 20)
    assert s.request_errors == 0


def test_summarize_policy_with_missing_phases_after_a_failure() -> None:
    partial = {SOLO_LIGHT: phases()[SOLO_LIGHT]}
    s = summarize_policy("fair", [partial], spans(), 10.0, 2, 1.0, 2.0, error="exited with 2")
    assert s.error == "exited with 2"
    assert s.light_solo is not None and s.light_loaded is None and s.light_ratio is None
    assert s.service is None and s.tokens_per_s is None and s.phase_tokens_per_s == {}
    assert s.same_mix_tokens_per_s is None


def test_pool_solo_joins_every_servers_solo_requests() -> None:
    a, b = phases(), phases()
    b[SOLO_LIGHT] = [rec(LIGHT, float(i), [0.5]) for i in range(5)]
    del b[SOLO_VOICE]
    pooled = pool_solo([a, b])
    assert len(pooled[SOLO_LIGHT]) == 10 and len(pooled[SOLO_VOICE]) == 5
    assert HEAVY_LIGHT not in pooled
    assert pool_solo([{HEAVY_LIGHT: []}]) == {}


def test_ratios_divide_by_the_pooled_solo_baseline() -> None:
    slow_solo = {SOLO_LIGHT: [rec(LIGHT, float(i), [0.02]) for i in range(5)],
                 SOLO_VOICE: [rec(VOICE, float(i), [0.08]) for i in range(5)]}
    s = summarize_policy("fair", [phases()], spans(), 10.0, 2, 1.0, 2.0, solo=slow_solo)
    assert s.light_ratio == pytest.approx(0.1 / 0.02)
    assert s.voice_ratio == pytest.approx(0.05 / 0.08)
    assert s.light_solo is not None and s.light_solo.p95_s == pytest.approx(0.02)
    assert s.light_solo_own is not None and s.light_solo_own.p95_s == pytest.approx(0.05)
    assert s.voice_solo_own is not None and s.voice_solo_own.p95_s == pytest.approx(0.04)


def test_combined_rate_needs_every_named_phase() -> None:
    some = {HEAVY_LIGHT: phases()[HEAVY_LIGHT]}
    assert combined_rate([some], spans(), (HEAVY_LIGHT,)) == pytest.approx(10.5)
    assert combined_rate([some], spans(), LOADED_PHASES) is None
    assert combined_rate([some], spans(), ()) is None
    assert combined_rate([some, phases()], spans(), LOADED_PHASES) is None  # one run lacks
    assert combined_rate([], spans(), (HEAVY_LIGHT,)) is None


def test_rounds_pool_ttfts_service_windows_and_rates() -> None:
    """Two rounds of one policy: TTFTs pooled, every counted window in the service
    difference (its average and its worst), tokens of both rounds over both rounds' spans."""
    quick, slow = phases(light_ttft=0.1), phases(light_ttft=0.3)
    slow[HEAVY_LIGHT] = [r for r in slow[HEAVY_LIGHT] if r.user == LIGHT]  # 5 tokens, not 105
    slow[BACKLOGGED] = [Record(r.user, r.lane, r.sent_s, r.timing) for r in two_windows()
                        if r.user != LIGHT]  # bob never waits: no window counts
    s = summarize_policy("fair", [quick, slow], spans(), 10.0, 2, 1.0, 2.0)
    one = summarize_policy("fair", [quick], spans(), 10.0, 2, 1.0, 2.0)
    assert s.light_loaded is not None and s.light_loaded.requests == 10
    assert s.light_loaded.p95_s == pytest.approx(0.3)
    assert s.light_solo_own is not None and s.light_solo_own.requests == 10
    assert s.phase_tokens_per_s[HEAVY_LIGHT] == pytest.approx((105 + 5) / 20)
    assert one.service is not None and s.service is not None
    assert (s.service.windows, s.service.windows_total) == (2, 4)
    assert (s.service.avg, s.service.max) == (one.service.avg, one.service.max)
    assert s.service_totals == {HEAVY: pytest.approx(2 * one.service_totals[HEAVY]),
                                LIGHT: pytest.approx(one.service_totals[LIGHT])}


def test_pool_service_averages_over_counted_windows() -> None:
    pooled = pool_service([ServiceDifference(15.0, 3, 4, 100.0, 200.0),
                           ServiceDifference(15.0, 1, 4, 20.0, 20.0),
                           ServiceDifference(15.0, 0, 4, None, None)])
    assert (pooled.windows, pooled.windows_total) == (4, 12)
    assert pooled.avg == pytest.approx((3 * 100 + 20) / 4) and pooled.max == 200.0
    none = pool_service([ServiceDifference(15.0, 0, 4, None, None)])
    assert (none.windows, none.avg, none.max) == (0, None, None)


def test_rounds_alternate_the_policies_order() -> None:
    assert run_order(["fair", "fcfs"], 1) == [("fair", "fair"), ("fcfs", "fcfs")]
    assert run_order(["fair", "fcfs"], 3) == [
        ("fair", "fair-1"), ("fcfs", "fcfs-1"), ("fcfs", "fcfs-2"), ("fair", "fair-2"),
        ("fair", "fair-3"), ("fcfs", "fcfs-3")]
    assert run_order(["fcfs"], 2) == [("fcfs", "fcfs-1"), ("fcfs", "fcfs-2")]


@pytest.mark.parametrize(
    ("value", "op", "target", "met"),
    [(1.9, "<=", 2.0, True), (2.0, "<=", 2.0, True), (2.1, "<=", 2.0, False),
     (0.97, ">=", 0.97, True), (0.96, ">=", 0.97, False), (None, "<=", 2.0, None)],
)
def test_goal_met(value: float | None, op: str, target: float, met: bool | None) -> None:
    assert Goal("g", value, op, target).met is met


def test_evaluate_goals_fair_against_fcfs() -> None:
    fair = summary(light_ttft=0.09, voice_ttft=0.08)
    fcfs = summary(light_ttft=0.5, voice_ttft=0.5, policy="fcfs")
    fcfs.service = ServiceDifference(10.0, 2, 2, avg=400.0, max=1000.0)
    fair.service = ServiceDifference(10.0, 2, 2, avg=100.0, max=600.0)
    fcfs.tokens_per_s, fair.tokens_per_s = 300.0, 295.0
    fcfs.same_mix_tokens_per_s, fair.same_mix_tokens_per_s = 300.0, 280.0
    goals = {g.name: g for g in evaluate_goals({"fcfs": fcfs, "fair": fair})}
    assert goals[GOAL_LIGHT].value == pytest.approx(1.8) and goals[GOAL_LIGHT].met
    assert goals[GOAL_VOICE].value == pytest.approx(2.0) and goals[GOAL_VOICE].met is False
    assert goals[GOAL_SD_AVG].value == pytest.approx(0.25) and goals[GOAL_SD_AVG].met
    assert goals[GOAL_SD_MAX].value == pytest.approx(0.6) and goals[GOAL_SD_MAX].met is False
    assert goals[GOAL_THROUGHPUT].value == pytest.approx(295 / 300)
    assert goals[GOAL_THROUGHPUT].met
    assert goals[GOAL_THROUGHPUT_SAME_MIX].met is False


def test_goals_are_unknown_without_the_fair_run() -> None:
    goals = evaluate_goals({"fcfs": summary(policy="fcfs")})
    assert [g.met for g in goals] == [None] * 7


# ---- rendering --------------------------------------------------------------------------


def both() -> dict[str, PolicySummary]:
    fcfs = summary(light_ttft=0.5, voice_ttft=0.5, policy="fcfs")
    fair = summary(light_ttft=0.09, voice_ttft=0.05)
    fcfs.service = ServiceDifference(10.0, 2, 2, avg=400.0, max=1000.0)
    return {"fcfs": fcfs, "fair": fair}


def test_render_table_has_both_policies_goals_and_verdicts() -> None:
    summaries = both()
    table = render_table(summaries, evaluate_goals(summaries), 10.0)
    lines = table.splitlines()
    assert lines[0] == "| figure | fcfs | fair | goal | met |"
    assert lines[1] == "|---|---:|---:|---|---|"
    assert all(line.count("|") == 6 for line in lines)
    light = next(line for line in lines if line.startswith("| light-user TTFT p95 relative"))
    assert "10.00×" in light and "1.80×" in light and "fair ≤ 2×" in light
    assert "**yes** (1.80×)" in light
    voice = next(line for line in lines if line.startswith("| voice TTFT p95 relative"))
    assert "**yes** (1.25×)" in voice
    sd = next(line for line in lines if "window, avg" in line)
    assert "400 (2/2 windows)" in sd and "per 10 s window" in sd
    assert "**yes** (0.12×)" in sd  # (86 + 6) / 2 = 46 of 400
    assert "50 / 50 (n=5)" in table  # solo light p50 / p95 ms
    assert "output tok/s, loaded phases together" in table


def test_render_table_marks_unknown_goals() -> None:
    summaries = {"fcfs": summary(policy="fcfs")}
    table = render_table(summaries, evaluate_goals(summaries), 20.0)
    assert "| fcfs | goal | met |" in table.splitlines()[0]
    light = next(line for line in table.splitlines() if "relative to solo" in line)
    assert light.endswith("| fair ≤ 2× | – |")


def meta() -> dict[str, object]:
    return {
        "date": "2026-01-01T00:00:00+00:00", "command": "python -m bench.fairness",
        "model": {"path": "/m", "model_type": "llama", "num_hidden_layers": 4},
        "blas_report": "OpenBLAS", "git_commit": "abc", "versions": {"python": "3.11"},
        "machine": "Linux x86_64, 2 CPUs", "max_batch_size": 8, "w_in": 1.0, "w_out": 2.0,
        "window_s": 10.0, "windows": 2, "workload": "alice 6 in flight", "duration_s": 480.0,
    }


def test_render_report_carries_the_facts_and_failures() -> None:
    summaries = both()
    summaries["fair"].error = "fair exited with code 2 before it was ready"
    servers = {p: {"command": f"appliance serve --policy {p}", "log": f"{p}.log"}
               for p in summaries}
    text = render_report(meta(), summaries, evaluate_goals(summaries), servers)
    assert "- command: `python -m bench.fairness`" in text
    assert "llama, layers 4" in text and "- BLAS: OpenBLAS" in text
    assert "`appliance serve --policy fair` (log `fair.log`)" in text
    assert "- fair FAILED: fair exited with code 2" in text
    assert "per 10 s window" in text
    assert "rounds" not in text
    assert "- rounds: 2, servers in the order below" in render_report(
        {**meta(), "rounds": 2}, summaries, evaluate_goals(summaries), servers)


def test_report_json_is_serializable_with_raw_records() -> None:
    summaries = both()
    servers = {p: {"command": "c", "log": "l", "error": None, "phases": phases()}
               for p in summaries}
    report = report_json(meta(), summaries, evaluate_goals(summaries), servers)
    again = json.loads(json.dumps(report))
    first = again["servers"]["fair"]["phases"][SOLO_LIGHT][0]
    assert first["user"] == LIGHT and first["sent_s"] == 0.0 and first["ttft_s"] == 0.05
    assert again["goals"][0]["met"] in (True, False, None)
    assert again["summaries"]["fcfs"]["service"]["avg"] == 400.0


def test_summarize_all_pools_each_policys_rounds_and_names_a_failed_one() -> None:
    cfg = config("--rounds", "2", "--window", "10", "--windows", "2", "--ramp-seconds", "0")
    assert cfg.rounds == 2
    servers = {name: {"policy": policy, "error": None, "phases": phases()}
               for policy, name in run_order(cfg.policies, cfg.rounds)}
    servers["fair-2"]["error"] = "exited with 1"
    summaries = summarize_all(cfg, servers)
    assert list(summaries) == ["fcfs", "fair"]
    for s in summaries.values():
        assert s.light_loaded is not None and s.light_loaded.requests == 10
        assert s.light_solo is not None and s.light_solo.requests == 20  # all four pooled
    assert summaries["fair"].error == "fair-2: exited with 1"
    assert summaries["fcfs"].error is None
    with pytest.raises(SystemExit):
        config("--rounds", "0")


def test_the_weighted_phase_reports_the_service_ratio_and_its_goal() -> None:
    """alice (weight 1) got 100 output tokens in the measured span, erin (weight 4) 380;
    chunks outside [2, 12) do not count."""
    weighted = [rec(HEAVY, 0.0, [3.0, 5.0], usage=100),
                rec(WEIGHTED_USER, 0.0, [2.0, 4.0, 6.0, 8.0], usage=380),
                rec(WEIGHTED_USER, 11.0, [2.0], usage=500)]  # its chunk comes at 13 s
    runs = [{**phases(), WEIGHTED: weighted}]
    fair = summarize_policy("fair", runs, {**spans(), WEIGHTED: PhaseWindow(2.0, 12.0)},
                            10.0, 2, 1.0, 2.0)
    assert fair.weighted_totals == {HEAVY: pytest.approx(200.0),
                                    WEIGHTED_USER: pytest.approx(760.0)}
    assert fair.weighted_ratio == pytest.approx(3.8)
    # waiting for a first chunk: alice over [2, 3), erin over [11, 12) of the span
    assert fair.weighted_waiting == {HEAVY: pytest.approx(0.1),
                                     WEIGHTED_USER: pytest.approx(0.1)}
    goal = next(g for g in evaluate_goals({"fair": fair}) if g.name == GOAL_WEIGHTED)
    assert goal.value == pytest.approx(0.05) and goal.met
    fair.weighted_ratio = 1.1  # admission order alone: about one to one
    goal = next(g for g in evaluate_goals({"fair": fair}) if g.name == GOAL_WEIGHTED)
    assert goal.met is False
    table = render_table({"fair": fair}, evaluate_goals({"fair": fair}), 10.0)
    row = next(line for line in table.splitlines() if "erin (weight 4) / alice" in line)
    assert "1.10×" in row and "fair 4× ± 20%" in row and "**no**" in row
    assert "| alice 10% : erin 10% |" in table
    assert summary().weighted_ratio is None  # a run without the phase


def test_waiting_share_counts_overlapping_waits_once_and_only_inside_the_span() -> None:
    """erin waits over [0, 3) and [2, 5) (together [0, 5)), then [8, 20): within [2, 10)
    that is [2, 5) and [8, 10), 5 s of 8."""
    records = [rec(WEIGHTED_USER, 0.0, [3.0]), rec(WEIGHTED_USER, 2.0, [3.0]),
               rec(WEIGHTED_USER, 8.0, [12.0]), rec(HEAVY, 0.0, [100.0])]
    assert waiting_share(records, WEIGHTED_USER, 2.0, 10.0) == pytest.approx(5 / 8)
    assert waiting_share(records, HEAVY, 2.0, 10.0) == pytest.approx(1.0)
    assert waiting_share(records, LIGHT, 2.0, 10.0) == 0.0
    assert waiting_share(records, HEAVY, 5.0, 5.0) is None
