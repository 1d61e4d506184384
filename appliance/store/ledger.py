"""The usage ledger: one row per finished request, and the sums read from it.

The row's message, ``LedgerRecord``, lives in ``store.records`` (no SQLAlchemy there): the
engine builds it when a request finishes and hands it to the ``StoreWriter``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from appliance.store.models import LedgerEntry
from appliance.store.records import LedgerRecord
from appliance.vocab import DAY_S, HOUR_S


@dataclass(frozen=True, slots=True)
class Usage:
    """Sums over a user's ledger rows in a time window."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    preemptions: int = 0
    ttft_ms_mean: float | None = None
    itl_ms_mean: float | None = None

    @property
    def total_tokens(self) -> int:
        """Prompt plus output tokens (cached tokens are part of the prompt count)."""
        return self.prompt_tokens + self.output_tokens

    @property
    def computed_tokens(self) -> int:
        """Tokens the model actually processed: prompt-cache hits excluded."""
        return self.prompt_tokens - self.cached_tokens + self.output_tokens


def insert_records(session: Session, records: Sequence[LedgerRecord]) -> list[str]:
    """Insert rows in one statement; a request id already in the ledger is not written
    twice (re-submitting a record does not count it twice). Returns the ids that were
    skipped so: request ids are UUIDv7s, unique across restarts, so any conflict is a bug
    or a replay, and the caller must say so loudly (never a silent drop)."""
    if not records:
        return []
    stmt = (sqlite_insert(LedgerEntry)
            .on_conflict_do_nothing(index_elements=[LedgerEntry.request_id])
            .returning(LedgerEntry.request_id))
    written = set(session.scalars(stmt, [dataclasses.asdict(r) for r in records]).all())
    return [r.request_id for r in records if r.request_id not in written]


def usage_since(
    session: Session, since: float, *, user_id: int | None = None
) -> dict[int, Usage]:
    """Usage per user over requests finished at or after ``since`` (unix seconds).

    Users with no requests in the window are absent from the result.
    """
    query = (
        select(
            LedgerEntry.user_id,
            func.count(),
            func.coalesce(func.sum(LedgerEntry.prompt_tokens), 0),
            func.coalesce(func.sum(LedgerEntry.cached_tokens), 0),
            func.coalesce(func.sum(LedgerEntry.output_tokens), 0),
            func.coalesce(func.sum(LedgerEntry.preemptions), 0),
            func.avg(LedgerEntry.ttft_ms),
            func.avg(LedgerEntry.itl_mean_ms),
        )
        .where(LedgerEntry.finished_at >= since)
        .group_by(LedgerEntry.user_id)
    )
    if user_id is not None:
        query = query.where(LedgerEntry.user_id == user_id)
    return {
        uid: Usage(int(n), int(p), int(c), int(o), int(pre), ttft, itl)
        for uid, n, p, c, o, pre, ttft, itl in session.execute(query)
    }


def service_rows(session: Session, since: float, limit: int) -> list[tuple[Any, ...]]:
    """Newest first, at most ``limit``: (user id, finished_at, prompt + output tokens,
    preemptions, ttft_ms, itl_mean_ms, itl_p95_ms, class) of the requests finished since
    ``since``."""
    rows = session.execute(
        select(LedgerEntry.user_id, LedgerEntry.finished_at,
               LedgerEntry.prompt_tokens + LedgerEntry.output_tokens, LedgerEntry.preemptions,
               LedgerEntry.ttft_ms, LedgerEntry.itl_mean_ms, LedgerEntry.itl_p95_ms,
               LedgerEntry.klass)
        .where(LedgerEntry.finished_at >= since)
        .order_by(LedgerEntry.finished_at.desc()).limit(limit))
    return [tuple(r) for r in rows]


def token_rows_since(session: Session, since: float, limit: int, only_user: int | None = None
                     ) -> list[tuple[Any, ...]]:
    """(user id, finished at, prompt + output tokens) of rows finished since ``since``,
    newest first, at most ``limit``; one user's only when ``only_user`` is given."""
    query = (select(LedgerEntry.user_id, LedgerEntry.finished_at,
                    LedgerEntry.prompt_tokens + LedgerEntry.output_tokens)
             .where(LedgerEntry.finished_at >= since)
             .order_by(LedgerEntry.finished_at.desc()).limit(limit))
    if only_user is not None:
        query = query.where(LedgerEntry.user_id == only_user)
    return [tuple(r) for r in session.execute(query)]


def usage_last_hour(session: Session, now: float) -> dict[int, Usage]:
    return usage_since(session, now - HOUR_S)


def usage_last_day(session: Session, now: float) -> dict[int, Usage]:
    return usage_since(session, now - DAY_S)
