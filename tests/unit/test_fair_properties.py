"""Invariants of the scheduler over random workloads (hypothesis), driven by the simulator.

* running never exceeds the batch size, and the KV budget is never exceeded;
* every request finishes (no livelock, no request left waiting for ever);
* no user exceeds the daily token quota by more than one tick's tokens;
* two continuously backlogged users never differ in served weighted tokens by more than
  ``2 * max(w_in * longest prompt, w_out * batch tokens)`` (VTC, Sheng et al. 2024);
* no request waits longer than the aging bound allows.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.sched.quota import QuotaLimits
from appliance.sched.simulator import Arrival, CostModel, Loop, SimResult, Simulator
from appliance.sched.states import RequestState
from appliance.sched.types import CHUNK_IDLE, Plan, SchedulerConfig, SeqView
from appliance.vocab import Klass

USERS = ("alice", "bob", "carol")
COST = CostModel()
# APPLIANCE_PROPERTY_EXAMPLES=500 for a deeper search than the quick default.
FAST = settings(max_examples=int(os.environ.get("APPLIANCE_PROPERTY_EXAMPLES", "25")),
                deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

arrivals = st.lists(st.builds(
    Arrival, t=st.floats(0, 20), user=st.sampled_from(USERS), klass=st.sampled_from(Klass),
    prompt=st.integers(1, 3000), output=st.integers(1, 200),
    max_tokens=st.none() | st.integers(1, 300)), min_size=1, max_size=40)

configs = st.builds(
    SchedulerConfig, max_batch_size=st.integers(1, 8),
    prefill_chunk_size=st.sampled_from([-1, 0, 64, 700]),
    policy=st.sampled_from(["fair", "fcfs"]), aging_seconds=st.sampled_from([0.0, 2.0, 30.0]),
    background_reserve=st.integers(0, 2),
    kv_budget_tokens=st.none() | st.integers(3500, 20_000),
    enable_preemption=st.booleans(),
    preemption_policy=st.sampled_from(["fair", "longest-first", "lowest-priority"]))


class Watch:
    """Checks each plan as it is made and remembers each user's largest one-tick share."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.tick_tokens: dict[str, int] = {}

    def __call__(self, now: float, views: Sequence[SeqView], plan: Plan) -> None:
        running = [v for v in views if v.state.running and v.rid not in plan.preempt]
        assert len(running) + len(plan.admit) <= self.config.max_batch_size
        by_id = {v.rid: v for v in views}
        mine: dict[str, int] = {}
        for v in running:
            if v.state is RequestState.DECODING:
                mine[v.user] = mine.get(v.user, 0) + 1
        for rid, n in plan.prefill:
            mine[by_id[rid].user] = mine.get(by_id[rid].user, 0) + n + 1
        for user, n in mine.items():
            self.tick_tokens[user] = max(self.tick_tokens.get(user, 0), n)


@FAST
@given(arrivals, configs)
def test_batch_size_and_kv_budget_hold_and_every_request_finishes(
        work: list[Arrival], config: SchedulerConfig) -> None:
    watch = Watch(config)
    res = Simulator(config, observer=watch, max_ticks=200_000).run(work)
    assert res.unfinished == 0
    assert len(res.requests) == len(work)
    assert res.max_running <= config.max_batch_size
    if config.kv_budget_tokens is not None:
        assert res.peak_kv <= config.kv_budget_tokens
    for r in res.requests:
        if r.reason in ("stop", "length"):
            assert r.generated >= 1


@FAST
@given(arrivals, configs, st.dictionaries(st.sampled_from(USERS), st.integers(1, 5000)))
def test_no_user_exceeds_the_daily_quota_by_more_than_one_tick(
        work: list[Arrival], config: SchedulerConfig, per_day: dict[str, int]) -> None:
    watch = Watch(config)
    quotas = {u: QuotaLimits(tokens_per_day=n) for u, n in per_day.items()}
    res = Simulator(config, quotas=quotas, observer=watch).run(work)
    for user, limit in per_day.items():
        assert res.usage.get(user, 0) <= limit + watch.tick_tokens.get(user, 0)


def _service_gaps(res: SimResult, a: str, b: str) -> list[float]:
    """Spread of W_a - W_b over each stretch of ticks in which both users have a queued
    request and neither leaves the backlog (a user who leaves is lifted on return)."""
    spreads, diffs = [], []
    for i, queued in enumerate(res.queued):
        if {a, b} <= queued and {a, b} <= res.present[i]:
            if not diffs:
                diffs.append(res.served[i].get(a, 0.0) - res.served[i].get(b, 0.0))
            diffs.append(res.served[i + 1].get(a, 0.0) - res.served[i + 1].get(b, 0.0))
        elif diffs:
            spreads.append(max(diffs) - min(diffs))
            diffs = []
    if diffs:
        spreads.append(max(diffs) - min(diffs))
    return spreads


@FAST
@given(st.integers(1, 8), st.sampled_from([-1, 0, 256]),
       st.tuples(st.integers(16, 2000), st.integers(16, 2000)).map(sorted),
       st.tuples(st.integers(4, 200), st.integers(4, 200)).map(sorted),
       st.tuples(st.integers(16, 2000), st.integers(16, 2000)).map(sorted),
       st.tuples(st.integers(4, 200), st.integers(4, 200)).map(sorted),
       st.sampled_from(Klass), st.none() | st.integers(6000, 30_000), st.booleans())
def test_two_backlogged_users_get_service_within_the_vtc_bound(
        batch: int, chunk: int, a_prompt: list[int], a_out: list[int], b_prompt: list[int],
        b_out: list[int], klass: Klass, budget: int | None, preempt: bool) -> None:
    config = SchedulerConfig(max_batch_size=batch, prefill_chunk_size=chunk,
                             kv_budget_tokens=budget, enable_preemption=preempt)
    loops = [Loop("alice", klass, batch + 2, (a_prompt[0], a_prompt[1]),
                  (a_out[0], a_out[1]), stop=15.0),
             Loop("bob", klass, batch + 2, (b_prompt[0], b_prompt[1]), (b_out[0], b_out[1]),
                  stop=15.0, seed=1)]
    res = Simulator(config).run(loops=loops)
    # 2 * max(w_in * L, w_out * M) (Sheng et al. 2024, Theorem 4.4): L the longest prompt
    # (plus its kept output, as a preempted request re-prefills it), M the tokens a running
    # batch can hold, prompts and outputs: batch * (L + O), or the KV budget if smaller.
    longest_out = max(a_out[1], b_out[1])
    longest_prompt = max(a_prompt[1], b_prompt[1]) + longest_out
    batch_tokens = batch * (longest_prompt + longest_out)
    if budget is not None:
        batch_tokens = min(batch_tokens, budget)
    bound = 2 * max(config.w_in * longest_prompt, config.w_out * batch_tokens)
    assert max(_service_gaps(res, "alice", "bob"), default=0.0) <= bound


@FAST
@given(st.integers(2, 8), st.sampled_from([Klass.VOICE, Klass.INTERACTIVE]),
       st.sampled_from([Klass.BACKGROUND, Klass.INTERACTIVE]), st.floats(0.0, 15.0),
       st.integers(1, 3000), st.integers(1, 100), st.floats(1.0, 5.0), st.integers(0, 1))
def test_no_request_waits_longer_than_the_aging_bound(
        batch: int, flood: Klass, klass: Klass, t0: float, prompt: int, output: int,
        aging: float, reserve: int) -> None:
    config = SchedulerConfig(max_batch_size=batch, aging_seconds=aging,
                             background_reserve=reserve)
    loops = [Loop(u, flood, batch, (1000, 3000), (50, 100), stop=t0 + 40.0, seed=k)
             for k, u in enumerate(("bob", "carol"))]
    probe = Arrival(t0, "alice", klass, prompt, output)
    res = Simulator(config, cost=COST).run([probe], loops)
    started = next(r.started for r in res.requests if r.user == "alice")
    assert started is not None
    # A tick lasts at most one full decode step plus the prefill of its chunks (due
    # grants included); a slot frees within one flood request's service time.
    tick = COST.tick_seconds(batch, CHUNK_IDLE * (batch + 1))
    service = (math.ceil(3000 / 512) * 16 + 100 + 2) * tick
    levels = max(int(flood) - int(klass), 0)
    assert started - t0 <= levels * aging + 2 * service


def test_fcfs_breaks_the_bound_that_fair_keeps() -> None:
    """The bound is not vacuous: under fcfs the heavy user's lead grows with time."""
    gaps = {}
    for policy in ("fair", "fcfs"):
        loops = [Loop("alice", Klass.INTERACTIVE, 4, (1500, 2000), (100, 200), stop=30.0),
                 Loop("bob", Klass.INTERACTIVE, 4, (16, 100), (4, 20), stop=30.0, seed=1)]
        res = Simulator(SchedulerConfig(max_batch_size=2, policy=policy)).run(loops=loops)
        gaps[policy] = max(_service_gaps(res, "alice", "bob"))
    bound = 2 * max(2200, 2 * 2 * (2200 + 200))
    assert gaps["fair"] <= bound < gaps["fcfs"]
