"""How much of an embedding the forward after a tick may read (``Scheduler.embed_tokens``):
the tick's budget, like a background prompt's prefill (issue 52, D14)."""

from __future__ import annotations

from appliance.sched.budget import tick_budget
from appliance.sched.cost import CostModel
from appliance.sched.scheduler import Scheduler
from appliance.sched.types import SchedulerConfig


def test_a_piece_fits_what_the_tick_leaves_and_always_advances() -> None:
    s, costs = Scheduler(SchedulerConfig()), CostModel()
    objectives = s.config.objectives
    budget = tick_budget(costs, objectives, 4, 100, present=False, ride=False)
    n = s.embed_tokens(0.0, "1", 0, 4, 100, spent_s=budget.decode_s, costs=costs)
    assert n >= objectives.min_chunk
    assert costs.prefill(n) <= budget.target_s - budget.decode_s + 1e-9
    # a tick that spent its whole budget still leaves the smallest chunk
    assert s.embed_tokens(0.0, "1", 0, 4, 100, spent_s=10.0, costs=costs) == objectives.min_chunk
    # deeper into a long input a piece costs more per token: it gets fewer
    assert s.embed_tokens(0.0, "1", 1500, 4, 100, spent_s=budget.decode_s, costs=costs) <= n


def test_someone_elses_presence_makes_the_pieces_patient() -> None:
    s, costs = Scheduler(SchedulerConfig()), CostModel()
    alone = s.embed_tokens(0.0, "1", 0, 0, 0, spent_s=0.0, costs=costs)
    s.step(0.0, [])  # nothing live: nobody present
    s._seen_at["2"] = 0.0  # user 2 chatted just now
    assert s.embed_tokens(1.0, "1", 0, 0, 0, spent_s=0.0, costs=costs) < alone
    assert s.embed_tokens(1.0, "2", 0, 0, 0, spent_s=0.0, costs=costs) == alone  # own chat
    later = 1.0 + s.config.objectives.presence_s + 1
    assert s.embed_tokens(later, "1", 0, 0, 0, spent_s=0.0, costs=costs) == alone


def test_fixed_chunks_without_a_cost_model() -> None:
    s = Scheduler(SchedulerConfig(prefill_chunk_size=96))
    assert s.embed_tokens(0.0, "1", 0, 2, 10, spent_s=0.0, costs=CostModel()) == 96
