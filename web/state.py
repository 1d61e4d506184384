"""The web UI's in-memory state: answers being streamed, and the dashboard hub.

Lives on the event loop only (no locks): handlers and SSE generators all run there.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from appliance.jobs.runner import JobService
from appliance.service.generation import Generation
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


class WebState:
    def __init__(self, services: Services, templates: Any, jobs: JobService | None = None
                 ) -> None:
        self.services = services
        self.answers: dict[str, LiveAnswer] = {}
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

    def _expire(self, now: float) -> None:
        for sid, answer in list(self.answers.items()):
            if not answer.connected and now - answer.created > CONNECT_WITHIN_S:
                answer.gen.close()
                del self.answers[sid]
