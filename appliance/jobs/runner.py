"""The job scheduler and the life of one run.

``JobService.start()`` runs in the Litestar lifespan (APScheduler's ``AsyncIOScheduler``
needs the running loop): it marks runs a dead daemon left ``running`` as ``interrupted``
and retries each once, adds every scheduled job to the scheduler with a stable id
(``job-<id>``), catches up one missed slot per job (the latest, within
``misfire_grace``), and polls the table every few seconds for changes made elsewhere (the
CLI, another tab). ``stop()`` runs before the engine drains: the scheduler stops and
running runs end ``interrupted`` (retried once at the next start).

A run (``execute``): read the source, summarise it (``mapreduce``), store the output,
deliver it to the webhook, delete the job's old runs. Each stage's answer is saved as it
completes (``job_steps``): a retried run reads back the stages an earlier attempt finished
instead of asking them again. Every model request goes through ``service.submit`` as the
owner, in the ``background`` class, with endpoint ``job``: the same counters, quotas and
ledger as an HTTP request. All writes are short ``BEGIN IMMEDIATE`` transactions on worker
threads (the store's writer discipline; no writer thread of our own).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

import anyio
from apscheduler.executors.asyncio import AsyncIOExecutor
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from sqlalchemy.exc import DatabaseError

from appliance.engine.request import GenerationRequest
from appliance.jobs import fetch, mapreduce, sources
from appliance.jobs.definition import Limits
from appliance.jobs.netguard import Guard, Refused, parse_allow_list
from appliance.jobs.schedule import household_zone, in_words, latest_slot, make_trigger
from appliance.service.chat_format import Turn, text_prompt
from appliance.service.checks import DEFAULTS
from appliance.service.errors import AtConcurrencyLimit, OverQuota, ServiceError, Unavailable
from appliance.service.generation import submit
from appliance.service.identity import Principal
from appliance.service.latency import JOB_ENDPOINT
from appliance.store import jobs as store_jobs
from appliance.store.faults import storage_fault
from appliance.store.models import Job, User
from appliance.vocab import DAY_S, FinishReason, Klass

if TYPE_CHECKING:
    from appliance.service.services import Services
    from appliance.settings import JobsSettings

log = logging.getLogger(__name__)

SYNC_INTERVAL_S = 3.0
BUSY_WAIT_S = (1, 2, 5, 10, 30, 60)
OUTPUT_MAX_CHARS = 64 * 1024
WEBHOOK_MAX_BYTES = 64 * 1024


class JobFailed(Exception):
    """Ends a run with ``status`` and ``reason``."""

    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


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


@dataclass(slots=True)
class Live:
    """A run in progress, as the pages see it."""

    run_id: int
    job_id: int
    user_id: int
    started: float
    done: int = 0
    total: int = 0
    task: asyncio.Task[None] | None = None
    cancel_reason: str = ""


@dataclass(slots=True)
class Tally:
    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    ids: list[str] = field(default_factory=list)
    reused: int = 0
    """Stages read back from an interrupted attempt instead of asked again."""


def step_key(model: str, max_tokens: int, prompt: str) -> str:
    """What identifies a stage across attempts: the same model asked the same thing."""
    return hashlib.sha256(f"{model}\0{max_tokens}\0{prompt}".encode()).hexdigest()


def ledger_request_id(request: GenerationRequest) -> str:
    """The id the ledger stores for a request."""
    return request.request_id


class JobService:
    def __init__(self, services: Services, settings: JobsSettings,
                 flush_ledger: Callable[[], object] | None = None) -> None:
        self.services = services
        self.settings = settings
        self.zone = household_zone(settings.timezone)
        self.allow = parse_allow_list(settings.url_allow)
        self.limits = Limits(settings.document_max_bytes, settings.output_max_tokens,
                             self.zone)
        self.flush_ledger = flush_ledger
        self.scheduler: AsyncIOScheduler | None = None
        self.live: dict[int, Live] = {}
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

    # ---- one run ----
    async def execute(self, run_id: int) -> None:
        if run_id in self.live or self._stopping:
            return
        started = await anyio.to_thread.run_sync(self._start, run_id)
        if started is None:
            return
        job, owner = started
        live = Live(run_id, job.id, job.user_id, time.time(),
                    task=asyncio.current_task())
        self.live[run_id] = live
        tally = Tally()
        status, output, error, size = "done", None, None, 0
        cursor: dict[str, Any] = {}
        log.info("job %d run %d started (owner %d)", job.id, run_id, job.user_id)
        try:
            doc = await self._read_source(job, owner)
            size, cursor = len(doc.text.encode()), doc.cursor
            if not doc.text.strip():
                output = "Nothing new since the last run."
            else:
                output = await self._summarise(job, owner, doc.text, live, tally)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # the run ends here; recording it must still work
            status = live.cancel_reason or "interrupted"
            error = ("cancelled" if status == "cancelled"
                     else "the daemon stopped during the run; it is retried once at start")
        except JobFailed as exc:
            status, error = exc.status, exc.reason
        except (Refused, fetch.FetchError, sources.SourceError, ValueError) as exc:
            status, error = "error", str(exc)
        except Exception as exc:
            log.exception("job %d run %d failed", job.id, run_id)
            status, error = "error", f"internal error ({type(exc).__name__})"
        finally:
            self.live.pop(run_id, None)
        if output is not None and len(output) > OUTPUT_MAX_CHARS:
            output = output[:OUTPUT_MAX_CHARS]
        await asyncio.shield(anyio.to_thread.run_sync(
            self._finish, run_id, job.id, status, output if status == "done" else None,
            error, size, tally, cursor if status == "done" else {}))
        log.info("job %d run %d %s: %d requests, %d+%d tokens, %d stages reused", job.id,
                 run_id, status, tally.requests, tally.prompt_tokens, tally.output_tokens,
                 tally.reused)
        if status == "done" and job.webhook_url and output is not None:
            await self._deliver(job, owner, run_id, output)

    def _start(self, run_id: int) -> tuple[Job, User] | None:
        with self.services.store.sessions.begin() as s:
            run = store_jobs.get_run(s, run_id)
            if run.status not in ("pending", "interrupted"):
                return None
            job = s.get(Job, run.job_id)
            owner = s.get(User, job.user_id) if job is not None else None
            if job is None or owner is None:
                return None
            store_jobs.start_run(s, run_id)
            s.expunge(job)
            s.expunge(owner)
            return job, owner

    def _finish(self, run_id: int, job_id: int, status: str, output: str | None,
                error: str | None, size: int, tally: Tally, cursor: dict[str, Any]) -> None:
        if self.flush_ledger is not None:
            self.flush_ledger()  # the run's counts are the ledger's sums
        with self.services.store.sessions.begin() as s:
            store_jobs.finish_run(s, run_id, status, output=output, error=error,
                                  source_bytes=size)
            if cursor and s.get(Job, job_id) is not None:
                store_jobs.set_cursor(s, job_id, json.dumps(cursor))
            pruned = store_jobs.prune_runs(s, job_id, keep=self.settings.runs_keep,
                                           max_age_s=self.settings.runs_keep_days * DAY_S)
        if pruned:
            log.info("job %d: %d old runs deleted", job_id, pruned)

    async def _read_source(self, job: Job, owner: User) -> sources.Document:
        s = self.settings
        if owner.disabled:
            raise JobFailed("error", "the job's owner is disabled")
        if job.source_kind == "text":
            return await anyio.to_thread.run_sync(sources.from_text, job.source_text or "",
                                                  s.document_max_bytes)
        cursor = json.loads(job.cursor) if job.cursor else {}
        if job.source_kind == "url":
            headers = json.loads(job.headers) if job.headers else {}
            fetched = await fetch.request("GET", job.url or "", self.guard(owner.role == "admin"),
                                          headers=headers, max_bytes=s.fetch_max_bytes,
                                          timeout=s.fetch_timeout)
            return await anyio.to_thread.run_sync(sources.from_fetched, fetched, cursor,
                                                  s.document_max_bytes)
        since = float(cursor.get("since") or job.created_at - DAY_S)
        return await anyio.to_thread.run_sync(self._conversations, owner.id, since)

    def _conversations(self, user_id: int, since: float) -> sources.Document:
        with self.services.store.read_sessions() as s:
            return sources.conversations_since(s, user_id, since, time.time(),
                                               self.settings.document_max_bytes)

    async def _summarise(self, job: Job, owner: User, text: str, live: Live,
                         tally: Tally) -> str:
        principal = Principal(owner.id, owner.name, owner.role, owner.max_class)
        model = self.services.model
        finished = await anyio.to_thread.run_sync(self._done_steps, live.run_id)
        if finished:
            log.info("job %d run %d resumes: %d stages already done", job.id, live.run_id,
                     len(finished))

        async def ask(prompt_text: str, max_tokens: int) -> str:
            # A stage an interrupted attempt finished is read back, not asked (and charged)
            # again; each new one is saved as soon as it is answered.
            key = step_key(model.name, max_tokens, prompt_text)
            if key in finished:
                tally.reused += 1
                return finished[key]
            answer = await self._ask(principal, live.run_id, prompt_text, max_tokens, tally)
            await anyio.to_thread.run_sync(self._save_step, live.run_id, key, answer,
                                           tally.ids[-1])
            return answer

        async def progress(done: int, total: int) -> None:
            live.done, live.total = done, total
            await anyio.to_thread.run_sync(self._progress, live.run_id, done, total)

        return await mapreduce.summarise(model.tokenizer, job.instructions, text,
                                         model.ctx_limit, job.max_output_tokens, ask, progress,
                                         self.settings.chunk_tokens)

    def _done_steps(self, run_id: int) -> dict[str, str]:
        with self.services.store.read_sessions() as s:
            return store_jobs.done_steps(s, run_id)

    def _save_step(self, run_id: int, key: str, output: str, request_id: str) -> None:
        with self.services.store.sessions.begin() as s:
            store_jobs.save_step(s, run_id, key, output, request_id)

    def _progress(self, run_id: int, done: int, total: int) -> None:
        with self.services.store.sessions.begin() as s:
            store_jobs.set_progress(s, run_id, done, total)

    def _record(self, run_id: int, request_id: str) -> None:
        with self.services.store.sessions.begin() as s:
            store_jobs.record_request(s, run_id, request_id)

    async def _ask(self, principal: Principal, run_id: int, text: str, max_tokens: int,
                   tally: Tally) -> str:
        """One stage: the owner's ``background`` request through the service, like any
        HTTP request."""
        prompt = text_prompt(self.services.model.tokenizer, [Turn("user", text)])
        for wait in (*BUSY_WAIT_S, None):
            try:
                gen = await submit(self.services, prompt, DEFAULTS, max_tokens,
                                   principal, Klass.BACKGROUND, JOB_ENDPOINT)
                break
            except (AtConcurrencyLimit, Unavailable) as exc:
                if wait is None:
                    raise JobFailed("error", exc.message) from None
                await asyncio.sleep(wait)  # busy or at the concurrency limit: wait a turn
            except OverQuota as exc:
                raise JobFailed("quota", exc.message) from None
            except ServiceError as exc:
                raise JobFailed("error", exc.message) from None
        request_id = ledger_request_id(gen.handle.request)
        tally.ids.append(request_id)
        await anyio.to_thread.run_sync(self._record, run_id, request_id)
        answer, finish = await gen.text()
        tally.requests += 1
        tally.prompt_tokens += finish.usage.prompt_tokens
        tally.output_tokens += finish.usage.completion_tokens
        if finish.reason is FinishReason.QUOTA:
            raise JobFailed("quota", "the owner's daily token quota ran out during the run")
        if not finish.reason.answered:
            raise JobFailed("error", f"a model request ended with {finish.reason}: "
                            f"{finish.error or 'no detail'}")
        return answer

    async def _deliver(self, job: Job, owner: User, run_id: int, output: str) -> None:
        body = json.dumps({"job": job.name, "job_id": job.id, "run_id": run_id,
                           "status": "done", "output": output}).encode()
        detail = ""
        for attempt in range(1, self.settings.webhook_retries + 1):
            try:
                got = await fetch.request(
                    "POST", job.webhook_url or "", self.guard(owner.role == "admin"),
                    headers={"Content-Type": "application/json"}, content=body,
                    max_bytes=WEBHOOK_MAX_BYTES, timeout=self.settings.fetch_timeout)
            except (Refused, fetch.FetchError) as exc:
                detail = str(exc)
                if isinstance(exc, Refused):
                    break
            else:
                if 200 <= got.status < 300:
                    await anyio.to_thread.run_sync(self._delivered, run_id, "sent",
                                                   f"HTTP {got.status} (attempt {attempt})")
                    return
                detail = f"HTTP {got.status}"
            if attempt < self.settings.webhook_retries:
                await asyncio.sleep(2 ** (attempt - 1))
        await anyio.to_thread.run_sync(self._delivered, run_id, "failed", detail)

    def _delivered(self, run_id: int, outcome: str, detail: str) -> None:
        with self.services.store.sessions.begin() as s:
            store_jobs.set_delivery(s, run_id, outcome, detail)
