"""``POST /hooks/voice``: a short spoken answer for Home Assistant's ``rest_command``,
Node-RED or openHAB, in the ``voice`` class (or the key's maximum, when lower).

Body: ``{"text", "conversation_id"?, "language"?, "system"?, "max_tokens"? (150),
"deadline_ms"? (8000), "stream"? (false)}``. Answer: ``{"text", "conversation_id",
"finish_reason": stop|length|deadline|quota, "usage", "timings": {"queue_ms", "ttft_ms",
"total_ms"}}``. The deadline covers the whole request (queue included): when it passes, the
request is cancelled in the engine (its slot frees on the next tick) and the words said so
far are the answer. Only what may be spoken is sent: a tool call's markup never is, and a
model that asks for a tool gets a plain sentence said instead (the hook runs no tools; see
:mod:`appliance.api.voice_text`). ``stream: true`` sends Server-Sent Events: one ``sentence`` event per
finished sentence (to start speaking early), then ``done`` with the answer object.
Conversations are remembered server-side (:mod:`appliance.service.voice_memory`).
Errors use the OpenAI shape of ``/v1``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from litestar import Request, post
from litestar.datastructures import State
from litestar.response import Stream

from appliance.api.common import decode_body
from appliance.api.errors import ApiError, bad_request
from appliance.api.ollama_stream import finish_error
from appliance.api.schemas import SamplingFields
from appliance.api.streams import EventStream
from appliance.api.voice_text import CANNOT_ACT, SpokenText
from appliance.service.chat_format import TEMPLATE_OVERRUN, render_prompt
from appliance.service.checks import check_prompt_size
from appliance.service.engine_client import FinishEvent, RequestHandle, TokenEvent
from appliance.service.errors import InvalidRequest
from appliance.service.generation import Generation, off_loop, submit
from appliance.service.services import Services
from appliance.service.voice_memory import SentenceSplitter
from appliance.vocab import FinishReason

log = logging.getLogger(__name__)

ENDPOINT = "/hooks/voice"
DEFAULT_MAX_TOKENS = 150
DEFAULT_DEADLINE_MS = 8000
"""Under Home Assistant's ``rest_command`` timeout of 10 s."""
MAX_DEADLINE_MS = 120_000
MAX_TEXT_CHARS = 4000
MAX_SYSTEM_CHARS = 8000
"""A household's instructions for its assistant: a page or two of text."""
MAX_LANGUAGE_CHARS = 64
"""A language's code or name ("de", "pt-BR", "Deutsch")."""
SYSTEM = ("You are the voice assistant of a home. Answer in one or two short spoken "
          "sentences, without lists or markup.")


class VoiceBody(msgspec.Struct, kw_only=True):
    text: str
    conversation_id: str | None = None
    language: str | None = None
    system: str | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    deadline_ms: int = DEFAULT_DEADLINE_MS
    stream: bool = False


def _check(body: VoiceBody) -> None:
    if not body.text.strip():
        raise bad_request("'text' must not be empty.", param="text")
    if len(body.text) > MAX_TEXT_CHARS:
        raise bad_request(f"'text' is limited to {MAX_TEXT_CHARS} characters.", param="text")
    if not 1 <= body.max_tokens <= 4096:
        raise bad_request(f"'max_tokens' must be 1..4096, got {body.max_tokens}.",
                          param="max_tokens")
    if not 100 <= body.deadline_ms <= MAX_DEADLINE_MS:
        raise bad_request(f"'deadline_ms' must be 100..{MAX_DEADLINE_MS}, got "
                          f"{body.deadline_ms}.", param="deadline_ms")
    if body.system is not None and len(body.system) > MAX_SYSTEM_CHARS:
        raise bad_request(f"'system' is limited to {MAX_SYSTEM_CHARS} characters.",
                          param="system")
    if body.language is not None and len(body.language) > MAX_LANGUAGE_CHARS:
        raise bad_request(f"'language' is limited to {MAX_LANGUAGE_CHARS} characters (a "
                          "code such as 'de' or 'pt-BR').", param="language")
    if body.conversation_id is not None and len(body.conversation_id) > 128:
        raise bad_request("'conversation_id' is limited to 128 characters (leave it empty "
                          "to start a conversation).", param="conversation_id")


def _system(body: VoiceBody) -> str:
    system = body.system or SYSTEM
    if body.language:
        system += f" Answer in the language '{body.language}'."
    return system


def _prompt(services: Services, body: VoiceBody, history: list[dict[str, str]]
            ) -> list[int]:
    """System, remembered turns and the question; the oldest turns are dropped while the
    prompt would leave no room for the answer. Blocking (templating, tokenising): run it
    off the event loop."""
    system = _system(body)
    while True:
        turns = [*history, {"role": "user", "content": body.text}]
        prompt = _render(services.model.tokenizer, system, turns)
        if len(prompt) + body.max_tokens < services.model.ctx_limit or not history:
            return prompt
        history = history[2:]


def _render(tokenizer: Any, system: str, turns: list[dict[str, str]]) -> list[int]:
    """The prompt through the model's template, bounded like every other. A template that
    refuses a system turn (Gemma 2, Mistral v0.1 say "roles must alternate") gets the
    instructions at the head of the first user turn instead, as those models' own cards
    advise; one that refuses that too is a 400 in words, never a 500."""
    try:
        return render_prompt(tokenizer, [{"role": "system", "content": system}, *turns],
                             None, None)
    except InvalidRequest as exc:
        if exc.code == TEMPLATE_OVERRUN:
            raise
        refused = exc
    first = dict(turns[0])
    first["content"] = f"{system}\n\n{first['content']}"
    try:
        return render_prompt(tokenizer, [first, *turns[1:]], None, None)
    except InvalidRequest as exc:
        if exc.code == TEMPLATE_OVERRUN:
            raise
        log.info("voice: the template refused a system turn (%s), then the folded turns",
                 refused.code)
        raise InvalidRequest(exc.message, exc.code) from None


@dataclass(slots=True)
class Answer:
    """What the hook has heard of one request so far (only what may be spoken is kept)."""

    start: float
    n_prompt: int
    spoken: SpokenText
    handle: RequestHandle
    parts: list[str] = field(default_factory=list)
    tokens: int = 0
    first_at: float | None = None
    finish: FinishEvent | None = None
    reason: FinishReason = FinishReason.DEADLINE

    def add(self, text: str) -> str:
        if self.first_at is None:
            self.first_at = time.monotonic()
        self.tokens += 1
        return self.say(self.spoken.feed(text))

    def say(self, text: str) -> str:
        self.parts.append(text)
        return text

    def close(self) -> str:
        """The rest of the spoken text, and a plain sentence where the model asked for a
        tool (the hook runs none; the call's markup is never spoken)."""
        rest = self.spoken.finish()
        if self.spoken.asked_tool:
            rest += ("" if not (self.text + rest) else " ") + CANNOT_ACT
        return self.say(rest)

    @property
    def text(self) -> str:
        return "".join(self.parts).strip()

    def body(self, conversation_id: str) -> dict[str, Any]:
        f = self.finish
        prompt = f.usage.prompt_tokens if f else self.n_prompt
        out = f.usage.completion_tokens if f else self.tokens
        ms = lambda s: None if s is None else round(s * 1000.0, 1)  # noqa: E731
        # the engine notes admission on the handle: an answer cut by the deadline before
        # its finish event still has it (null only when it never left the queue)
        queue_s = f.queue_s if f and f.queue_s is not None else self.handle.queue_s
        return {"text": self.text, "conversation_id": conversation_id,
                "finish_reason": self.reason,
                "usage": {"prompt_tokens": prompt, "completion_tokens": out,
                          "total_tokens": prompt + out},
                "timings": {"queue_ms": ms(queue_s),
                            "ttft_ms": ms(None if self.first_at is None
                                          else self.first_at - self.start),
                            "total_ms": ms(time.monotonic() - self.start)}}


async def _events(gen: Generation, answer: Answer, deadline: float
                  ) -> AsyncIterator[str]:
    """Spoken text deltas until the finish or the deadline (then the request is
    cancelled), and what :meth:`Answer.close` adds."""
    events: Any = gen.events()  # an async generator: closed below
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                event = await asyncio.wait_for(anext(events), left)
            except (TimeoutError, StopAsyncIteration):
                break
            if isinstance(event, TokenEvent):
                yield answer.add(event.text)
                continue
            answer.finish = event
            if not event.reason.answered:
                raise finish_error(event)
            answer.reason = event.reason
            yield answer.say(answer.spoken.feed(event.text))
            break
    finally:
        gen.close()
        await events.aclose()
    yield answer.close()


@post(ENDPOINT, status_code=200)
async def voice(request: Request[Any, Any, Any], state: State) -> Any:
    start = time.monotonic()
    services: Services = state.services
    body: VoiceBody = decode_body(await request.body(), VoiceBody)
    _check(body)
    who = request.user
    memory = services.voice_memory
    cid, history = memory.history(who.user_id, body.conversation_id, time.time())
    # what the template will print at least (older turns may be dropped to fit), counted
    # before any templating
    check_prompt_size(services.model, len(body.text) + len(_system(body)), "text")
    prompt = await off_loop(services, _prompt, services, body, history)
    gen = await submit(services, prompt, SamplingFields(), body.max_tokens, who, who.klass,
                       ENDPOINT)
    answer = Answer(start, len(prompt), SpokenText(services.model.tokenizer), gen.handle)
    deadline = start + body.deadline_ms / 1000.0

    def remember() -> None:
        memory.remember(who.user_id, cid, body.text, answer.text, time.time())

    if body.stream:
        return _sse(gen, answer, deadline, cid, remember)
    async for _ in _events(gen, answer, deadline):  # an engine error raises its ApiError
        pass
    remember()
    return answer.body(cid)


def _sse_event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _sse(gen: Generation, answer: Answer, deadline: float, cid: str,
         remember: Callable[[], None]) -> Stream:
    async def body() -> AsyncIterator[bytes]:
        split = SentenceSplitter()
        try:
            async for text in _events(gen, answer, deadline):
                for sentence in split.feed(text):
                    yield _sse_event("sentence", {"text": sentence})
        except ApiError as exc:
            yield _sse_event("error", exc.body())
            return
        for sentence in split.finish():
            yield _sse_event("sentence", {"text": sentence})
        remember()
        yield _sse_event("done", answer.body(cid))

    return EventStream(body(), media_type="text/event-stream",
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


ROUTES = [voice]
