"""KV budget rules: admission, the watermark, refusal, cache eviction, preemption."""

from __future__ import annotations

import pytest

from appliance.sched.memory import reservation, worst_case
from appliance.sched.scheduler import Scheduler
from appliance.sched.states import RequestState
from appliance.sched.types import KvBudget, Plan, SchedulerConfig, SeqView
from appliance.vocab import Klass

Q, P, D = RequestState.QUEUED, RequestState.PREFILLING, RequestState.DECODING
BG, IA, VO = Klass.BACKGROUND, Klass.INTERACTIVE, Klass.VOICE


def seq(rid: int, state: RequestState = Q, user: str = "bob", prompt: int = 100,
        max_tokens: int | None = 100, klass: Klass = IA, kv: int | None = None,
        computed: int = 0, generated: int = 0, arrival: float | None = None) -> SeqView:
    if kv is None and state is D:
        kv = prompt
    return SeqView(rid=rid, user=user, klass=klass, state=state, prefill_len=prompt,
                   computed=computed, kv_tokens=kv, max_tokens=max_tokens,
                   generated=generated, arrival=float(rid) if arrival is None else arrival)


def sched(**kw: object) -> Scheduler:
    return Scheduler(SchedulerConfig(**kw))  # type: ignore[arg-type]


def test_without_a_budget_memory_is_not_considered() -> None:
    plan = sched(max_batch_size=4).step(0.0, [seq(i, prompt=10**6) for i in range(1, 4)])
    assert plan.admit == (1, 2, 3)


# ---- admission, preemption off (the default): reserve the worst case ----
def test_admission_reserves_prompt_plus_max_tokens_when_preemption_is_off() -> None:
    assert worst_case(seq(1, prompt=300, max_tokens=200)) == 500
    plan = sched(kv_budget_tokens=1000).step(
        0.0, [seq(1, prompt=300, max_tokens=200), seq(2, prompt=300, max_tokens=200),
              seq(3, prompt=10, max_tokens=10)])
    assert plan.admit == (1, 2)


def test_a_request_that_does_not_fit_waits_and_nothing_smaller_overtakes_it() -> None:
    plan = sched(kv_budget_tokens=1000).step(
        0.0, [seq(1, D, prompt=400, max_tokens=100, kv=400),
              seq(2, prompt=400, max_tokens=200), seq(3, prompt=10, max_tokens=10)])
    assert plan.admit == ()
    assert plan.reject == ()


def test_admission_keeps_the_watermark_free_while_a_batch_decodes() -> None:
    budget = KvBudget(10_000, 0.01)
    assert (budget.limit(decoding=False), budget.limit(decoding=True)) == (10_000, 9_900)
    running = seq(1, D, prompt=4000, max_tokens=1000, kv=4000)
    fits = seq(2, prompt=3900, max_tokens=1000)
    too_big = seq(3, prompt=3901, max_tokens=1000)
    assert sched(kv_budget_tokens=10_000).step(0.0, [running, fits]).admit == (2,)
    assert sched(kv_budget_tokens=10_000).step(0.0, [running, too_big]).admit == ()


def test_with_nothing_decoding_the_whole_budget_may_be_committed() -> None:
    plan = sched(kv_budget_tokens=1000).step(0.0, [seq(1, prompt=500, max_tokens=500)])
    assert plan.admit == (1,)


def test_a_request_that_can_never_fit_is_rejected_rather_than_left_waiting() -> None:
    plan = sched(kv_budget_tokens=1000).step(0.0, [seq(1, prompt=900, max_tokens=200),
                                                   seq(2, prompt=100, max_tokens=100)])
    assert plan.reject == (1,)
    assert plan.admit == (2,)


def test_kept_output_counts_toward_a_readmitted_request() -> None:
    preempted = seq(1, prompt=150, generated=50, max_tokens=100)  # 100 prompt + 50 kept
    assert worst_case(preempted) == 200
    assert reservation(preempted, optimistic=True) == 151


# ---- admission, preemption on: prompt + first token ----
def test_with_preemption_on_admission_needs_only_prompt_and_first_token() -> None:
    s = sched(kv_budget_tokens=1000, enable_preemption=True)
    plan = s.step(0.0, [seq(1, prompt=900, max_tokens=200), seq(2, prompt=98, max_tokens=5)])
    assert plan.admit == (1, 2)
    assert plan.reject == ()


def test_with_preemption_on_a_prompt_larger_than_the_budget_is_rejected() -> None:
    plan = sched(kv_budget_tokens=1000, enable_preemption=True).step(0.0, [seq(1, prompt=1000)])
    assert plan.reject == (1,)


# ---- reclaiming: cold cache first, then preemption, then refusal ----
def test_cold_prompt_cache_is_evicted_before_anyone_is_preempted() -> None:
    s = sched(kv_budget_tokens=1000, enable_preemption=True)
    plan = s.step(0.0, [seq(1, D, kv=600), seq(2, D, kv=390)], cache_tokens=10)
    assert plan.evict_tokens == 2
    assert plan.preempt == ()


def test_when_the_cache_is_not_enough_the_fair_victim_is_preempted() -> None:
    s = sched(kv_budget_tokens=1000, enable_preemption=True)
    s.counters.observe({"alice", "bob"})
    s.counters.charge("bob", 500, 0)
    plan = s.step(0.0, [seq(1, D, user="alice", kv=600), seq(2, D, user="bob", kv=399),
                        seq(3, user="carol")], cache_tokens=1)
    assert plan.evict_tokens == 1
    assert plan.preempt == (2,)
    assert plan.admit == ()  # nothing is admitted in a tick that preempts


def test_the_fair_victim_is_the_lowest_class_before_the_highest_counter() -> None:
    s = sched(kv_budget_tokens=1000, enable_preemption=True)
    s.counters.charge("bob", 500, 0)
    plan = s.step(0.0, [seq(1, D, user="alice", kv=600, klass=BG), seq(2, D, user="bob", kv=400)])
    assert plan.preempt == (1,)


def test_an_old_request_is_protected_by_its_age() -> None:
    s = sched(kv_budget_tokens=1000, enable_preemption=True)
    old = seq(1, D, user="alice", kv=600, klass=BG, arrival=0.0)  # aged to interactive
    young = seq(2, D, user="bob", kv=400, arrival=59.0)
    s.counters.charge("alice", 500, 0)
    assert s.step(60.0, [old, young]).preempt == (1,)  # same level: highest counter goes
    s.counters.charge("bob", 1000, 0)
    assert s.step(60.0, [old, young]).preempt == (2,)


@pytest.mark.parametrize(("policy", "victim"), [
    ("fair", 3), ("longest-first", 1), ("lowest-priority", 2)])
def test_the_preemption_policy_picks_the_victim(policy: str, victim: int) -> None:
    s = sched(kv_budget_tokens=1000, enable_preemption=True, preemption_policy=policy)
    s.counters.charge("carol", 900, 0)
    seqs = [seq(1, D, user="alice", kv=500, klass=VO, arrival=0.0),
            seq(2, D, user="bob", kv=200, klass=BG, arrival=1.0),
            seq(3, D, user="carol", kv=298, klass=BG, arrival=0.5)]
    assert s.step(2.0, seqs).preempt == (victim,)


def test_preemption_frees_enough_for_the_whole_tick() -> None:
    s = sched(kv_budget_tokens=100, enable_preemption=True, preemption_policy="longest-first")
    plan = s.step(0.0, [seq(1, D, kv=50), seq(2, D, kv=30), seq(3, D, kv=20)])
    assert plan.preempt == (1,)


def test_with_preemption_off_nobody_is_preempted_and_prefill_shrinks_to_fit() -> None:
    s = sched(kv_budget_tokens=1000)
    plan = s.step(0.0, [seq(1, D, kv=700, max_tokens=None),
                        seq(2, P, prompt=400, computed=100, kv=100, max_tokens=None)])
    assert plan.preempt == ()
    assert plan.prefill == ((2, 1000 - 700 - 1 - 100),)


def test_when_the_engine_reports_more_kv_than_reserved_the_plan_adds_nothing() -> None:
    s = sched(kv_budget_tokens=1000)  # padding made the batch bigger than accounted for
    plan = s.step(0.0, [seq(1, D, kv=1000, max_tokens=None), seq(2, P, prompt=50, kv=0),
                        seq(3, prompt=10, max_tokens=10)])
    assert (plan.admit, plan.prefill, plan.preempt) == ((), (), ())


def test_a_partial_chunk_stops_one_short_of_the_first_token() -> None:
    s = sched(kv_budget_tokens=1000)
    plan = s.step(0.0, [seq(1, P, prompt=1000, computed=0, kv=0, max_tokens=None)])
    assert plan.prefill == ((1, 999),)


def test_the_plan_counts_the_first_token_of_a_finished_prefill() -> None:
    s = sched(kv_budget_tokens=1001, enable_preemption=True)
    assert s.step(0.0, [seq(1, P, prompt=1000, kv=0)]).prefill == ((1, 1000),)


def test_plan_empty_covers_rejections_and_evictions() -> None:
    assert Plan().empty
    assert not Plan(reject=(1,)).empty
    assert not Plan(evict_tokens=1).empty


@pytest.mark.parametrize("kw", [
    {"preemption_policy": "random"}, {"kv_admission_watermark": 1.0},
    {"kv_budget_tokens": 0}, {"aging_seconds": -1.0}, {"max_batch_size": 0}])
def test_bad_settings_are_refused(kw: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(**kw)  # type: ignore[arg-type]


def test_the_step_asserts_every_request_is_in_one_place() -> None:
    with pytest.raises(AssertionError, match="twice"):
        sched().step(0.0, [seq(1), seq(1)])
