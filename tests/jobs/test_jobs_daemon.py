"""Jobs across restarts of the real daemon (`appliance serve` as a process): slots missed
while it was down are caught up as one run, and a run killed with -9 is `interrupted`,
retried once from the map steps it had not finished, and its row agrees with the ledger."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.daemon import cli, make_household, start_daemon
from tests.helpers import wait_until


def _runs(c: httpx.Client, job_id: int) -> list[dict[str, Any]]:
    return sorted(c.get(f"/jobs/{job_id}/runs").json(), key=lambda r: r["scheduled_for"])


@pytest.mark.slow
@pytest.mark.timeout(900)  # two daemon starts; far longer on a loaded machine
def test_slots_missed_while_down_are_caught_up_as_one_run(tiny_model: Path,
                                                          tmp_path: Path) -> None:
    keys = make_household(tmp_path)
    d = start_daemon(tiny_model, tmp_path, "--member-min-interval", "1")
    with d.client(keys["bob"]) as bob:
        job = bob.post("/jobs", json={"name": "tick", "source": "text", "text": "Tick.",
                                      "schedule": "interval", "interval_s": 2,
                                      "max_output_tokens": 16}).json()
        wait_until(lambda: any(r["status"] == "done" for r in _runs(bob, job["id"])), 60,
                   "a first scheduled run")
    assert d.terminate() == 0
    stopped = time.time()
    # Each run is logged by our job runner; APScheduler's own line per execution (two every
    # 3 s for the job service's poll) is kept out of the household's log.
    log = (tmp_path / "daemon.log").read_text()
    assert f"job {job['id']} run " in log and "apscheduler.executors" not in log
    time.sleep(5)  # two or three slots go by while the daemon is down
    d = start_daemon(tiny_model, tmp_path, "--member-min-interval", "1",
                     log_name="daemon2.log")
    try:
        with d.client(keys["bob"]) as bob:
            wait_until(lambda: any(r["trigger"] == "catch-up" for r in _runs(bob, job["id"])),
                       60, "the catch-up run")
            after = [r for r in _runs(bob, job["id"]) if r["scheduled_for"] > stopped]
            missed = [r for r in after if r["trigger"] == "catch-up"]
            assert len(missed) == 1  # several slots missed, one run
            assert missed[0]["status"] in ("pending", "running", "done")
            wait_until(lambda: _runs(bob, job["id"])[-1]["trigger"] == "schedule"
                       and _runs(bob, job["id"])[-1]["scheduled_for"] > missed[0]["scheduled_for"],
                       60, "the schedule going on after the catch-up")
            slots = [r["scheduled_for"] for r in _runs(bob, job["id"])]
            assert len(slots) == len(set(slots))
    finally:
        d.terminate()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kill_9_mid_run_leaves_it_interrupted_then_resumed_once_and_the_ledger_agrees(
        demo_model: Path, tmp_path: Path) -> None:
    keys = make_household(tmp_path)
    corpus = (Path(__file__).resolve().parents[2] / "appliance" / "demo"
              / "corpus.txt").read_text()
    doc = tmp_path / "long.txt"
    doc.write_text(corpus[:24_000])  # several map stages on the demo model
    cli(tmp_path, "job", "add", "long read", "--user", "bob", "--text-file", str(doc),
        "--max-output-tokens", "16")
    d = start_daemon(demo_model, tmp_path)
    with d.client(keys["bob"]) as bob:
        job = bob.get("/jobs").json()[0]
        run = bob.post(f"/jobs/{job['id']}/run").json()
        wait_until(lambda: bob.get(f"/jobs/{job['id']}/runs/{run['id']}").json()
                   ["progress"]["done"] >= 2, 120, "two stages done")
    d.kill()
    db = tmp_path / "appliance.db"
    with sqlite3.connect(db) as con:
        status, attempts = con.execute("SELECT status, attempts FROM job_runs WHERE id = ?",
                                       (run["id"],)).fetchone()
        asked_before = set(con.execute("SELECT request_ids FROM job_runs WHERE id = ?",
                                       (run["id"],)).fetchone()[0].split())
        (k,) = con.execute("SELECT count(*) FROM job_steps WHERE run_id = ?",
                           (run["id"],)).fetchone()
        (total_before,) = con.execute("SELECT chunks_total FROM job_runs WHERE id = ?",
                                      (run["id"],)).fetchone()
    assert (status, attempts) == ("running", 1)  # what a killed daemon leaves behind
    n = total_before - 1  # map steps (the last stage is the reduce)
    assert 2 <= k <= n  # each map step was saved as it completed
    d = start_daemon(demo_model, tmp_path, log_name="daemon2.log")
    try:
        with d.client(keys["bob"]) as bob:
            def finished() -> bool:
                got = bob.get(f"/jobs/{job['id']}/runs/{run['id']}").json()
                return got["status"] not in ("pending", "running", "interrupted")
            wait_until(finished, 300, "the retried run")
            got = bob.get(f"/jobs/{job['id']}/runs/{run['id']}").json()
    finally:
        assert d.terminate() == 0
    assert got["status"] == "done" and got["attempts"] == 2
    assert got["interrupted_at"] is not None and got["output"]
    assert "retrying it once" in (tmp_path / "daemon2.log").read_text()
    assert f"resumes: {k} stages already done" in (tmp_path / "daemon2.log").read_text()
    with sqlite3.connect(db) as con:
        ledger = con.execute("SELECT request_id, prompt_tokens, output_tokens FROM ledger "
                             "WHERE endpoint = 'job'").fetchall()
        (runs_count,) = con.execute("SELECT count(*) FROM job_runs").fetchone()
    assert runs_count == 1  # retried in the same row, not a second run
    ids = set(got["request_ids"])
    assert {r[0] for r in ledger} <= ids  # every job request of the ledger is the run's
    assert got["requests"] == len(ledger)
    assert got["prompt_tokens"] == sum(r[1] for r in ledger)
    assert got["output_tokens"] == sum(r[2] for r in ledger)
    # the retry asked only the map steps not yet done, then the reduce; all in the ledger
    asked_after = set(got["request_ids"]) - asked_before
    assert len(asked_after) - (got["progress"]["total"] - n) == n - k
    assert asked_after <= {r[0] for r in ledger}


def test_a_backlog_of_old_runs_is_pruned_when_the_daemon_starts(tiny_model: Path,
                                                                 tmp_path: Path) -> None:
    """A paused job's runs (or a database from before pruning) are trimmed at start, not
    only after the job's next run (issue #37, item 8)."""
    keys = make_household(tmp_path)
    cli(tmp_path, "job", "add", "paused digest", "--user", "bob", "--text-file", "-",
        stdin="Bins on Thursday.\n")
    db = tmp_path / "appliance.db"
    now = time.time()
    with sqlite3.connect(db) as con:
        (job_id,) = con.execute("SELECT id FROM jobs").fetchone()
        con.executemany(
            "INSERT INTO job_runs (job_id, scheduled_for, trigger, status, attempts, "
            "created_at, finished_at, chunks_total, chunks_done, requests, prompt_tokens, "
            "output_tokens, request_ids, source_bytes) "
            "VALUES (?, ?, 'manual', 'done', 1, ?, ?, 1, 1, 0, 0, 0, '', 0)",
            [(job_id, now - 3600 + i, now - 3600 + i, now - 3600 + i) for i in range(10)])
    d = start_daemon(tiny_model, tmp_path, "--runs-keep", "3")
    try:
        with d.client(keys["bob"]) as bob:
            wait_until(lambda: len(bob.get(f"/jobs/{job_id}/runs").json()) == 3, 30,
                       "the start-up prune")
    finally:
        assert d.terminate() == 0
    with sqlite3.connect(db) as con:
        kept = [r[0] for r in con.execute("SELECT scheduled_for FROM job_runs ORDER BY 1")]
    assert kept == [now - 3600 + i for i in (7, 8, 9)]
