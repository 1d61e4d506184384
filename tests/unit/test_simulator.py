"""The simulator: the real scheduler on a simulated clock."""

from __future__ import annotations

import pytest

from appliance.percentiles import percentile
from appliance.sched.quota import QuotaLimits
from appliance.sched.simulator import (
    Arrival,
    CostModel,
    Loop,
    SimResult,
    Simulator,
)
from appliance.sched.types import SchedulerConfig
from appliance.sched.workloads import SCENARIOS, main, table
from appliance.vocab import Klass

IA, BG, VO = Klass.INTERACTIVE, Klass.BACKGROUND, Klass.VOICE


def test_every_request_runs_to_its_length() -> None:
    arrivals = [Arrival(0.0, "alice", IA, 300, 20), Arrival(0.5, "bob", BG, 5000, 7),
                Arrival(0.1, "carol", VO, 10, 1, max_tokens=1)]
    res = Simulator(SchedulerConfig()).run(arrivals)
    by_user = {r.user: r for r in res.requests}
    assert (by_user["alice"].generated, by_user["alice"].reason) == (20, "stop")
    assert (by_user["carol"].generated, by_user["carol"].reason) == (1, "length")
    assert by_user["bob"].generated == 7
    assert res.unfinished == 0


def test_the_cost_model_sets_the_clock() -> None:
    cost = CostModel(decode_base_s=0.01, decode_per_seq_s=0.0, prefill_per_token_s=0.001)
    res = Simulator(SchedulerConfig(), cost=cost).run([Arrival(0.0, "alice", IA, 100, 3)])
    r = res.requests[0]
    assert r.ttft == pytest.approx(0.1)  # one 100-token prefill tick yields the first token
    assert r.finished == pytest.approx(0.12)  # then two decode steps


def test_a_light_user_gets_a_faster_first_token_under_fair_than_under_fcfs() -> None:
    work = SCENARIOS["heavy-light"](3, 120.0)
    p50 = {}
    for policy in ("fair", "fcfs"):
        res = Simulator(SchedulerConfig(policy=policy)).run(work.arrivals, work.loops)
        ttfts = [t for r in res.requests if r.user == "alice" and (t := r.ttft) is not None]
        p50[policy] = percentile(ttfts, 50)
    assert p50["fair"] is not None and p50["fcfs"] is not None
    assert p50["fair"] < p50["fcfs"] / 1.5


def test_background_work_starves_under_fcfs_but_not_under_fair() -> None:
    work = SCENARIOS["voice-background"](3, 150.0)
    done = {}
    for policy in ("fair", "fcfs"):
        res = Simulator(SchedulerConfig(policy=policy)).run(work.arrivals, work.loops)
        started = [r for r in res.requests if r.user == "bob" and r.started is not None
                   and r.started < 150.0]
        done[policy] = len(started)
    assert done["fair"] >= 2 * max(done["fcfs"], 1)


def test_a_preempted_request_keeps_its_tokens_and_finishes() -> None:
    config = SchedulerConfig(kv_budget_tokens=1200, enable_preemption=True, max_batch_size=4)
    arrivals = [Arrival(0.0, "bob", IA, 500, 300), Arrival(0.0, "alice", IA, 500, 300)]
    res = Simulator(config).run(arrivals)
    assert res.preemptions >= 1
    assert [r.generated for r in res.requests] == [300, 300]
    assert res.peak_kv <= 1200


def test_a_running_request_that_exhausts_the_days_tokens_finishes_with_quota() -> None:
    sim = Simulator(SchedulerConfig(), quotas={"carol": QuotaLimits(tokens_per_day=150)})
    res = sim.run([Arrival(0.0, "carol", IA, 100, 500), Arrival(1.0, "carol", IA, 10, 5)])
    assert res.requests[0].reason == "quota"
    assert [limit for _, limit in res.refused] == ["tokens_per_day"]
    assert res.usage["carol"] == 150


def test_a_closed_loop_client_keeps_its_requests_in_flight() -> None:
    loop = Loop("bob", IA, 3, (10, 20), (5, 10), stop=5.0)
    res = Simulator(SchedulerConfig()).run(loops=[loop])
    assert len(res.requests) > 3
    assert res.max_running <= 3


def test_service_difference_counts_only_windows_where_both_users_wait() -> None:
    res = SimResult(times=[0.0, 30.0, 60.0, 90.0, 120.0],
                    served=[{}, {"alice": 10.0, "bob": 30.0}, {"alice": 20.0, "bob": 60.0},
                            {"alice": 20.0, "bob": 100.0}, {"alice": 20.0, "bob": 100.0}],
                    queued=[frozenset({"alice", "bob"})] * 2 + [frozenset({"bob"})] * 2)
    assert res.service_difference(60.0) == (40.0, 40.0, 1)


def test_the_table_names_every_user() -> None:
    res = Simulator(SchedulerConfig()).run([Arrival(0.0, "alice", IA, 10, 2)])
    assert "alice" in table(res)


def test_the_command_line_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--policy", "fcfs", "--scenario", "voice-background",
                 "--duration", "20"]) == 0
    out = capsys.readouterr().out
    assert "policy=fcfs scenario=voice-background" in out
    assert "service difference" in out
