"""Fairness counters stay finite by construction, whatever weights reach them (issue 13:
a weight of 1e-320 once made a counter +Inf, and the lift carried Inf to everybody)."""

from __future__ import annotations

import math
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.sched.fair import VirtualCounters
from appliance.store.users import _validate_weight
from appliance.vocab import WEIGHT_MAX, WEIGHT_MIN

USERS = ("alice", "bob", "carol", "dave")
EXAMPLES = settings(max_examples=int(os.environ.get("APPLIANCE_PROPERTY_EXAMPLES", "200")),
                    deadline=None, database=None)

positive = st.floats(min_value=0.0, exclude_min=True, allow_infinity=False, allow_nan=False,
                     allow_subnormal=True)
ops = st.one_of(
    st.tuples(st.just("weight"), st.sampled_from(USERS), positive),
    st.tuples(st.just("charge"), st.sampled_from(USERS),
              st.tuples(st.integers(0, 1_000_000), st.integers(0, 100_000))),
    st.tuples(st.just("observe"), st.just(""), st.sets(st.sampled_from(USERS))),
)
persisted = st.dictionaries(st.sampled_from(USERS), st.floats(allow_nan=True,
                                                               allow_infinity=True))


@EXAMPLES
@given(restored=persisted, steps=st.lists(ops, max_size=200),
       w=st.tuples(st.floats(0, 1000), st.floats(0, 1000)))
def test_counters_stay_finite_whatever_the_weights_and_charges(
        restored: dict[str, float], steps: list[tuple[str, str, object]],
        w: tuple[float, float]) -> None:
    c = VirtualCounters(w_in=w[0], w_out=w[1])
    c.restore(restored)  # even counters persisted as inf or nan before the fix
    for kind, user, arg in steps:
        if kind == "weight":
            c.set_weight(user, arg)  # type: ignore[arg-type]
            assert WEIGHT_MIN <= c.weight(user) <= WEIGHT_MAX
        elif kind == "charge":
            prefill, output = arg  # type: ignore[misc]
            assert math.isfinite(c.charge(user, prefill, output))
        else:
            c.observe(arg)  # type: ignore[arg-type]
        assert all(math.isfinite(v) and v >= 0 for v in c.snapshot().values())


def test_a_tiny_weight_is_clamped_so_one_token_costs_at_most_100_times_w_out() -> None:
    c = VirtualCounters()
    c.set_weight("carol", 1e-320)
    assert c.charge("carol", 0, 1) == pytest.approx(2.0 / WEIGHT_MIN)
    c.observe({"carol", "bob"})
    assert math.isfinite(c.get("bob"))


@pytest.mark.parametrize("bad", [1e-320, 0.0, -1.0, 0.009, 100.01, float("inf"),
                                 float("nan"), True])
def test_the_store_refuses_a_weight_outside_0_01_to_100(bad: float) -> None:
    with pytest.raises(ValueError, match="from 0.01 to 100"):
        _validate_weight(bad)


@pytest.mark.parametrize("good", [0.01, 1, 2.5, 100])
def test_the_store_takes_a_weight_inside_the_bounds(good: float) -> None:
    assert _validate_weight(good) == float(good)
