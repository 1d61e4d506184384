"""Ollama's NDJSON streams: one compact JSON object per line, written as each token arrives.

A stream ends with a ``done: true`` object carrying the counts and durations (integer
nanoseconds), or, when generation fails mid-way, with an ``{"error": "..."}`` line (the
``ollama`` client raises it as a ``ResponseError``). A client that goes away cancels the
request in the engine.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from litestar.response import Stream
from litestar.types import Receive

from appliance.api.common import while_connected
from appliance.api.errors import ApiError, backend_error, engine_down
from appliance.service.engine_client import FinishEvent, TokenEvent
from appliance.service.generation import Generation

NDJSON = "application/x-ndjson"


def now_iso() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


@dataclass(slots=True)
class Clock:
    """Nanosecond marks of one request, from the handler's first line."""

    start: int = field(default_factory=time.monotonic_ns)
    first_token: int | None = None

    def token(self) -> None:
        if self.first_token is None:
            self.first_token = time.monotonic_ns()

    def final(self, finish: FinishEvent) -> dict[str, Any]:
        """The counts and durations of a final chunk. The model is always resident, so
        ``load_duration`` is 0; prompt evaluation is the engine's admission-to-first-token
        time; evaluation runs from the first token to the end."""
        end = time.monotonic_ns()
        prefill_s = 0.0
        if finish.ttft_s is not None:
            prefill_s = max(0.0, finish.ttft_s - (finish.queue_s or 0.0))
        return {"done_reason": finish.reason,
                "total_duration": end - self.start, "load_duration": 0,
                "prompt_eval_count": finish.usage.prompt_tokens,
                "prompt_eval_duration": int(prefill_s * 1e9),
                "eval_count": finish.usage.completion_tokens,
                "eval_duration": end - (self.first_token or end)}


class Pieces:
    """Turns engine text into the message fields of one chunk (content, thinking, tool
    calls); the plain version passes text through as ``content``."""

    def token(self, token: int) -> None:
        """Each generated token id, before its text."""

    def feed(self, text: str) -> dict[str, Any]:
        return {"content": text} if text else {}

    def finish(self) -> dict[str, Any]:
        return {}


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Fields of two deltas in order: texts and tool-call lists concatenate."""
    out = dict(a)
    for k, v in b.items():
        out[k] = out[k] + v if k in out else v
    return out


async def ndjson(gen: Generation, clock: Clock, pieces: Pieces,
                 chunk: Callable[[dict[str, Any], bool], dict[str, Any]]) -> AsyncIterator[bytes]:
    """``chunk(fields, done)`` shapes a line (``message`` for chat, ``response`` for
    generate); the final one gets :meth:`Clock.final`'s fields."""
    try:
        async for event in gen.events():
            if isinstance(event, TokenEvent):
                clock.token()
                pieces.token(event.token)
                fields = pieces.feed(event.text)
                if fields:
                    yield line(chunk(fields, False))
                continue
            if not event.reason.answered:
                yield line({"error": finish_error(event).message})
                break
            tail = merge(pieces.feed(event.text), pieces.finish())
            if tail:
                yield line(chunk(tail, False))
            yield line({**chunk({}, True), **clock.final(event)})
    finally:
        gen.close()


async def collect(gen: Generation, clock: Clock, pieces: Pieces, receive: Receive
                  ) -> tuple[dict[str, Any], FinishEvent]:
    """The whole answer's fields (``stream: false``); a client that leaves first cancels
    the request (:func:`appliance.api.common.while_connected`)."""
    return await while_connected(gen, receive, _collect(gen, clock, pieces))


def finish_error(finish: FinishEvent) -> ApiError:
    """The error of a request that ended without an answer (503 when the engine is down)."""
    return engine_down(finish.error) if finish.unavailable else backend_error(finish.error)


async def _collect(gen: Generation, clock: Clock, pieces: Pieces
                   ) -> tuple[dict[str, Any], FinishEvent]:
    fields: dict[str, Any] = {}
    async for event in gen.events():
        if isinstance(event, TokenEvent):
            clock.token()
            pieces.token(event.token)
            fields = merge(fields, pieces.feed(event.text))
        else:
            fields = merge(fields, pieces.feed(event.text))
            fields = merge(fields, pieces.finish())
    assert gen.finish is not None
    return fields, gen.finish


class NdjsonStream(Stream):
    """A Stream whose own media type wins over the route's (as ``streams.EventStream``)."""

    def to_asgi_response(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["media_type"] = self.media_type
        return super().to_asgi_response(*args, **kwargs)


def stream_response(body: AsyncIterator[bytes]) -> Stream:
    return NdjsonStream(body, media_type=NDJSON,
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
