"""The web UI's in-memory state: answers being streamed, and the dashboard hub.

Lives on the event loop only (no locks): handlers and SSE generators all run there.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from appliance.jobs.runner import JobService
from appliance.service.generation import Generation
from appliance.service.identity import Principal
from appliance.service.services import Services
from web.live import Hub

CONNECT_WITHIN_S = 60.0
"""An answer whose stream nobody opens within this time is cancelled (the tab went away)."""


@dataclass(slots=True)
class LiveAnswer:
    """A chat answer between the POST that started it and the end of its SSE stream."""

    gen: Generation
    user_id: int
    conversation_id: int
    created: float = field(default_factory=time.monotonic)
    connected: bool = False
    prefix: str = ""
    """A continued answer: what it said before; the new text is appended to it."""
    rewrite: int | None = None
    """The stored answer this one takes the place of when saved (Continue, Regenerate)."""
    keep_old: bool = False
    """Keep the replaced answer as an earlier version (Regenerate)."""
    who: Principal | None = None
    """Who asked (a generated title is asked for in their name)."""
    first_token_at: float | None = None
    finished_at: float | None = None

    def writing_s(self) -> float | None:
        """Seconds from the first token to the last (None when none came)."""
        if self.first_token_at is None or self.finished_at is None:
            return None
        return max(self.finished_at - self.first_token_at, 0.0)


@dataclass(slots=True)
class Reading:
    """A long attached file being read in parts before its question is answered
    (``web.attach``). It lives on the server, not in a tab: a reload finds it again."""

    user_id: int
    conversation_id: int
    name: str
    chars: int
    state: str = "reading"
    """reading | answering (the answer ``sid`` is ready) | stopped | failed"""
    done: int = 0
    total: int = 0
    parts: int = 0
    sid: str | None = None
    error: str = ""
    finished_at: float | None = None
    started_at: float = field(default_factory=time.monotonic)
    engine_rid: int | None = None
    """The engine request of the part being read now: its slot says how far it is."""
    share: float = 0.0
    """How much of the part being read is read (0..1), from the engine's slot info."""
    task: asyncio.Task[None] | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    """Set (and replaced) at every change, to wake the pages that watch."""

    @property
    def status(self) -> str:
        """Where the reading stands, in words: "Reading part 2 of 5 of “notes.pdf”…"."""
        if self.total == 0 or self.parts == 1:  # not begun, or short enough to read whole
            return f"Reading “{self.name}”…"
        if self.done < self.parts:
            return f"Reading part {self.done + 1} of {self.parts} of “{self.name}”…"
        return f"Putting the notes on {self.parts} parts of “{self.name}” together…"

    @property
    def spent(self) -> str:
        """Inside the part and the time so far, in words: "62 % of this part, 1 min 5 s so far"."""
        s = int((self.finished_at or time.monotonic()) - self.started_at)
        took = f"{s // 60} min {s % 60} s" if s >= 60 else f"{s} s"
        inside = (f"{round(100 * self.share)} % of this part read, " if self.share < 1
                  else "this part read, writing its notes; ")
        return f"{inside}{took} so far"

    def touch(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


READING_KEPT_S = 120.0
"""A finished reading is forgotten this long after its end (its result is stored)."""


class WebState:
    def __init__(self, services: Services, templates: Any, jobs: JobService | None = None
                 ) -> None:
        self.services = services
        self.answers: dict[str, LiveAnswer] = {}
        self.readings: dict[str, Reading] = {}
        self.naming: dict[int, asyncio.Task[None]] = {}
        """Titles being generated, by conversation (``web.titles``)."""
        self.hub = Hub(services, templates, jobs)

    def add_answer(self, answer: LiveAnswer) -> str:
        self._expire(time.monotonic())
        sid = secrets.token_urlsafe(12)
        self.answers[sid] = answer
        return sid

    def connect(self, sid: str, user_id: int) -> LiveAnswer | None:
        """The answer for its owner's first stream connection; None otherwise."""
        answer = self.answers.get(sid)
        if answer is None or answer.user_id != user_id or answer.connected:
            return None
        answer.connected = True
        return answer

    def stop(self, sid: str, user_id: int) -> bool:
        """Cancel an answer of this user (the engine frees its slot on the next tick)."""
        answer = self.answers.get(sid)
        if answer is None or answer.user_id != user_id:
            return False
        answer.gen.close()
        return True

    def done(self, sid: str) -> None:
        self.answers.pop(sid, None)

    def add_reading(self, reading: Reading) -> str:
        now = time.monotonic()
        for rid, r in list(self.readings.items()):
            if r.finished_at is not None and now - r.finished_at > READING_KEPT_S:
                del self.readings[rid]
        rid = secrets.token_urlsafe(12)
        self.readings[rid] = reading
        return rid

    def reading_in(self, conversation_id: int, user_id: int) -> tuple[str, Reading] | None:
        """The reading a reloaded page shows: one still reading, or whose answer is ready
        and not yet watched."""
        for rid, r in self.readings.items():
            if r.conversation_id != conversation_id or r.user_id != user_id:
                continue
            answer = self.answers.get(r.sid or "")
            if r.state == "reading" or (answer is not None and not answer.connected):
                return rid, r
        return None

    def _expire(self, now: float) -> None:
        for sid, answer in list(self.answers.items()):
            if not answer.connected and now - answer.created > CONNECT_WITHIN_S:
                answer.gen.close()
                del self.answers[sid]
