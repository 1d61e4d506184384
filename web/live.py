"""The dashboard's live data: one shared frame per interval, whatever the number of viewers.

Cost to the engine: each frame reads ``engine.snapshot`` (an immutable value the engine swaps
in after every tick; no lock) and renders a few small templates on the event loop. Ledger
figures come from one query in a worker thread at most every ``STATS_TTL_S``, shared by all
viewers. Frames are cached per audience (admins share one; each member sees their own) and
per interval, so five open dashboards cost what one does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import anyio

from appliance.jobs.runner import JobService
from appliance.service.engine_client import EngineSnapshot, SlotInfo
from appliance.service.services import Services
from appliance.vocab import CLASS_LABELS
from web import charts, stats
from web.format import HELPERS

INTERVAL_S = 0.5
"""How often a viewer gets fresh figures."""
STATS_TTL_S = 2.0
"""How long ledger figures are reused before the next query."""
HISTORY_S = 120.0
"""Span of the throughput chart."""


@dataclass(frozen=True, slots=True)
class Audience:
    admin: bool
    user_id: int
    name: str

    @property
    def key(self) -> tuple[str, int]:
        return ("admin", 0) if self.admin else ("member", self.user_id)


@dataclass(frozen=True, slots=True)
class KvView:
    in_use: int
    reserved: int | None
    prompt_cache: int | None
    budget: int | None


class Hub:
    def __init__(self, services: Services, templates: Any, jobs: JobService | None = None
                 ) -> None:
        self._services = services
        self._jobs = jobs
        self._templates = templates
        self._frames: dict[tuple[str, int], tuple[int, dict[str, str]]] = {}
        self._samples: deque[tuple[float, int]] = deque(maxlen=int(HISTORY_S / INTERVAL_S) + 1)
        self._stats: tuple[float, stats.Service] | None = None
        self._stats_lock: asyncio.Lock | None = None
        self.frames_made = 0
        self.busy_s = 0.0
        """Event-loop time spent making frames (sampling and rendering): what viewers cost."""
        self.table_cpu_s = 0.0
        """CPU time of the worker thread reading the service table for those frames."""

    async def frame(self, audience: Audience) -> dict[str, str]:
        """Event name -> HTML fragment, the same object for every viewer in one interval."""
        tick = int(time.monotonic() / INTERVAL_S)
        cached = self._frames.get(audience.key)
        if cached is not None and cached[0] == tick:
            return cached[1]
        table = await self.service_table()
        cached = self._frames.get(audience.key)  # made by another viewer meanwhile
        if cached is not None and cached[0] == tick:
            return cached[1]
        started = time.perf_counter()
        snap = self._services.engine.snapshot
        self._sample(snap)
        frame = self._render(audience, snap, table)
        self._frames[audience.key] = (tick, frame)
        self.frames_made += 1
        self.busy_s += time.perf_counter() - started
        return frame

    async def service_table(self) -> stats.Service:
        now = time.monotonic()
        if self._stats is not None and now - self._stats[0] < STATS_TTL_S:
            return self._stats[1]
        if self._stats_lock is None:
            self._stats_lock = asyncio.Lock()
        async with self._stats_lock:
            if self._stats is not None and time.monotonic() - self._stats[0] < STATS_TTL_S:
                return self._stats[1]
            table = await anyio.to_thread.run_sync(self._read_table)
            self._stats = (time.monotonic(), table)
            return table

    def _read_table(self) -> stats.Service:
        started = time.thread_time()
        try:
            with self._services.store.read_sessions() as s:
                return stats.service(s, time.time())
        finally:
            self.table_cpu_s += time.thread_time() - started

    # ---- throughput samples (taken only while someone watches) ----
    def _sample(self, snap: EngineSnapshot) -> None:
        now = time.monotonic()
        if self._samples and now - self._samples[-1][0] < INTERVAL_S * 0.9:
            return
        self._samples.append((now, snap.generated_tokens_total))

    def rates(self) -> list[float]:
        """Generated tokens per second between consecutive samples, oldest first."""
        s = list(self._samples)
        return [max(0.0, (b[1] - a[1]) / (b[0] - a[0])) for a, b in zip(s, s[1:], strict=False)
                if b[0] > a[0]]

    # ---- rendering ----
    def _render(self, audience: Audience, snap: EngineSnapshot,
                service: stats.Service) -> dict[str, str]:
        rates = self.rates()
        recent = rates[-4:]
        rate = sum(recent) / len(recent) if recent else 0.0
        table = _with_live_counters(service[0], snap.counters)
        ctx: dict[str, Any] = {
            "h": HELPERS, "snap": snap, "admin": audience.admin, "me_name": audience.name,
            "max_batch": self._services.max_batch_size, "rate": rate,
            "chart": charts.spark(rates, width=320, height=60),
            "kv": kv_view(snap, self._services.engine.kv_budget_bytes),
            "slots": [s for s in snap.slots if audience.admin or s.user_id == audience.user_id],
            "others": 0 if audience.admin else sum(s.user_id != audience.user_id
                                                   for s in snap.slots),
            "queue": queue_by_class(snap.queue, None if audience.admin else audience.user_id),
            "users": table if audience.admin else
            [u for u in table if u.user_id == audience.user_id],
            "spark": charts.spark, "updated": time.strftime("%H:%M:%S"),
            "jobs": jobs_view(self._jobs, None if audience.admin else audience.user_id),
            "group": self._services.engine.group_status(),
            "classes": service[1],
        }
        names = ("summary", "slots", "queue", "kv", "throughput", "users", "latency", "jobs",
                 "machines")
        return {name: self._templates.get_template(f"_dash_{name}.html").render(**ctx)
                for name in names}


def kv_view(snap: EngineSnapshot, budget: int | None = None) -> KvView:
    """KV figures from the engine's snapshot; ``budget``: the engine's ``kv_budget_bytes``."""
    return KvView(in_use=snap.kv_bytes, reserved=snap.kv_reserved_bytes,
                  prompt_cache=snap.prompt_cache_bytes, budget=budget)


@dataclass(frozen=True, slots=True)
class QueuedView:
    klass: str
    count: int
    longest_wait_s: float
    requests: tuple[SlotInfo, ...]
    """The requests shown: all of them for admins, the viewer's own for members."""


def queue_by_class(queue: tuple[SlotInfo, ...], only_user: int | None) -> list[QueuedView]:
    out = []
    for klass in CLASS_LABELS:
        group = [q for q in queue if q.klass == klass]
        shown = tuple(sorted((q for q in group if only_user is None or q.user_id == only_user),
                             key=lambda q: -q.waited_s))
        out.append(QueuedView(klass, len(group), max((q.waited_s for q in group), default=0.0),
                              shown))
    return out


def _with_live_counters(table: list[stats.UserService],
                        live: Mapping[str, float]) -> list[stats.UserService]:
    """Overlay the scheduler's live counters (keyed by user id as text, as the engine's
    snapshot has them) on the persisted ones."""
    if not live:
        return table
    out = []
    for u in table:
        value = live.get(str(u.user_id))
        out.append(u if value is None else dataclasses.replace(u, counter=float(value)))
    return out


@dataclass(frozen=True, slots=True)
class JobsView:
    running: list[tuple[str, int, int]]
    """(job name, stages done, stages total) of the runs in progress."""
    upcoming: list[tuple[str, str]]
    """(job name, next run in words), soonest first."""


def jobs_view(jobs: JobService | None, only_user: int | None, limit: int = 5) -> JobsView:
    """Running and next background jobs, from the job scheduler's memory (no query)."""
    if jobs is None:
        return JobsView([], [])
    return JobsView(*jobs.overview(only_user, limit))
