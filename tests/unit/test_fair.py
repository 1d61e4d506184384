"""The fair policy's rules, one by one: counters, lift, weights, order, aging, reserve."""

from __future__ import annotations

import pytest

from appliance.sched.fair import VirtualCounters, effective_class
from appliance.sched.policy import POLICIES, FcfsPolicy, make_policy
from appliance.sched.scheduler import Scheduler
from appliance.sched.states import RequestState
from appliance.sched.types import SchedulerConfig, SeqView
from appliance.vocab import Klass

Q, P, D = RequestState.QUEUED, RequestState.PREFILLING, RequestState.DECODING
BG, IA, VO = Klass.BACKGROUND, Klass.INTERACTIVE, Klass.VOICE


def seq(rid: int, user: str = "bob", klass: Klass = IA, state: RequestState = Q,
        arrival: float | None = None, prompt: int = 10) -> SeqView:
    return SeqView(rid=rid, user=user, klass=klass, state=state, prefill_len=prompt,
                   arrival=float(rid) if arrival is None else arrival)


def sched(**kw: object) -> Scheduler:
    return Scheduler(SchedulerConfig(**kw))  # type: ignore[arg-type]


# ---- counters ----
def test_a_counter_charges_one_per_prefill_token_and_two_per_output_token() -> None:
    c = VirtualCounters()
    assert c.charge("alice", 100, 10) == 120
    assert c.get("alice") == 120
    assert c.get("bob") == 0


def test_the_token_weights_are_configurable() -> None:
    c = VirtualCounters(w_in=0.5, w_out=4.0)
    c.charge("alice", 100, 10)
    assert c.get("alice") == 90


def test_a_user_weight_divides_the_charge() -> None:
    c = VirtualCounters()
    c.set_weight("alice", 2.0)
    c.charge("alice", 100, 0)
    c.charge("bob", 100, 0)
    assert (c.get("alice"), c.get("bob")) == (50, 100)


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan")])
def test_a_weight_must_be_positive_and_finite(bad: float) -> None:
    with pytest.raises(ValueError, match="weight"):
        VirtualCounters().set_weight("alice", bad)


def test_cached_prompt_tokens_cost_nothing_because_only_computed_ones_are_charged() -> None:
    s = sched()
    alice = SeqView(rid=1, user="alice", klass=IA, arrival=0.0, state=P, prefill_len=1000,
                    computed=900)  # 900 tokens came from the prompt cache
    plan = s.step(0.0, [alice])
    assert plan.prefill == ((1, 100),)
    s.update(plan, [], decoded=False, served={"alice": (100, 1)})  # as the engine counts
    assert s.counters.get("alice") == 100 + 2  # 100 computed + the first output token


def test_a_user_becoming_backlogged_is_lifted_to_the_lowest_backlogged_counter() -> None:
    c = VirtualCounters()
    c.observe({"bob", "carol"})
    c.charge("bob", 500, 0)
    c.charge("carol", 800, 0)
    c.observe({"bob", "carol", "alice"})
    assert c.get("alice") == 500


def test_the_lift_never_lowers_a_counter() -> None:
    c = VirtualCounters()
    c.restore({"alice": 900.0, "bob": 100.0})
    c.observe({"bob"})
    c.observe({"bob", "alice"})
    assert c.get("alice") == 900


def test_idle_time_banks_no_credit_even_when_nobody_else_is_waiting() -> None:
    c = VirtualCounters()
    c.observe({"alice"})
    c.charge("alice", 5000, 0)
    c.observe(set())  # alice is done; the house is idle
    c.observe({"bob"})  # bob was idle all along
    assert c.get("bob") == 5000


def test_a_continuously_backlogged_user_is_not_lifted_again() -> None:
    c = VirtualCounters()
    c.observe({"alice", "bob"})
    c.charge("bob", 1000, 0)
    c.observe({"alice", "bob"})
    assert c.get("alice") == 0


def test_counters_survive_a_snapshot_and_restore() -> None:
    c = VirtualCounters()
    c.charge("alice", 10, 5)
    c.set_weight("bob", 2.0)
    c.charge("bob", 10, 0)
    saved = c.snapshot()
    d = VirtualCounters()
    d.restore(saved)
    assert d.snapshot() == {"alice": 20.0, "bob": 5.0}


def test_the_scheduler_charges_the_work_the_engine_reports() -> None:
    s = sched()
    views = [seq(1, "alice", state=D)]
    plan = s.step(0.0, views)
    s.update(plan, views, decoded=True, served={"alice": (0, 3), "bob": (7, 0)})
    assert (s.counters.get("alice"), s.counters.get("bob")) == (6, 7)


# ---- order ----
def test_it_admits_the_light_user_before_the_heavy_user() -> None:
    s = sched(max_batch_size=1)
    s.counters.observe({"alice", "bob"})
    s.counters.charge("bob", 4000, 0)
    plan = s.step(10.0, [seq(1, "bob"), seq(2, "alice")])
    assert plan.admit == (2,)


def test_slots_filled_in_one_tick_alternate_between_users() -> None:
    queue = [seq(i, "alice", arrival=float(i)) for i in (1, 2, 3)]
    queue += [seq(i, "bob", arrival=float(i)) for i in (4, 5, 6)]
    assert sched(max_batch_size=4).step(10.0, queue).admit == (1, 4, 2, 5)


def test_prefill_already_granted_counts_against_its_user() -> None:
    s = sched(max_batch_size=4)
    s.counters.observe({"alice", "bob"})
    s.counters.charge("bob", 500, 0)
    alice_reading = seq(1, "alice", state=P, prompt=1000)  # 1000 tokens still to compute
    plan = s.step(10.0, [alice_reading, seq(2, "alice"), seq(3, "bob")])
    assert plan.admit == (3, 2)


def test_class_comes_before_the_counter() -> None:
    s = sched(max_batch_size=1)
    s.counters.observe({"alice", "bob"})
    s.counters.charge("bob", 4000, 0)
    plan = s.step(10.0, [seq(1, "bob", VO), seq(2, "alice")])
    assert plan.admit == (1,)


def test_equal_counters_go_in_arrival_order() -> None:
    plan = sched(max_batch_size=1).step(0.0, [seq(2, "alice"), seq(1, "bob")])
    assert plan.admit == (1,)


def test_fair_is_the_default_and_fcfs_remains() -> None:
    assert SchedulerConfig().policy == "fair"
    assert set(POLICIES) == {"fair", "fcfs"}
    assert isinstance(make_policy("fcfs"), FcfsPolicy)
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        SchedulerConfig(policy="lifo")


def test_fcfs_ignores_counters() -> None:
    s = sched(max_batch_size=1, policy="fcfs")
    s.counters.charge("bob", 4000, 0)
    assert s.step(10.0, [seq(1, "bob"), seq(2, "alice")]).admit == (1,)


# ---- aging ----
@pytest.mark.parametrize(("klass", "waited", "expected"), [
    (BG, 0.0, BG), (BG, 29.9, BG), (BG, 30.0, IA), (BG, 60.0, VO), (BG, 600.0, VO),
    (IA, 30.0, VO), (VO, 90.0, VO),
])
def test_aging_raises_a_class_one_level_per_aging_seconds(klass: Klass, waited: float,
                                                          expected: Klass) -> None:
    assert effective_class(klass, waited, 30.0) is expected


def test_aging_zero_disables_aging() -> None:
    assert effective_class(BG, 1e6, 0.0) is BG


def test_a_background_request_that_waited_long_enough_goes_before_fresh_voice() -> None:
    s = sched(max_batch_size=1, background_reserve=0)
    s.counters.observe({"bob", "carol"})
    s.counters.charge("carol", 1, 0)  # bob served least: he wins the tie at voice level
    queue = [seq(1, "bob", BG, arrival=0.0), seq(2, "carol", VO, arrival=59.0)]
    assert s.step(59.0, queue).admit == (2,)
    assert s.step(60.0, queue).admit == (1,)


def test_aging_does_not_reorder_requests_of_one_class_when_nothing_outranks_them() -> None:
    s = sched(max_batch_size=1)
    s.counters.observe({"alice", "bob"})
    s.counters.charge("bob", 4000, 0)
    # bob's request waited long enough to age two levels; alice's is fresh. Both are
    # interactive and nothing higher waits, so the counter decides, not the wait.
    plan = s.step(100.0, [seq(1, "bob", arrival=0.0), seq(2, "alice", arrival=99.0)])
    assert plan.admit == (2,)


def test_fcfs_does_not_age() -> None:
    s = sched(max_batch_size=1, policy="fcfs")
    assert s.step(1e6, [seq(1, "bob", BG, arrival=0.0), seq(2, "carol", VO)]).admit == (2,)


# ---- background reserve ----
def test_the_background_reserve_gives_queued_background_work_a_slot() -> None:
    s = sched(max_batch_size=2, background_reserve=1)
    plan = s.step(0.0, [seq(1, "alice", VO), seq(2, "alice", VO), seq(3, "bob", BG)])
    assert plan.admit == (3, 1)


def test_the_reserve_is_kept_only_while_fewer_background_requests_run() -> None:
    s = sched(max_batch_size=3, background_reserve=1)
    seqs = [seq(1, "bob", BG, state=D), seq(2, "alice", VO), seq(3, "bob", BG)]
    assert s.step(0.0, seqs).admit == (2, 3)


def test_without_background_work_the_reserve_costs_nothing() -> None:
    s = sched(max_batch_size=2, background_reserve=1)
    assert s.step(0.0, [seq(1, "alice"), seq(2, "alice")]).admit == (1, 2)


def test_a_batch_of_one_keeps_no_reserve() -> None:
    s = sched(max_batch_size=1, background_reserve=1)
    assert s.step(0.0, [seq(1, "bob", BG), seq(2, "alice")]).admit == (2,)
