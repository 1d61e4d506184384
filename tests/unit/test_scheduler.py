"""The scheduler as a pure step function: hand-built inputs, no MLX, no clock."""

from __future__ import annotations

import pytest

from appliance.sched.scheduler import Scheduler
from appliance.sched.states import (
    ALLOWED,
    FINISHED,
    InvalidTransition,
    RequestState,
    check_transition,
)
from appliance.sched.types import CHUNK_BUSY, CHUNK_IDLE, SchedulerConfig, SeqView
from appliance.vocab import Klass

Q, P, D = RequestState.QUEUED, RequestState.PREFILLING, RequestState.DECODING


def seq(rid: int, state: RequestState = Q, prompt: int = 10, computed: int = 0,
        klass: Klass = Klass.INTERACTIVE, arrival: float | None = None,
        user: str = "bob") -> SeqView:
    return SeqView(rid=rid, user=user, klass=klass, arrival=float(rid if arrival is None
                                                                  else arrival),
                   state=state, prefill_len=prompt, computed=computed)


def sched(**kw: object) -> Scheduler:
    return Scheduler(SchedulerConfig(**kw))  # type: ignore[arg-type]


def test_it_admits_in_arrival_order_up_to_the_batch_size() -> None:
    plan = sched(max_batch_size=2).step(0.0, [seq(3), seq(1), seq(2)])
    assert plan.admit == (1, 2)


def test_running_requests_count_against_the_batch_size() -> None:
    plan = sched(max_batch_size=2).step(0.0, [seq(1, D), seq(2), seq(3)])
    assert plan.admit == (2,)


def test_a_higher_class_is_admitted_first() -> None:
    plan = sched(max_batch_size=1).step(0.0, [seq(1), seq(2, klass=Klass.VOICE)])
    assert plan.admit == (2,)


def test_prefill_uses_2048_tokens_while_nothing_decodes() -> None:
    plan = sched().step(0.0, [seq(1, prompt=5000)])
    assert plan.prefill == ((1, CHUNK_IDLE),)


def test_prefill_uses_512_tokens_while_a_batch_decodes() -> None:
    plan = sched().step(0.0, [seq(1, D), seq(2, prompt=5000)])
    assert plan.prefill == ((2, CHUNK_BUSY),)


def test_an_explicit_chunk_size_fixes_both() -> None:
    assert sched(prefill_chunk_size=100).step(0.0, [seq(1, prompt=500)]).prefill == ((1, 100),)
    assert sched(prefill_chunk_size=100).step(
        0.0, [seq(1, D), seq(2, prompt=500)]).prefill == ((2, 100),)


def test_chunk_size_zero_reads_the_whole_prompt_at_once() -> None:
    plan = sched(prefill_chunk_size=0).step(0.0, [seq(1, prompt=9000)])
    assert plan.prefill == ((1, 9000),)


def test_short_prompts_share_one_tick_budget() -> None:
    plan = sched().step(0.0, [seq(1, D), seq(2, prompt=200), seq(3, prompt=200)])
    assert plan.prefill == ((2, 200), (3, 200))


def test_a_tick_that_finishes_a_prompt_carries_no_partial_chunk_behind_it() -> None:
    plan = sched().step(0.0, [seq(1, D), seq(2, prompt=300), seq(3, prompt=3000)])
    assert plan.prefill == ((2, 300),)
    # ahead in the order, a long prompt still takes its chunk first
    plan = sched().step(0.0, [seq(1, D), seq(2, prompt=3000), seq(3, prompt=300)])
    assert plan.prefill == ((2, CHUNK_BUSY),)


def test_a_partly_read_prompt_continues_where_it_stopped() -> None:
    plan = sched().step(0.0, [seq(1, P, prompt=3000, computed=2048)])
    assert plan.prefill == ((1, 952),)


def test_a_lower_class_prefill_is_parked_but_granted_every_interval() -> None:
    s = sched(prefill_grant_interval=4)
    seqs = [seq(1, D, klass=Klass.VOICE), seq(2, P, prompt=5000, klass=Klass.BACKGROUND)]
    grants = []
    for tick in range(12):
        plan = s.step(float(tick), seqs)
        grants.append(bool(plan.prefill))
        s.update(plan, seqs, decoded=True, served={})
    assert grants == [False, False, False, True] * 3


def test_a_parked_prefill_is_not_parked_when_nothing_outranks_it() -> None:
    seqs = [seq(1, D, klass=Klass.BACKGROUND), seq(2, P, prompt=100, klass=Klass.BACKGROUND)]
    assert sched().step(0.0, seqs).prefill == ((2, 100),)


def test_the_plan_never_prefills_a_request_twice_or_beyond_its_prompt() -> None:
    seqs = [seq(i, P, prompt=40, computed=i) for i in range(1, 8)]
    plan = sched(max_batch_size=8).step(0.0, seqs)
    rids = [r for r, _ in plan.prefill]
    assert len(rids) == len(set(rids))
    assert sum(n for _, n in plan.prefill) <= CHUNK_IDLE


def test_state_table_allows_preemption_and_forbids_leaving_a_finished_state() -> None:
    check_transition(D, Q)
    check_transition(Q, P)
    for finished in FINISHED:
        assert ALLOWED[finished] == frozenset()
        with pytest.raises(InvalidTransition):
            check_transition(finished, Q)
    with pytest.raises(InvalidTransition):
        check_transition(Q, D)


def test_a_voice_request_takes_the_slot_of_a_background_one_when_all_are_taken() -> None:
    s = sched(max_batch_size=2, background_reserve=0)
    running = [seq(1, D, klass=Klass.BACKGROUND), seq(2, D, klass=Klass.INTERACTIVE)]
    plan = s.step(10.0, [*running, seq(3, klass=Klass.VOICE)])
    assert plan.preempt == (1,) and plan.keep_kv == (1,)
    assert plan.admit == (3,)


def test_no_slot_is_taken_from_an_equal_class_or_while_a_slot_is_free() -> None:
    full = [seq(1, D), seq(2, D)]
    assert sched(max_batch_size=2).step(0.0, [*full, seq(3)]).preempt == ()
    assert sched(max_batch_size=3).step(
        0.0, [seq(1, D, klass=Klass.BACKGROUND), seq(2, klass=Klass.VOICE)]).preempt == ()


def test_the_background_reserve_is_not_taken_by_a_higher_class() -> None:
    running = [seq(1, D, klass=Klass.BACKGROUND), seq(2, D, klass=Klass.INTERACTIVE)]
    plan = sched(max_batch_size=2, background_reserve=1).step(
        0.0, [*running, seq(3, klass=Klass.VOICE)])
    assert plan.preempt == (2,)


def test_class_preemption_can_be_switched_off() -> None:
    running = [seq(1, D, klass=Klass.BACKGROUND), seq(2, D, klass=Klass.BACKGROUND)]
    plan = sched(max_batch_size=2, class_preemption=False, background_reserve=0).step(
        0.0, [*running, seq(3, klass=Klass.VOICE)])
    assert plan.preempt == () and plan.admit == ()


def test_queue_order_is_the_order_admission_takes_and_changes_nothing() -> None:
    s = sched(max_batch_size=1)
    s.counters.charge("bob", 0, 500)  # bob has been served a lot: carol goes before him
    seqs = [seq(1, D, user="dave"), seq(2, user="bob"), seq(3, user="carol"),
            seq(4, klass=Klass.VOICE, user="alice")]
    before = s.counters.snapshot()
    assert s.queue_order(0.0, seqs) == [4, 3, 2]  # voice first, then the lower counter
    assert s.counters.snapshot() == before
    assert s.queue_order(0.0, [seq(1, D)]) == []


def test_due_grants_falling_in_one_tick_take_turns() -> None:
    """Three background prompts parked behind a voice stream fall due together: one gets
    its grant beyond the budget, the others stay due and get theirs in the next ticks (not
    three grants, three times the tick, at once)."""
    s = sched(prefill_grant_interval=4, max_batch_size=8)
    seqs = [seq(1, D, klass=Klass.VOICE)] + [
        seq(i, P, prompt=5000, klass=Klass.BACKGROUND) for i in (2, 3, 4)]
    granted = []
    for tick in range(6):
        plan = s.step(float(tick), seqs)
        granted.append(tuple(rid for rid, _ in plan.prefill))
        s.update(plan, seqs, decoded=True, served={})
    assert granted[:3] == [(), (), ()]
    assert [len(g) for g in granted[3:]] == [1, 1, 1]
    assert sorted(g[0] for g in granted[3:]) == [2, 3, 4]
