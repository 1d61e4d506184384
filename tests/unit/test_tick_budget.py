"""The cost model and the tick budget: fitted from recorded tick times, with a fake clock.

A "machine" here is a cost law (seconds for a decode step and for a prefill forward); the
tests record what it would measure, feed the model, and check what the scheduler plans.
No MLX, no real clock.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest

from appliance.sched.budget import TickObjectives, tick_budget
from appliance.sched.cost import BASE_DECODE_PRIOR as DECODE_PRIOR
from appliance.sched.cost import PREFILL_PRIOR, CostModel, CostProfile, OnlineFit
from appliance.sched.scheduler import Scheduler
from appliance.sched.states import RequestState
from appliance.sched.types import SchedulerConfig, SeqView
from appliance.vocab import Klass

Q, P, D = RequestState.QUEUED, RequestState.PREFILLING, RequestState.DECODING


@dataclass(frozen=True)
class Machine:
    """A cost law in the model's family (seconds)."""

    d0: float = 0.045
    d1: float = 0.003
    d2: float = 0.018  # per 1e3 row-positions
    p0: float = 0.08
    p1: float = 1.5  # per 1e3 tokens
    p2: float = 7.0  # per 1e6 token-positions

    def decode(self, rows: int, kv: int) -> float:
        return self.d0 + self.d1 * rows + self.d2 * rows * kv / 1e3

    def prefill(self, rows: int, n: int, k: int) -> float:
        return self.p0 + self.p1 * rows * n / 1e3 + self.p2 * rows * n * (k + n / 2) / 1e6


SLOW_CPU = Machine()
FAST_GPU = Machine(d0=0.004, d1=0.0001, d2=0.0004, p0=0.004, p1=0.05, p2=0.002)


def trained(machine: Machine, ticks: int = 60,
            profile: CostProfile | None = None) -> CostModel:
    """A cost model (of a device with ``profile``'s steps; none by default) fed the tick
    times ``machine`` records over a mixed workload."""
    costs = CostModel(profile=profile or CostProfile())
    for i in range(ticks):
        rows, kv = 1 + i % 8, 64 + (i * 97) % 2500
        costs.observe_decode(rows, kv, machine.decode(rows, kv))
        n, k = (16, 32, 64, 128, 256)[i % 5], (i * 131) % 2000
        costs.observe_prefill(1, n, k, machine.prefill(1, n, k))
        if i % 7 == 0:
            costs.observe_prefill(3, 64, 0, machine.prefill(3, 64, 0))
    return costs


def seq(rid: int, state: RequestState = Q, prompt: int = 64, computed: int = 0,
        kv: int | None = None, klass: Klass = Klass.INTERACTIVE, user: str = "bob") -> SeqView:
    return SeqView(rid=rid, user=user, klass=klass, arrival=float(rid), state=state,
                   prefill_len=prompt, computed=computed, kv_tokens=kv)


# ---- the fit ----
@pytest.mark.parametrize("machine", [SLOW_CPU, FAST_GPU], ids=["slow-cpu", "fast-gpu"])
def test_the_fit_predicts_recorded_tick_times_of_any_machine(machine: Machine) -> None:
    costs = trained(machine)
    for rows, kv in [(1, 64), (6, 2200), (8, 500)]:
        assert costs.decode(rows, kv) == pytest.approx(machine.decode(rows, kv), rel=0.05)
    for n, k in [(32, 0), (128, 0), (200, 1800), (512, 512)]:
        assert costs.prefill(n, k) == pytest.approx(machine.prefill(1, n, k), rel=0.05)


def test_before_any_data_the_priors_predict() -> None:
    costs = CostModel()
    assert costs.decode(1, 0) == pytest.approx(DECODE_PRIOR[0] + DECODE_PRIOR[1])
    assert costs.prefill(1000, 0) == pytest.approx(
        PREFILL_PRIOR[0] + PREFILL_PRIOR[1] + PREFILL_PRIOR[2] * 0.5)
    assert costs.decode(0, 100) == 0.0 and costs.prefill(0, 0) == 0.0


def test_the_fit_follows_a_machine_that_gets_slower() -> None:
    costs = trained(SLOW_CPU)
    busy = Machine(d0=2 * SLOW_CPU.d0, d1=2 * SLOW_CPU.d1, d2=2 * SLOW_CPU.d2)
    for _ in range(200):
        costs.observe_decode(8, 300, busy.decode(8, 300))
    assert costs.decode(8, 300) == pytest.approx(busy.decode(8, 300), rel=0.05)


def test_coefficients_never_go_negative() -> None:
    fit = OnlineFit((0.1, 0.1, 0.1))
    for x in range(1, 40):  # time falls as the feature grows: least squares wants b1 < 0
        fit.observe((1.0, float(x), 0.0), max(0.0, 1.0 - 0.02 * x))
    assert all(b >= 0 for b in fit.beta)


def test_nonsense_measurements_are_ignored() -> None:
    fit = OnlineFit((0.1, 0.2))
    fit.observe((1.0, 1.0), float("nan"))
    fit.observe((1.0, 1.0), -1.0)
    assert fit.observations == 0 and fit.beta == (0.1, 0.2)


def test_a_pulled_coefficient_follows_its_new_prior_and_a_bad_one_is_refused() -> None:
    fit = OnlineFit((0.1, 0.2))
    fit.observe((1.0, 0.0), 0.1)  # the second feature never informed
    fit.pull(1, 0.05)
    fit.observe((1.0, 0.0), 0.1)
    assert fit.beta[1] == pytest.approx(0.05)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="positive"):
            fit.pull(1, bad)
    assert fit.prior == (0.1, 0.05)


def test_tokens_within_is_the_inverse_of_the_prediction() -> None:
    costs = trained(SLOW_CPU)
    for seconds, k in [(0.3, 0), (0.5, 1000), (2.0, 0), (0.1, 0)]:
        n = costs.tokens_within(seconds, k)
        if n:
            assert costs.prefill(n, k) <= seconds + 1e-9
        assert costs.prefill(n + 1, k) > seconds


def test_the_efficient_chunk_balances_fixed_cost_against_attention() -> None:
    costs = trained(SLOW_CPU)
    best = costs.efficient_chunk()
    assert best is not None

    def per_token(n: int) -> float:
        return costs.prefill(n, 0) / n
    assert per_token(best) <= per_token(best // 2) and per_token(best) <= per_token(best * 2)


# ---- the tick budget ----
def test_with_nothing_decoding_a_tick_is_bounded_by_the_ttft_objective() -> None:
    costs = trained(SLOW_CPU)
    budget = tick_budget(costs, TickObjectives(ttft_target_s=1.0), 0, 0)
    assert budget.target_s == pytest.approx(0.5) and budget.decode_s == 0


def test_while_decoding_a_tick_lasts_the_itl_factor_times_the_decode_step() -> None:
    costs = trained(SLOW_CPU)
    step = costs.decode(8, 101)
    budget = tick_budget(costs, TickObjectives(itl_factor=4.0, ttft_target_s=10.0), 8, 100)
    assert budget.target_s == pytest.approx(4 * step)
    assert budget.prefill_s == pytest.approx(3 * step)


def test_an_explicit_itl_target_wins_but_the_ttft_bound_caps_it() -> None:
    costs = trained(SLOW_CPU)
    assert tick_budget(costs, TickObjectives(itl_target_s=0.3), 4, 100).target_s == 0.3
    assert tick_budget(costs, TickObjectives(itl_target_s=3.0, ttft_target_s=1.0),
                       4, 100).target_s == 0.5


def test_past_every_objective_a_tick_still_has_the_decode_step_and_the_prefill_floor(
        ) -> None:
    costs = trained(SLOW_CPU)
    budget = tick_budget(costs, TickObjectives(ttft_target_s=0.1), 8, 3000)
    best = costs.efficient_chunk()
    assert budget.decode_s > 0.1 and best is not None
    assert budget.prefill_s == pytest.approx(costs.prefill(best, 0))
    no_floor = tick_budget(costs, TickObjectives(ttft_target_s=0.1, prefill_floor=0), 8, 3000)
    assert no_floor.target_s == no_floor.decode_s


def test_a_flat_cost_per_token_never_makes_a_stream_wait_out_a_huge_chunk() -> None:
    """Attention almost free: the most efficient chunk is thousands of tokens, seconds of
    reading. While a stream decodes, the floor stops at the TTFT objective (a fairness run
    once planned a 10.9 s tick beside a stream for a 998-token chunk)."""
    flat = Machine(p0=0.25, p1=3.0, p2=0.05)
    costs = trained(flat)
    best = costs.efficient_chunk()
    assert best is not None and costs.prefill(best, 0) > 5.0
    objectives = TickObjectives(ttft_target_s=1.0, itl_factor=1.0)
    streaming = tick_budget(costs, objectives, 1, 500, present=False)
    assert streaming.target_s <= streaming.decode_s + 1.0 + 1e-9


def test_a_busy_machine_still_reads_several_short_prompts_in_one_forward() -> None:
    """Ten times slower than the objectives assume: the floor keeps prompts batched."""
    busy = Machine(**{k: 10 * v for k, v in SLOW_CPU.__dict__.items()})
    costs = trained(busy)
    s = Scheduler(SchedulerConfig(objectives=TickObjectives(ttft_target_s=1.0)))
    plan = s.step(0.0, [seq(i, prompt=60) for i in range(1, 9)], costs=costs)
    assert len(plan.prefill) >= 2 and all(n == 60 for _, n in plan.prefill)


def test_objectives_are_validated() -> None:
    with pytest.raises(ValueError):
        TickObjectives(itl_factor=0.5)
    with pytest.raises(ValueError):
        TickObjectives(ttft_target_s=0)
    with pytest.raises(ValueError, match="presence_s"):
        TickObjectives(presence_s=-1)
    with pytest.raises(ValueError, match="arrival_tokens"):
        TickObjectives(arrival_tokens=0)


# ---- the scheduler plans in time ----
def plan_seconds(machine: Machine, plan_prefill: tuple[tuple[int, int], ...],
                 views: dict[int, SeqView]) -> float:
    fresh = [n for rid, n in plan_prefill
             if views[rid].computed == 0 and n == views[rid].remaining]
    total = machine.prefill(len(fresh), max(fresh), 0) if len(fresh) > 1 else 0.0
    for rid, n in plan_prefill:
        if len(fresh) > 1 and views[rid].computed == 0 and n == views[rid].remaining:
            continue
        total += machine.prefill(1, n, views[rid].computed)
    return total


def test_a_long_prompt_beside_decoding_streams_gets_what_the_itl_budget_leaves() -> None:
    costs = trained(SLOW_CPU)
    s = Scheduler(SchedulerConfig(objectives=TickObjectives(itl_target_s=0.4)))
    views = [seq(1, D, kv=300), seq(2, D, kv=300), seq(3, P, prompt=4000, computed=1000)]
    plan = s.step(0.0, views, costs=costs)
    assert s.budget is not None
    ((rid, n),) = plan.prefill
    assert rid == 3 and 0 < n < 3000
    by_id = {v.rid: v for v in views}
    predicted = costs.decode(2, 301) + plan_seconds(SLOW_CPU, plan.prefill, by_id)
    assert predicted <= s.budget.target_s * 1.05


def test_several_short_prompts_share_one_tick() -> None:
    costs = trained(SLOW_CPU)
    s = Scheduler(SchedulerConfig())
    plan = s.step(0.0, [seq(i, prompt=40) for i in range(1, 6)], costs=costs)
    assert len(plan.prefill) >= 3
    assert all(n == 40 for _, n in plan.prefill)


def test_the_first_chunk_is_at_least_min_chunk_when_the_step_eats_the_budget() -> None:
    costs = trained(SLOW_CPU)
    s = Scheduler(SchedulerConfig(objectives=TickObjectives(ttft_target_s=0.05, min_chunk=16,
                                                            prefill_floor=0)))
    plan = s.step(0.0, [seq(1, D, kv=2000), seq(2, P, prompt=3000, computed=0)], costs=costs)
    assert plan.prefill == ((2, 16),)


def test_a_fixed_chunk_size_ignores_the_cost_model() -> None:
    costs = trained(SLOW_CPU)
    s = Scheduler(SchedulerConfig(prefill_chunk_size=100))
    assert s.step(0.0, [seq(1, prompt=500)], costs=costs).prefill == ((1, 100),)
    assert s.budget is None
    off = Scheduler(SchedulerConfig(prefill_chunk_size=0))
    assert off.step(0.0, [seq(1, prompt=9000)], costs=costs).prefill == ((1, 9000),)


def test_a_fast_machine_reads_a_long_prompt_in_big_chunks() -> None:
    s = Scheduler(SchedulerConfig())
    plan = s.step(0.0, [seq(1, prompt=6000)], costs=trained(FAST_GPU))
    assert plan.prefill[0][1] >= 2048


def test_closed_loop_on_a_fake_clock_keeps_every_tick_near_its_target() -> None:
    """The engine's loop on a fake clock: plan with the model, "run" the plan on the
    machine law, record the time, feed it back. From the priors alone (no training) the
    ticks converge to their targets: a long prompt read beside four decoding streams."""
    machine = SLOW_CPU
    costs = CostModel()
    s = Scheduler(SchedulerConfig(max_batch_size=8,
                                  objectives=TickObjectives(itl_target_s=0.5)))
    views = {i: seq(i, D, kv=200) for i in range(1, 5)}
    views[9] = seq(9, P, prompt=3000)
    clock, late = 0.0, []
    for tick in range(200):
        plan = s.step(clock, list(views.values()), costs=costs)
        assert s.budget is not None
        decode = machine.decode(4, views[1].kv_tokens + 1)  # type: ignore[operator]
        costs.observe_decode(4, views[1].kv_tokens + 1, decode)  # type: ignore[operator]
        took = decode
        for rid, n in plan.prefill:
            t = machine.prefill(1, n, views[rid].computed)
            costs.observe_prefill(1, n, views[rid].computed, t)
            views[rid].computed += n
            took += t
        clock += took
        for i in range(1, 5):
            views[i].kv_tokens = (views[i].kv_tokens or 0) + 1
        if tick >= 10 and plan.prefill:
            late.append(took / s.budget.target_s)
        if views[9].remaining == 0:
            break
        s.update(plan, list(views.values()), decoded=True, served={})
    assert views[9].remaining == 0, "the long prompt was read to its end"
    assert late and max(late) <= 1.10


def test_when_the_objective_leaves_no_room_the_prompt_still_advances_by_min_chunk() -> None:
    costs = trained(SLOW_CPU)
    s = Scheduler(SchedulerConfig(objectives=TickObjectives(itl_factor=1.0, min_chunk=24,
                                                            prefill_floor=0)))
    plan = s.step(0.0, [seq(1, D, kv=100), seq(2, P, prompt=3000, computed=500)], costs=costs)
    assert plan.prefill == ((2, 24),)


def test_a_tick_record_holds_its_forwards_and_its_whole_time() -> None:
    """The tick log keeps both: the forwards the cost model is fitted to, and the whole tick
    (joins, leaves, prompt-cache copies, the plan), so a gap the model cannot see shows."""
    from appliance.engine.ticks import TickTiming

    now = [0.0]
    timing = TickTiming(CostModel(), lambda: now[0], None)
    timing.begin()
    now[0] = 0.010  # the plan
    start = now[0]
    now[0] = 0.070  # the decode step
    timing.forward("decode", 4, 1, 100, start)
    now[0] = 0.150  # a row's KV copied out to the prompt cache
    record = timing.end(1, 0.1, (), ride=False)
    assert record.measured_s == pytest.approx(0.060)
    assert record.wall_s == pytest.approx(0.150)
    assert timing.over_target == 0  # the forwards kept to the target


def test_the_longest_ticks_of_a_minute_are_logged_with_why_they_were_long(
        caplog: pytest.LogCaptureFixture) -> None:
    """Each minute of work, the engine's log names its three longest ticks: what they read
    (request id, tokens, positions before), whether the chunks rode, what the cost model
    predicted against what the forwards took, and the reason: host work between forwards,
    a misprediction, or the plan's own budget."""
    from appliance.engine.ticks import TickTiming

    now = [0.0]
    timing = TickTiming(CostModel(), lambda: now[0], None)

    def tick(n: int, forward_s: float, host_s: float, chunks: tuple = (),
             copies: int = 0, left: int = 0) -> None:
        timing.begin()
        start = now[0]
        now[0] += forward_s
        timing.forward("decode", 2, 1, 100, start)
        now[0] += host_s
        timing.end(n, 1.0, chunks, ride=bool(chunks), kv_copies=copies, left=left)

    caplog.set_level(logging.INFO, logger="appliance.engine.runner")
    tick(1, 0.010, 0.0)
    tick(2, 0.050, 0.200, copies=29, left=2)  # KV windows copied, two rows finished
    tick(3, 0.400, 0.0, ((7, 32, 900),))  # far over what a fresh cost model predicts
    tick(4, 0.020, 0.0)
    timing.begin()  # a prompt read with nothing decoding: a first token's wait, no gap
    start = now[0]
    now[0] += 0.900
    timing.forward("prefill", 1, 500, 0, start)
    timing.end(9, 1.0, ((8, 500, 0),))
    assert [r.tick for r in timing.longest] == [3, 2, 4]
    assert not [r for r in caplog.records if "longest ticks" in r.getMessage()]
    now[0] = 61.0
    tick(5, 0.001, 0.0)
    (line,) = [r.getMessage() for r in caplog.records if "longest ticks" in r.getMessage()]
    assert "tick=3 wall_ms=400" in line and "chunks=7:32@900" in line and "ride=True" in line
    assert "tick=2 wall_ms=250" in line and "kv_copies=29 left=2 joined=0 why=host" in line
    assert timing.longest == []  # a new minute
    timing.report_longest()  # idle: nothing since, nothing logged
    assert len([r for r in caplog.records if "longest ticks" in r.getMessage()]) == 1
