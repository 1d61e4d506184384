"""Words every layer shares (the store, the scheduler, the API): pure constants, no imports
from the rest of the appliance, so any layer may use them."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

WEIGHT_MIN = 0.01
WEIGHT_MAX = 100.0
"""A user's weight lies in [WEIGHT_MIN, WEIGHT_MAX]: the store refuses others, and the
counters clamp whatever reaches them, so a charge is at most ``100 * (w_in + w_out)`` per
token and a counter stays finite."""

DAY_S = 24 * 3600.0
"""Seconds in a day: the rolling window of the daily quota, the ledger's "today"."""
HOUR_S = 3600.0


class Refused(ValueError):
    """A value refused in words for the person who gave it (a 400 on every transport); any
    other ``ValueError`` reaching a handler is a bug (a 500)."""


class Klass(enum.IntEnum):
    """Request classes (priority: voice > interactive > background); higher value goes
    first. ``label`` is the name the store, the API and the pages use."""

    BACKGROUND = 0
    INTERACTIVE = 1
    VOICE = 2

    @classmethod
    def parse(cls, name: str) -> Klass:
        try:
            return cls[name.upper()]
        except KeyError:
            raise Refused(
                f"unknown class {name!r}; use voice, interactive or background") from None

    @property
    def label(self) -> str:
        return self.name.lower()


CLASS_LABELS: tuple[str, ...] = tuple(k.label for k in sorted(Klass, reverse=True))
"""Every class's name, highest first: voice, interactive, background."""


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
    UNLOAD = "unload"
    """Not from the engine: Ollama's reason for an empty request with ``keep_alive: 0`` (here
    the model stays loaded; the caller's prompt-cache entries are released)."""

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


@dataclass(frozen=True, slots=True)
class QuotaLimits:
    """A user's limits; None means unlimited. One type for the store (the ``quotas`` row)
    and the scheduler's checks (``appliance.sched.quota``)."""

    tokens_per_day: int | None = None
    max_concurrent: int | None = None
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            top = QUOTA_MAX[field.name]
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top
            ):
                raise Refused(f"{field.name} must be >= 1 or null (unlimited), an "
                                 f"integer at most {top}")


QUOTA_MAX = {"tokens_per_day": 10**9, "max_concurrent": 1024,
             "max_prompt_tokens": 1_048_576, "max_output_tokens": 1_048_576}
"""Upper bounds: beyond these a value is a typo, not a limit (a billion tokens a day is
more than a household machine can produce; the contexts are the engine's own bounds)."""


UNLIMITED = QuotaLimits()
