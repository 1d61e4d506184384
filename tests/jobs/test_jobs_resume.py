"""An interrupted run resumes from the stages it had not finished (issue #37, item 11):
each map step's answer is saved as it completes, and the retry asks (and charges) only the
rest. The interruption is the daemon's own (``stop()`` cancels running runs as
``interrupted``), the retry the one start-up makes; the daemon's kill -9 twin is in
``test_jobs_daemon.py``."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import LiveServer, live_server, make_settings, wait_until
from tests.jobs.test_jobs_api import make_job, wait_run

STOP_AFTER = 4  # map steps done before the interruption


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[LiveServer]:
    # a small context and small chunks: many short map steps on the tiny model
    with live_server(make_settings(tiny_model, ctx_size=1024, chunk_tokens=64)) as s:
        yield s


def _run(c: httpx.Client, job_id: int, run_id: int) -> dict[str, Any]:
    return c.get(f"/jobs/{job_id}/runs/{run_id}").json()


def _steps(server: LiveServer, run_id: int) -> int:
    db = Path(server.daemon.settings.store.data_dir) / "appliance.db"
    with sqlite3.connect(db) as con:
        (n,) = con.execute("SELECT count(*) FROM job_steps WHERE run_id = ?",
                           (run_id,)).fetchone()
    return int(n)


def _on_jobs_loop(server: LiveServer, fn: Any, *args: Any) -> None:
    jobs = server.jobs
    loop: asyncio.AbstractEventLoop = jobs.scheduler._eventloop
    loop.call_soon_threadsafe(fn, *args)


def _interrupt(server: LiveServer, run_id: int) -> None:
    """What ``JobService.stop()`` does to a running run, for this one run."""
    live = server.jobs.live[run_id]
    live.cancel_reason = "interrupted"
    assert live.task is not None
    live.task.cancel()


def test_an_interrupted_run_resumes_and_asks_only_the_map_steps_not_yet_done(
        server: LiveServer) -> None:
    tokenizer = server.services.model.tokenizer
    corpus = (Path(__file__).resolve().parents[2] / "appliance" / "demo"
              / "corpus.txt").read_text()
    text = tokenizer.decode(tokenizer.encode(corpus[:8000])[:1100])
    with server.client("bob") as bob:
        job = make_job(bob, source="text", text=text, max_output_tokens=16)
        run = bob.post(f"/jobs/{job['id']}/run").json()
        wait_until(lambda: _run(bob, job["id"], run["id"])["progress"]["done"] >= STOP_AFTER,
                   120, f"{STOP_AFTER} map steps")
        _on_jobs_loop(server, _interrupt, server, run["id"])
        wait_until(lambda: _run(bob, job["id"], run["id"])["status"] == "interrupted", 60,
                   "the run to be interrupted")
        first = _run(bob, job["id"], run["id"])
        n = first["progress"]["total"] - 1  # map steps; the last stage is the reduce
        k = _steps(server, run["id"])
        assert STOP_AFTER <= k < n, (k, n)
        asked_before = set(first["request_ids"])
        _on_jobs_loop(server, server.jobs._spawn, run["id"])  # start-up's retry
        wait_until(lambda: _run(bob, job["id"], run["id"])["attempts"] == 2, 60, "the retry")
        done = wait_run(bob, job["id"], run["id"], 300)
    assert done["status"] == "done" and done["attempts"] == 2, done
    assert done["output"]
    reduce_stages = done["progress"]["total"] - n
    asked_after = set(done["request_ids"]) - asked_before
    assert len(asked_after) - reduce_stages == n - k  # only the map steps not yet done
    server.writer.flush()
    with server.store.read_sessions() as s:
        from sqlalchemy import text as sql

        charged = {r[0] for r in s.execute(sql("SELECT request_id FROM ledger WHERE "
                                                "endpoint = 'job'"))}
    assert asked_after <= charged  # each new request is in the ledger once...
    assert done["requests"] == len(charged & set(done["request_ids"]))  # ...and counted
    assert _steps(server, run["id"]) == 0  # a finished run keeps no stages
