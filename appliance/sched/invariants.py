"""What every plan must satisfy, asserted at the end of each step.

* running requests (after preemption) plus admissions never exceed ``max_batch_size``;
* every request is in exactly one place: listed once, admitted or rejected only from the
  queue, preempted only while running, prefilled only while prefilling (or just admitted),
  never beyond its prompt;
* with a KV budget: what the plan admits fits under the budget less the watermark, and the
  tick's KV (held + decode growth + prefill chunks + cold cache left) fits the budget. With
  preemption off the one exception is decode growth of requests already running beyond
  what the engine reported, which the plan cannot change; then it adds nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from appliance.sched.memory import chunk_growth, held, reservation
from appliance.sched.states import RequestState
from appliance.sched.types import KvBudget, Plan, SchedulerConfig, SeqView


def check_plan(config: SchedulerConfig, plan: Plan, seqs: Sequence[SeqView],
               cache: int) -> None:
    by_id = {s.rid: s for s in seqs}
    assert len(by_id) == len(seqs), "a request appears twice"
    admit, preempt, reject = set(plan.admit), set(plan.preempt), set(plan.reject)
    assert len(admit) == len(plan.admit) and len(preempt) == len(plan.preempt)
    assert not (admit & preempt or admit & reject or preempt & reject)
    assert all(by_id[r].state is RequestState.QUEUED for r in admit | reject)
    assert all(by_id[r].state.running for r in preempt)
    running = [s for s in seqs if s.state.running and s.rid not in preempt]
    assert not admit or len(running) + len(admit) <= config.max_batch_size
    prefilled = [rid for rid, _ in plan.prefill]
    assert len(prefilled) == len(set(prefilled))
    for rid, n in plan.prefill:
        s = by_id[rid]
        assert (s.state is RequestState.PREFILLING and rid not in preempt) or rid in admit
        assert 0 < n <= s.remaining
    budget = config.budget
    if budget is not None:
        _check_budget(config.enable_preemption, budget, plan, by_id, running, cache)


def _check_budget(optimistic: bool, budget: KvBudget, plan: Plan, by_id: dict[int, SeqView],
                  running: list[SeqView], cache: int) -> None:
    assert 0 <= plan.evict_tokens <= max(cache, 0)
    decoding = sum(s.state is RequestState.DECODING for s in running)
    if plan.admit:
        committed = sum(reservation(s, optimistic) for s in running)
        committed += sum(reservation(by_id[r], optimistic) for r in plan.admit)
        assert committed <= budget.limit(decoding=decoding > 0), "admitted over the budget"
    used = sum(held(s) for s in running) + decoding + cache - plan.evict_tokens
    used += sum(chunk_growth(by_id[rid], n) for rid, n in plan.prefill)
    adds_nothing = not (plan.admit or plan.prefill)
    assert used <= budget.tokens or (not optimistic and adds_nothing), "KV budget exceeded"
