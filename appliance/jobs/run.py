"""The life of one run: read the source, summarise it (``mapreduce``), store the output,
deliver it to the webhook, delete the job's old runs.

Each stage's answer is saved as it completes (``job_steps``): a retried run reads back the
stages an earlier attempt finished instead of asking them again. Every model request goes
through the service (``appliance.service.generation.submit``) as the owner, in the
``background`` class, with endpoint ``job``: the same counters, quotas and ledger as an HTTP
request. All writes are short ``BEGIN IMMEDIATE`` transactions on worker threads.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio

from appliance.jobs import fetch, mapreduce, sources
from appliance.jobs.netguard import Guard, Refused
from appliance.service.chat_format import Turn, text_prompt
from appliance.service.checks import DEFAULTS
from appliance.service.engine_client import GenerationRequest
from appliance.service.errors import AtConcurrencyLimit, OverQuota, ServiceError, Unavailable
from appliance.service.generation import off_loop, submit
from appliance.service.identity import Principal
from appliance.service.latency import JOB_ENDPOINT
from appliance.service.services import Services
from appliance.store import jobs as store_jobs
from appliance.store.models import Job, User
from appliance.vocab import DAY_S, FinishReason, Klass

if TYPE_CHECKING:
    from appliance.settings import JobsSettings

log = logging.getLogger(__name__)

BUSY_WAIT_S = (1, 2, 5, 10, 30, 60)
OUTPUT_MAX_CHARS = 64 * 1024
WEBHOOK_MAX_BYTES = 64 * 1024


class JobFailed(Exception):
    """Ends a run with ``status`` and ``reason``."""

    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


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


class RunLife:
    """The life of one run (:meth:`execute`), from its source to its delivery. ``live`` is
    the scheduler's map of runs in progress, which it cancels through their tasks."""

    def __init__(self, services: Services, settings: JobsSettings,
                 guard: Callable[[bool], Guard], live: dict[int, Live],
                 flush_ledger: Callable[[], object] | None = None) -> None:
        self.services = services
        self.settings = settings
        self.guard = guard
        self.live = live
        self.flush_ledger = flush_ledger

    async def execute(self, run_id: int) -> None:
        if run_id in self.live:
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
        # templated off the event loop, bounded like every prompt
        prompt = await off_loop(self.services, text_prompt, self.services.model.tokenizer,
                                [Turn("user", text)])
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
