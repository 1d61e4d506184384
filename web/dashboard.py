"""The dashboard: live slots, queue, KV budget, throughput and per-user service.

Admins see everyone; a member sees the load (counts only) and their own requests and usage.
The page renders the current frame, then ``/dashboard/stream`` sends each part again as an
SSE event whenever it changed, every ``live.INTERVAL_S``. A stream lasts ``LIFETIME_S`` and
ends with a ``bye`` event; the page's script then opens the next one (no error, nothing
logged), and a browser without it reconnects after ``retry``: streams stay short-lived, so
a shutdown never waits on an open dashboard for long.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from litestar import Request, Response, get
from litestar.params import Parameter
from litestar.response import Template
from markupsafe import Markup

from web import sse
from web.common import PAGE, me, page, web_state
from web.live import INTERVAL_S, Audience, Hub

LIFETIME_S = 15.0
RETRY_MS = 250


def _audience(request: Request[Any, Any, Any]) -> Audience:
    who = me(request)
    return Audience(who.is_admin, who.user_id, who.name)


@get("/dashboard", opt=PAGE)
async def dashboard(request: Request[Any, Any, Any]) -> Template:
    frame = await web_state(request).hub.frame(_audience(request))
    return page(request, "dashboard.html", frame={k: Markup(v) for k, v in frame.items()})


@get("/dashboard/stream")
async def dashboard_stream(
        request: Request[Any, Any, Any],
        frames: int = Parameter(default=0, ge=0, le=10_000,
                                description="stop after this many frames (0: no limit)"),
) -> Response[Any]:
    return sse.stream(_events(web_state(request).hub, _audience(request), frames))


async def _events(hub: Hub, audience: Audience, frames: int) -> AsyncIterator[bytes]:
    """Every part once, then only the parts that changed; a frame at least every interval."""
    yield sse.retry(RETRY_MS)
    sent: dict[str, str] = {}
    deadline = time.monotonic() + LIFETIME_S
    n = 0
    while True:
        frame = await hub.frame(audience)
        for name, html in frame.items():
            if sent.get(name) != html:
                sent[name] = html
                yield sse.event(name, html)
        n += 1
        if (frames and n >= frames) or time.monotonic() >= deadline:
            yield sse.event("bye", "")
            return
        # wake at the next interval boundary, when a fresh frame exists
        await asyncio.sleep(INTERVAL_S - time.monotonic() % INTERVAL_S + 0.005)


ROUTES = [dashboard, dashboard_stream]
