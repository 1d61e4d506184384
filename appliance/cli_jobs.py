"""``appliance job list | add | run | pause | resume | rm``: background jobs from the shell.

These work on the database directly, like ``appliance user``; a running daemon notices the
change within a few seconds (it re-reads the jobs table), and ``job run`` queues a run that
the daemon starts then.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from appliance.settings import Settings

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from appliance.jobs.netguard import AllowEntry
    from appliance.store.models import Job


def add_parsers(sub: argparse._SubParsersAction) -> None:
    from appliance import settings as settings_mod

    job = sub.add_parser("job", help="background summary jobs")
    settings_mod.add_flags(job)
    jsub = job.add_subparsers(dest="job_cmd", required=True)
    ls = jsub.add_parser("list", help="jobs, their schedules and last runs")
    ls.add_argument("--user", default=None, help="only this user's jobs")
    add = jsub.add_parser("add", help="define a job")
    add.add_argument("name")
    add.add_argument("--user", required=True, help="the job's owner")
    src = add.add_mutually_exclusive_group(required=True)
    src.add_argument("--text-file", type=Path, help="summarise this document (text, "
                     "Markdown or HTML; '-' reads standard input)")
    src.add_argument("--url", help="fetch this page or RSS/Atom feed at each run")
    src.add_argument("--conversations", action="store_true",
                     help="the owner's chats since the last run")
    add.add_argument("--header", action="append", default=[], metavar="NAME:VALUE",
                     help="a header sent with --url (repeatable)")
    add.add_argument("--instructions", default=None, help="what to produce")
    when = add.add_mutually_exclusive_group()
    when.add_argument("--cron", default=None, help="when: a 5-field cron ('0 7 * * *'), "
                      "@daily, or words ('every day at 7', 'every monday at 8:30')")
    when.add_argument("--every", type=int, default=None, metavar="SECONDS",
                      help="run every this many seconds")
    add.add_argument("--max-output-tokens", type=int, default=None)
    add.add_argument("--webhook", default=None, help="POST each result here as JSON")
    parsers = [ls, add]
    for name, text in (("run", "queue a run now"), ("pause", "stop scheduling it"),
                       ("resume", "schedule it again"), ("rm", "delete it and its runs")):
        p = jsub.add_parser(name, help=text)
        p.add_argument("job", help="the job's id, or its name")
        p.add_argument("--user", default=None, help="whose job (when names clash)")
        parsers.append(p)
    for p in parsers:  # the settings flags after the subcommand too (job add ... --url-allow)
        settings_mod.add_flags(p, sections=("store", "jobs"), suppress=True)


def run(settings: Settings, args: argparse.Namespace) -> int:
    from appliance.cli_admin import db_path
    from appliance.store import migrate
    from appliance.store.datadir import check_not_lost
    from appliance.store.db import open_store
    from appliance.store.errors import AlreadyExists, NotFound

    path = db_path(settings)
    check_not_lost(path)  # never a new empty database beside a backup
    migrate.upgrade(path)
    store = open_store(path)
    try:
        with store.sessions.begin() as s:
            return _job(s, settings, args)
    except (ValueError, NotFound, AlreadyExists) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        store.close()


def _job(s: Session, settings: Settings, args: argparse.Namespace) -> int:
    from appliance.jobs import definition
    from appliance.jobs.netguard import Guard
    from appliance.jobs.schedule import describe, household_zone
    from appliance.store import jobs, users

    if args.job_cmd == "list":
        uid = users.require_user(s, args.user).id if args.user else None
        names = jobs.owner_names(s)
        for j in jobs.list_jobs(s, uid):
            last = next(iter(jobs.list_runs(s, j.id, limit=1)), None)
            state = "paused" if j.paused else "active"
            print(f"{j.id}\t{names.get(j.user_id, '?')}\t{j.name}\t{j.source_kind}\t"
                  f"{describe(j.schedule_kind, j.cron, j.interval_s)}\t{state}\t"
                  f"last={last.status if last else 'never'}")
        return 0
    if args.job_cmd == "add":
        owner = users.require_user(s, args.user)
        fields: dict[str, object] = {"name": args.name, "instructions": args.instructions,
                                     "max_output_tokens": args.max_output_tokens,
                                     "webhook_url": args.webhook}
        if args.text_file is not None:
            text = (sys.stdin.read() if str(args.text_file) == "-"
                    else args.text_file.read_text(encoding="utf-8"))
            fields.update(source_kind="text", source_text=text)
        elif args.url:
            headers = {}
            for h in args.header:
                name, sep, value = h.partition(":")
                if not sep:
                    raise ValueError(f"--header needs NAME:VALUE, got {h!r}")
                headers[name.strip()] = value.strip()
            fields.update(source_kind="url", url=args.url, headers=headers)
        else:
            fields.update(source_kind="conversations")
        if args.cron:
            fields.update(schedule_kind="cron", cron=args.cron)
        elif args.every is not None:
            fields.update(schedule_kind="interval", interval_s=args.every)
        js = settings.jobs
        limits = definition.Limits(js.document_max_bytes, js.output_max_tokens,
                                   household_zone(js.timezone))
        allow = _allow_list(s, js.url_allow) if args.url or args.webhook else ()
        guard = Guard(allow, privileged=owner.role == "admin")
        now = time.time()
        floor = js.admin_min_interval if owner.role == "admin" else js.member_min_interval
        clean = definition.validate({k: v for k, v in fields.items() if v is not None},
                                    limits, guard, now=now, min_interval_s=floor)
        job = jobs.create_job(s, owner.id, clean, now=now)
        print(f"job {job.id} added for {owner.name}: "
              f"{describe(job.schedule_kind, job.cron, job.interval_s)}")
        return 0
    job = _find(s, args.job, args.user)
    if args.job_cmd == "run":
        run = jobs.add_run(s, job.id, time.time(), "manual")
        assert run is not None
        print(f"run {run.id} of job {job.id} queued; the daemon starts it within seconds")
    elif args.job_cmd in ("pause", "resume"):
        jobs.update_job(s, job, {"paused": args.job_cmd == "pause"})
        print(f"job {job.id} {'paused' if job.paused else 'resumed'}")
    else:
        jobs.delete_job(s, job)
        print(f"job {job.id} deleted")
    return 0


def _allow_list(s: Session, own: str) -> tuple[AllowEntry, ...]:
    """The addresses an admin's job may reach: this command's own setting (the same config
    file, environment and flags as the daemon's) and the list the daemon last started with,
    which it enforces at every fetch (its flags are not in this command's environment)."""
    from appliance.jobs.netguard import parse_allow_list
    from appliance.store import jobs

    daemon = jobs.daemon_url_allow(s)
    if daemon is not None and daemon.strip() != own.strip():
        print(f"note: the daemon last started with url_allow={daemon!r}; it is what its runs "
              f"may reach (this command's own: {own!r})", file=sys.stderr)
    return parse_allow_list(own) + parse_allow_list(daemon or "")


def _find(s: Session, ref: str, user: str | None) -> Job:
    from sqlalchemy import select

    from appliance.store import jobs, users
    from appliance.store.errors import NotFound
    from appliance.store.models import Job
    if user:
        return jobs.find_job(s, users.require_user(s, user).id, ref)
    if ref.isdigit():
        found = s.get(Job, int(ref))
        if found is not None:
            return found
    matches = list(s.scalars(select(Job).where(Job.name == ref)))
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise ValueError(f"several users have a job named {ref!r}; add --user")
    raise NotFound(f"no job {ref!r}")
