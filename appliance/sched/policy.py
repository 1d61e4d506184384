"""Queue policies: the order in which waiting (and prefilling) requests are served.

Small and pluggable: ``fcfs`` now; the fairness issue adds ``fair`` beside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from appliance.sched.scheduler import SeqView


class QueuePolicy(Protocol):
    name: str

    def order(self, now: float, seqs: Sequence[SeqView]) -> list[SeqView]:
        """Return ``seqs`` best-first. Must not mutate anything."""
        ...


class FcfsPolicy:
    """Higher class first, then arrival order (then request id, for determinism)."""

    name = "fcfs"

    def order(self, now: float, seqs: Sequence[SeqView]) -> list[SeqView]:
        return sorted(seqs, key=lambda s: (-int(s.klass), s.arrival, s.rid))


POLICIES: dict[str, type] = {"fcfs": FcfsPolicy}


def make_policy(name: str) -> QueuePolicy:
    try:
        return POLICIES[name]()  # type: ignore[no-any-return]
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}") from None
