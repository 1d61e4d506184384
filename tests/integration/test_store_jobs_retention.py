"""Which runs ``prune_runs`` deletes (issue #37, item 8), with a fake clock: finished runs
beyond the newest N or older than the age limit go; unfinished runs, the newest run and the
latest scheduled one (the catch-up anchor) stay."""

from __future__ import annotations

from appliance.store import jobs as store_jobs
from appliance.store.db import Store

DAY = 86400.0
NOW = 1_800_000_000.0


def _job(store: Store, user_id: int) -> int:
    with store.sessions.begin() as s:
        return store_jobs.create_job(s, user_id, {
            "name": "digest", "instructions": "x", "source_kind": "text", "source_text": "t",
            "schedule_kind": "interval", "interval_s": 3600, "max_output_tokens": 16},
            now=NOW - 400 * DAY).id


def _run(store: Store, job_id: int, when: float, trigger: str, status: str,
         attempts: int = 1) -> int:
    with store.sessions.begin() as s:
        run = store_jobs.add_run(s, job_id, when, trigger, now=when)
        assert run is not None
        if status != "pending":
            store_jobs.start_run(s, run.id, now=when)
            run.attempts = attempts
        if status in (*store_jobs.FINISHED, "interrupted"):
            store_jobs.finish_run(s, run.id, status, now=when + 1)
        return run.id


def _ids(store: Store, job_id: int) -> set[int]:
    with store.read_sessions() as s:
        return {r.id for r in store_jobs.list_runs(s, job_id, limit=1000)}


def test_runs_older_than_the_age_limit_go_but_the_anchors_and_unfinished_ones_stay(
        store: Store, ids: dict[str, int]) -> None:
    job = _job(store, ids["bob"])
    anchor = _run(store, job, NOW - 200 * DAY, "schedule", "done")  # the latest slot
    old = [_run(store, job, NOW - (300 - d) * DAY, "manual", "done") for d in range(3)]
    retry = _run(store, job, NOW - 250 * DAY, "manual", "interrupted", attempts=1)
    gave_up = _run(store, job, NOW - 240 * DAY, "manual", "interrupted", attempts=2)
    pending = _run(store, job, NOW - 230 * DAY, "manual", "pending")
    newest = _run(store, job, NOW - 150 * DAY, "manual", "error")
    with store.sessions.begin() as s:
        deleted = store_jobs.prune_runs(s, job, keep=100, max_age_s=90 * DAY, now=NOW)
    assert deleted == len(old) + 1
    assert _ids(store, job) == {anchor, retry, pending, newest}
    assert gave_up not in _ids(store, job)
    with store.read_sessions() as s:
        assert store_jobs.last_slot(s, job) == NOW - 200 * DAY  # catch-up still knows it


def test_only_the_newest_n_finished_runs_are_kept(store: Store, ids: dict[str, int]) -> None:
    job = _job(store, ids["carol"])
    made = [_run(store, job, NOW - (10 - i) * 60, "schedule", "done") for i in range(10)]
    running = _run(store, job, NOW - 30 * 60, "manual", "running")
    with store.sessions.begin() as s:
        assert store_jobs.prune_runs(s, job, keep=4, now=NOW) == 6
    # the four newest by slot, and the older running run (unfinished runs are never deleted)
    assert _ids(store, job) == {*made[-4:], running}
    with store.sessions.begin() as s:
        assert store_jobs.prune_runs(s, job, keep=4, now=NOW) == 0
