"""The cost model and the tick budget: fitted from recorded tick times, with a fake clock.

A "machine" here is a cost law (seconds for a decode step and for a prefill forward); the
tests record what it would measure, feed the model, and check what the scheduler plans.
No MLX, no real clock.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from appliance.sched.budget import TickObjectives, tick_budget
from appliance.sched.cost import DECODE_PRIOR, PREFILL_PRIOR, CostModel, OnlineFit
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


def trained(machine: Machine, ticks: int = 60) -> CostModel:
    """A cost model fed the tick times ``machine`` records over a mixed workload."""
    costs = CostModel()
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


# ---- latency while someone is present ----
def test_past_the_objectives_a_present_household_caps_work_that_can_wait_at_min_chunk(
        ) -> None:
    """The decode step eats the TTFT bound: the tick grows to the most efficient chunk, but
    while voice or interactive work is about, work that can wait (a document's chunk, a
    background prompt) gets only the time of a min_chunk chunk."""
    costs = trained(SLOW_CPU)
    objectives = TickObjectives(ttft_target_s=0.6)
    away = tick_budget(costs, objectives, 8, 3000, present=False)
    here = tick_budget(costs, objectives, 8, 3000, present=True)
    assert away.patient_s is None and away.decode_s > 0.3
    assert here.target_s == away.target_s
    assert here.patient_s == pytest.approx(costs.prefill(objectives.min_chunk))


def test_while_present_work_that_can_wait_keeps_a_tick_to_one_arrivals_reading() -> None:
    """Nothing decodes and the TTFT bound allows half a second, but an arrival's own prompt
    reads in far less: a tick of someone's document lasts about that, not half a second."""
    costs = trained(SLOW_CPU)
    objectives = TickObjectives(ttft_target_s=1.0, arrival_tokens=64)
    budget = tick_budget(costs, objectives, 0, 0, present=True)
    assert budget.target_s == pytest.approx(0.5)
    assert budget.patient_s is not None and budget.patient_s < 0.25
    assert budget.patient_s == pytest.approx(costs.prefill(64))
    assert tick_budget(costs, objectives, 0, 0, present=False).patient_s is None


def _doc_chunk(klass: Klass, now: float, s: Scheduler, costs: CostModel,
               bob_waits: bool = False) -> int:
    views = [seq(i, D, kv=3000, klass=klass, user="alice") for i in range(1, 9)]
    views.append(seq(20, P, prompt=3000, computed=600, klass=klass, user="alice"))
    if bob_waits:  # queued behind the full batch
        views.append(seq(30, Q, prompt=30, user="bob"))
    plan = s.step(now, views, costs=costs)
    ((rid, n),) = plan.prefill
    assert rid == 20
    return n


def test_a_long_document_is_read_in_small_chunks_only_while_someone_else_is_present(
        ) -> None:
    costs = trained(SLOW_CPU)
    objectives = TickObjectives(ttft_target_s=0.6, presence_s=60.0)
    s = Scheduler(SchedulerConfig(max_batch_size=9, objectives=objectives))
    # alice alone with her own document: read at the machine's pace
    alone = _doc_chunk(Klass.INTERACTIVE, 0.0, s, costs)
    assert s.budget is not None and s.budget.patient_s is None
    interactive = _doc_chunk(Klass.INTERACTIVE, 0.0, s, costs, bob_waits=True)
    assert s.budget is not None and s.budget.patient_s is not None
    assert interactive == max(objectives.min_chunk,
                              costs.tokens_within(s.budget.patient_s, 600))
    assert alone > 2 * interactive
    # background work only, but bob chatted 30 s ago: still present
    assert _doc_chunk(Klass.BACKGROUND, 30.0, s, costs) == interactive
    # nobody for longer than presence_s: the night job reads at the machine's best pace
    night = _doc_chunk(Klass.BACKGROUND, 100.0, s, costs)
    assert s.budget is not None and s.budget.patient_s is None
    assert night == costs.tokens_within(s.budget.prefill_s, 600) > 2 * interactive


def test_a_short_fresh_prompt_is_read_whole_when_the_budget_leaves_only_min_chunk() -> None:
    costs = trained(SLOW_CPU)
    s = Scheduler(SchedulerConfig(objectives=TickObjectives(ttft_target_s=0.05, min_chunk=16,
                                                            prefill_floor=0)))
    plan = s.step(0.0, [seq(1, D, kv=2000), seq(2, P, prompt=30, computed=0)], costs=costs)
    assert plan.prefill == ((2, 30),), "a 30-token chat turn is not split in two ticks"
    plan = s.step(0.0, [seq(1, D, kv=2000), seq(2, P, prompt=30, computed=10)], costs=costs)
    assert plan.prefill == ((2, 16),), "the tail of a prompt keeps to min_chunk"


def test_a_background_prompt_read_whole_only_when_nobody_is_about() -> None:
    """A job's 300-token prompt: while someone chatted within presence_s it is read in
    pieces of about one arrival's reading; at night, whole."""
    costs = trained(SLOW_CPU)
    objectives = TickObjectives(ttft_target_s=4.0, presence_s=60.0)
    s = Scheduler(SchedulerConfig(objectives=objectives))
    job = [seq(1, Q, prompt=300, klass=Klass.BACKGROUND, user="carol")]
    assert s.step(0.0, job, costs=costs).prefill == ((1, 300),)
    s = Scheduler(SchedulerConfig(objectives=objectives))
    s.step(0.0, [seq(2, D, kv=20)], costs=costs)  # bob was chatting
    ((rid, n),) = s.step(10.0, job, costs=costs).prefill
    assert rid == 1 and n < 150
    assert s.step(100.0, job, costs=costs).prefill == ((1, 300),)


def test_a_user_lifted_to_the_backlog_goes_before_the_long_documents_being_read() -> None:
    """Equal counters (bob was just lifted to alice's): alice's unread documents count
    against her, so bob's short prompt is read first, in this very tick."""
    costs = trained(SLOW_CPU)
    s = Scheduler(SchedulerConfig(objectives=TickObjectives(ttft_target_s=1.0)))
    views = [seq(1, P, prompt=1500, computed=300, user="alice"),
             seq(2, P, prompt=1400, computed=0, user="alice"),
             seq(9, Q, prompt=30, user="bob")]
    plan = s.step(0.0, views, costs=costs)
    assert plan.prefill[0] == (9, 30)


def test_an_overdue_arrival_lets_the_tick_last_the_ttft_objective() -> None:
    costs = trained(SLOW_CPU)
    objectives = TickObjectives(ttft_target_s=1.0)  # ITL objective: 2 decode steps
    assert tick_budget(costs, objectives, 2, 100).target_s < 0.5
    assert tick_budget(costs, objectives, 0, 0).target_s == pytest.approx(0.5)
    for rows in (0, 2):
        assert tick_budget(costs, objectives, rows, 100,
                           overdue=True).target_s == pytest.approx(1.0)


def test_a_burst_with_nothing_decoding_is_read_together_at_once() -> None:
    """Eight chat turns arrive at once and nothing decodes. Read in ticks of half the TTFT
    objective, the first few would stream and then wait through the ticks that read the
    rest; the tick may last the objective at once and reads them in one forward. One
    arrival alone, background prompts, or a chat turn beside documents (it would wait out
    the documents' long tick) keep the half bound."""
    costs = trained(SLOW_CPU)
    burst = [SeqView(rid=i, user=f"u{i}", klass=Klass.INTERACTIVE, arrival=0.0, state=Q,
                     prefill_len=51) for i in range(1, 9)]
    s = Scheduler(SchedulerConfig())
    plan = s.step(0.0, burst, costs=costs)
    assert s.budget is not None and s.budget.target_s == pytest.approx(1.0)
    by_id = {v.rid: v for v in burst}
    assert plan_seconds(SLOW_CPU, plan.prefill, by_id) <= 1.0 * 1.05
    half = Scheduler(SchedulerConfig(objectives=TickObjectives(ttft_target_s=0.5)))
    assert len(plan.prefill) > len(half.step(0.0, burst, costs=costs).prefill)
    assert all(n == 51 for _, n in plan.prefill)
    documents = [SeqView(rid=i, user="alice", klass=Klass.INTERACTIVE, arrival=0.0, state=Q,
                         prefill_len=1500) for i in range(20, 26)]
    for alone in ([burst[0]], [SeqView(rid=v.rid, user=v.user, klass=Klass.BACKGROUND,
                                       arrival=0.0, state=Q, prefill_len=51) for v in burst],
                  [burst[0], *documents]):
        s = Scheduler(SchedulerConfig())
        s.step(0.0, alone, costs=costs)
        assert s.budget is not None and s.budget.target_s == pytest.approx(0.5)


def test_a_burst_of_arrivals_is_read_several_a_tick_once_it_has_waited_half_the_ttft() -> None:
    """Eight chat turns arrive at once; the first is already decoding. Read one a tick
    (the ITL objective), the last would wait eight ticks; once the others have waited
    half the TTFT objective, a tick may last the objective and reads several in one
    forward."""
    costs = trained(SLOW_CPU)
    views = [seq(1, D, kv=60)] + [
        SeqView(rid=i, user=f"u{i}", klass=Klass.INTERACTIVE, arrival=0.0, state=P,
                prefill_len=51) for i in range(2, 9)]
    by_id = {v.rid: v for v in views}
    early = Scheduler(SchedulerConfig()).step(0.2, views, costs=costs)
    late_s = Scheduler(SchedulerConfig())
    late = late_s.step(0.5, views, costs=costs)
    assert len(late.prefill) > len(early.prefill) >= 1
    assert all(n == 51 for _, n in late.prefill)
    assert late_s.budget is not None and late_s.budget.target_s == pytest.approx(1.0)
    predicted = costs.decode(1, 61) + plan_seconds(SLOW_CPU, late.prefill, by_id)
    assert predicted <= 1.0 * 1.05
    # background work is never the reason a tick grows
    quiet = [v if v.state is D else SeqView(rid=v.rid, user=v.user, klass=Klass.BACKGROUND,
                                            arrival=0.0, state=P, prefill_len=51)
             for v in views]
    s = Scheduler(SchedulerConfig())
    s.step(0.5, quiet, costs=costs)
    assert s.budget is not None and s.budget.target_s < 0.5
    # nor a prompt being read in chunks (it is no longer waiting for its start)
    s = Scheduler(SchedulerConfig())
    s.step(0.5, [views[0], SeqView(rid=9, user='u9', klass=Klass.INTERACTIVE, arrival=0.0,
                                   state=P, prefill_len=3000, computed=500)], costs=costs)
    assert s.budget is not None and s.budget.target_s < 0.5


def test_the_end_of_a_document_read_in_pieces_waits_like_its_other_pieces() -> None:
    """While bob is about, alice's document is read a piece of about one arrival's reading a
    tick, and so is its last piece, though the tick's share could read it whole (that
    tick is what bob's next turn would wait out); a fresh prompt as short is read whole."""
    costs = trained(SLOW_CPU)
    s = Scheduler(SchedulerConfig(objectives=TickObjectives(ttft_target_s=1.0,
                                                            presence_s=60.0)))
    s.step(0.0, [seq(9, D, kv=20, user="bob")], costs=costs)  # bob was chatting
    doc = seq(1, P, prompt=400, user="alice")
    plan = s.step(1.0, [doc], costs=costs)
    ((_, first),) = plan.prefill
    assert first < 100
    s.update(plan, [doc], False, {})
    end = seq(1, P, prompt=400, computed=300, user="alice")
    assert s.budget is not None and costs.prefill(100, 300) < s.budget.target_s  # fits whole
    ((_, last),) = s.step(2.0, [end], costs=costs).prefill
    assert s.budget is not None and s.budget.patient_s is not None
    assert last < 100 and costs.prefill(last, 300) <= s.budget.patient_s * 1.05
    fresh = seq(2, P, prompt=100, user="alice")
    assert s.step(3.0, [fresh], costs=costs).prefill == ((2, 100),)


def test_fresh_documents_that_fit_whole_wait_like_pieces_while_someone_else_is_present(
        ) -> None:
    """On a fast machine six fresh 850-token documents fit the half-second bound whole
    (with nothing decoding); while bob is about they are read about one arrival's reading
    a tick, so his next turn does not wait out the whole burst. A voice command as long is
    still read whole, and so are the documents with nobody about."""
    costs = trained(FAST_GPU)
    objectives = TickObjectives(ttft_target_s=1.0, presence_s=60.0)
    docs = [seq(i, P, prompt=850, user="alice") for i in range(1, 7)]
    assert sum(costs.prefill(850) for _ in docs) < 0.5
    s = Scheduler(SchedulerConfig(objectives=objectives))
    s.step(0.0, [seq(9, D, kv=20, user="bob")], costs=costs)  # bob was chatting
    plan = s.step(1.0, docs, costs=costs)
    assert s.budget is not None and s.budget.patient_s is not None
    read = sum(n for _, n in plan.prefill)
    assert 0 < read < 850 and costs.prefill(read) <= 2 * s.budget.patient_s
    voice = seq(7, P, prompt=850, klass=Klass.VOICE, user="dave")
    assert s.step(2.0, [voice], costs=costs).prefill == ((7, 850),)
    alone = Scheduler(SchedulerConfig(objectives=objectives))
    assert sum(n for _, n in alone.step(1.0, docs, costs=costs).prefill) == 6 * 850


def test_a_document_that_waited_does_not_make_the_tick_overdue() -> None:
    """A heavy user's queued documents have always waited half the TTFT objective; the
    tick beside bob's stream keeps to the ITL objective, not the whole TTFT one."""
    costs = trained(SLOW_CPU)
    doc = SeqView(rid=2, user="alice", klass=Klass.INTERACTIVE, arrival=0.0, state=P,
                  prefill_len=1500)
    turn = SeqView(rid=3, user="carol", klass=Klass.INTERACTIVE, arrival=0.0, state=P,
                   prefill_len=50)
    s = Scheduler(SchedulerConfig())
    s.step(0.6, [seq(1, D, kv=60), doc], costs=costs)
    assert s.budget is not None and s.budget.target_s < 0.5
    s.step(0.6, [seq(1, D, kv=60), doc, turn], costs=costs)  # a chat turn that waited
    assert s.budget is not None and s.budget.target_s == pytest.approx(1.0)


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
    record = timing.end(1, 0.1, 0, ride=False)
    assert record.measured_s == pytest.approx(0.060)
    assert record.wall_s == pytest.approx(0.150)
    assert timing.over_target == 0  # the forwards kept to the target
