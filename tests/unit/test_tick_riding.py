"""Prompt chunks read in the decode step's forward (``CostModel.rides``): the step's fit of
a riding chunk's cost, and the tick budget and chunk sizes planned with it. The machines
and helpers are those of test_tick_budget.py. No MLX, no real clock."""

from __future__ import annotations

import pytest

from appliance.backend.profile import CPU_KERNEL, KERNEL_ROWS, WIDE_ROWS
from appliance.sched.budget import BURST_STEPS, PRESENT_TICK, TickObjectives, tick_budget
from appliance.sched.cost import STEP_SHARE as WIDE_SHARE
from appliance.sched.cost import CostModel
from appliance.sched.scheduler import Scheduler
from appliance.sched.types import SchedulerConfig
from appliance.vocab import Klass
from tests.unit.test_tick_budget import SLOW_CPU, D, Machine, P, seq, trained

RIDE_P1, RIDE_P2 = 2.0, 7.0
"""A chunk riding in the decode step: per-token costs as in a forward of its own (a bit
more per token: the step's rows and the chunk's share products), no fixed cost (on this
machine; TINY's chunks have one)."""


def ride(n: int, k: int) -> float:
    return RIDE_P1 * n / 1e3 + RIDE_P2 * n * (k + n / 2) / 1e6


def trained_riding(machine: Machine = SLOW_CPU, ticks: int = 80) -> CostModel:
    """Decode steps with and without chunks riding in them, and prefill forwards alone."""
    costs = trained(machine, ticks, CPU_KERNEL)
    costs.rides = True
    for i in range(ticks):
        rows, kv = 1 + i % 8, 64 + (i * 97) % 2500
        chunks = [(8 + (i * 37) % 89, (i * 211) % 1800)]
        if i % 3 == 0:
            chunks.append((30, 0))
        costs.observe_decode(rows, kv, machine.decode(rows, kv)
                             + sum(ride(n, k) for n, k in chunks), chunks)
    return costs


def test_chunks_riding_in_the_decode_step_are_fitted_without_a_fixed_cost() -> None:
    costs = trained_riding()
    for rows, kv in [(1, 64), (6, 2200), (8, 500)]:
        assert costs.decode(rows, kv) == pytest.approx(SLOW_CPU.decode(rows, kv), rel=0.05)
    for n, k in [(8, 0), (32, 1000), (96, 300)]:
        assert costs.prefill(n, k, riding=True) == pytest.approx(ride(n, k), rel=0.05)
        assert costs.prefill(n, k, riding=True) < costs.prefill(n, k)  # no fixed cost
    for seconds, k in [(0.05, 0), (0.2, 1500)]:
        n = costs.tokens_within(seconds, k, riding=True)
        assert costs.prefill(n, k, riding=True) <= seconds + 1e-9
        assert costs.prefill(n + 1, k, riding=True) > seconds


TINY = Machine(d0=0.004, d1=0.0001, d2=0.0005, p0=0.002, p1=0.05, p2=0.2)
"""About the demo model served on two CPU cores (bench.mixed, and the server's
steps): a chunk riding in its decode step costs TINY_RIDE_FIXED of its own and the prefill
rate per token."""
TINY_RIDE_FIXED = 0.0015


def tiny_ride(n: int, k: int) -> float:
    return TINY_RIDE_FIXED + TINY.p1 * n / 1e3 + TINY.p2 * n * (k + n / 2) / 1e6


def trained_tiny(rows: int, tokens: int, ticks: int = 120) -> CostModel:
    """TINY's decode steps of 1 to ``rows`` rows, four in five with a chunk of 8 to
    ``tokens`` tokens riding in them."""
    costs = trained(TINY, profile=CPU_KERNEL)
    costs.rides = True
    for i in range(ticks):
        b, kv = 1 + i % rows, 100 + (i * 97) % 900
        chunks = [(8 + i % (tokens - 7), (i * 211) % 900)] if i % 5 else []
        costs.observe_decode(b, kv, TINY.decode(b, kv)
                             + sum(tiny_ride(n, k) for n, k in chunks), chunks)
    return costs


def test_a_riding_chunks_own_fixed_cost_is_not_put_on_its_tokens() -> None:
    """Chunks of 8-15 tokens only (what a busy riding tick reads): without a fixed cost per
    chunk in the fit, its 1.5 ms went on the tokens, twice the true rate or more, and a
    64-token chunk was predicted at twice its cost, so bigger chunks were never tried."""
    costs = trained_tiny(6, 15)
    for n, k in [(8, 0), (15, 300)]:
        assert costs.ride(n, k, 4) == pytest.approx(tiny_ride(n, k), rel=0.05)
    unseen = costs.step_cost(KERNEL_ROWS)  # the step past KERNEL_ROWS, at its prior
    assert unseen == pytest.approx(WIDE_SHARE * TINY.d0, rel=0.1)
    for n, k in [(64, 0), (128, 500)]:  # four to eight times the chunks it saw
        assert costs.ride(n, k, 4) - unseen == pytest.approx(tiny_ride(n, k), rel=0.15)


def test_until_it_sees_wide_forwards_the_fit_predicts_their_step_from_the_decode_step() -> None:
    """The demo model's steps take 2 ms and its products have no step past WIDE_ROWS: a
    fixed prior of 20 ms (SmolLM's step) kept every riding chunk within 16 rows, 8-12
    tokens beside 4-8 decode rows, so the fit never saw a wide forward to learn from."""
    costs = trained_tiny(4, 12)  # narrow forwards only
    step = costs.step_cost(WIDE_ROWS)
    assert step == pytest.approx(WIDE_SHARE * TINY.d0, rel=0.3)
    share = tiny_ride(40, 200) + step  # time for 40 tokens and the step
    assert costs.ride_tokens_within(share, 200, 4) > WIDE_ROWS - 4
    for i in range(60):  # then wide forwards: no step on this machine
        chunks = [(20 + i % 20, 300)]
        costs.observe_decode(4, 500, TINY.decode(4, 500) + tiny_ride(*chunks[0]), chunks)
    assert costs.step_cost(WIDE_ROWS) < step / 3


def test_while_present_a_riding_chunk_of_work_that_can_wait_pays_its_own_fixed_cost_twice(
) -> None:
    """The demo model reads a chat turn alone in about a decode step, so keeping a tick
    within that left work that can wait its min_chunk: 8 tokens a tick, 1.5 ms of a 2.2 ms
    chunk its own fixed cost (a heavy user's documents beside a light user's streams: 10
    prompt tokens per riding tick; with this floor, 15). Such a chunk now gets at least
    prefill_floor times that fixed cost."""
    costs = trained_tiny(6, 15)
    objectives = TickObjectives()
    budget = tick_budget(costs, objectives, 4, 500, present=True)
    assert budget.riding and budget.patient_s is not None
    arrival = PRESENT_TICK * costs.prefill(objectives.arrival_tokens)
    # reading a chat turn alone leaves less than a min_chunk chunk beside the step
    assert arrival - budget.decode_s < costs.ride(objectives.min_chunk, 0, 4)
    fixed = costs.chunk_fixed(riding=True)
    assert fixed == pytest.approx(TINY_RIDE_FIXED, rel=0.2)
    assert budget.patient_s == pytest.approx(objectives.prefill_floor * fixed)
    # (the true costs give 9 tokens: 2 x 1.5 ms at 500 positions)
    assert costs.ride_tokens_within(budget.patient_s, 500, 4) > objectives.min_chunk
    # on the SmolLM shape a min_chunk chunk costs more than that: unchanged
    slow = trained_riding()
    budget = tick_budget(slow, objectives, 4, 500, present=True)
    assert budget.patient_s == pytest.approx(max(slow.ride(objectives.min_chunk, 0, 4), min(
        budget.prefill_s,
        PRESENT_TICK * slow.prefill(objectives.arrival_tokens) - budget.decode_s)))


def test_a_tick_rides_only_when_the_engine_reads_chunks_in_a_decode_step_that_runs() -> None:
    costs = trained_riding()
    objectives = TickObjectives(itl_target_s=0.4)
    assert tick_budget(costs, objectives, 4, 300).riding
    assert not tick_budget(costs, objectives, 0, 0).riding  # nothing decodes
    costs.rides = False
    assert not tick_budget(costs, objectives, 4, 300).riding


def test_riding_a_long_prompt_gets_more_tokens_in_the_same_tick_target() -> None:
    """Beside decoding streams, a chunk riding in the step pays no forward fixed cost, so
    the same ITL target reads more of the prompt, and the tick still fits it."""
    chunks = {}
    for rides in (False, True):
        costs = trained_riding()
        costs.rides = rides
        s = Scheduler(SchedulerConfig(objectives=TickObjectives(itl_target_s=0.3)))
        views = [seq(1, D, kv=300), seq(2, D, kv=300), seq(3, P, prompt=4000, computed=100)]
        plan = s.step(0.0, views, costs=costs)
        assert s.budget is not None and s.budget.riding is rides
        ((rid, n),) = plan.prefill
        chunks[rides] = n
        took = SLOW_CPU.decode(2, 301) + (ride(n, 100) if rides
                                          else SLOW_CPU.prefill(1, n, 100))
        assert took <= s.budget.target_s * 1.05
    assert chunks[True] > chunks[False], chunks


def test_while_present_a_riding_tick_gives_work_that_can_wait_at_least_a_riding_min_chunk(
        ) -> None:
    costs = trained_riding()
    objectives = TickObjectives(ttft_target_s=0.6)
    here = tick_budget(costs, objectives, 8, 3000, present=True)
    assert here.riding
    assert here.patient_s == pytest.approx(costs.prefill(objectives.min_chunk, riding=True))
    # the floor is a few riding min_chunks, not forward fixed costs
    assert here.target_s == pytest.approx(
        here.decode_s + objectives.prefill_floor * costs.prefill(objectives.min_chunk,
                                                                 riding=True))


def test_riding_a_chat_turn_is_read_whole_unless_it_needs_over_a_fifth_again_the_share(
        ) -> None:
    """Riding chunks cost no fixed cost, so a prompt that does not fit is split, but not
    into a stub: one that costs at most WHOLE_RIDING (1.2) times what the tick has left is
    read whole (split, its first token would wait a tick for the stub)."""
    costs = trained_riding()
    step = costs.decode(2, 301)
    turn = costs.ride(60, 0, 2)
    for share, whole in ((turn / 1.15, True), (turn / 1.3, False)):
        s = Scheduler(SchedulerConfig(objectives=TickObjectives(
            itl_target_s=step + share, prefill_floor=0)))
        views = [seq(1, D, kv=300), seq(2, D, kv=300), seq(3, P, prompt=60)]
        ((rid, n),) = s.step(0.0, views, costs=costs).prefill
        assert s.budget is not None and s.budget.riding
        assert (n == 60) is whole, (share, n)


def test_riding_a_voice_command_is_read_whole_where_a_chat_turn_is_split() -> None:
    """The household hears a voice command's wait: riding, it is read whole when it costs
    at most two min_chunk forwards of its own, even where a chat turn would be split."""
    costs = trained_riding()
    step = costs.decode(2, 301)
    turn = costs.prefill(60, riding=True)
    assert turn <= 2 * costs.prefill(8)
    got = {}
    for klass in (Klass.INTERACTIVE, Klass.VOICE):
        s = Scheduler(SchedulerConfig(objectives=TickObjectives(
            itl_target_s=step + turn / 1.8, prefill_floor=0)))
        views = [seq(1, D, kv=300), seq(2, D, kv=300), seq(3, P, prompt=60, klass=klass)]
        ((_, n),) = s.step(0.0, views, costs=costs).prefill
        got[klass] = n
    assert got[Klass.VOICE] == 60 and got[Klass.INTERACTIVE] < 60, got


def test_an_overdue_burst_riding_in_the_decode_step_lasts_at_most_burst_steps() -> None:
    """Riding chunks have no fixed cost to share, so an overdue burst stretches the streams'
    gap to BURST_STEPS decode steps, not to the TTFT objective (at C = 8 with synchronised
    clients every request's first gap was such a tick, 700 ms); read apart it may still
    take the whole objective."""
    costs = trained_riding()
    objectives = TickObjectives(ttft_target_s=2.0)
    step = costs.decode(2, 101)
    assert tick_budget(costs, objectives, 2, 100).target_s == pytest.approx(2 * step)
    burst = tick_budget(costs, objectives, 2, 100, overdue=True)
    assert burst.target_s == pytest.approx(BURST_STEPS * step) and burst.target_s < 2.0
    apart = tick_budget(costs, objectives, 2, 100, overdue=True, ride=False)
    assert apart.target_s == pytest.approx(2.0)
    assert tick_budget(costs, objectives, 0, 0, overdue=True).target_s == pytest.approx(2.0)


def test_a_chat_turn_or_voice_command_of_someone_with_nothing_streaming_is_read_apart(
        ) -> None:
    """Beside other people's streams, a short prompt of someone with nothing decoding is
    read in a forward of its own before the step (its first token comes when that forward
    ends, not after the step), planned at the rates of a forward of its own; the same
    prompt of the streams' owner, and anyone's document, ride."""
    costs = trained_riding()

    def plan(user: str, prompt: int, klass: Klass = Klass.INTERACTIVE) -> tuple[bool, bool]:
        s = Scheduler(SchedulerConfig(objectives=TickObjectives(itl_target_s=0.4)))
        views = [seq(1, D, kv=300, user="alice"), seq(2, D, kv=300, user="alice"),
                 seq(3, P, prompt=prompt, klass=klass, user=user)]
        p = s.step(0.0, views, costs=costs)
        assert s.budget is not None and s.budget.riding is p.ride
        if not p.ride:
            assert p.prefill == ((3, prompt),)  # read whole, before the step
        return p.ride, s.budget.riding

    assert plan("bob", 60) == (False, False)
    assert plan("bob", 40, Klass.VOICE) == (False, False)
    assert plan("alice", 60) == (True, True)  # one person's streams and turn: it rides
    assert plan("bob", 4000) == (True, True)  # a document rides


WIDE_STEP = 0.05
"""The step to matrix products of more than WIDE_ROWS rows (the appliance's own kernel
takes at most 16 rows, OpenBLAS the rest: about 50 ms on the SmolLM-135M shape)."""


def trained_wide(ticks: int = 120, kernel_step: float = 0.0) -> CostModel:
    """As :func:`trained_riding`, on a machine whose forwards of more than WIDE_ROWS rows
    cost WIDE_STEP more, and of more than KERNEL_ROWS ``kernel_step`` more again."""
    costs = trained(SLOW_CPU, ticks, CPU_KERNEL)
    costs.rides = True
    for i in range(ticks):
        rows, kv = 1 + i % 8, 64 + (i * 97) % 2500
        chunks = [(4 + (i * 37) % 93, (i * 211) % 1800)]
        tokens = sum(n for n, _ in chunks)
        costs.observe_decode(rows, kv, SLOW_CPU.decode(rows, kv)
                             + sum(ride(n, k) for n, k in chunks)
                             + (WIDE_STEP if rows + tokens > WIDE_ROWS else 0.0)
                             + (kernel_step if rows + tokens > KERNEL_ROWS else 0.0), chunks)
    return costs


def test_the_fit_learns_the_step_to_products_of_more_than_wide_rows() -> None:
    costs = trained_wide()
    assert costs.decode(4, 300, [(12, 0)]) == pytest.approx(
        SLOW_CPU.decode(4, 300) + ride(12, 0), rel=0.05)
    assert costs.decode(4, 300, [(13, 0)]) == pytest.approx(
        SLOW_CPU.decode(4, 300) + ride(13, 0) + WIDE_STEP, rel=0.05)
    # a chunk's share of the step (a difference of fitted terms: within 10 ms)
    assert costs.ride(13, 0, 4) == pytest.approx(ride(13, 0) + WIDE_STEP, abs=0.01)
    assert costs.ride(12, 0, 20) == pytest.approx(ride(12, 0), abs=0.01)  # already wide
    # where products have no such step, it fits a small fraction of one (the prior's pull)
    assert trained_riding().step_cost(WIDE_ROWS) < WIDE_STEP / 5


def test_a_riding_chunk_stays_within_wide_rows_unless_the_time_reads_more_past_them() -> None:
    costs = trained_wide()
    narrow = WIDE_ROWS - 4

    def tokens(n: int) -> float:  # the fitted time of n riding tokens, without the step
        return costs.prefill(n, 0, riding=True) + 1e-9

    # time for a few more tokens than fit within 16 rows, not for the step as well
    assert costs.ride_tokens_within(tokens(narrow + 6), 0, 4) == narrow
    # time for far more past the step
    n = costs.ride_tokens_within(tokens(80) + WIDE_STEP, 0, 4)
    assert n > narrow and costs.ride(n, 0, 4) <= tokens(80) + WIDE_STEP
    # a small share: as many tokens as fit; past the step already, no step to pay
    assert costs.ride_tokens_within(tokens(5), 0, 4) == 5
    assert costs.ride_tokens_within(tokens(narrow), 0, 20) == narrow  # 32 rows in all


KERNEL_STEP = 0.022
"""The step past KERNEL_ROWS rows (OpenBLAS's gemm instead of the appliance's kernel: about
22 ms on the SmolLM-135M shape, a decode step of 7 rows with 25 and 26 tokens riding)."""


def test_a_riding_chunk_stops_at_the_kernels_rows_unless_the_time_reads_more_past_them(
) -> None:
    """Seven streams and a burst of chat turns riding (C = 8): a tick planned at its target
    crossed 32 rows, priced as 31, and took the step on top (BENCHMARKS Run 18)."""
    costs = trained_wide(kernel_step=KERNEL_STEP)
    assert costs.step_cost(KERNEL_ROWS) == pytest.approx(KERNEL_STEP, abs=0.006)
    # no such step: under its prior (half a decode step's fixed cost), which it is pulled to
    assert trained_wide().step_cost(KERNEL_ROWS) < 0.6 * WIDE_SHARE * costs.decode_fit.beta[0]
    rows, room = 7, KERNEL_ROWS - 7
    assert costs.ride(room + 1, 0, rows) - costs.ride(room, 0, rows) == pytest.approx(
        KERNEL_STEP + costs.prefill(room + 1, 0, riding=True) - costs.prefill(room, 0, riding=True),
        abs=0.006)

    def past_first(n: int) -> float:  # n riding tokens and the first step, not the second
        return costs.prefill(n, 0, riding=True) + costs.step_cost(WIDE_ROWS) + 1e-9

    assert costs.ride_tokens_within(past_first(room), 0, rows) == room
    assert costs.ride_tokens_within(past_first(room + 4), 0, rows) == room
    n = costs.ride_tokens_within(past_first(120) + costs.step_cost(KERNEL_ROWS), 0, rows)
    assert n > room and costs.ride(n, 0, rows) <= past_first(120) + costs.step_cost(KERNEL_ROWS)
    # past both steps already: nothing more to pay
    assert costs.ride_tokens_within(costs.prefill(10, 0, riding=True) + 1e-9, 0, 40) == 10


def test_a_stream_gap_beside_a_riding_chat_turn_stays_near_the_itl_target() -> None:
    """A chat turn riding beside 4 streams is read in chunks that keep the forward within
    WIDE_ROWS rows (each tick about the target), not in one that crosses the step."""
    costs = trained_wide()
    step = costs.decode(4, 301)
    s = Scheduler(SchedulerConfig(objectives=TickObjectives(itl_target_s=1.5 * step,
                                                            prefill_floor=0)))
    views = [*(seq(i, D, kv=300, user=f"u{i}") for i in range(1, 5)),
             seq(9, P, prompt=60, user="u1")]
    ((_, n),) = s.step(0.0, views, costs=costs).prefill
    assert s.budget is not None and s.budget.riding
    assert 0 < n <= WIDE_ROWS - 4
    assert costs.decode(4, 301, [(n, 0)]) <= s.budget.target_s * 1.05


def test_a_riding_chat_turn_is_read_in_even_chunks_not_full_ticks_and_a_stub() -> None:
    """A 55-token turn whose tick share fits 24 riding tokens: read greedily it took 24, 24
    and 7 (two ticks at the target, the streams' ITL tail); read evenly, 19, 18 and 18 in
    as many ticks, each shorter than the target."""
    costs = trained_riding()
    step = costs.decode(2, 301)
    objectives = TickObjectives(itl_target_s=step + costs.prefill(24, riding=True) + 1e-9,
                                prefill_floor=0)
    s = Scheduler(SchedulerConfig(objectives=objectives))
    computed, chunks = 0, []
    while computed < 55:
        views = [seq(1, D, kv=300), seq(2, D, kv=300), seq(3, P, prompt=55, computed=computed)]
        ((_, n),) = s.step(float(len(chunks)), views, costs=costs).prefill
        assert s.budget is not None and s.budget.riding
        assert costs.decode(2, 301) + costs.prefill(n, computed, riding=True) < (
            objectives.itl_target_s)
        chunks.append(n)
        computed += n
    assert chunks == [19, 18, 18]


def test_what_an_even_chunk_leaves_starts_no_other_prompt_with_a_crumb() -> None:
    """Two chat turns wait beside the streams: the first is read evenly, and the time left
    goes to the second only as a chunk of at least min_chunk tokens (two tokens made it a
    prompt in pieces, read apart from the fresh prompts read together next)."""
    costs = trained_riding()
    step = costs.decode(2, 301)
    for extra in range(0, 12):
        objectives = TickObjectives(
            itl_target_s=step + costs.prefill(24 + extra, riding=True) + 1e-9,
            prefill_floor=0)
        s = Scheduler(SchedulerConfig(objectives=objectives))
        views = [seq(1, D, kv=300), seq(2, D, kv=300), seq(3, P, prompt=55),
                 seq(4, P, prompt=55)]
        plan = s.step(0.0, views, costs=costs).prefill
        assert plan[0][0] == 3 and plan[0][1] < 24 + extra  # even, not the whole share
        assert all(n >= objectives.min_chunk for _, n in plan[1:]), (extra, plan)


def test_a_chat_turn_beside_someone_elses_streams_is_read_whole_in_its_own_forward() -> None:
    """bob has nothing streaming, so his turn does not ride in alice's decode step: it is
    read in a forward of its own, whole, even where the streams' ITL target would leave it
    a few tokens a tick (each piece would wait a decode step of alice's streams). alice's
    own turn beside her streams rides and is split as before; a document of bob's too."""
    # a 4-bit model on a CPU: a forward's fixed cost is small beside its tokens'
    costs = trained_riding(Machine(d0=0.007, d1=0.0011, d2=0.004, p0=0.005, p1=1.1, p2=1.0))
    assert costs.prefill(60) > 2 * costs.prefill(8)
    step = costs.decode(5, 1001)
    objectives = TickObjectives(itl_target_s=step + costs.prefill(10), prefill_floor=0)
    streams = [seq(i, D, kv=1000, user="alice") for i in (1, 2, 3, 4, 5)]
    s = Scheduler(SchedulerConfig(objectives=objectives))
    plan = s.step(0.0, [*streams, seq(6, P, prompt=60, user="bob")], costs=costs)
    assert not plan.ride and plan.prefill == ((6, 60),)
    s = Scheduler(SchedulerConfig(objectives=objectives))
    plan = s.step(0.0, [*streams, seq(6, P, prompt=60, user="alice")], costs=costs)
    ((_, n),) = plan.prefill
    assert plan.ride and n < 60
    s = Scheduler(SchedulerConfig(objectives=objectives))
    plan = s.step(0.0, [*streams, seq(6, P, prompt=600, user="bob")], costs=costs)
    ((_, n),) = plan.prefill
    assert n < 60
