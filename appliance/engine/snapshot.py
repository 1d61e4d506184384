"""What the engine publishes after each tick for /health, /slots and the dashboard.

An immutable value swapped in by reference: readers on other threads never lock and never
slow the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SlotInfo:
    rid: int
    user_id: int
    user: str
    """The user's name, for the people who read /slots and the dashboard (code goes by
    ``user_id``)."""
    klass: str
    state: str
    prompt_tokens: int
    prefilled: int
    """Tokens of the prompt whose KV is computed (progress of a chunked prefill)."""
    generated: int
    max_tokens: int
    waited_s: float


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    active: int
    queued: int
    completed: int
    slots: tuple[SlotInfo, ...]
    queue: tuple[SlotInfo, ...]
    """Queued requests in the order the scheduler will admit them, next first."""
    kv_bytes: int
    ticks: int
    prompt_tokens_total: int
    generated_tokens_total: int
    preemptions_total: int
    errors_total: int
    cancelled_total: int
    counters: Mapping[str, float] = field(default_factory=dict)
    """The fairness scheduler's virtual token counter of each user (by user id as text)."""
    prompt_cache: Mapping[str, int] | None = None
    """entries, bytes, lookups, hits, tokens_reused, evictions; None when it is off."""
    kv_reserved_bytes: int = 0
    """KV the scheduler has set aside for running requests beyond what they hold now."""
    weights: Mapping[str, float] = field(default_factory=dict)
    """The weights the running scheduler uses (by user id as text; absent: 1)."""
    ticks_over_target: int = 0
    """Ticks that took more than twice their time target (``ticks.OVER_TARGET``)."""
    mixed_forwards: int = 0
    """Decode steps that read prompt chunks in their own forward (engine/mixed.py)."""
    draft_tokens: int = 0
    """Draft tokens lone streams verified (engine/lookup.py)."""
    draft_tokens_kept: int = 0
    """Of those, the ones that came true and were kept."""

    @property
    def prompt_cache_bytes(self) -> int:
        return int(self.prompt_cache["bytes"]) if self.prompt_cache else 0

    def ahead_of(self, rid: int) -> int | None:
        """How many queued requests the scheduler will admit before ``rid``; None when
        ``rid`` is not queued (running, finished, or not seen yet)."""
        return next((i for i, q in enumerate(self.queue) if q.rid == rid), None)

    @classmethod
    def empty(cls) -> EngineSnapshot:
        return cls(0, 0, 0, (), (), 0, 0, 0, 0, 0, 0, 0)
