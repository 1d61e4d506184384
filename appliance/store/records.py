"""The record of a finished request: one message from the engine to the ledger.

The engine builds it when a request finishes (``engine.runner``), the store writer inserts it
as one ``ledger`` row (``store.ledger.insert_records``), field for field. Plain data, no
SQLAlchemy, so the engine imports it without the store's machinery.
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance.vocab import FinishReason


@dataclass(frozen=True, slots=True)
class LedgerRecord:
    """A finished request. Times are unix seconds (``time.time()``); ids and counts only,
    never prompt or completion text."""

    request_id: str
    user_id: int
    api_key_id: int | None
    klass: str
    endpoint: str
    model: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    queued_at: float
    admitted_at: float | None
    first_token_at: float | None
    finished_at: float
    finish_reason: FinishReason
    preemptions: int = 0
    ttft_ms: float | None = None
    itl_mean_ms: float | None = None
    itl_p95_ms: float | None = None
