"""Per-user quotas and the fairness scheduler's persisted virtual token counters.

Functions take a ``Session`` and never commit: the caller owns the transaction.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping

from sqlalchemy import select
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from appliance.store.models import Quota, UsageCounter
from appliance.vocab import UNLIMITED, QuotaLimits


def _limits_of(row: Quota) -> QuotaLimits:
    return QuotaLimits(
        tokens_per_day=row.tokens_per_day,
        max_concurrent=row.max_concurrent,
        max_prompt_tokens=row.max_prompt_tokens,
        max_output_tokens=row.max_output_tokens,
    )


def get_quota(session: Session, user_id: int) -> QuotaLimits:
    row = session.get(Quota, user_id)
    return UNLIMITED if row is None else _limits_of(row)


def set_quota(session: Session, user_id: int, limits: QuotaLimits) -> None:
    """Replace the user's limits (all four fields; None clears one)."""
    row = session.get(Quota, user_id)
    if row is None:
        row = Quota(user_id=user_id)
        session.add(row)
    for field in dataclasses.fields(limits):
        setattr(row, field.name, getattr(limits, field.name))
    session.flush()


def load_quotas(session: Session) -> dict[int, QuotaLimits]:
    """Every user that has a quota row; users missing from the dict are unlimited."""
    return {row.user_id: _limits_of(row) for row in session.scalars(select(Quota))}


def load_counters(session: Session) -> dict[int, float]:
    """All persisted virtual token counters, by user id."""
    rows = session.execute(select(UsageCounter.user_id, UsageCounter.vtc))
    return {user_id: vtc for user_id, vtc in rows}


def save_counters(
    session: Session, values: Mapping[int, float], *, now: float | None = None
) -> None:
    """Upsert counters in one statement (insert or update per user)."""
    if not values:
        return
    stamp = time.time() if now is None else now
    rows = [{"user_id": uid, "vtc": float(v), "updated_at": stamp} for uid, v in values.items()]
    stmt = sqlite_insert(UsageCounter).values(rows)
    stmt = stmt.on_conflict_do_update(
        index_elements=[UsageCounter.user_id],
        set_={"vtc": stmt.excluded.vtc, "updated_at": stmt.excluded.updated_at},
    )
    session.execute(stmt)
