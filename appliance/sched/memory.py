"""KV memory in the scheduler's terms: tokens held, reserved and grown, and who gives way.

The budget is counted in KV tokens (one token's keys and values across all layers); the
engine converts ``--kv-cache-budget`` bytes with the model's KV bytes per token. Pure: the
engine reports what each request holds (``SeqView.kv_tokens``, padding included).

Two admission modes, chosen by ``--enable-preemption``:

* **conservative** (preemption off, the default): a request is admitted only if its worst
  case fits, ``prompt + max_tokens`` tokens. No running request can then need memory that
  is not there, so nothing ever has to be evicted from the batch; the cost is a smaller batch
  when ``max_tokens`` is large. Requests that do not fit wait (refusal by waiting).
* **optimistic** (preemption on): a request needs room for its prompt plus its first token,
  under ``budget * (1 - watermark)`` while a decode batch runs. Decoding grows into the
  watermark; when a tick would overflow the budget, victims are preempted (in
  :func:`victim_order`) and re-prefilled later with their tokens kept.
"""

from __future__ import annotations

from collections.abc import Sequence

from appliance.sched.fair import VirtualCounters, effective_class
from appliance.sched.states import RequestState
from appliance.sched.types import SeqView


def held(s: SeqView) -> int:
    """KV tokens ``s`` holds now: the engine's figure, else the computed prefix."""
    if s.kv_tokens is not None:
        return s.kv_tokens
    if s.state is RequestState.DECODING:
        return s.prefill_len
    if s.state is RequestState.PREFILLING:
        return s.computed
    return 0


def worst_case(s: SeqView) -> int:
    """KV tokens ``s`` holds at its longest: prompt + max_tokens (prompt + 1 if unknown)."""
    if s.max_tokens is None:
        return s.prefill_len + 1
    return s.prefill_len - s.generated + max(s.max_tokens, s.generated + 1)


def reservation(s: SeqView, optimistic: bool) -> int:
    """KV tokens set aside for ``s`` while it runs (see the module note)."""
    if not optimistic:
        return max(held(s), worst_case(s))
    if s.state is RequestState.DECODING:
        return held(s)
    return max(held(s), s.prefill_len + 1)


def chunk_growth(s: SeqView, n: int) -> int:
    """KV tokens a prefill chunk of ``n`` adds; the last chunk also yields the first token."""
    return n + (1 if n >= s.remaining else 0)


def victim_order(policy: str, now: float, running: Sequence[SeqView],
                 counters: VirtualCounters, aging_seconds: float) -> list[SeqView]:
    """Running requests, first victim first.

    ``fair``: lowest effective class (aged as in the queue, capped at the highest class
    running), then the highest counter, then the latest arrival. ``longest-first``: most KV
    held. ``lowest-priority``: lowest class, then latest arrival.
    """
    if policy == "fair":
        top = max((int(s.klass) for s in running), default=0)
        return sorted(running, key=lambda s: (
            min(int(effective_class(s.klass, now - s.arrival, aging_seconds)), top),
            -counters.get(s.user), -s.arrival, -s.rid))
    if policy == "longest-first":
        return sorted(running, key=lambda s: (-held(s), -s.arrival, -s.rid))
    if policy == "lowest-priority":
        return sorted(running, key=lambda s: (int(s.klass), -s.arrival, -s.rid))
    raise ValueError(f"unknown preemption policy {policy!r}")
