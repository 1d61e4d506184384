"""How often a job may run and how many of its runs are kept (issue #37, item 8): a
member's schedule has a floor (an admin's a lower one), a job stored before the floor runs
no more often than it allows, and old runs are deleted after each run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import func, select

from appliance.store import jobs as store_jobs
from appliance.store.models import JobRun
from tests.helpers import LiveServer, live_server, make_settings, wait_until
from tests.jobs.test_jobs_api import make_job, run_now


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[LiveServer]:
    # the floors at their defaults (members 300 s, admins 60 s); three runs kept per job
    with live_server(make_settings(tiny_model, runs_keep=3)) as s:
        yield s


def test_a_member_cannot_schedule_a_job_more_often_than_every_five_minutes(
        server: LiveServer) -> None:
    with server.client("bob") as bob:
        r = bob.post("/jobs", json={"name": "spin", "source": "text", "text": "t",
                                    "schedule": "interval", "interval_s": 1})
        assert r.status_code == 400
        message = r.json()["error"]["message"]
        assert "'interval_s'" in message and "300 seconds" in message
        assert "jobs.member_min_interval" in message
        r = bob.post("/jobs", json={"name": "spin", "source": "text", "text": "t",
                                    "schedule": "cron", "cron": "* * * * *"})
        assert r.status_code == 400
        assert "'cron' runs 60 seconds apart" in r.json()["error"]["message"]
        page = bob.post("/jobs/page", data={"name": "spin", "source": "text", "text": "t",
                                            "schedule": "interval", "interval_min": "1"},
                        headers={"HX-Request": "true"})
        assert page.status_code == 400 and "jobs.member_min_interval" in page.text
        job = make_job(bob, source="text", text="t", schedule="interval", interval_s=300)
        r = bob.patch(f"/jobs/{job['id']}", json={"interval_s": 10})
        assert r.status_code == 400 and "jobs.member_min_interval" in r.text
        assert bob.get(f"/jobs/{job['id']}").json()["schedule"]["interval_s"] == 300
        make_job(bob, source="text", text="t", schedule="cron", cron="*/5 * * * *")


def test_an_admin_may_go_down_to_a_minute_and_no_lower(server: LiveServer) -> None:
    with server.client("alice") as alice:
        r = alice.post("/jobs", json={"name": "fast", "source": "text", "text": "t",
                                      "schedule": "interval", "interval_s": 59})
        assert r.status_code == 400
        assert "60 seconds" in r.text and "jobs.admin_min_interval" in r.text
        make_job(alice, source="text", text="t", schedule="interval", interval_s=60)
        make_job(alice, source="text", text="t", schedule="cron", cron="* * * * *")


def test_a_job_stored_before_the_floor_runs_at_the_floor_and_can_still_be_paused(
        server: LiveServer) -> None:
    with server.store.sessions.begin() as s:
        job_id = store_jobs.create_job(s, server.user_ids["carol"], {
            "name": "legacy spinner", "instructions": "x", "source_kind": "text",
            "source_text": "t", "schedule_kind": "interval", "interval_s": 1,
            "max_output_tokens": 16}).id
    jobs = server.jobs
    wait_until(lambda: jobs.scheduler.get_job(f"job-{job_id}") is not None, 30,
               "the poll to schedule the stored job")
    trigger = jobs.scheduler.get_job(f"job-{job_id}").trigger
    assert trigger.interval.total_seconds() == 300
    with server.client("carol") as carol:
        r = carol.patch(f"/jobs/{job_id}", json={"paused": True})
        assert r.status_code == 200, r.text


def test_only_the_newest_runs_of_a_job_are_kept(server: LiveServer) -> None:
    with server.client("bob") as bob:
        job = make_job(bob, source="text", text="The bins go out on Thursday.")
        made = [run_now(bob, job["id"])["id"] for _ in range(5)]
        listed = [r["id"] for r in bob.get(f"/jobs/{job['id']}/runs").json()]
    assert listed == made[:-4:-1]  # the three newest, newest first
    with server.store.read_sessions() as s:
        count = s.scalar(select(func.count()).select_from(JobRun)
                         .where(JobRun.job_id == job["id"]))
    assert count == 3
