"""The real APScheduler with seconds-long triggers: one run per slot, pause, delete, a long
document map-reduced with its progress advancing, and no "database is locked" while the
ledger writer is busy."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from appliance.store.ledger import LedgerRecord
from tests.helpers import LiveServer, live_server, make_settings, wait_until
from tests.jobs.test_jobs_api import make_job, wait_run


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[LiveServer]:
    # seconds-long schedules: below the members' floor, which these tests do not test
    with live_server(make_settings(tiny_model, member_min_interval=1)) as s:
        yield s


def runs(c: httpx.Client, job_id: int) -> list[dict[str, Any]]:
    return sorted(c.get(f"/jobs/{job_id}/runs").json(), key=lambda r: r["scheduled_for"])


def test_an_interval_job_runs_once_per_slot(server: LiveServer) -> None:
    with server.client("bob") as bob:
        job = make_job(bob, source="text", text="Bins on Thursday.", schedule="interval",
                       interval_s=2)
        assert job["schedule"]["description"] == "Every 2 seconds"
        assert len(job["schedule"]["next_runs"]) == 3
        wait_until(lambda: len([r for r in runs(bob, job["id"]) if r["status"] == "done"]) >= 3,
                   60, "three scheduled runs")
        done = runs(bob, job["id"])
        slots = [r["scheduled_for"] for r in done]
        assert len(set(slots)) == len(slots)  # one run per slot
        assert {r["trigger"] for r in done} == {"schedule"}
        for a, b in zip(slots, slots[1:], strict=False):
            assert round(b - a, 3) % 2 == 0  # slots on the 2-second grid
        # the same slot fired again (a second scheduler, a clock hiccup) makes no new run
        fut = asyncio.run_coroutine_threadsafe(_refire(server, job["id"], slots[0]),
                                               _loop(server))
        fut.result(30)
        assert len(runs(bob, job["id"])) >= len(done)
        assert len({r["scheduled_for"] for r in runs(bob, job["id"])}) == \
            len(runs(bob, job["id"]))
        assert bob.delete(f"/jobs/{job['id']}").status_code == 204


def _services(server: LiveServer) -> Any:
    daemon = getattr(server, "daemon", None)  # the one assembly, where it exists
    return daemon.services if daemon is not None else server.services


def _loop(server: LiveServer) -> asyncio.AbstractEventLoop:
    loop = server.jobs.scheduler._eventloop
    assert loop is not None
    return loop


async def _refire(server: LiveServer, job_id: int, slot: float) -> None:
    from datetime import datetime

    svc = server.jobs
    await svc._fire(job_id, datetime.fromtimestamp(slot, svc.zone))


def test_pausing_stops_the_schedule_and_resuming_starts_it_again(server: LiveServer) -> None:
    with server.client("bob") as bob:
        job = make_job(bob, source="text", text="Water the plants.", schedule="interval",
                       interval_s=1)
        wait_until(lambda: len(runs(bob, job["id"])) >= 1, 30, "a first run")
        paused = bob.patch(f"/jobs/{job['id']}", json={"paused": True}).json()
        assert paused["paused"] and paused["schedule"]["next_runs"] == []
        wait_until(lambda: server.jobs.next_run(job["id"]) is None, 10,
                   "the schedule to go")
        paused_at = time.time()
        # The paused job's slots had their chance: a witness on the same 1-second interval,
        # fired by the same scheduler, finishes two runs of slots after the pause (a run
        # row is written when its slot fires, before any generation).
        witness = make_job(bob, source="text", text="Feed the cat.", schedule="interval",
                           interval_s=1)
        wait_until(lambda: len([r for r in runs(bob, witness["id"])
                                if r["scheduled_for"] > paused_at
                                and r["status"] == "done"]) >= 2, 30,
                   "two witness runs after the pause")
        assert bob.delete(f"/jobs/{witness['id']}").status_code == 204
        assert [r for r in runs(bob, job["id"]) if r["scheduled_for"] > paused_at] == []
        bob.patch(f"/jobs/{job['id']}", json={"paused": False})
        wait_until(lambda: any(r["scheduled_for"] > paused_at for r in runs(bob, job["id"])),
                   30, "runs after resuming")
        assert bob.delete(f"/jobs/{job['id']}").status_code == 204


def test_deleting_a_job_removes_its_schedule(server: LiveServer) -> None:
    with server.client("bob") as bob:
        job = make_job(bob, source="text", text="t", schedule="interval", interval_s=60)
        jobs = server.jobs
        wait_until(lambda: jobs.next_run(job["id"]) is not None, 10, "the schedule")
        assert bob.delete(f"/jobs/{job['id']}").status_code == 204
        assert jobs.next_run(job["id"]) is None
        assert bob.get(f"/jobs/{job['id']}").status_code == 404


def test_runs_are_written_while_the_ledger_writer_is_busy(
        server: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    """The store writer commits a flood of ledger rows and counters while jobs write their
    runs (each a short BEGIN IMMEDIATE transaction): nothing fails with "database is
    locked", and the writer drops nothing."""
    stop = threading.Event()
    uid = server.user_ids["carol"]

    def flood() -> None:
        n = 0
        while not stop.is_set():
            now = time.time()
            for _ in range(50):
                n += 1
                server.writer.submit_ledger(LedgerRecord(
                    request_id=f"flood-{n}", user_id=uid, api_key_id=None,
                    klass="background", endpoint="flood", model="", prompt_tokens=1,
                    cached_tokens=0, output_tokens=1, queued_at=now, admitted_at=now,
                    first_token_at=now, finished_at=now, finish_reason="stop"))
            server.writer.submit_counters({uid: float(n)})
            time.sleep(0.02)

    caplog.set_level(logging.WARNING)
    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    try:
        with server.client("carol") as carol:
            made = [make_job(carol, source="text", text=f"note {i}") for i in range(3)]
            started = [carol.post(f"/jobs/{j['id']}/run").json() for j in made]
            finished = [wait_run(carol, r["job_id"], r["id"]) for r in started]
    finally:
        stop.set()
        flooder.join(10)
    assert [r["status"] for r in finished] == ["done"] * 3
    assert server.writer.flush(30)
    assert server.writer.stats.dropped == 0
    assert "database is locked" not in caplog.text


@pytest.mark.slow
@pytest.mark.timeout(900)  # ~30 s on a quiet 2-core machine; far more on a loaded one
def test_a_long_document_is_map_reduced_with_progress_advancing(demo_model: Path) -> None:
    """At least 30,000 tokens on the demo model: many map stages, then the reduce."""
    corpus = (Path(__file__).resolve().parents[2] / "appliance" / "demo"
              / "corpus.txt").read_text()
    with live_server(make_settings(demo_model)) as server:
        tokenizer = _services(server).model.tokenizer
        ids = tokenizer.encode(corpus)
        while len(ids) < 30_500:
            ids = ids + ids
        text = tokenizer.decode(ids[:30_500])
        tokens = len(tokenizer.encode(text))
        assert tokens >= 30_000
        with server.client("bob") as bob:
            job = make_job(bob, source="text", text=text, max_output_tokens=32,
                           instructions="What is this about?")
            run = bob.post(f"/jobs/{job['id']}/run").json()
            seen: list[int] = []
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                got = bob.get(f"/jobs/{job['id']}/runs/{run['id']}").json()
                live = bob.get(f"/jobs/{job['id']}").json()["running"]
                if live and (not seen or live["done"] != seen[-1]):
                    seen.append(live["done"])
                if got["status"] not in ("pending", "running"):
                    break
                time.sleep(0.05)
        assert got["status"] == "done", got
        total = got["progress"]["total"]
        assert got["progress"]["done"] == total and total >= 10
        assert got["requests"] == total  # one request per stage, all in the ledger
        assert got["prompt_tokens"] >= tokens
        assert len(seen) >= 3 and seen == sorted(seen)  # seen advancing while it ran
        assert got["output"]
