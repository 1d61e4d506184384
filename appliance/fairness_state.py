"""The fairness scheduler's persisted state: counters, weights and the last day's usage.

Read from the store at start-up (and weights again whenever an admin changes them); the
engine hands counters back to the store writer every few seconds and at shutdown.
"""

from __future__ import annotations

import time

from sqlalchemy import select

from appliance.store.db import Store
from appliance.store.ledger import DAY_S
from appliance.store.limits import load_counters
from appliance.store.models import LedgerEntry, User


def load(store: Store) -> tuple[dict[str, float], dict[str, float]]:
    """(counters, weights), keyed by user id as text (the scheduler's user key)."""
    with store.read_sessions() as s:
        counters = {str(uid): v for uid, v in load_counters(s).items()}
        weights = {str(u.id): u.weight for u in s.scalars(select(User))}
    return counters, weights


def usage_rows(store: Store, now: float | None = None) -> list[tuple[str, float, int]]:
    """(user, finished_at, prompt + output tokens) of the ledger's last day."""
    since = (time.time() if now is None else now) - DAY_S
    with store.read_sessions() as s:
        rows = s.execute(select(LedgerEntry.user_id, LedgerEntry.finished_at,
                                LedgerEntry.prompt_tokens + LedgerEntry.output_tokens)
                         .where(LedgerEntry.finished_at > since))
        return [(str(uid), float(t), int(n)) for uid, t, n in rows]
