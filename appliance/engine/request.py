"""Messages between the HTTP side and the engine thread (no MLX here).

A handler builds a :class:`GenerationRequest`, submits it and reads :class:`TokenEvent` /
:class:`FinishEvent` from its :class:`RequestHandle`. Cancellation is a flag the engine
reads on its next tick.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from appliance.vocab import FinishReason, Klass

log = logging.getLogger(__name__)

_ids = itertools.count(1)

SEED_LIMIT = 1 << 64
"""Seeds are unsigned 64-bit integers (what ``mx.random.key`` takes): 0 <= seed < 2**64."""


def next_request_id() -> int:
    """The engine's own handle for a request in this process (scheduler, batch rows)."""
    return next(_ids)


def uuid7() -> uuid.UUID:
    """A version-7 UUID (RFC 9562): 48 bits of unix milliseconds, then 74 random bits.

    Python's ``uuid.uuid7`` arrives in 3.14; this is the same layout in a few lines rather
    than a dependency. Ids sort by creation time and never repeat across restarts.
    """
    ms = time.time_ns() // 1_000_000
    value = (ms & ((1 << 48) - 1)) << 80 | int.from_bytes(os.urandom(10), "big")
    value = (value & ~(0xF << 76)) | (0x7 << 76)  # version 7
    value = (value & ~(0x3 << 62)) | (0x2 << 62)  # RFC 4122 variant
    return uuid.UUID(int=value)


def new_request_id() -> str:
    """The id a request is known by outside the engine: the ledger row and the OpenAI
    ``id`` (``chatcmpl-<this>``). Unique across restarts (a UUIDv7 in hex)."""
    return uuid7().hex


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def needs_processors(self) -> bool:
        return bool(self.logit_bias or self.repetition_penalty or self.presence_penalty
                    or self.frequency_penalty)


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    user: str = "local"
    klass: Klass = Klass.INTERACTIVE
    user_id: int = 0
    api_key_id: int | None = None
    endpoint: str = ""
    tokens_per_day: int | None = None
    """The user's daily token quota: the request finishes with ``quota`` when it is used up."""
    grammar: str | None = None
    """Constrained decoding: an llguidance grammar (from a JSON schema or Lark) the answer
    must follow; None for free text."""
    keep_cache: bool = True
    """False (Ollama's ``keep_alive: 0``): when it finishes, its KV is not kept and its
    user's prompt-cache entries are released."""
    continues: bool = False
    """The prompt ends inside the answer (Continue): the text keeps the space it begins
    with, which joins it to the answer so far."""
    rid: int = field(default_factory=next_request_id)
    request_id: str = field(default_factory=new_request_id)

    @property
    def user_key(self) -> str:
        """How the scheduler, counters and usage know the user (the user id, as text)."""
        return str(self.user_id)


@dataclass(frozen=True, slots=True)
class UserAccess:
    """What an admin's change left one user allowed, for the requests already running:
    ``disabled`` ends them all, a key in ``revoked_keys`` ends those made with it (both
    ``cancelled``), ``tokens_per_day`` replaces the limit their requests were submitted with
    (used up: ``quota``)."""

    disabled: bool = False
    revoked_keys: frozenset[int] = frozenset()
    tokens_per_day: int | None = None


ACCESS_ENDED = {"disabled": "the account was disabled", "revoked": "the API key was revoked"}
"""The error a request ended by an admin's change carries (its finish reason: cancelled)."""


@dataclass(frozen=True, slots=True)
class TokenEvent:
    token: int
    text: str


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class FinishEvent:
    reason: FinishReason
    """stop | length | cancelled | error | quota"""
    usage: Usage
    text: str = ""
    """Text held back until the end (partial stop-string matches, detokenizer tail)."""
    error: str | None = None
    ttft_s: float | None = None
    preemptions: int = 0
    unavailable: bool = False
    """The engine stopped serving (dead or stalled): HTTP 503, retry later."""
    queue_s: float | None = None
    """Seconds from arrival to admission (None when never admitted)."""


Event = TokenEvent | FinishEvent

FaultHook = Callable[[GenerationRequest, str], None]
"""Test hook: called with (request, phase) before that request's prefill or decode; may raise."""


class RequestHandle:
    """The caller's side of one request: events in, a cancel flag out."""

    def __init__(self, request: GenerationRequest, sink: Callable[[Event], None]) -> None:
        self.request = request
        self._sink = sink
        self._cancelled = threading.Event()
        self._closed = False
        self._claimed = False
        self._lock = threading.Lock()
        self.queue_s: float | None = None
        """Seconds from arrival to first admission, set by the engine thread when it admits
        (a caller that stops waiting before the finish still knows it was admitted)."""

    @property
    def rid(self) -> int:
        return self.request.rid

    def emit(self, event: Event) -> bool:
        """Hand one event to the caller. Never raises: a sink that fails cancels its own
        request (the engine reaps it on the next tick) and nobody else's. After the finish
        event nothing more is delivered, so a request is finished exactly once even when
        the supervisor and the engine thread both try. Returns whether it was delivered."""
        with self._lock:
            if self._closed:
                return False
            if isinstance(event, FinishEvent):
                self._closed = True
        try:
            self._sink(event)
        except Exception as exc:
            log.error("request sink failed rid=%d: %s", self.rid, type(exc).__name__)
            self._cancelled.set()
            return False
        return True

    def claim_finish(self) -> bool:
        """True for the one caller that ends this request (the engine thread, or the
        supervisor failing the engine): it writes the ledger's row and then the finish
        event, so a request that both try gets one row."""
        with self._lock:
            if self._claimed or self._closed:
                return False
            self._claimed = True
            return True

    @property
    def finished(self) -> bool:
        """The finish event was handed over (or tried)."""
        return self._closed

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


def asyncio_sink(loop: asyncio.AbstractEventLoop,
                 q: asyncio.Queue[Event]) -> Callable[[Event], None]:
    """Hand events from the engine thread to an asyncio queue."""
    def sink(event: Event) -> None:
        loop.call_soon_threadsafe(q.put_nowait, event)
    return sink


def blocking_sink(q: queue.SimpleQueue[Event]) -> Callable[[Event], None]:
    return q.put


class GroupLost(BaseException):  # noqa: N818 - no request's handler may catch it and go on
    """The machines serving one model together no longer do (appliance/distributed): one
    died, hung or disagreed. Every request in flight ends; the daemon restarts."""
