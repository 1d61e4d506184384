"""The dashboard: live slots, queue, KV budget, throughput and per-user service.

Admins see everyone; a member sees the load (counts only) and their own requests and usage.
The page renders the current frame, then ``/dashboard/stream`` sends each part again as an
SSE event whenever it changed, every ``live.INTERVAL_S``, and a ``beat`` event each time
(the page greys its figures when beats stop: "not answering since HH:MM"). A stream lasts ``LIFETIME_S`` and
ends with a ``bye`` event; the page's script then opens the next one (no error, nothing
logged), and a browser without it reconnects after ``retry``: streams stay short-lived, so
a shutdown never waits on an open dashboard for long.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
from litestar import Request, Response, get
from litestar.params import Parameter
from litestar.response import Template
from markupsafe import Markup

from appliance.service.services import Services
from appliance.vocab import DAY_S, HOUR_S
from web import charts, sse, stats
from web.common import PAGE, me, page, services, web_state
from web.live import INTERVAL_S, Audience, Hub

LIFETIME_S = 5.0
"""A stream's length: a stopping daemon lets open streams end before it closes, so this
bounds how long a dashboard shows "live" after the daemon stopped taking connections."""
RETRY_MS = 250


def _audience(request: Request[Any, Any, Any]) -> Audience:
    who = me(request)
    return Audience(who.is_admin, who.user_id, who.name)


@get("/dashboard", opt=PAGE)
async def dashboard(request: Request[Any, Any, Any]) -> Template:
    frame = await web_state(request).hub.frame(_audience(request))
    return page(request, "dashboard.html", frame={k: Markup(v) for k, v in frame.items()},
                max_batch=services(request).max_batch_size,
                machines=services(request).engine.group_status() is not None,
                degraded=_degraded(services(request)))


def _degraded(svc: Services) -> list[tuple[str, str]]:
    """What the backend runs without, as (what, the command that fixes it)
    (appliance/backend/degraded.py); empty before the model has loaded."""
    loaded = svc.engine.loaded
    reasons = loaded.backend.degraded if loaded is not None else ()
    return [(what, fix) for what, _, fix in (r.rpartition("; fix: ") for r in reasons)]


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
        yield sse.event("beat", "")  # "still answering", even when no figure changed
        n += 1
        if (frames and n >= frames) or time.monotonic() >= deadline:
            yield sse.event("bye", "")
            return
        # wake at the next interval boundary, when a fresh frame exists
        await asyncio.sleep(INTERVAL_S - time.monotonic() % INTERVAL_S + 0.005)


def _history(svc: Services, audience: Audience) -> list[stats.UsageHistory]:
    with svc.store.read_sessions() as s:
        return stats.usage_history(s, time.time(),
                                   None if audience.admin else audience.user_id)


def _labels(now: float) -> tuple[list[str], list[str]]:
    hour0 = (now // HOUR_S - (stats.HISTORY_HOURS - 1)) * HOUR_S
    hours = [time.strftime("%H:00", time.localtime(hour0 + i * HOUR_S))
             for i in range(stats.HISTORY_HOURS)]
    today = time.mktime(time.localtime(now)[:3] + (12, 0, 0, 0, 0, -1))
    days = [time.strftime("%a %-d %b", time.localtime(today - (stats.HISTORY_DAYS - 1 - i)
                                                      * DAY_S))
            for i in range(stats.HISTORY_DAYS)]
    return hours, days


@get("/dashboard/history")
async def usage_history(request: Request[Any, Any, Any]) -> Template:
    """Tokens per hour (last day) and per day (last two weeks) per person, from the ledger;
    loaded with the page and once a minute, not part of the live stream."""
    history = await anyio.to_thread.run_sync(_history, services(request), _audience(request))
    hours, days = _labels(time.time())
    return page(request, "_dash_history.html", history=history, bar=charts.bars,
                hour_labels=hours, day_labels=days, days_n=stats.HISTORY_DAYS)


ROUTES = [dashboard, dashboard_stream, usage_history]
