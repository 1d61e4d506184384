"""Words every layer shares (the store, the scheduler, the API): pure constants, no imports
from the rest of the appliance, so any layer may use them."""

from __future__ import annotations

import enum

WEIGHT_MIN = 0.01
WEIGHT_MAX = 100.0
"""A user's weight lies in [WEIGHT_MIN, WEIGHT_MAX]: the store refuses others, and the
counters clamp whatever reaches them, so a charge is at most ``100 * (w_in + w_out)`` per
token and a counter stays finite."""

DAY_S = 24 * 3600.0
"""Seconds in a day: the rolling window of the daily quota, the ledger's "today"."""
HOUR_S = 3600.0


class FinishReason(enum.StrEnum):
    """Why a request ended. The value is the wire string: OpenAI's ``finish_reason``, Ollama's
    ``done_reason``, the voice hook's ``finish_reason`` and the ledger's column all show it
    as it is (one vocabulary, no per-API mapping)."""

    STOP = "stop"
    """The model ended its answer (end of sequence or a stop string)."""
    LENGTH = "length"
    """``max_tokens`` or the context ran out."""
    QUOTA = "quota"
    """The user's daily tokens ran out mid-answer."""
    CANCELLED = "cancelled"
    """The caller went away or cancelled."""
    ERROR = "error"
    """The backend failed the request."""
    DEADLINE = "deadline"
    """Not from the engine: the voice hook's deadline passed before the answer ended."""
    TOOL_CALLS = "tool_calls"
    """Not from the engine: OpenAI's name for a ``stop`` whose answer called tools."""
    LOAD = "load"
    """Not from the engine: Ollama's reason for an empty request (the model is loaded)."""

    @property
    def answered(self) -> bool:
        """The request ended with an answer (whole or cut short), not a failure."""
        return self not in FAILED

    @property
    def complete(self) -> bool:
        """The model's text ran to a natural end or its length limit (the detokenizer's
        tail and held-back stop-string text belong to the answer)."""
        return self is FinishReason.STOP or self is FinishReason.LENGTH


FAILED = frozenset({FinishReason.ERROR, FinishReason.CANCELLED})
"""Reasons that end a request without an answer: APIs report an error instead."""
