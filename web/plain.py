"""Refusals reworded for people: words and messages, not tokens.

A person thinks in words, so the chat says "about 1,500 words"; the exact token figures the
scheduler counted go in ``exact``, which the notice shows as its tooltip (title).
"""

from __future__ import annotations

import time

import anyio

from appliance.api.errors import ApiError, as_api_error
from appliance.service.checks import quota_of
from appliance.service.errors import OverQuota, ServiceError
from appliance.service.identity import Principal
from appliance.service.services import Services

WORDS_PER_TOKEN = 0.75
"""English text runs at about three words to four tokens with the common tokenizers."""


class PlainRefusal(ApiError):
    """An ApiError whose message is in plain words, with the exact figures beside it."""

    def __init__(self, exc: ApiError, message: str, exact: str) -> None:
        super().__init__(exc.status, message, exc.type, exc.code, headers=exc.headers,
                         param=exc.param)
        self.exact = exact


def words(tokens: int) -> str:
    """Tokens as a rounded count of words: "about 1,500 words"."""
    w = tokens * WORDS_PER_TOKEN
    step = 1 if w < 20 else 10 if w < 1000 else 100
    n = max(1, int(round(w / step)) * step)
    return f"about {n:,} word{'s' if n != 1 else ''}"


def _at(moment: float, now: float) -> str:
    """A clock time a person can act on: "at 16:25", or "tomorrow at 16:25"."""
    when, today = time.localtime(moment), time.localtime(now)
    clock = time.strftime("%H:%M", when)
    return f"at {clock}" if when.tm_yday == today.tm_yday else f"tomorrow at {clock}"


def too_long(exc: ServiceError, ctx_limit: int) -> Exception:
    """The model's context refusal (400 context_length_exceeded) in words."""
    if exc.code != "context_length_exceeded":
        return exc
    message = (f"This conversation is too long for the model, which reads {words(ctx_limit)}"
               " at most, its answer included. Start a new chat, or send a shorter message.")
    return PlainRefusal(as_api_error(exc), message, exc.message)


async def plain_refusal(svc: Services, who: Principal, exc: OverQuota,
                        prompt_tokens: int) -> ApiError:
    """The API's 429 reworded for a person: what was used, of what, and when it frees."""
    now = time.time()
    quota = await anyio.to_thread.run_sync(quota_of, svc.store, who.user_id)
    wait = exc.retry_after_s
    reset = now + wait if wait is not None and wait >= 0 else None
    exact = exc.message
    if exc.code == "tokens_per_day" and quota.tokens_per_day is not None:
        cap = quota.tokens_per_day
        used = min(int(svc.engine.usage.total(str(who.user_id), now)), cap)
        exact = f"{used:,} of {cap:,} tokens used today; this message needs {prompt_tokens:,}."
        if reset is None:
            message = (f"This conversation is {words(prompt_tokens)} long, more than your "
                       f"whole daily allowance of {words(cap)}. Start a new chat, or ask an "
                       "admin to raise your limit.")
        else:
            share = "All" if used >= cap else f"{round(100 * used / cap)} %"
            message = (f"{share} of today's allowance ({words(cap)}) is used — resets "
                       f"{_at(reset, now)}.")
            if used < cap:
                message += (f" This conversation needs {words(prompt_tokens)}: try a "
                            "shorter message or a new chat.")
    elif exc.code == "max_concurrent":
        message = "Another answer of yours is still being written. Wait for it to finish."
    elif exc.code == "max_prompt_tokens" and quota.max_prompt_tokens is not None:
        exact = (f"This conversation is {prompt_tokens:,} tokens; your limit is "
                 f"{quota.max_prompt_tokens:,} tokens per message.")
        message = (f"This conversation is too long for your limit of "
                   f"{words(quota.max_prompt_tokens)} per message. Start a new chat.")
    else:
        message = exc.message
    return PlainRefusal(as_api_error(exc), message, exact if exact != message else "")
