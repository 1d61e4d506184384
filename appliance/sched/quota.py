"""Per-user quotas as pure checks: may this request start, and must this one stop?

The caller (the HTTP layer at submission, the engine for running requests) passes the
numbers: usage from the ledger, the clock. Over quota means HTTP 429 with the verdict's
message and, when waiting helps, ``Retry-After: retry_after_s``.

The daily budget is a *rolling* 24 h: it counts the tokens (prompt + completion) of the
ledger rows in ``(now - 24 h, now]``. It "resets" when enough old usage ages out of that
window for the request to fit: with the usage rows at hand that moment is exact; without
them the bound is conservative (everything has aged out 24 h from now).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from appliance.vocab import DAY_S, Klass, QuotaLimits

CONCURRENCY_RETRY_S = 1
"""Retry-After for the concurrency limit: a slot frees when any running request ends."""


@dataclass(frozen=True, slots=True)
class QuotaVerdict:
    """Why a request is refused. ``retry_after_s`` None: waiting will not help (the request
    itself is over a per-request limit; send a smaller one)."""

    limit: str
    """tokens_per_day | max_concurrent | max_prompt_tokens | max_output_tokens | max_class"""
    message: str
    retry_after_s: int | None = None


def format_duration(seconds: float) -> str:
    """Whole minutes rounded up above a minute: ``3h12m``, ``45m``, ``30s``."""
    s = max(math.ceil(seconds), 0)
    if s < 60:
        return f"{s}s"
    minutes = math.ceil(s / 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes}m" if hours else f"{minutes}m"


def exhausted(limits: QuotaLimits, usage_today: int) -> bool:
    """True when the daily tokens are used up: a running request then finishes (``quota``)."""
    return limits.tokens_per_day is not None and usage_today >= limits.tokens_per_day


def effective_max_tokens(limits: QuotaLimits, requested: int | None, default: int) -> int:
    """The output cap to use: the client's, or the server default clamped to the limit.

    An explicit ``max_tokens`` over the limit is refused by :func:`check_admission`; the
    server's own default never causes a refusal."""
    if requested is not None:
        return requested
    cap = limits.max_output_tokens
    return default if cap is None else min(default, cap)


def reset_after(limit: int, usage_today: int, need: int, now: float,
                usage_events: Sequence[tuple[float, int]] | None,
                day_window_start: float) -> float:
    """Seconds until ``need`` more tokens fit under ``limit`` in the rolling day.

    ``usage_events``: (time, tokens) ledger rows; rows older than ``day_window_start``
    (normally ``now - 24 h``) have already aged out and are ignored. Usage not covered by
    the rows is assumed to be as recent as possible (it ages out 24 h from now)."""
    excess = usage_today + need - limit
    if excess <= 0:
        return 0.0
    events = sorted((t, n) for t, n in usage_events or () if t > day_window_start and n > 0)
    for t, n in events:
        excess -= n
        if excess <= 0:
            return max(t + DAY_S - now, 0.0)
    return DAY_S


def check_admission(limits: QuotaLimits, usage_today: int, running_count: int,
                    prompt_tokens: int, max_tokens: int, klass: Klass, max_class: Klass,
                    now: float, day_window_start: float,
                    usage_events: Sequence[tuple[float, int]] | None = None,
                    ) -> QuotaVerdict | None:
    """The first limit this request breaks, or None when it may be queued.

    ``running_count``: the user's requests queued or running now. ``day_window_start``: the
    start of the rolling day the caller summed ``usage_today`` over (``now - 24 h``).
    Checked in this order: class, prompt size, output size (per request: retrying does not
    help), then concurrency and the daily tokens (retrying later does). The daily check
    refuses a request whose prompt and first token no longer fit in what is left today.
    """
    for verdict in (_class(klass, max_class), _prompt(limits, prompt_tokens),
                    _output(limits, max_tokens), _concurrency(limits, running_count),
                    _daily(limits, usage_today, prompt_tokens, now, day_window_start,
                           usage_events)):
        if verdict is not None:
            return verdict
    return None


def _class(klass: Klass, max_class: Klass) -> QuotaVerdict | None:
    if klass <= max_class:
        return None
    return QuotaVerdict("max_class", f"class {klass.label} is above your maximum class "
                        f"{max_class.label}; ask for {max_class.label} or lower")


def _prompt(limits: QuotaLimits, prompt_tokens: int) -> QuotaVerdict | None:
    cap = limits.max_prompt_tokens
    if cap is None or prompt_tokens <= cap:
        return None
    return QuotaVerdict("max_prompt_tokens", f"prompt of {prompt_tokens} tokens is over "
                        f"your limit of {cap} prompt tokens per request")


def _output(limits: QuotaLimits, max_tokens: int) -> QuotaVerdict | None:
    cap = limits.max_output_tokens
    if cap is None or max_tokens <= cap:
        return None
    return QuotaVerdict("max_output_tokens", f"max_tokens of {max_tokens} is over your "
                        f"limit of {cap} output tokens per request")


def _concurrency(limits: QuotaLimits, running_count: int) -> QuotaVerdict | None:
    cap = limits.max_concurrent
    if cap is None or running_count < cap:
        return None
    return QuotaVerdict("max_concurrent", f"{running_count} requests in progress; your "
                        f"limit is {cap} at a time; retry when one finishes",
                        CONCURRENCY_RETRY_S)


def _daily(limits: QuotaLimits, usage_today: int, prompt_tokens: int, now: float,
           day_window_start: float,
           usage_events: Sequence[tuple[float, int]] | None) -> QuotaVerdict | None:
    cap = limits.tokens_per_day
    need = prompt_tokens + 1
    if cap is None or usage_today + need <= cap:
        return None
    if need > cap:
        return QuotaVerdict("tokens_per_day", f"prompt of {prompt_tokens} tokens is over "
                            f"your daily token quota of {cap} tokens")
    wait = reset_after(cap, usage_today, need, now, usage_events, day_window_start)
    what = (f"daily token quota of {cap} tokens used" if usage_today >= cap else
            f"prompt of {prompt_tokens} tokens does not fit in the {cap - usage_today} "
            f"tokens left of your daily quota of {cap}")
    return QuotaVerdict("tokens_per_day", f"{what}; resets in {format_duration(wait)}",
                        max(math.ceil(wait), 1))
