"""Background job definitions and their runs.

Ownership works like conversations: a job that belongs to someone else is ``NotFound`` for
a member (admins see everyone's). Functions take a ``Session`` and never commit: the caller
owns the transaction. Runs are unique per (job, scheduled time): ``add_run`` returns None
for a slot that already has one, which is how a slot is never run twice.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from sqlalchemy import and_, delete, func, or_, select, update
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

from appliance.store.errors import AlreadyExists, Invalid, NotFound
from appliance.store.models import HouseholdSetting, Job, JobRun, JobStep, LedgerEntry, User

EDITABLE = ("name", "instructions", "source_kind", "source_text", "url", "headers",
            "schedule_kind", "cron", "interval_s", "max_output_tokens", "webhook_url", "paused")
FINISHED = ("done", "error", "quota", "cancelled")
ACTIVE = ("pending", "running")


DAEMON_URL_ALLOW = "daemon.jobs.url_allow"
"""The allow list the daemon last started with (``appliance job add`` checks with it too)."""


def record_daemon_url_allow(session: Session, text: str) -> None:
    row = session.get(HouseholdSetting, DAEMON_URL_ALLOW)
    if row is None:
        session.add(HouseholdSetting(key=DAEMON_URL_ALLOW, value=text))
    else:
        row.value = text


def daemon_url_allow(session: Session) -> str | None:
    """What :func:`record_daemon_url_allow` kept; None before any daemon started."""
    row = session.get(HouseholdSetting, DAEMON_URL_ALLOW)
    return None if row is None else row.value


def create_job(session: Session, user_id: int, fields: Mapping[str, Any],
               *, now: float | None = None) -> Job:
    stamp = time.time() if now is None else now
    job = Job(user_id=user_id, created_at=stamp, updated_at=stamp,
              **{k: v for k, v in fields.items() if k in EDITABLE})
    session.add(job)
    try:
        with session.begin_nested():
            session.flush()
    except IntegrityError:
        raise AlreadyExists(f"you already have a job named {fields.get('name')!r}") from None
    return job


def get_job(session: Session, job_id: int, *, viewer_id: int, admin: bool) -> Job:
    job = session.get(Job, job_id)
    if job is None or (not admin and job.user_id != viewer_id):
        raise NotFound("job not found")
    return job


def find_job(session: Session, user_id: int, name_or_id: str) -> Job:
    """A job of ``user_id`` by its name or id (for the CLI)."""
    query = select(Job).where(Job.user_id == user_id, Job.name == name_or_id)
    job = session.scalars(query).one_or_none()
    if job is None and name_or_id.isdigit():
        job = session.get(Job, int(name_or_id))
        if job is not None and job.user_id != user_id:
            job = None
    if job is None:
        raise NotFound(f"no job {name_or_id!r}")
    return job


def list_jobs(session: Session, user_id: int | None = None) -> list[Job]:
    """A user's jobs, or everyone's (``None``), by name."""
    query = select(Job).order_by(Job.user_id, Job.name)
    if user_id is not None:
        query = query.where(Job.user_id == user_id)
    return list(session.scalars(query))


def owner_names(session: Session) -> dict[int, str]:
    return {uid: name for uid, name in session.execute(select(User.id, User.name))}


def admin_ids(session: Session) -> set[int]:
    return set(session.scalars(select(User.id).where(User.role == "admin")))


def update_job(session: Session, job: Job, changes: Mapping[str, Any],
               *, now: float | None = None) -> Job:
    for key, value in changes.items():
        if key not in EDITABLE:
            raise Invalid(f"'{key}' cannot be changed")
        setattr(job, key, value)
    job.updated_at = time.time() if now is None else now
    try:
        with session.begin_nested():
            session.flush()
    except IntegrityError:
        raise AlreadyExists(f"you already have a job named {changes.get('name')!r}") from None
    return job


def set_cursor(session: Session, job_id: int, cursor: str) -> None:
    session.execute(update(Job).where(Job.id == job_id).values(cursor=cursor))


def delete_job(session: Session, job: Job) -> None:
    session.delete(job)
    session.flush()


# ---- runs ----
def add_run(session: Session, job_id: int, scheduled_for: float, trigger: str,
            *, now: float | None = None) -> JobRun | None:
    """A new pending run for the slot, or None when the slot already has one."""
    stamp = time.time() if now is None else now
    stmt = (sqlite_insert(JobRun)
            .values(job_id=job_id, scheduled_for=scheduled_for, trigger=trigger,
                    status="pending", attempts=0, created_at=stamp, chunks_total=0,
                    chunks_done=0, requests=0, prompt_tokens=0, output_tokens=0,
                    request_ids="", source_bytes=0)
            .on_conflict_do_nothing(index_elements=[JobRun.job_id, JobRun.scheduled_for]))
    result = session.execute(stmt)
    if not getattr(result, "rowcount", 0):
        return None
    return session.scalars(select(JobRun).where(JobRun.job_id == job_id,
                                                JobRun.scheduled_for == scheduled_for)).one()


def get_run(session: Session, run_id: int) -> JobRun:
    run = session.get(JobRun, run_id)
    if run is None:
        raise NotFound("run not found")
    return run


def list_runs(session: Session, job_id: int, *, limit: int = 50) -> list[JobRun]:
    query = (select(JobRun).where(JobRun.job_id == job_id)
             .order_by(JobRun.scheduled_for.desc(), JobRun.id.desc()).limit(limit))
    return list(session.scalars(query))


def runs_with_status(session: Session, statuses: tuple[str, ...]) -> list[JobRun]:
    return list(session.scalars(select(JobRun).where(JobRun.status.in_(statuses))
                                .order_by(JobRun.id)))


def start_run(session: Session, run_id: int, *, now: float | None = None) -> JobRun:
    run = get_run(session, run_id)
    run.status = "running"
    run.attempts += 1
    run.started_at = time.time() if now is None else now
    run.finished_at = None
    run.error = None
    return run


def record_request(session: Session, run_id: int, request_id: str) -> None:
    """Note a model request of the run before it is made (the ledger is matched on it)."""
    run = get_run(session, run_id)
    run.request_ids = f"{run.request_ids} {request_id}".strip()


def set_progress(session: Session, run_id: int, done: int, total: int) -> None:
    session.execute(update(JobRun).where(JobRun.id == run_id)
                    .values(chunks_done=done, chunks_total=total))


def done_steps(session: Session, run_id: int) -> dict[str, str]:
    """The run's finished stages: key -> output (see ``JobStep``)."""
    rows = session.execute(select(JobStep.key, JobStep.output)
                           .where(JobStep.run_id == run_id)).tuples().all()
    return dict(rows)


def save_step(session: Session, run_id: int, key: str, output: str, request_id: str,
              *, now: float | None = None) -> None:
    stamp = time.time() if now is None else now
    session.execute(sqlite_insert(JobStep)
                    .values(run_id=run_id, key=key, output=output, request_id=request_id,
                            created_at=stamp)
                    .on_conflict_do_nothing(index_elements=[JobStep.run_id, JobStep.key]))


def forget_steps(session: Session, run_id: int) -> None:
    session.execute(delete(JobStep).where(JobStep.run_id == run_id))


def usage_from_ledger(session: Session, run: JobRun) -> None:
    """The run's request and token counts: the ledger's sums over its request ids."""
    ids = run.request_ids.split()
    if not ids:
        run.requests = run.prompt_tokens = run.output_tokens = 0
        return
    n, prompt, output = session.execute(
        select(func.count(), func.coalesce(func.sum(LedgerEntry.prompt_tokens), 0),
               func.coalesce(func.sum(LedgerEntry.output_tokens), 0))
        .where(LedgerEntry.request_id.in_(ids), LedgerEntry.endpoint == "job")).one()
    run.requests, run.prompt_tokens, run.output_tokens = int(n), int(prompt), int(output)


def finish_run(session: Session, run_id: int, status: str, *, output: str | None = None,
               error: str | None = None, source_bytes: int | None = None,
               now: float | None = None) -> JobRun:
    if status not in (*FINISHED, "interrupted"):
        raise ValueError(f"not a finished status: {status}")
    run = get_run(session, run_id)
    run.status = status
    run.finished_at = time.time() if now is None else now
    if status == "interrupted":
        run.interrupted_at = run.finished_at
    run.output = output
    run.error = error
    if source_bytes is not None:
        run.source_bytes = source_bytes
    if status != "interrupted":
        forget_steps(session, run_id)  # only a retry reads them
    usage_from_ledger(session, run)
    return run


def set_delivery(session: Session, run_id: int, outcome: str, detail: str) -> None:
    session.execute(update(JobRun).where(JobRun.id == run_id)
                    .values(delivery=outcome, delivery_detail=detail))


def last_slot(session: Session, job_id: int) -> float | None:
    """The latest scheduled slot that has a run (catch-up starts after it)."""
    return session.scalar(select(func.max(JobRun.scheduled_for))
                          .where(JobRun.job_id == job_id,
                                 JobRun.trigger.in_(("schedule", "catch-up"))))


def last_success(session: Session, job_id: int) -> float | None:
    return session.scalar(select(func.max(JobRun.started_at))
                          .where(JobRun.job_id == job_id, JobRun.status == "done"))


def prune_runs(session: Session, job_id: int, *, keep: int, max_age_s: float = 0,
               now: float | None = None) -> int:
    """Delete the job's finished runs beyond its newest ``keep`` and, when ``max_age_s``,
    those finished longer ago; the number deleted. Never deleted: unfinished runs (pending,
    running, interrupted with a retry left), the newest run, and the latest scheduled one
    (``last_slot``: catch-up after a restart counts from it)."""
    stamp = time.time() if now is None else now
    mine = JobRun.job_id == job_id
    newest = (select(JobRun.id).where(mine)
              .order_by(JobRun.scheduled_for.desc(), JobRun.id.desc()))
    anchor = (select(JobRun.id).where(mine, JobRun.trigger.in_(("schedule", "catch-up")))
              .order_by(JobRun.scheduled_for.desc(), JobRun.id.desc()).limit(1))
    finished = or_(JobRun.status.in_(FINISHED),
                   and_(JobRun.status == "interrupted", JobRun.attempts >= 2))
    stale: ColumnElement[bool] = JobRun.id.not_in(newest.limit(keep))
    if max_age_s > 0:
        stale = or_(stale, JobRun.finished_at < stamp - max_age_s)
    result = session.execute(
        delete(JobRun).where(mine, finished, stale, JobRun.id.not_in(newest.limit(1)),
                             JobRun.id.not_in(anchor))
        .execution_options(synchronize_session=False))
    return int(getattr(result, "rowcount", 0) or 0)


def interrupt_leftovers(session: Session, *, now: float | None = None) -> list[int]:
    """At start-up: runs left ``running`` by a daemon that died are ``interrupted``; the
    ids of runs to retry (interrupted ones tried only once so far). Pending runs stay."""
    stamp = time.time() if now is None else now
    for run in runs_with_status(session, ("running",)):
        run.status = "interrupted"
        run.interrupted_at = stamp
        run.finished_at = stamp
        usage_from_ledger(session, run)
    retry = []
    for run in runs_with_status(session, ("interrupted",)):
        if run.attempts < 2:
            retry.append(run.id)
        else:
            forget_steps(session, run.id)  # never retried: its stages are of no use
    return retry
