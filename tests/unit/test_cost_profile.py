"""The cost model reads a device's profile (appliance/backend/profile.py), never a kernel: a
profile with no steps (MLX's own BLAS, Metal, CUDA) plans as well as one with the CPU
kernel's. No MLX, no real clock."""

from __future__ import annotations

import pytest

from appliance.backend.profile import CPU_KERNEL, PLAIN, WIDE_ROWS, profile_for
from appliance.sched.budget import TickObjectives
from appliance.sched.cost import BASE_DECODE_PRIOR, CostModel, CostProfile
from appliance.sched.scheduler import Scheduler
from appliance.sched.types import SchedulerConfig
from tests.unit.test_tick_budget import FAST_GPU, SLOW_CPU, D, P, seq, trained
from tests.unit.test_tick_riding import ride


def riding(profile: CostProfile, ticks: int = 120) -> CostModel:
    """SLOW_CPU's steps, with chunks of 8-96 tokens riding and no step at any row count."""
    costs = trained(SLOW_CPU, ticks, profile)
    costs.rides = True
    for i in range(ticks):
        rows, kv = 1 + i % 8, 64 + (i * 97) % 2500
        chunks = [(8 + (i * 37) % 89, (i * 211) % 1800)]
        costs.observe_decode(rows, kv, SLOW_CPU.decode(rows, kv) + ride(*chunks[0]), chunks)
    return costs


def test_a_profile_without_steps_fits_no_step_terms() -> None:
    costs = CostModel(profile=PLAIN)
    assert len(costs.decode_fit.beta) == len(BASE_DECODE_PRIOR)
    assert len(CostModel(profile=CPU_KERNEL).decode_fit.beta) == len(BASE_DECODE_PRIOR) + 2
    assert profile_for(kernel_active=False) is PLAIN
    assert profile_for(kernel_active=True) is CPU_KERNEL


def test_without_steps_a_riding_chunk_takes_all_the_time_it_is_given() -> None:
    """No stop at the kernel's 16 or 32 rows: the tokens that fit the time, whatever the
    forward's width."""
    costs = riding(PLAIN)
    for seconds in (0.02, 0.08, 0.2):
        n = costs.ride_tokens_within(seconds, 0, 4)
        assert costs.ride(n, 0, 4) <= seconds + 1e-9 < costs.ride(n + 1, 0, 4)
    assert costs.ride_tokens_within(0.2, 0, 4) > 2 * WIDE_ROWS
    kernel = riding(CPU_KERNEL)  # the same machine read through the kernel's profile
    assert kernel.decode(4, 300, [(40, 0)]) == pytest.approx(costs.decode(4, 300, [(40, 0)]),
                                                             rel=0.1)


@pytest.mark.parametrize("machine", [SLOW_CPU, FAST_GPU], ids=["slow-cpu", "fast-gpu"])
def test_without_steps_the_scheduler_plans_ticks_within_the_target(machine: object) -> None:
    """A chat turn beside four streams on a device with no steps: it rides, in chunks whose
    forward stays within the tick's target."""
    costs = trained(machine, 120, PLAIN)  # type: ignore[arg-type]
    costs.rides = True
    step = costs.decode(4, 301)
    s = Scheduler(SchedulerConfig(objectives=TickObjectives(itl_target_s=2 * step)))
    views = [*(seq(i, D, kv=300, user=f"u{i}") for i in range(1, 5)),
             seq(9, P, prompt=400, user="u1")]
    plan = s.step(0.0, views, costs=costs)
    ((_, n),) = plan.prefill
    assert s.budget is not None and plan.ride and n > 0
    assert costs.decode(4, 301, [(n, 0)]) <= s.budget.target_s * 1.05


def test_a_profile_refuses_steps_out_of_order() -> None:
    with pytest.raises(ValueError, match="increasing"):
        CostProfile("bad", (32, 16))
    with pytest.raises(ValueError, match="increasing"):
        CostProfile("bad", (0,))


def test_before_any_chunk_rides_its_tokens_cost_what_a_prompt_forward_taught() -> None:
    """A model five times slower a token than the priors' small one: its first prompt's
    forwards teach the prefill fit, and the first chunk riding in a decode step is
    predicted at that rate, not the prior's (a 1B file's first riding tick ran 2.3x over)."""
    costs = CostModel(profile=CPU_KERNEL, rides=True)
    for _ in range(3):
        costs.observe_decode(1, 100, 0.045)
    def tokens() -> float:  # a riding chunk's tokens, without its own fixed cost
        return costs.prefill(16, 0, overhead=False, riding=True)

    prior = tokens()
    for n, k in ((66, 0), (89, 0), (40, 89)):  # 7.5 ms a token, and attention
        costs.observe_prefill(1, n, k, 0.03 + n * 0.0075 + n * (k + n / 2) * 8e-6)
    assert tokens() > 3 * prior
    assert tokens() == pytest.approx(costs.prefill(16, 0, overhead=False), rel=0.05)
    for i in range(60):  # riding seen (4 ms a token): its own rate, whatever the prefill's
        n = 4 + (i * 7) % 40
        costs.observe_decode(1, 100, 0.045)
        costs.observe_decode(1, 100, 0.045 + n * 0.004, [(n, 100)])
    assert costs.decode(1, 100, [(16, 100)]) - costs.decode(1, 100) == pytest.approx(
        16 * 0.004, rel=0.2)
