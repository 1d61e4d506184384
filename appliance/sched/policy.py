"""Queue policies: the order in which waiting (and prefilling) requests are served.

Small and pluggable, chosen by a setting: ``fair`` (the default: classes with aging, then
the virtual token counters of :mod:`appliance.sched.fair`) and ``fcfs`` (class, then
arrival).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from appliance.sched.fair import FairPolicy, VirtualCounters
from appliance.sched.types import DEFAULT_AGING_SECONDS, POLICY_NAMES, SeqView


class QueuePolicy(Protocol):
    name: str

    def order(self, now: float, seqs: Sequence[SeqView]) -> list[SeqView]:
        """Return ``seqs`` best-first. Must not mutate anything."""
        ...

    def admit_order(self, now: float, queued: Sequence[SeqView],
                    running: Sequence[SeqView]) -> list[SeqView]:
        """``queued`` best-first for free slots, knowing what already runs. Pure."""
        ...


class FcfsPolicy:
    """Higher class first, then arrival order (then request id, for determinism)."""

    name = "fcfs"

    def order(self, now: float, seqs: Sequence[SeqView]) -> list[SeqView]:
        return sorted(seqs, key=lambda s: (-int(s.klass), s.arrival, s.rid))

    def admit_order(self, now: float, queued: Sequence[SeqView],
                    running: Sequence[SeqView]) -> list[SeqView]:
        return self.order(now, queued)


POLICIES: dict[str, type] = {"fair": FairPolicy, "fcfs": FcfsPolicy}
assert tuple(POLICIES) == POLICY_NAMES


def make_policy(name: str, counters: VirtualCounters | None = None,
                aging_seconds: float = DEFAULT_AGING_SECONDS) -> QueuePolicy:
    """Build a policy by name; ``fair`` reads ``counters`` (its own when None)."""
    if name not in POLICIES:
        raise ValueError(f"unknown scheduling policy {name!r}; use one of "
                         f"{', '.join(sorted(POLICIES))}")
    if name == "fair":
        vtc = VirtualCounters() if counters is None else counters
        return FairPolicy(vtc=vtc, aging_seconds=aging_seconds)
    return POLICIES[name]()
