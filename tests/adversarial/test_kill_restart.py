"""Restarts of the real ``appliance serve``: after kill -9 under load the database is intact
and the ledger complete up to one flush interval; after the restart new requests get NEW
ledger rows (request ids are UUIDv7s, not a counter that restarts at 1)."""

from __future__ import annotations

import concurrent.futures as cf
import sqlite3
import threading
import time
from pathlib import Path

import httpx

from appliance.store.writer import DEFAULT_FLUSH_INTERVAL_S
from tests.daemon import Daemon, make_household, start_daemon
from tests.helpers import wait_until

CHAT = {"messages": [{"role": "user", "content": "Tell me a story"}]}
LOAD = 12
"""Answers received before the kill (six clients keep asking until it)."""


def _ledger(db: Path) -> dict[str, tuple[str, str, int, float]]:
    con = sqlite3.connect(db)
    try:
        return {r[0]: r for r in con.execute(
            "SELECT request_id, finish_reason, output_tokens, finished_at FROM ledger")}
    finally:
        con.close()


def _chats(d: Daemon, key: str, n: int) -> list[str]:
    with d.client(key) as c:
        replies = [c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3})
                   for _ in range(n)]
    assert [r.status_code for r in replies] == [200] * n
    return [r.json()["id"].removeprefix("chatcmpl-") for r in replies]


def test_kill_9_under_load_then_restart_keeps_the_ledger_and_adds_new_rows(
        tiny_model: Path, tmp_path: Path) -> None:
    keys = make_household(tmp_path)
    d = start_daemon(tiny_model, tmp_path)
    done: list[tuple[str, float]] = []
    killed = threading.Event()

    def worker(n: int) -> None:
        with d.client(keys["bob"]) as c:
            while not killed.is_set():
                try:
                    r = c.post("/v1/chat/completions",
                               json={**CHAT, "max_tokens": 20 + n, "temperature": 0.8})
                except httpx.TransportError:
                    return
                if r.status_code == 200:
                    done.append((r.json()["id"].removeprefix("chatcmpl-"), time.time()))

    with cf.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(worker, n) for n in range(6)]
        # under load: kill once a dozen answers are in (however slow the machine is)
        try:
            wait_until(lambda: len(done) >= LOAD, 240, f"{LOAD} answers")
        finally:
            killed_at = time.time()
            d.kill()
            killed.set()
        for f in futures:
            f.result()
    db = tmp_path / "appliance.db"
    con = sqlite3.connect(db)
    try:
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        con.close()
    rows = _ledger(db)
    margin = DEFAULT_FLUSH_INTERVAL_S + 0.5  # one flush interval plus the commit itself
    must_have = [rid for rid, t in done if t < killed_at - margin]
    missing = [rid for rid in must_have if rid not in rows]
    assert not missing, f"{len(missing)} of {len(must_have)} rows lost"
    assert all(r[1] and r[2] is not None and r[3] for r in rows.values())
    # the daemon starts again on the same database, and what it serves is recorded anew
    d2 = start_daemon(tiny_model, tmp_path, log_name="restart.log")
    after = _chats(d2, keys["bob"], 5)
    assert d2.terminate() == 0
    rows2 = _ledger(db)
    assert set(after) <= set(rows2), "requests after the restart must get ledger rows"
    assert len(rows2) == len(rows) + 5
    assert not set(after) & set(rows)
