"""The bridge between HTTP handlers and the engine thread (shared by every API flavour)."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import msgspec

from appliance.api.chat_format import render_prompt
from appliance.api.errors import (
    ApiError,
    bad_request,
    busy,
    engine_down,
    shutting_down,
    storage_unavailable,
)
from appliance.api.latency import LatencyMetrics, Probe
from appliance.api.schemas import ChatMessage, SamplingFields
from appliance.api.structured import Constraint, grammar_for
from appliance.api.throttle import LoginThrottle
from appliance.api.voice_memory import VoiceMemory
from appliance.engine.core import Engine, EngineBusy, EngineDown, EngineStopping, UserBusy
from appliance.engine.request import (
    SEED_LIMIT,
    Event,
    FinishEvent,
    GenerationRequest,
    SamplingParams,
    asyncio_sink,
)
from appliance.sched.quota import (
    CONCURRENCY_RETRY_S,
    QuotaLimits,
    QuotaVerdict,
    check_admission,
    effective_max_tokens,
)
from appliance.store import limits
from appliance.store.db import Store
from appliance.store.writer import StoreWriter
from appliance.vocab import DAY_S, Klass

if TYPE_CHECKING:
    from litestar.types import Receive

    from appliance.api.auth import Principal

T = TypeVar("T")
log = logging.getLogger(__name__)

PROMPT_THREADS = 4
"""Prompts templated and tokenised at once, each on a worker thread: a few megabyte prompts
must neither block the event loop nor take every thread that authentication and the
database use."""


@dataclass(slots=True)
class ModelInfo:
    name: str
    path: str
    is_demo: bool
    ctx_limit: int
    vocab_size: int
    tokenizer: Any
    created: int = field(default_factory=lambda: int(time.time()))
    max_token_chars: int = 0
    """The most characters one token stands for (``longest_token_chars``); 0: unknown, no
    cheap size check."""


@dataclass(slots=True)
class Services:
    """Everything a handler may use; built once in ``create_app``."""

    engine: Engine
    model: ModelInfo
    store: Store
    default_max_tokens: int
    max_batch_size: int
    throttle: LoginThrottle = field(default_factory=LoginThrottle)
    started_at: float = field(default_factory=time.time)
    on_policy_change: Callable[[], None] | None = None
    latency: LatencyMetrics = field(default_factory=LatencyMetrics)
    """TTFT, inter-token, queue and end-to-end histograms (``/metrics``)."""
    models_dir: Path | None = None
    """Where admins' ``/api/pull`` downloads go (``appliance model pull`` uses it too)."""
    voice_memory: VoiceMemory = field(default_factory=VoiceMemory)
    """Conversations of ``/hooks/voice`` (in memory, with a TTL)."""
    note_key_used: Callable[[int, float], None] | None = None
    """Where an API key's last-used time goes (the store writer); None: not recorded."""
    jobs: Any = None
    """The background job scheduler (``appliance.jobs.runner.JobService``), when wired."""
    writer: StoreWriter | None = None
    """The store writer: its backlog decides whether model requests may start."""
    shared_idle_s: float = 600.0
    """A 'Shared device' browser session ends after this long without a request."""
    prompt_limiter: anyio.CapacityLimiter = field(
        default_factory=lambda: anyio.CapacityLimiter(PROMPT_THREADS))

    def policy_changed(self) -> None:
        """Call after an admin changes weights, classes or quotas: the running scheduler
        re-reads the weights (quotas and classes are read at every request anyway)."""
        if self.on_policy_change is not None:
            self.on_policy_change()


def decode_body(raw: bytes, kind: type[Any]) -> Any:
    if not raw.strip():
        raise bad_request("The request body is empty; send a JSON object.", "invalid_json")
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        raise bad_request(f"Invalid request: {exc}", "invalid_type",
                          _error_field(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"Malformed JSON: {exc}", "invalid_json") from None
    except RecursionError:
        raise bad_request("The JSON is nested too deeply.", "invalid_json") from None


def _error_field(message: str) -> str | None:
    """The field a msgspec validation error names (``... - at `$.messages[0].role```), as
    OpenAI's ``param`` (``messages[0].role``); a missing field is named in the text."""
    found = re.search(r"at `\$\.?([^`]*)`", message)
    missing = re.search(r"missing required field `([^`]+)`", message)
    path = found.group(1) if found else ""
    if missing:
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
    return path or None


def check_model(services: Services, name: str | None) -> None:
    if name and name not in (services.model.name, services.model.path, "default"):
        raise ApiError(404, f"The model '{name}' does not exist. This server serves "
                       f"'{services.model.name}' (see GET /v1/models).", "invalid_request_error",
                       "model_not_found", param="model")


def _check_range(name: str, value: float | None, lo: float, hi: float) -> None:
    if value is not None and not lo <= value <= hi:
        raise bad_request(f"'{name}' must be between {lo} and {hi}, got {value}.", param=name)


def sampling_from(body: SamplingFields, vocab_size: int) -> SamplingParams:
    _check_range("temperature", body.temperature, 0.0, 2.0)
    _check_range("top_p", body.top_p, 0.0, 1.0)
    _check_range("min_p", body.min_p, 0.0, 1.0)
    _check_range("top_k", body.top_k, 0, 1 << 31)
    _check_range("presence_penalty", body.presence_penalty, -2.0, 2.0)
    _check_range("frequency_penalty", body.frequency_penalty, -2.0, 2.0)
    _check_range("repetition_penalty", body.repetition_penalty, 0.0, 10.0)
    if body.seed is not None and not 0 <= body.seed < SEED_LIMIT:
        raise bad_request(f"'seed' must be an integer from 0 to 2**64 - 1, got {body.seed}.",
                          param="seed")
    if body.n != 1:
        raise bad_request("Only n=1 is supported.", "unsupported_value", "n")
    if body.best_of not in (None, 1):
        raise bad_request("Only best_of=1 is supported.", "unsupported_value", "best_of")
    if body.logprobs:
        raise bad_request("logprobs are not supported by this server.", "unsupported_value",
                          "logprobs")
    bias: list[tuple[int, float]] = []
    for key, value in (body.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}.",
                              param="logit_bias") from None
        if not 0 <= token < vocab_size:
            raise bad_request(f"logit_bias token {token} is outside the vocabulary "
                              f"(0..{vocab_size - 1}).", param="logit_bias")
        _check_range("logit_bias value", value, -100.0, 100.0)
        bias.append((token, value))
    return SamplingParams(
        temperature=0.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
        min_p=body.min_p or 0.0, repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        logit_bias=tuple(bias), seed=body.seed)


def stops_from(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > 4:
        raise bad_request("At most 4 stop sequences are allowed.", param="stop")
    return tuple(s for s in stops if s)


def max_tokens_from(value: int | None, default: int) -> int:
    if value is None:
        return default
    if value < 1:
        raise bad_request(f"'max_tokens' must be at least 1, got {value}.", param="max_tokens")
    return value


def message_text(message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        if part.type != "text":
            raise bad_request(f"Content parts of type '{part.type}' are not supported; this "
                              "model reads text only.", "unsupported_value", "messages")
        parts.append(part.text or "")
    return "".join(parts)


def chat_turns(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages as chat-template turns (``developer`` is a system message)."""
    if not messages:
        raise bad_request("'messages' must hold at least one message.", param="messages")
    turns: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m.role not in ("system", "user", "assistant", "tool", "developer"):
            raise bad_request(f"Unknown message role '{m.role}'.", param=f"messages[{i}].role")
        if m.role == "tool" and not m.tool_call_id:
            raise bad_request("A 'tool' message needs 'tool_call_id': the id of the tool "
                              "call it answers.", param=f"messages[{i}].tool_call_id")
        turn: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                "content": message_text(m)}
        if m.tool_calls:
            turn["tool_calls"] = m.tool_calls
        if m.tool_call_id:
            turn["tool_call_id"] = m.tool_call_id
        if m.name:
            turn["name"] = m.name
        turns.append(turn)
    return turns


def chat_prompt(tokenizer: Any, messages: list[ChatMessage],
                tools: list[dict[str, Any]] | None = None) -> list[int]:
    return render_prompt(tokenizer, chat_turns(messages), tools, None)


def user_chars(contents: Iterable[str | list[Any] | None]) -> int:
    """Characters of the users' messages (what no chat template drops; templates may drop
    earlier reasoning or merge system turns, so only user text is a sure lower bound)."""
    total = 0
    for content in contents:
        if isinstance(content, str):
            total += len(content.strip())
        elif content:
            total += len("".join(getattr(p, "text", None) or "" for p in content).strip())
    return total


def check_prompt_size(model: ModelInfo, chars: int, param: str = "messages") -> None:
    """Refuse, before templating or tokenising anything, a prompt whose ``chars`` characters
    cannot fit the context whatever the tokenizer makes of them (at least
    ``chars // max_token_chars`` tokens): a 5 MB prompt costs no tokenizer time."""
    if model.max_token_chars <= 0:
        return
    at_least = chars // model.max_token_chars
    if at_least >= model.ctx_limit:
        raise bad_request(
            f"This model's maximum context length is {model.ctx_limit} tokens. However, "
            f"your prompt has {chars} characters, at least {at_least} tokens, which leaves "
            "no room for an answer. Shorten the prompt or the conversation.",
            "context_length_exceeded", param)


async def off_loop(services: Services, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` (templating, tokenising) on a worker thread, at most
    ``PROMPT_THREADS`` at once, so a long prompt never stalls the event loop."""
    return await anyio.to_thread.run_sync(fn, *args, limiter=services.prompt_limiter)


def check_context(n_prompt: int, ctx_limit: int) -> None:
    if n_prompt == 0:
        raise bad_request("The prompt is empty.", param="prompt")
    if n_prompt >= ctx_limit:
        raise bad_request(
            f"This model's maximum context length is {ctx_limit} tokens. However, your "
            f"prompt has {n_prompt} tokens, which leaves no room for an answer. Shorten the "
            "prompt or the conversation.", "context_length_exceeded", "messages")


class Generation:
    """One submitted request, seen from the event loop."""

    def __init__(self, engine: Engine, request: GenerationRequest,
                 max_concurrent: int | None = None, probe: Probe | None = None) -> None:
        self._engine = engine
        self.probe = probe
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self.finish: FinishEvent | None = None
        try:
            self.handle = engine.submit(
                request, asyncio_sink(asyncio.get_running_loop(), self._queue), max_concurrent)
        except EngineBusy:
            raise busy() from None
        except EngineDown as exc:
            raise engine_down(str(exc)) from None
        except EngineStopping:
            raise shutting_down() from None
        except UserBusy as exc:
            raise ApiError(429, str(exc), "rate_limit_error", "max_concurrent",
                           headers={"Retry-After": str(CONCURRENCY_RETRY_S)}) from None

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

    async def text_while_connected(self, receive: Receive) -> tuple[str, FinishEvent]:
        """:meth:`text`, unless the client leaves first (see :meth:`while_connected`)."""
        return await self.while_connected(receive, self.text())

    async def while_connected(self, receive: Receive, reading: Awaitable[T]) -> T:
        """``reading`` (which reads this request's answer), unless the client leaves first:
        then the request is cancelled (its slot and KV are freed on the next tick, as for a
        stream) and :class:`ClientGone` is raised. ``receive`` is the ASGI receive of a
        request whose body was read, so the next message it gives is ``http.disconnect``."""
        answer = asyncio.ensure_future(reading)
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (answer, gone):
                if not task.done():
                    task.cancel()
            await asyncio.gather(answer, gone, return_exceptions=True)
        if answer.done() and not answer.cancelled():
            return answer.result()
        self.close()
        raise ClientGone()


class ClientGone(ApiError):
    """The client closed the connection before its answer was ready (nobody reads this)."""

    def __init__(self) -> None:
        super().__init__(499, "The client closed the request.", "invalid_request_error",
                         "client_closed_request")


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def check_grammar(services: Services, grammar: str, user_id: int, param: str) -> None:
    """A 400 naming ``param`` when the engine could not run ``grammar`` (a recursive schema
    makes llguidance give up at the first token); off the event loop, as building a matcher
    for a large schema takes a while. The log names the user and the error class only: a
    grammar is the client's schema."""
    error = await anyio.to_thread.run_sync(services.engine.check_grammar, grammar)
    if error is None:
        return
    log.info("grammar refused at admission user_id=%d param=%s: %s", user_id, param, error)
    what = {"tools": "A tool's parameters schema", "format": "The format schema"}.get(
        param, "The response_format schema")
    raise bad_request(f"{what} cannot be enforced: constrained decoding gives up on it "
                      f"({error}). Recursive schemas that must nest forever, or that "
                      "refer to the whole document, are not supported.", param=param)


def quota_of(store: Store, user_id: int) -> QuotaLimits:
    with store.read_sessions() as s:
        return limits.get_quota(s, user_id)


def quota_error(verdict: QuotaVerdict) -> ApiError:
    headers = {} if verdict.retry_after_s is None else {"Retry-After": str(verdict.retry_after_s)}
    return ApiError(429, f"Over quota: {verdict.message}.", "rate_limit_error", verdict.limit,
                    headers=headers)


async def submit(services: Services, prompt: list[int], body: SamplingFields,
                 max_tokens: int | None, principal: Principal, klass: Klass,
                 endpoint: str, *, constraint: Constraint | None = None,
                 grammar: str | None = None, param: str | None = None,
                 keep_cache: bool = True) -> Generation:
    """Check the request against the context and the user's quotas, then queue it.

    ``constraint`` (a JSON schema, or ``{"type": "json_object"}``) makes the engine decode
    only answers that follow it; ``grammar`` is an llguidance grammar given directly (forced
    tool calls). A constraint or grammar that cannot be compiled, or that the engine could
    not run, is a 400 naming ``param``, the field it came from (default
    ``response_format`` for a constraint, ``tools`` for a grammar).
    """
    check_context(len(prompt), services.model.ctx_limit)
    if services.writer is not None and (why := services.writer.refusal()) is not None:
        # an answer nobody can be charged for: past the backlog's bound, none is started
        raise storage_unavailable(why)
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
    now = time.time()
    key = str(principal.user_id)
    usage = services.engine.usage
    verdict = check_admission(quota, usage.total(key, now), 0, len(prompt), out, klass,
                              principal.klass, now, now - DAY_S, usage.events(key, now))
    if verdict is not None:
        raise quota_error(verdict)
    request = GenerationRequest(
        prompt=tuple(prompt), max_tokens=out, sampling=sampling, stop=stops_from(body.stop),
        user=principal.name, klass=klass, user_id=principal.user_id,
        api_key_id=principal.key_id, endpoint=endpoint, tokens_per_day=quota.tokens_per_day,
        grammar=grammar, keep_cache=keep_cache)
    return Generation(services.engine, request, quota.max_concurrent,
                      services.latency.probe(klass.label, endpoint))
