"""Quota check for a chat message before it is submitted (the rules: ``sched/quota.py``).

Over quota is HTTP 429 with the rule's message and, when waiting helps, ``Retry-After``.
The store's limits, the user's rolling-day ledger rows and their requests in the engine's
snapshot are the inputs; ``check_admission`` decides. One short query per message sent.
"""

from __future__ import annotations

import dataclasses
import time

import anyio
from sqlalchemy import select

from appliance.api.auth import Principal
from appliance.api.errors import ApiError
from appliance.api.service import Services
from appliance.sched import quota
from appliance.sched.classes import Klass
from appliance.store import limits
from appliance.store.models import LedgerEntry


def _inputs(services: Services, user_id: int, now: float
            ) -> tuple[quota.QuotaLimits, list[tuple[float, int]]]:
    with services.store.read_sessions() as s:
        mine = quota.QuotaLimits(**dataclasses.asdict(limits.get_quota(s, user_id)))
        if mine.tokens_per_day is None:
            return mine, []
        rows = s.execute(
            select(LedgerEntry.finished_at,
                   LedgerEntry.prompt_tokens + LedgerEntry.output_tokens)
            .where(LedgerEntry.user_id == user_id,
                   LedgerEntry.finished_at > now - quota.DAY_S))
        return mine, [(float(t), int(n or 0)) for t, n in rows]


async def admit(services: Services, who: Principal, prompt_tokens: int, klass: Klass) -> int:
    """The answer's max_tokens (the server default within the user's limit); 429 when this
    request would break one of the user's limits."""
    now = time.time()
    mine, events = await anyio.to_thread.run_sync(_inputs, services, who.user_id, now)
    max_tokens = quota.effective_max_tokens(mine, None, services.default_max_tokens)
    snap = services.engine.snapshot
    running = sum(s.user == who.name for s in (*snap.slots, *snap.queue))
    verdict = quota.check_admission(
        mine, sum(n for _, n in events), running, prompt_tokens, max_tokens, klass,
        who.klass, now, now - quota.DAY_S, events)
    if verdict is None:
        return max_tokens
    headers = {} if verdict.retry_after_s is None else {
        "Retry-After": str(verdict.retry_after_s)}
    raise ApiError(429, f"Over your quota: {verdict.message}.", "rate_limit_error",
                   "quota_exceeded", headers=headers)
