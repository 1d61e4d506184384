"""``/jobs``: background summary jobs over JSON (API key, or a session with CSRF).

Members see and change their own jobs only (another member's answers 404, exactly like one
that does not exist); admins see everyone's. Handlers parse and authorize; the rules live
in ``appliance.jobs`` and ``appliance.store.jobs``.
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from typing import Any

import anyio
import msgspec
from litestar import Request, Response, delete, get, patch, post
from litestar.datastructures import State
from litestar.params import FromPath

from appliance.api.common import decode_body
from appliance.api.errors import ApiError, bad_request
from appliance.jobs import definition
from appliance.jobs.runner import JobService
from appliance.jobs.schedule import describe, in_words, make_trigger, next_times
from appliance.service.identity import Principal
from appliance.service.services import Services
from appliance.store import jobs as store_jobs
from appliance.store.errors import NotFound
from appliance.store.models import Job, JobRun, User

RUNS_LIMIT = 50


class JobBody(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Create: name and a source are needed; edit: any subset (``headers`` absent keeps
    the stored ones, ``{}`` clears them)."""

    name: str | None = None
    instructions: str | None = None
    source: str | None = None
    text: str | None = None
    url: str | None = None
    headers: dict[str, str] | None = None
    schedule: str | None = None
    cron: str | None = None
    interval_s: int | None = None
    max_output_tokens: int | None = None
    webhook_url: str | None = None
    paused: bool | None = None


_FIELD = {"source": "source_kind", "text": "source_text", "schedule": "schedule_kind"}


def body_fields(body: JobBody) -> dict[str, Any]:
    raw = msgspec.structs.asdict(body)
    return {_FIELD.get(k, k): v for k, v in raw.items() if v is not None}


def _services(state: State) -> Services:
    return state.services


def job_fields(job: Job) -> dict[str, Any]:
    return {k: getattr(job, k) for k in store_jobs.EDITABLE}


SCHEDULE_FIELDS = ("schedule_kind", "cron", "interval_s")


def validate_for(jobs: JobService, fields: dict[str, Any], owner_is_admin: bool,
                 now: float | None = None, *, floor: bool = True) -> dict[str, Any]:
    """``floor``: check the owner's shortest schedule (an edit that leaves the schedule as
    it was skips it, so a job stored before the rule can still be paused or renamed)."""
    return definition.validate(fields, jobs.limits, jobs.guard(owner_is_admin), now=now,
                               min_interval_s=jobs.min_interval(owner_is_admin) if floor else 0)


def run_json(run: JobRun, *, output: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": run.id, "job_id": run.job_id, "status": run.status, "trigger": run.trigger,
        "scheduled_for": run.scheduled_for, "attempts": run.attempts,
        "started_at": run.started_at, "finished_at": run.finished_at,
        "interrupted_at": run.interrupted_at,
        "progress": {"done": run.chunks_done, "total": run.chunks_total},
        "requests": run.requests, "prompt_tokens": run.prompt_tokens,
        "output_tokens": run.output_tokens, "source_bytes": run.source_bytes,
        "error": run.error, "delivery": run.delivery, "delivery_detail": run.delivery_detail,
    }
    if output:
        out["output"] = run.output
        out["request_ids"] = run.request_ids.split()
    return out


def job_json(svc: JobService, job: Job, owner: str, last: JobRun | None = None
             ) -> dict[str, Any]:
    now = datetime.now(svc.zone)
    trigger = make_trigger(job.schedule_kind, job.cron, job.interval_s, job.created_at, svc.zone)
    upcoming = [] if job.paused else next_times(trigger, now, 3)
    live = next((v for v in svc.live.values() if v.job_id == job.id), None)
    headers = json.loads(job.headers) if job.headers else {}
    return {
        "id": job.id, "owner": owner, "owner_id": job.user_id, "name": job.name,
        "instructions": job.instructions,
        "source": {"kind": job.source_kind, "url": job.url,
                   "text_bytes": len((job.source_text or "").encode()),
                   "headers": {k: "(set)" for k in headers}},
        "schedule": {"kind": job.schedule_kind, "cron": job.cron, "interval_s": job.interval_s,
                     "description": describe(job.schedule_kind, job.cron, job.interval_s),
                     "next_runs": [t.isoformat() for t in upcoming],
                     "next_runs_in_words": [in_words(t, now) for t in upcoming]},
        "max_output_tokens": job.max_output_tokens, "webhook_url": job.webhook_url,
        "paused": job.paused, "created_at": job.created_at, "updated_at": job.updated_at,
        "running": None if live is None else {"run_id": live.run_id, "done": live.done,
                                              "total": live.total},
        "last_run": None if last is None else run_json(last),
    }


# ---- blocking parts (worker threads) ----
def _list(jobs: JobService, viewer: Principal) -> list[dict[str, Any]]:
    with jobs.services.store.read_sessions() as s:
        names = store_jobs.owner_names(s)
        found = store_jobs.list_jobs(s, None if viewer.is_admin else viewer.user_id)
        lasts = {j.id: next(iter(store_jobs.list_runs(s, j.id, limit=1)), None) for j in found}
    return [job_json(jobs, j, names.get(j.user_id, "?"), lasts[j.id]) for j in found]


def _get(jobs: JobService, viewer: Principal, job_id: int) -> dict[str, Any]:
    with jobs.services.store.read_sessions() as s:
        job = store_jobs.get_job(s, job_id, viewer_id=viewer.user_id, admin=viewer.is_admin)
        owner = s.get(User, job.user_id)
        last = next(iter(store_jobs.list_runs(s, job.id, limit=1)), None)
    return job_json(jobs, job, owner.name if owner else "?", last)


def create(jobs: JobService, viewer: Principal, fields: dict[str, Any]) -> dict[str, Any]:
    now = time.time()
    clean = validate_for(jobs, fields, viewer.is_admin, now)
    with jobs.services.store.sessions.begin() as s:
        job = store_jobs.create_job(s, viewer.user_id, clean, now=now)
    return job_json(jobs, job, viewer.name)


def edit(jobs: JobService, viewer: Principal, job_id: int, changes: dict[str, Any]
         ) -> dict[str, Any]:
    with jobs.services.store.sessions.begin() as s:
        job = store_jobs.get_job(s, job_id, viewer_id=viewer.user_id, admin=viewer.is_admin)
        owner = s.get(User, job.user_id)
        assert owner is not None
        merged = {**job_fields(job), **changes}
        if "headers" not in changes and job.headers:
            merged["headers"] = json.loads(job.headers)
        if changes.get("source_kind", job.source_kind) != job.source_kind:
            merged.setdefault("source_text", None)
        clean = validate_for(jobs, merged, owner.role == "admin", job.created_at,
                             floor=any(k in changes for k in SCHEDULE_FIELDS))
        store_jobs.update_job(s, job, clean)
        name = owner.name
    return job_json(jobs, job, name)


def _delete(services: Services, viewer: Principal, job_id: int) -> None:
    with services.store.sessions.begin() as s:
        job = store_jobs.get_job(s, job_id, viewer_id=viewer.user_id, admin=viewer.is_admin)
        store_jobs.delete_job(s, job)


def _runs(services: Services, viewer: Principal, job_id: int) -> list[dict[str, Any]]:
    with services.store.read_sessions() as s:
        store_jobs.get_job(s, job_id, viewer_id=viewer.user_id, admin=viewer.is_admin)
        return [run_json(r) for r in store_jobs.list_runs(s, job_id, limit=RUNS_LIMIT)]


def _run(services: Services, viewer: Principal, job_id: int, run_id: int) -> dict[str, Any]:
    with services.store.read_sessions() as s:
        store_jobs.get_job(s, job_id, viewer_id=viewer.user_id, admin=viewer.is_admin)
        run = store_jobs.get_run(s, run_id)
        if run.job_id != job_id:
            raise NotFound("run not found")
        return run_json(run, output=True)


def _check(services: Services, viewer: Principal, job_id: int) -> None:
    with services.store.read_sessions() as s:
        store_jobs.get_job(s, job_id, viewer_id=viewer.user_id, admin=viewer.is_admin)


def refused(exc: definition.InvalidJob) -> ApiError:
    """A definition refused: 400 naming the field (``param``) and ``invalid_value``."""
    return bad_request(str(exc), "invalid_value", exc.param)


def job_service(state: State) -> JobService:
    """The job scheduler (``create_app``'s ``jobs``); a 503 where this process has none."""
    jobs: JobService | None = state.get("jobs")
    if jobs is None:
        raise ApiError(503, "Jobs are not available in this process.", "overloaded")
    return jobs


# ---- handlers ----
@get("/jobs")
async def list_jobs(request: Request, state: State) -> list[dict[str, Any]]:
    return await anyio.to_thread.run_sync(_list, job_service(state), request.user)


@post("/jobs", status_code=201)
async def create_job(request: Request, state: State) -> dict[str, Any]:
    svc = job_service(state)
    fields = body_fields(decode_body(await request.body(), JobBody))
    try:
        made = await anyio.to_thread.run_sync(create, svc, request.user,
                                              definition.schedule_fields(fields))
    except definition.InvalidJob as exc:
        raise refused(exc) from None
    svc.reschedule()
    return made


@get("/jobs/{job_id:int}")
async def get_job(request: Request, state: State, job_id: FromPath[int]) -> dict[str, Any]:
    return await anyio.to_thread.run_sync(_get, job_service(state), request.user, job_id)


@patch("/jobs/{job_id:int}")
async def edit_job(request: Request, state: State, job_id: FromPath[int]) -> dict[str, Any]:
    svc = job_service(state)
    changes = body_fields(decode_body(await request.body(), JobBody))
    if not changes:
        raise ApiError(400, "Nothing to change: send at least one field.",
                       code="invalid_value")
    try:
        done = await anyio.to_thread.run_sync(edit, svc, request.user, job_id,
                                              definition.schedule_fields(changes))
    except definition.InvalidJob as exc:
        raise refused(exc) from None
    svc.reschedule()
    return done


@delete("/jobs/{job_id:int}", status_code=204)
async def delete_job(request: Request, state: State, job_id: FromPath[int]) -> None:
    services = _services(state)
    svc = job_service(state)
    await anyio.to_thread.run_sync(_delete, services, request.user, job_id)
    svc.forget(job_id)


@post("/jobs/{job_id:int}/run", status_code=202)
async def run_job(request: Request, state: State, job_id: FromPath[int]) -> dict[str, Any]:
    services = _services(state)
    svc = job_service(state)
    await anyio.to_thread.run_sync(_check, services, request.user, job_id)
    run_id = await svc.run_now(job_id)
    return await anyio.to_thread.run_sync(_run, services, request.user, job_id, run_id)


@get("/jobs/{job_id:int}/runs")
async def list_runs(request: Request, state: State, job_id: FromPath[int]
                    ) -> list[dict[str, Any]]:
    services = _services(state)
    return await anyio.to_thread.run_sync(_runs, services, request.user, job_id)


@get("/jobs/{job_id:int}/runs/{run_id:int}")
async def get_run(request: Request, state: State, job_id: FromPath[int],
                  run_id: FromPath[int]) -> dict[str, Any]:
    services = _services(state)
    return await anyio.to_thread.run_sync(_run, services, request.user, job_id, run_id)


@post("/jobs/{job_id:int}/runs/{run_id:int}/cancel", status_code=200)
async def cancel_run(request: Request, state: State, job_id: FromPath[int],
                     run_id: FromPath[int]) -> Response[dict[str, Any]]:
    services = _services(state)
    svc = job_service(state)
    await anyio.to_thread.run_sync(_run, services, request.user, job_id, run_id)
    cancelled = await svc.cancel(run_id)
    if not cancelled:
        raise ApiError(409, "The run has already finished.", "conflict_error", "finished")
    return Response({"id": run_id, "cancelled": True})


ROUTES = [list_jobs, create_job, get_job, edit_job, delete_job, run_job, list_runs, get_run,
          cancel_run]
