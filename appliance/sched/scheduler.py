"""Who goes next: the scheduler as a step function over explicit inputs.

``plan = scheduler.step(now, view)``; the engine runs the plan; then
``scheduler.update(plan, decoded=...)``. No clock reads, no database, no MLX in here:
tests build the inputs by hand.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from appliance.sched.classes import Klass
from appliance.sched.policy import QueuePolicy, make_policy
from appliance.sched.states import RequestState

CHUNK_IDLE = 2048
CHUNK_BUSY = 512


@dataclass(slots=True)
class SeqView:
    """The scheduler's view of one request (the engine owns the request itself)."""

    rid: int
    user: str
    klass: Klass
    arrival: float
    state: RequestState
    prefill_len: int = 0
    """Tokens whose KV must exist before decoding (prompt, plus kept output after preemption)."""
    computed: int = 0
    """Tokens of ``prefill_len`` whose KV is already computed."""

    @property
    def remaining(self) -> int:
        return self.prefill_len - self.computed


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_batch_size: int = 8
    prefill_chunk_size: int = -1
    """-1: CHUNK_IDLE while nothing decodes, CHUNK_BUSY while decoding; N fixes both; 0: off."""
    prefill_grant_interval: int = 16
    policy: str = "fcfs"

    def chunk(self, decoding: bool) -> int | None:
        """Prefill tokens allowed this tick; None means unlimited (chunking off)."""
        if self.prefill_chunk_size == 0:
            return None
        if self.prefill_chunk_size > 0:
            return self.prefill_chunk_size
        return CHUNK_BUSY if decoding else CHUNK_IDLE


@dataclass(frozen=True, slots=True)
class Plan:
    admit: tuple[int, ...] = ()
    preempt: tuple[int, ...] = ()
    prefill: tuple[tuple[int, int], ...] = ()
    """(rid, tokens) prefill chunks to run this tick, in order."""

    @property
    def empty(self) -> bool:
        return not (self.admit or self.preempt or self.prefill)


@dataclass(slots=True)
class Scheduler:
    config: SchedulerConfig
    policy: QueuePolicy = field(init=False)
    _parked_ticks: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.policy = make_policy(self.config.policy)

    def step(self, now: float, seqs: Sequence[SeqView]) -> Plan:
        """Plan one tick.

        The rule:
        1. Admission: queued requests in policy order (class first, then the policy's
           tie-break: arrival for fcfs) fill free slots up to ``max_batch_size``.
        2. Prefill budget: one chunk of tokens per tick (2048 with no decode batch running,
           512 with one, or the fixed ``prefill_chunk_size``), shared by prefilling
           requests in policy order; a prompt shorter than the budget leaves the rest to
           the next one, so several short prompts are read in one tick.
        3. Parking: a prefill of a lower class than some decoding request waits, so a
           background document never stalls a voice answer; it still gets one chunk at
           least every ``prefill_grant_interval`` decode ticks.
        """
        queued = [s for s in seqs if s.state is RequestState.QUEUED]
        running = [s for s in seqs if s.state.running]
        free = self.config.max_batch_size - len(running)
        admitted = self.policy.order(now, queued)[: max(free, 0)]
        admit_ids = {s.rid for s in admitted}

        decoding = [s for s in running if s.state is RequestState.DECODING]
        prefilling = [s for s in running if s.state is RequestState.PREFILLING] + admitted
        prefill = self._prefill_plan(now, prefilling, decoding)
        plan = Plan(admit=tuple(s.rid for s in admitted), prefill=prefill)
        self._check(plan, seqs, running, admit_ids)
        return plan

    def _prefill_plan(self, now: float, prefilling: list[SeqView],
                      decoding: list[SeqView]) -> tuple[tuple[int, int], ...]:
        budget = self.config.chunk(decoding=bool(decoding))
        top_decoding = max((s.klass for s in decoding), default=None)
        due: list[SeqView] = []
        ready: list[SeqView] = []
        for s in self.policy.order(now, prefilling):
            if s.remaining <= 0:
                continue
            if top_decoding is not None and s.klass < top_decoding:
                if self._parked_ticks.get(s.rid, 0) >= self.config.prefill_grant_interval - 1:
                    due.append(s)
            else:
                ready.append(s)
        chunks: list[tuple[int, int]] = []
        left = budget  # None: unlimited
        for s in due:  # a due grant always gets one full chunk, budget or not
            n = s.remaining if budget is None else min(s.remaining, budget)
            chunks.append((s.rid, n))
            if left is not None:
                left = max(left - n, 0)
        for s in ready:
            if left is not None and left <= 0:
                break
            n = s.remaining if left is None else min(s.remaining, left)
            chunks.append((s.rid, n))
            if left is not None:
                left -= n
        return tuple(chunks)

    def update(self, plan: Plan, seqs: Sequence[SeqView], decoded: bool) -> None:
        """After the tick: count decode ticks for parked prefills, forget finished ones."""
        granted = {rid for rid, _ in plan.prefill}
        live = {s.rid for s in seqs if s.state is RequestState.PREFILLING}
        for rid in list(self._parked_ticks):
            if rid not in live:
                del self._parked_ticks[rid]
        for rid in live:
            if rid in granted:
                self._parked_ticks[rid] = 0
            elif decoded:
                self._parked_ticks[rid] = self._parked_ticks.get(rid, 0) + 1

    def _check(self, plan: Plan, seqs: Sequence[SeqView], running: list[SeqView],
               admit_ids: set[int]) -> None:
        assert len(running) + len(plan.admit) <= max(self.config.max_batch_size, len(running))
        ids = [s.rid for s in seqs]
        assert len(ids) == len(set(ids)), "a request appears twice"
        by_id = {s.rid: s for s in seqs}
        prefilled = [rid for rid, _ in plan.prefill]
        assert len(prefilled) == len(set(prefilled))
        for rid, n in plan.prefill:
            s = by_id[rid]
            assert s.state is RequestState.PREFILLING or rid in admit_ids
            assert 0 < n <= s.remaining
