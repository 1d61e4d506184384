"""The scheduler's messages and settings: what the engine hands in (``SeqView``), what it
gets back (``Plan``) and how the scheduler is configured (``SchedulerConfig``).

Types live below the algorithms that use them (fair.py, memory.py, policy.py,
invariants.py, scheduler.py all import from here, never the other way round), so the
scheduler's modules have no import cycles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from appliance.sched.budget import TickObjectives
from appliance.sched.states import RequestState
from appliance.vocab import Klass

DEFAULT_W_IN = 1.0
DEFAULT_W_OUT = 2.0
DEFAULT_AGING_SECONDS = 30.0
POLICY_NAMES: tuple[str, ...] = ("fair", "fcfs")
"""Queue policies (``appliance.sched.policy.POLICIES`` holds their classes)."""
PREEMPTION_POLICIES: tuple[str, ...] = ("fair", "longest-first", "lowest-priority")
"""Victim orders under memory pressure (``appliance.sched.memory.victim_order``)."""
CHUNK_IDLE = 2048
CHUNK_BUSY = 512

Chunks = tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class KvBudget:
    tokens: int
    watermark: float = 0.01

    def limit(self, decoding: bool) -> int:
        """Admission limit: the watermark stays free while a decode batch runs."""
        if not decoding:
            return self.tokens
        return self.tokens - math.ceil(self.tokens * self.watermark)


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
    kv_tokens: int | None = None
    """KV tokens this request holds now as the engine measures them (padding included).
    None: estimated as ``computed`` while prefilling and ``prefill_len`` while decoding."""
    max_tokens: int | None = None
    """Most output tokens the request may produce in all; None: unknown (admission then
    reserves only prompt + 1 even with preemption off)."""
    generated: int = 0
    """Output tokens produced so far (kept across preemption, and counted in ``prefill_len``
    once it is re-prefilled)."""

    @property
    def remaining(self) -> int:
        return self.prefill_len - self.computed


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_batch_size: int = 8
    prefill_chunk_size: int = -1
    """-1: sized in time from the cost model and ``objectives`` (without a cost model:
    CHUNK_IDLE while nothing decodes, CHUNK_BUSY while decoding); N fixes it; 0: off."""
    objectives: TickObjectives = TickObjectives()
    """Latency objectives that bound a tick's length (with ``prefill_chunk_size`` -1)."""
    check_invariants: bool = True
    """Assert the plan's invariants (invariants.py) at the end of every step; the daemon
    turns this off on its hot path unless ``--debug-invariants``."""
    prefill_grant_interval: int = 16
    policy: str = "fair"
    """Queue order: ``fair`` (class with aging, then virtual token counter) or ``fcfs``."""
    w_in: float = DEFAULT_W_IN
    """Counter cost of one computed prefill token."""
    w_out: float = DEFAULT_W_OUT
    """Counter cost of one output token."""
    aging_seconds: float = DEFAULT_AGING_SECONDS
    """A waiting request rises one class per this many seconds (fair policy); 0: no aging."""
    background_reserve: int = 1
    """Batch slots kept for background work (fair policy): while a background request is
    queued and fewer than this many background requests run, background takes the next free
    slots before any other class. Never more than ``max_batch_size - 1`` (so a batch of 1
    has none). fcfs keeps strict class order, with neither aging nor reserve."""
    kv_budget_tokens: int | None = None
    """KV budget in tokens (``--kv-cache-budget`` bytes / KV bytes per token); None: none."""
    kv_admission_watermark: float = 0.01
    """Share of the KV budget admission leaves free while a decode batch runs."""
    enable_preemption: bool = False
    """Admit on prompt + first token and preempt when memory runs out (else: reserve each
    request's worst case, prompt + max_tokens, and never preempt)."""
    preemption_policy: str = "fair"
    """Victim order: ``fair`` (lowest effective class, then highest counter),
    ``longest-first`` or ``lowest-priority``."""
    class_preemption: bool = True
    """When every slot is taken and a request of a higher class waits, one running request
    of a lower class yields its slot (its KV is kept in the prompt cache, so it resumes
    without recomputing). Independent of ``enable_preemption``, which is about memory."""

    share_preemption: bool = True
    """fair policy: with every slot taken, a user holding more than their weighted share of
    a class's rows, and ``share_margin`` ahead on the counters of the user whose request
    waits first, yields one row (KV kept, as for class preemption): weights then shape
    service, not just the order of admission (``fair.share_victim``)."""
    share_margin: float = 64.0
    """Counter units (32 output tokens at weight 1) a user must be ahead before a row of
    theirs yields: larger, fewer yields; smaller, closer to the weights over short spans."""

    def __post_init__(self) -> None:
        if self.share_margin < 0:
            raise ValueError("share_margin must be >= 0")
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"unknown scheduling policy {self.policy!r}")
        if self.preemption_policy not in PREEMPTION_POLICIES:
            raise ValueError(f"unknown preemption policy {self.preemption_policy!r}; use "
                             f"{', '.join(PREEMPTION_POLICIES)}")
        if self.aging_seconds < 0 or self.background_reserve < 0:
            raise ValueError("aging_seconds and background_reserve must be >= 0")
        if self.kv_budget_tokens is not None and self.kv_budget_tokens < 1:
            raise ValueError("kv_budget_tokens must be >= 1 (or None for no budget)")
        if not 0 <= self.kv_admission_watermark < 1:
            raise ValueError("kv_admission_watermark must be in [0, 1)")

    def chunk(self, decoding: bool) -> int | None:
        """Prefill tokens allowed this tick; None means unlimited (chunking off)."""
        if self.prefill_chunk_size == 0:
            return None
        if self.prefill_chunk_size > 0:
            return self.prefill_chunk_size
        return CHUNK_BUSY if decoding else CHUNK_IDLE

    @property
    def reserved_background_slots(self) -> int:
        if self.policy != "fair":
            return 0
        return min(self.background_reserve, self.max_batch_size - 1)

    @property
    def budget(self) -> KvBudget | None:
        if self.kv_budget_tokens is None:
            return None
        return KvBudget(self.kv_budget_tokens, self.kv_admission_watermark)


@dataclass(frozen=True, slots=True)
class Plan:
    admit: tuple[int, ...] = ()
    preempt: tuple[int, ...] = ()
    prefill: Chunks = ()
    """(rid, tokens) prefill chunks to run this tick, in order."""
    reject: tuple[int, ...] = ()
    """Queued requests that cannot fit the KV budget even alone: the engine finishes them
    (``length`` when they already produced output, else ``error``)."""
    evict_tokens: int = 0
    """Cold prompt-cache tokens the engine frees before running this tick."""
    keep_kv: tuple[int, ...] = ()
    """Preempted requests that yield a slot to a higher class (not to free memory): the
    engine keeps their KV in the prompt cache so they resume without recomputing."""
    ride: bool = True
    """The prefill chunks may be read in the decode step's forward (when the engine reads
    chunks so). False: in forwards of their own before the step, so that a chat turn or
    voice command of someone with nothing streaming shows its first token a decode step
    sooner (see ``Scheduler._allowance``)."""

    @property
    def empty(self) -> bool:
        return not (self.admit or self.preempt or self.prefill or self.reject
                    or self.evict_tokens)
