"""The job scheduler: which runs start when (the life of one run is ``jobs.run``).

``JobService.start()`` runs in the Litestar lifespan (APScheduler's ``AsyncIOScheduler``
needs the running loop): it marks runs a dead daemon left ``running`` as ``interrupted``
and retries each once, adds every scheduled job to the scheduler with a stable id
(``job-<id>``), catches up one missed slot per job (the latest, within
``misfire_grace``), and polls the table every few seconds for changes made elsewhere (the
CLI, another tab). ``stop()`` runs before the engine drains: the scheduler stops and
running runs end ``interrupted`` (retried once at the next start).

A run is unique per (job, scheduled time) in ``job_runs``; ``execute`` hands it to
``RunLife`` unless the scheduler is stopping. All writes are short ``BEGIN IMMEDIATE``
transactions on worker threads (the store's writer discipline; no writer thread of our own).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

import anyio
from apscheduler.executors.asyncio import AsyncIOExecutor
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from sqlalchemy.exc import DatabaseError

from appliance.jobs.definition import Limits
from appliance.jobs.netguard import Guard, parse_allow_list
from appliance.jobs.run import Live, RunLife
from appliance.jobs.schedule import household_zone, in_words, latest_slot, make_trigger
from appliance.service.services import Services
from appliance.store import jobs as store_jobs
from appliance.store.faults import storage_fault
from appliance.store.models import Job
from appliance.vocab import DAY_S

if TYPE_CHECKING:
    from appliance.settings import JobsSettings

log = logging.getLogger(__name__)

SYNC_INTERVAL_S = 3.0


class _SlotJob:
    """An APScheduler job seen with its scheduled time added to its keyword arguments."""

    def __init__(self, job: Any, slot: datetime) -> None:
        self._job = job
        self.kwargs = {**job.kwargs, "slot": slot}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._job, name)

    def __str__(self) -> str:
        return str(self._job)


class SlotExecutor(AsyncIOExecutor):
    """APScheduler's asyncio executor, telling the job function which slot it runs for
    (a run is unique per slot; with ``coalesce`` only the latest of a backlog runs)."""

    def _do_submit_job(self, job: Any, run_times: list[datetime]) -> None:
        super()._do_submit_job(_SlotJob(job, run_times[-1]), run_times[-1:])


class JobService:
    def __init__(self, services: Services, settings: JobsSettings,
                 flush_ledger: Callable[[], object] | None = None) -> None:
        self.services = services
        self.settings = settings
        self.zone = household_zone(settings.timezone)
        self.allow = parse_allow_list(settings.url_allow)
        self.limits = Limits(settings.document_max_bytes, settings.output_max_tokens,
                             self.zone)
        self.scheduler: AsyncIOScheduler | None = None
        self.live: dict[int, Live] = {}
        self.runs = RunLife(services, settings, self.guard, self.live, flush_ledger)
        self._signatures: dict[int, tuple[Any, ...]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = False
        self.known: dict[int, tuple[str, int]] = {}
        """Job id -> (name, owner id), refreshed at every sync (for the dashboard)."""

    def guard(self, admin: bool) -> Guard:
        return Guard(self.allow, privileged=admin)

    def min_interval(self, admin: bool) -> int:
        """The shortest schedule (seconds) a job of an admin or a member may have."""
        s = self.settings
        return s.admin_min_interval if admin else s.member_min_interval

    # ---- lifespan ----
    async def start(self) -> None:
        self.scheduler = AsyncIOScheduler(
            timezone=self.zone, executors={"default": SlotExecutor()},
            job_defaults={"coalesce": True, "max_instances": 1,
                          "misfire_grace_time": int(self.settings.misfire_grace)})
        self.scheduler.start()
        retry = await anyio.to_thread.run_sync(self._interrupt_leftovers)
        for run_id in retry:
            log.info("job run %d was interrupted; retrying it once", run_id)
            self._spawn(run_id)
        await self.sync(catch_up=True)
        self.scheduler.add_job(self._poll, "interval", seconds=SYNC_INTERVAL_S,
                               id="appliance-sync", replace_existing=True,
                               misfire_grace_time=None)

    async def stop(self) -> None:
        """Stop scheduling; running runs end ``interrupted`` (retried at the next start)."""
        self._stopping = True
        if self.scheduler is not None and self.scheduler.running:
            self.scheduler.shutdown(wait=False)
        for live in list(self.live.values()):
            if live.task is not None:
                live.cancel_reason = "interrupted"
                live.task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=10)

    def _interrupt_leftovers(self) -> list[int]:
        with self.services.store.sessions.begin() as s:
            # the CLI validates new jobs against the list this daemon enforces at fetch time
            store_jobs.record_daemon_url_allow(s, self.settings.url_allow)
            retry = store_jobs.interrupt_leftovers(s)
            # runs pile up only while a job runs, and each run prunes its own job; this is
            # for jobs paused with a backlog (or one left by a version that never pruned)
            pruned = sum(store_jobs.prune_runs(s, job.id, keep=self.settings.runs_keep,
                                               max_age_s=self.settings.runs_keep_days * DAY_S)
                         for job in store_jobs.list_jobs(s))
        if pruned:
            log.info("%d old job runs deleted at start", pruned)
        return retry

    # ---- keeping the scheduler in step with the table ----
    async def _poll(self, slot: datetime | None = None) -> None:
        await self.sync()

    async def sync(self, catch_up: bool = False) -> None:
        if self._stopping or self.scheduler is None:
            return
        jobs, pending, admins = await anyio.to_thread.run_sync(self._read_jobs)
        self.known = {j.id: (j.name, j.user_id) for j in jobs}
        wanted: dict[int, Job] = {j.id: j for j in jobs
                                  if j.schedule_kind != "none" and not j.paused}
        for job_id in list(self._signatures):
            if job_id not in wanted:
                self._unschedule(job_id)
        for job in wanted.values():
            interval = self._interval(job, job.user_id in admins)
            sig = (job.schedule_kind, job.cron, interval, job.created_at)
            if self._signatures.get(job.id) == sig:
                continue
            if interval != job.interval_s:
                log.warning("job %d: interval %s s is below its owner's floor; scheduled "
                            "every %s s", job.id, job.interval_s, interval)
            trigger = make_trigger(job.schedule_kind, job.cron, interval, job.created_at,
                                   self.zone)
            self.scheduler.add_job(self._fire, trigger, id=f"job-{job.id}",
                                   name=f"job {job.id}", kwargs={"job_id": job.id},
                                   replace_existing=True)
            self._signatures[job.id] = sig
            if catch_up:
                await self._catch_up(job, trigger)
        for run_id in pending:
            if run_id not in self.live:
                self._spawn(run_id)

    def _interval(self, job: Job, admin: bool) -> int | None:
        """The job's interval, raised to its owner's floor: a job stored before the floor
        existed (or whose owner lost the admin role) never runs more often than it allows."""
        if job.schedule_kind != "interval" or job.interval_s is None:
            return job.interval_s
        return max(job.interval_s, self.min_interval(admin))

    def _read_jobs(self) -> tuple[list[Job], list[int], set[int]]:
        with self.services.store.read_sessions() as s:
            return (store_jobs.list_jobs(s),
                    [r.id for r in store_jobs.runs_with_status(s, ("pending",))],
                    store_jobs.admin_ids(s))

    def _unschedule(self, job_id: int) -> None:
        self._signatures.pop(job_id, None)
        if self.scheduler is not None and self.scheduler.get_job(f"job-{job_id}"):
            self.scheduler.remove_job(f"job-{job_id}")

    async def _catch_up(self, job: Job, trigger: Any) -> None:
        """One run for the latest slot missed while the daemon was down (if recent)."""
        now = datetime.now(self.zone)
        last = await anyio.to_thread.run_sync(self._last_slot, job.id)
        after = datetime.fromtimestamp(max(last or job.created_at,
                                           now.timestamp() - self.settings.misfire_grace),
                                       self.zone)
        slot = latest_slot(trigger, after, now)
        if slot is None:
            return
        run_id = await anyio.to_thread.run_sync(self._add_run, job.id, slot.timestamp(),
                                                "catch-up")
        if run_id is not None:
            log.info("job %d: catching up the slot missed at %s", job.id, slot.isoformat())
            self._spawn(run_id)

    def _last_slot(self, job_id: int) -> float | None:
        with self.services.store.read_sessions() as s:
            return store_jobs.last_slot(s, job_id)

    def _add_run(self, job_id: int, slot: float, trigger: str) -> int | None:
        with self.services.store.sessions.begin() as s:
            run = store_jobs.add_run(s, job_id, slot, trigger)
            return None if run is None else run.id

    async def _fire(self, job_id: int, slot: datetime | None = None) -> None:
        """APScheduler's job: one run per slot (a slot that already has a run is skipped)."""
        if self._stopping:
            return
        if slot is None:  # only SlotExecutor calls this, and it always passes the slot
            slot = datetime.now(self.zone)
        try:
            run_id = await anyio.to_thread.run_sync(self._add_run, job_id, slot.timestamp(),
                                                    "schedule")
        except DatabaseError as exc:
            if storage_fault(exc) is None:
                raise
            # one line, not APScheduler's traceback; the store's health says the rest
            log.warning("job %d: slot %s not run: the database takes no writes (%s)", job_id,
                        slot.isoformat(), storage_fault(exc))
            return
        if run_id is None:
            log.info("job %d: slot %s already has a run", job_id, slot.isoformat())
            return
        await self.execute(run_id)

    # ---- on demand ----
    async def run_now(self, job_id: int) -> int:
        """A manual run, started at once; its id."""
        slot = time.time()
        while True:
            run_id = await anyio.to_thread.run_sync(self._add_run, job_id, slot, "manual")
            if run_id is not None:
                break
            slot += 0.001  # two clicks in the same instant: two runs
        self._spawn(run_id)
        return run_id

    async def cancel(self, run_id: int) -> bool:
        """Cancel a pending or running run; False when it had already finished."""
        live = self.live.get(run_id)
        if live is not None and live.task is not None:
            live.cancel_reason = "cancelled"
            live.task.cancel()
            return True
        return bool(await anyio.to_thread.run_sync(self._cancel_pending, run_id))

    def _cancel_pending(self, run_id: int) -> bool:
        with self.services.store.sessions.begin() as s:
            run = store_jobs.get_run(s, run_id)
            if run.status != "pending":
                return False
            store_jobs.finish_run(s, run_id, "cancelled", error="cancelled before it started")
            return True

    def forget(self, job_id: int) -> None:
        """A deleted job: its schedule goes now, its running run is cancelled."""
        self._unschedule(job_id)
        for live in list(self.live.values()):
            if live.job_id == job_id and live.task is not None:
                live.cancel_reason = "cancelled"
                live.task.cancel()

    def reschedule(self) -> None:
        """Re-read the table soon (after an edit through the API)."""
        if not self._stopping:
            task = asyncio.get_running_loop().create_task(self.sync())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def next_run(self, job_id: int) -> datetime | None:
        if self.scheduler is None:
            return None
        job = self.scheduler.get_job(f"job-{job_id}")
        return None if job is None else job.next_run_time

    def overview(self, only_user: int | None, limit: int = 5
                 ) -> tuple[list[tuple[str, int, int]], list[tuple[str, str]]]:
        """Runs in progress and the next scheduled runs (names, progress, times in words),
        for everyone or one user, from memory only."""
        def mine(job_id: int, owner: int | None = None) -> bool:
            who = owner if owner is not None else self.known.get(job_id, ("", -1))[1]
            return only_user is None or who == only_user

        running = [(self.known.get(v.job_id, (f"job {v.job_id}", 0))[0], v.done, v.total)
                   for v in self.live.values() if mine(v.job_id, v.user_id)]
        upcoming: list[tuple[datetime, str]] = []
        if self.scheduler is not None:
            for job in self.scheduler.get_jobs():
                if not job.id.startswith("job-") or job.next_run_time is None:
                    continue
                job_id = int(job.id[4:])
                if mine(job_id):
                    upcoming.append((job.next_run_time,
                                     self.known.get(job_id, (f"job {job_id}", 0))[0]))
        upcoming.sort()
        now = datetime.now(self.zone)
        return running[:limit], [(name, in_words(t, now)) for t, name in upcoming[:limit]]

    def _spawn(self, run_id: int) -> None:
        task = asyncio.get_running_loop().create_task(self.execute(run_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def execute(self, run_id: int) -> None:
        """Run ``run_id`` now, unless the scheduler is stopping."""
        if not self._stopping:
            await self.runs.execute(run_id)
