"""Weights shape service, not only the order of admission: with every slot taken, a user over
their weighted share of the batch, and ahead on the counters, yields a row (pure: hand-built
views, and the real scheduler on the simulator's clock)."""

from __future__ import annotations

import bisect

import pytest

from appliance.sched.fair import VirtualCounters, share_victim
from appliance.sched.scheduler import Scheduler
from appliance.sched.simulator import Loop, SimResult, Simulator
from appliance.sched.states import RequestState
from appliance.sched.types import SchedulerConfig, SeqView
from appliance.vocab import Klass

Q, D = RequestState.QUEUED, RequestState.DECODING
BG, IA, VO = Klass.BACKGROUND, Klass.INTERACTIVE, Klass.VOICE


def seq(rid: int, user: str, state: RequestState = D, klass: Klass = IA) -> SeqView:
    return SeqView(rid=rid, user=user, klass=klass, state=state, arrival=float(rid),
                   prefill_len=20, computed=20 if state is D else 0)


def batch(alice: int, bob: int, queued: tuple[str, ...] = ("alice", "bob")) -> list[SeqView]:
    """``alice`` rows of alice's and ``bob`` of bob's decoding, then one queued each."""
    rows = [seq(i, "alice") for i in range(1, alice + 1)]
    rows += [seq(10 + i, "bob") for i in range(1, bob + 1)]
    return rows + [seq(100 + i, user, Q) for i, user in enumerate(queued)]


def counters(alice: float, bob: float, bob_weight: float = 4.0) -> VirtualCounters:
    vtc = VirtualCounters()
    vtc.set_weight("bob", bob_weight)
    vtc.charge("alice", 0, int(alice / 2))
    vtc.charge("bob", 0, int(bob * bob_weight / 2))
    return vtc


def _victim(vtc: VirtualCounters, views: list[SeqView], best_user: str,
            margin: float = 64.0) -> SeqView | None:
    queued = [s for s in views if s.state is Q]
    best = next(s for s in queued if s.user == best_user)
    return share_victim(vtc, best, queued, [s for s in views if s.state is D], margin)


def test_a_user_over_their_weighted_share_and_ahead_yields_their_latest_row() -> None:
    # alice (weight 1) holds 2 of 8 rows, her share is 1.6; bob (weight 4) is 100 behind
    victim = _victim(counters(alice=1000, bob=900), batch(2, 6), "bob")
    assert victim is not None and (victim.user, victim.rid) == ("alice", 2)


def test_nobody_yields_within_the_margin() -> None:
    assert _victim(counters(alice=1000, bob=950), batch(2, 6), "bob") is None


def test_a_user_at_their_rounded_down_share_keeps_their_rows() -> None:
    # 1 row of 8 is alice's share rounded down: however far ahead, she keeps it
    assert _victim(counters(alice=5000, bob=100), batch(1, 7), "bob") is None
    # and bob, at 7 of 8 (share 6.4), yields once he is ahead
    victim = _victim(counters(alice=900, bob=1000), batch(1, 7), "alice")
    assert victim is not None and victim.user == "bob"


def test_equal_weights_settle_at_equal_rows() -> None:
    vtc = counters(alice=1000, bob=500, bob_weight=1.0)
    assert _victim(vtc, batch(4, 4), "bob") is None
    victim = _victim(vtc, batch(5, 3), "bob")
    assert victim is not None and victim.user == "alice"


def test_only_rows_of_the_waiting_requests_class_yield() -> None:
    vtc = counters(alice=5000, bob=0, bob_weight=1.0)
    views = [seq(i, "alice") for i in range(1, 8)] + [seq(9, "bob"),
                                                       seq(20, "bob", Q, klass=BG)]
    assert _victim(vtc, views, "bob") is None


def test_the_scheduler_hands_the_yielded_slot_to_the_best_queued_request() -> None:
    s = Scheduler(SchedulerConfig(max_batch_size=8, background_reserve=0))
    s.counters.set_weight("bob", 4.0)
    s.counters.observe({"alice", "bob"})
    s.counters.charge("alice", 0, 500)
    s.counters.charge("bob", 0, 1600)  # 400 after the weight: 600 behind alice
    plan = s.step(0.0, batch(2, 6))
    assert plan.preempt == (2,) and plan.keep_kv == (2,)
    assert plan.admit == (101,)  # bob's queued request


def test_share_preemption_can_be_switched_off() -> None:
    s = Scheduler(SchedulerConfig(max_batch_size=8, share_preemption=False))
    s.counters.set_weight("bob", 4.0)
    s.counters.charge("alice", 0, 5000)
    assert s.step(0.0, batch(2, 6)).preempt == ()


def _service(res: SimResult, until: float) -> dict[str, float]:
    return res.served[bisect.bisect_right(res.times, until) - 1]


def _ratio(output: tuple[int, int], share: bool) -> tuple[float, int]:
    """bob's service over alice's in 20 s (both backlogged throughout), and the yields."""
    loops = [Loop("alice", IA, 8, (20, 20), output, think_s=0.005, stop=20.0),
             Loop("bob", IA, 8, (20, 20), output, think_s=0.005, stop=20.0, seed=1)]
    res = Simulator(SchedulerConfig(max_batch_size=8, share_preemption=share),
                    weights={"bob": 4.0}).run(loops=loops)
    got = _service(res, 20.0)
    return got["bob"] / got["alice"], res.preemptions


@pytest.mark.parametrize("output", [(256, 256), (16, 600)])
def test_weights_shape_service_when_requests_run_to_their_end(
        output: tuple[int, int]) -> None:
    """Issue #37 item 0: alice (weight 1) and bob (weight 4) each keep 8 requests in flight
    on a batch of 8 for 20 s: bob gets 4x alice's service within 20 %, whatever the
    lengths, with a few yields, not churn."""
    ratio, yields = _ratio(output, share=True)
    assert ratio == pytest.approx(4.0, rel=0.2)
    assert yields < 60


def test_admission_order_alone_does_not_give_the_weights() -> None:
    """Without yielding, slots free at the pace of the requests (256 tokens each, all
    admitted together): bob got 1.6x here, 1.06-1.12x on the demo model."""
    ratio, yields = _ratio((256, 256), share=False)
    assert ratio < 2.0 and yields == 0
