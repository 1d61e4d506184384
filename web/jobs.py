"""The Jobs page: define a job (a schedule picker that says the next runs in words), run it
now, watch its progress, read its history with outputs rendered as safe Markdown.

The page lives at ``/jobs/page`` (``/jobs`` itself is the JSON API). The forms call the same
functions as the API (``appliance.api.jobs``), so the rules are the API's. While a run is in
progress the list and the history re-render every second (htmx polling that stops by itself
once nothing runs).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import anyio
from litestar import Request, Response, get, post
from litestar.params import FromPath, FromQuery
from litestar.response import Redirect, Template

from appliance.api import jobs as api_jobs
from appliance.jobs.phrases import parse_schedule
from appliance.jobs.runner import JobService
from appliance.jobs.schedule import describe, in_words, make_trigger, next_times
from appliance.service.identity import Principal
from appliance.store.errors import AlreadyExists, Invalid, NotFound
from appliance.vocab import Refused
from web.common import PAGE, form_fields, is_htmx, me, page, services


def _list(jobs: JobService, who: Principal) -> list[dict[str, Any]]:
    return api_jobs._list(jobs, who)


def _jobs(request: Request[Any, Any, Any]) -> JobService:
    return api_jobs.job_service(request.app.state)


def _int(f: dict[str, str], key: str) -> int | None:
    value = f.get(key, "").strip()
    if not value:
        return None
    if not value.lstrip("-").isdigit():
        raise Invalid(f"'{key}' must be a whole number")
    return int(value)


def fields_from_form(f: dict[str, str]) -> dict[str, Any]:
    """The form's fields as the API's (stored) field names."""
    out: dict[str, Any] = {"name": f.get("name", ""), "instructions": f.get("instructions"),
                           "source_kind": f.get("source") or "text",
                           "schedule_kind": f.get("schedule") or "none",
                           "cron": f.get("cron"), "webhook_url": f.get("webhook_url") or None}
    if out["source_kind"] == "text":
        out["source_text"] = f.get("text", "")
    elif out["source_kind"] == "url":
        out["url"] = f.get("url", "")
        headers: dict[str, str] = {}
        for line in f.get("headers", "").splitlines():
            if line.strip():
                name, sep, value = line.partition(":")
                if not sep:
                    raise Invalid("headers: one 'Name: value' per line")
                headers[name.strip()] = value.strip()
        out["headers"] = headers
    if out["schedule_kind"] == "interval":
        minutes = _int(f, "interval_min")
        out["interval_s"] = None if minutes is None else minutes * 60
    out["max_output_tokens"] = _int(f, "max_output_tokens")
    return {k: v for k, v in out.items() if v is not None}


@get("/jobs/page", opt=PAGE)
async def jobs_page(request: Request[Any, Any, Any]) -> Template:
    jobs = await anyio.to_thread.run_sync(_list, _jobs(request), me(request))
    return page(request, "jobs.html", nav="jobs", jobs=jobs, notice=None, form={})


@get("/jobs/page/list")
async def jobs_list(request: Request[Any, Any, Any]) -> Template:
    jobs = await anyio.to_thread.run_sync(_list, _jobs(request), me(request))
    return page(request, "_jobs_list.html", jobs=jobs, notice=None)


def _minutes(text: str) -> int | None:
    """The interval field in whole minutes (None when empty); Refused otherwise."""
    if not text.strip():
        return None
    try:
        return int(text)
    except ValueError:
        raise Refused(f"the interval {text.strip()!r} is not a whole number of minutes") from None


@get("/jobs/page/preview")
async def schedule_preview(request: Request[Any, Any, Any], schedule: FromQuery[str] = "none",
                           cron: FromQuery[str] = "",
                           interval_min: FromQuery[str] = "") -> Template:
    """The schedule in words and its next three runs, or what is wrong with it."""
    svc = _jobs(request)
    now = datetime.now(svc.zone)
    try:
        minutes = _minutes(interval_min)
        seconds = None if minutes is None else minutes * 60
        if schedule == "cron":  # words ('every day at 7') as the job will store them
            parsed = parse_schedule(cron)
            schedule, cron, seconds = parsed.kind, parsed.cron or "", parsed.interval_s
        trigger = make_trigger(schedule, cron or None, seconds, now.timestamp(), svc.zone)
        words = describe(schedule, cron or None, seconds)
        upcoming = [in_words(t, now) for t in next_times(trigger, now, 3)]
        error = None
    except Refused as exc:
        words, upcoming, error = "", [], str(exc)
    return page(request, "_jobs_preview.html", words=words, upcoming=upcoming, error=error)


@post("/jobs/page", status_code=201)
async def create_from_form(request: Request[Any, Any, Any]) -> Response[Any]:
    who = me(request)
    f = await form_fields(request)
    status = 201
    try:
        made = await anyio.to_thread.run_sync(api_jobs.create, _jobs(request), who,
                                              fields_from_form(f))
        _jobs(request).reschedule()
        notice = ("ok", f"Job “{made['name']}” created.")
        form: dict[str, str] = {}
    except (ValueError, AlreadyExists) as exc:
        status = 409 if isinstance(exc, AlreadyExists) else 400
        notice, form = ("error", f"Could not create the job: {exc}"), f
    if not is_htmx(request) and status == 201:
        return Redirect("/jobs/page", status_code=303)
    jobs = await anyio.to_thread.run_sync(_list, _jobs(request), who)
    return page(request, "_jobs_panel.html", status_code=status, jobs=jobs, notice=notice,
                form=form)


async def _after(request: Request[Any, Any, Any], notice: tuple[str, str],
                 job_id: int | None = None) -> Response[Any]:
    if not is_htmx(request):
        return Redirect(f"/jobs/page/{job_id}" if job_id else "/jobs/page", status_code=303)
    if job_id is not None and request.headers.get("hx-target") == "history":
        return await _history(request, job_id)
    jobs = await anyio.to_thread.run_sync(_list, _jobs(request), me(request))
    return page(request, "_jobs_list.html", jobs=jobs, notice=notice)


@post("/jobs/page/{job_id:int}/run", status_code=200)
async def run_from_page(request: Request[Any, Any, Any], job_id: FromPath[int]) -> Response[Any]:
    svc, who = services(request), me(request)
    await anyio.to_thread.run_sync(api_jobs._check, svc, who, job_id)  # another's: 404
    run_id = await _jobs(request).run_now(job_id)
    return await _after(request, ("ok", f"Run {run_id} started."), job_id)


@post("/jobs/page/{job_id:int}/{action:str}", status_code=200)
async def change_from_page(request: Request[Any, Any, Any], job_id: FromPath[int],
                           action: FromPath[str]) -> Response[Any]:
    svc, who = services(request), me(request)
    if action in ("pause", "resume"):
        await anyio.to_thread.run_sync(api_jobs.edit, _jobs(request), who, job_id,
                                       {"paused": action == "pause"})
        _jobs(request).reschedule()
        return await _after(request, ("ok", f"Job {action}d."))
    if action == "delete":
        await anyio.to_thread.run_sync(api_jobs._delete, svc, who, job_id)
        _jobs(request).forget(job_id)
        return await _after(request, ("ok", "Job deleted."))
    raise NotFound("no such action")


@post("/jobs/page/{job_id:int}/runs/{run_id:int}/cancel", status_code=200)
async def cancel_from_page(request: Request[Any, Any, Any], job_id: FromPath[int],
                           run_id: FromPath[int]) -> Response[Any]:
    svc, who = services(request), me(request)
    await anyio.to_thread.run_sync(api_jobs._run, svc, who, job_id, run_id)
    await _jobs(request).cancel(run_id)
    return await _history(request, job_id)


def _detail(jobs: JobService, who: Principal, job_id: int
            ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    job = api_jobs._get(jobs, who, job_id)
    with jobs.services.store.read_sessions() as s:
        from appliance.store import jobs as store_jobs

        runs = [api_jobs.run_json(r, output=True)
                for r in store_jobs.list_runs(s, job_id, limit=api_jobs.RUNS_LIMIT)]
    return job, runs


@get("/jobs/page/{job_id:int}", opt=PAGE)
async def job_page(request: Request[Any, Any, Any], job_id: FromPath[int]) -> Template:
    job, runs = await anyio.to_thread.run_sync(_detail, _jobs(request), me(request), job_id)
    return page(request, "job.html", nav="jobs", job=job, runs=runs,
                headers_json=json.dumps(job["source"]["headers"]))


@get("/jobs/page/{job_id:int}/history")
async def history(request: Request[Any, Any, Any], job_id: FromPath[int]) -> Template:
    return await _history(request, job_id)


async def _history(request: Request[Any, Any, Any], job_id: int) -> Template:
    job, runs = await anyio.to_thread.run_sync(_detail, _jobs(request), me(request), job_id)
    return page(request, "_job_history.html", job=job, runs=runs)


ROUTES = [jobs_page, jobs_list, schedule_preview, create_from_form, run_from_page,
          change_from_page, cancel_from_page, job_page, history]
