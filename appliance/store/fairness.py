"""The fairness scheduler's persisted state: counters, weights and the last day's usage.

Read once when the daemon starts (``appliance.daemon.build_daemon``) and the weights again
whenever an admin changes them; the engine hands counters back to the store writer every
few seconds, when it goes idle, and at shutdown.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from appliance.store.limits import load_counters
from appliance.store.models import LedgerEntry, User
from appliance.vocab import DAY_S


@dataclass(frozen=True, slots=True)
class FairnessState:
    """Keyed by user id as text (the scheduler's user key)."""

    counters: dict[str, float]
    weights: dict[str, float]
    usage: list[tuple[str, float, int]]
    """(user, finished_at, prompt + output tokens) of the ledger's last day."""


def load_weights(session: Session) -> dict[str, float]:
    return {str(u.id): u.weight for u in session.scalars(select(User))}


def load_usage(session: Session, now: float) -> list[tuple[str, float, int]]:
    """(user, finished_at, prompt + output tokens) of the ledger rows in the last day."""
    rows = session.execute(select(LedgerEntry.user_id, LedgerEntry.finished_at,
                                  LedgerEntry.prompt_tokens + LedgerEntry.output_tokens)
                           .where(LedgerEntry.finished_at > now - DAY_S))
    return [(str(uid), float(t), int(n)) for uid, t, n in rows]


def load_state(session: Session, now: float) -> FairnessState:
    return FairnessState(counters={str(uid): v for uid, v in load_counters(session).items()},
                         weights=load_weights(session), usage=load_usage(session, now))
