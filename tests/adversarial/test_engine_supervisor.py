"""A dead or stalled engine through the real ``appliance serve``: every waiting request gets
a clear 503 (none hangs) and its row in the ledger, ``/health`` never says ok again, and
the daemon exits with status 70 so systemd or launchd start a fresh one. Faults come from ``APPLIANCE_TEST_FAULT``
(see appliance/engine/faults.py): requests with ``max_tokens`` 13 trigger them."""

from __future__ import annotations

import concurrent.futures as cf
import sqlite3
import time
from pathlib import Path

import httpx
import pytest

from appliance.engine.supervisor import ENGINE_DOWN_EXIT
from tests.daemon import Daemon, make_household, start_daemon

CHAT = {"messages": [{"role": "user", "content": "Tell me a story"}]}


def _health(d: Daemon) -> int | None:
    try:
        return httpx.get(d.url + "/health", timeout=5).status_code
    except httpx.TransportError:
        return None  # the daemon is already gone


@pytest.mark.parametrize("fault, flags", [
    ("decode:die:13", ()),
    ("prefill:stall:13", ("--engine-stall-timeout", "8")),
])
def test_a_dead_or_stalled_engine_answers_503_then_the_daemon_exits_70(
        tiny_model: Path, tmp_path: Path, fault: str, flags: tuple[str, ...]) -> None:
    keys = make_household(tmp_path)
    d = start_daemon(tiny_model, tmp_path, "--max-batch-size", "2", *flags,
                     env={"APPLIANCE_TEST_FAULT": fault})
    try:
        with d.client(keys["bob"]) as c:
            assert c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3}
                          ).status_code == 200  # healthy before the fault

            def ask(n: int) -> httpx.Response | None:
                try:
                    return c.post("/v1/chat/completions", json={**CHAT, "max_tokens": n})
                except httpx.TransportError:
                    return None  # refused after the daemon left: never a hang

            with cf.ThreadPoolExecutor(5) as pool:
                killer = pool.submit(ask, 13)
                time.sleep(0.3)
                others = [pool.submit(ask, 40) for _ in range(4)]
                answer = killer.result(timeout=90)
                replies = [f.result(timeout=90) for f in others]
        assert answer is not None and answer.status_code == 503, answer and answer.text
        err = answer.json()["error"]
        assert err["code"] == "engine_unavailable"
        assert ("engine thread died" if "die" in fault else "stalled") in err["message"]
        for r in replies:  # finished before the fault, or told to retry; none hangs
            assert r is None or r.status_code in (200, 503), r.text
            if r is not None and r.status_code == 503:
                assert r.headers["retry-after"].isdigit()
        assert _health(d) in (503, None)  # never "ok" again
        assert d.proc.wait(60) == ENGINE_DOWN_EXIT
    finally:
        if d.proc.poll() is None:
            d.kill()
    log = d.log.read_text()
    assert "engine not serving" in log and f"exiting with status {ENGINE_DOWN_EXIT}" in log
    # the requests the supervisor ended are in the ledger, as any that ends (their usage
    # so far counts toward quotas): at least the one that hit the fault
    with sqlite3.connect(tmp_path / "appliance.db") as db:
        ended = db.execute("select count(*) from ledger where finish_reason = 'error'"
                           ).fetchone()[0]
    assert ended >= 1
    if "stall" in fault:  # where the engine thread was stuck: the fault's sleep
        assert "the threads' stacks" in log and "faults.py" in log, log[-3000:]
