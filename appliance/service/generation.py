"""Submission and the generation handle: the one path from any caller to the engine.

``submit`` checks a request against the context, the store's health, its grammar and the
user's quotas, then queues it; the :class:`Generation` it returns yields the engine's events
on the event loop. HTTP handlers, web pages and jobs all come through here, so every request
is charged, limited and recorded the same way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import anyio

from appliance.engine.core import (
    EngineBusy,
    EngineDown,
    EngineStopping,
    ModelChanging,
    UserBusy,
)
from appliance.engine.request import Event, FinishEvent, GenerationRequest, asyncio_sink
from appliance.sched.quota import CONCURRENCY_RETRY_S, check_admission, effective_max_tokens
from appliance.service.checks import (
    SamplingAsk,
    check_context,
    max_tokens_from,
    over_quota,
    quota_of,
    sampling_from,
    stops_from,
)
from appliance.service.engine_client import EngineClient
from appliance.service.errors import (
    AtConcurrencyLimit,
    Busy,
    EngineUnavailable,
    InvalidRequest,
    ShuttingDown,
    StorageUnavailable,
)
from appliance.service.identity import Principal
from appliance.service.latency import Probe
from appliance.service.services import Services
from appliance.service.structured import Constraint, grammar_for
from appliance.vocab import DAY_S, Klass, QuotaLimits

T = TypeVar("T")
log = logging.getLogger(__name__)


class Generation:
    """One submitted request, seen from the event loop."""

    def __init__(self, engine: EngineClient, request: GenerationRequest,
                 max_concurrent: int | None = None, probe: Probe | None = None) -> None:
        self._engine = engine
        self.probe = probe
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self.finish: FinishEvent | None = None
        try:
            self.handle = engine.submit(
                request, asyncio_sink(asyncio.get_running_loop(), self._queue), max_concurrent)
        except EngineBusy:
            raise Busy() from None
        except EngineDown as exc:
            raise EngineUnavailable(str(exc)) from None
        except EngineStopping as exc:
            raise ShuttingDown(exc.to if isinstance(exc, ModelChanging) else None) from None
        except UserBusy as exc:
            raise AtConcurrencyLimit(str(exc), retry_after_s=CONCURRENCY_RETRY_S) from None

    def ahead(self) -> int | None:
        """Requests the engine will start before this one (None: not known yet, or no
        longer waiting), from its last queue snapshot."""
        return self._engine.snapshot.ahead_of(self.handle.rid)

    async def events(self) -> AsyncIterator[Event]:
        """Events until the finish; leaving early (client gone) cancels the request."""
        try:
            while self.finish is None:
                event = await self._queue.get()
                if isinstance(event, FinishEvent):
                    self.finish = event
                    if self.probe is not None:
                        self.probe.finish(event)
                elif self.probe is not None:
                    self.probe.token()
                yield event
        finally:
            self.close()

    def close(self) -> None:
        """Cancel the request unless it already finished (idempotent)."""
        if self.finish is None:
            self._engine.cancel(self.handle)

    async def text(self) -> tuple[str, FinishEvent]:
        parts = [e.text async for e in self.events()]
        assert self.finish is not None
        return "".join(parts), self.finish


async def off_loop(services: Services, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` (templating, tokenising) on a worker thread, at most
    ``PROMPT_THREADS`` at once, so a long prompt never stalls the event loop."""
    return await anyio.to_thread.run_sync(fn, *args, limiter=services.prompt_limiter)


async def check_grammar(services: Services, grammar: str, user_id: int, param: str) -> None:
    """Refuse, naming ``param``, a grammar the engine could not run (a recursive schema
    makes llguidance give up at the first token); off the event loop, as building a matcher
    for a large schema takes a while. The log names the user and the error class only: a
    grammar is the client's schema."""
    error = await anyio.to_thread.run_sync(services.engine.check_grammar, grammar)
    if error is None:
        return
    log.info("grammar refused at admission user_id=%d param=%s: %s", user_id, param, error)
    what = {"tools": "A tool's parameters schema", "format": "The format schema"}.get(
        param, "The response_format schema")
    raise InvalidRequest(f"{what} cannot be enforced: constrained decoding gives up on it "
                         f"({error}). Recursive schemas that must nest forever, or that "
                         "refer to the whole document, are not supported.", param=param)


def check_storage(services: Services) -> None:
    """Refuse what nobody could be charged for: past the store writer's backlog bound, no
    model request starts."""
    if services.writer is not None and (why := services.writer.refusal()) is not None:
        raise StorageUnavailable(why)


def check_quota(quota: QuotaLimits, services: Services, principal: Principal,
                prompt_tokens: int, output_tokens: int, klass: Klass) -> None:
    """Refuse a request the owner's daily tokens, rates or classes do not allow."""
    now = time.time()
    key = str(principal.user_id)
    usage = services.engine.usage
    verdict = check_admission(quota, usage.total(key, now), 0, prompt_tokens, output_tokens,
                              klass, principal.klass, now, now - DAY_S, usage.events(key, now))
    if verdict is not None:
        raise over_quota(verdict)


async def submit(services: Services, prompt: list[int], body: SamplingAsk,
                 max_tokens: int | None, principal: Principal, klass: Klass,
                 endpoint: str, *, constraint: Constraint | None = None,
                 grammar: str | None = None, param: str | None = None,
                 keep_cache: bool = True, continues: bool = False) -> Generation:
    """Check the request against the context and the user's quotas, then queue it.

    ``constraint`` (a JSON schema, or ``{"type": "json_object"}``) makes the engine decode
    only answers that follow it; ``grammar`` is an llguidance grammar given directly (forced
    tool calls). A constraint or grammar that cannot be compiled, or that the engine could
    not run, is an :class:`InvalidRequest` naming ``param``, the field it came from
    (default ``response_format`` for a constraint, ``tools`` for a grammar). ``continues``:
    the prompt ends inside an answer that the new text carries on (its first space kept).
    """
    check_context(len(prompt), services.model.ctx_limit)
    check_storage(services)
    if constraint is not None:
        grammar = grammar_for(constraint, param or "response_format")
    if grammar is not None:
        await check_grammar(services, grammar, principal.user_id,
                            param or ("response_format" if constraint is not None else "tools"))
    sampling = sampling_from(body, services.model.vocab_size)
    quota = await anyio.to_thread.run_sync(quota_of, services.store, principal.user_id)
    if max_tokens is not None:
        max_tokens_from(max_tokens, 1)
    out = effective_max_tokens(quota, max_tokens, services.default_max_tokens)
    check_quota(quota, services, principal, len(prompt), out, klass)
    request = GenerationRequest(
        prompt=tuple(prompt), max_tokens=out, sampling=sampling, stop=stops_from(body.stop),
        user=principal.name, klass=klass, user_id=principal.user_id,
        api_key_id=principal.key_id, endpoint=endpoint, tokens_per_day=quota.tokens_per_day,
        grammar=grammar, keep_cache=keep_cache, continues=continues)
    return Generation(services.engine, request, quota.max_concurrent,
                      services.latency.probe(klass.label, endpoint))
