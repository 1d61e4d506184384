"""Issue 52 items 10-12, through the real ``appliance serve``: the data folder is owned (a
second daemon on it exits naming the first's PID), SIGHUP drains like SIGTERM (the stream in
flight and those queued have their ledger rows, and nothing is cancelled with a
traceback), and the database file is watched (deleted → /health
503 and writes refused; the restart refuses to make an empty database beside the backup and
says how to restore it; restored, everyone is back as of the last backup)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import shlex
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from appliance.store.datadir import DATA_DIR_BUSY_EXIT, DATABASE_LOST_EXIT
from tests.conftest import free_port
from tests.daemon import Daemon, ledger_ids, make_household, start_daemon
from tests.helpers import wait_until

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def _serve(model: Path, data_dir: Path, log: Path, env: dict[str, str]
           ) -> subprocess.Popen[bytes]:
    with open(log, "wb") as fh:
        return subprocess.Popen([sys.executable, "-m", "appliance", "serve", "--model",
                                 str(model), "--port", str(free_port())],
                                env={**env, "APPLIANCE_DATA_DIR": str(data_dir)},
                                stdout=fh, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def served(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[Daemon, dict[str, str]]]:
    data = tmp_path_factory.mktemp("owned")
    keys = make_household(data)
    d = start_daemon(tiny_model, data, "--shutdown-timeout", "1", "--max-batch-size", "1")
    yield d, keys
    if d.proc.poll() is None:
        d.kill()


def test_a_second_daemon_on_the_same_folder_exits_naming_the_first(
        served: tuple[Daemon, dict[str, str]], tiny_model: Path) -> None:
    d, _ = served
    log = d.data_dir / "second.log"
    # and, outside the test suite's setting, the fault hooks' variables are ignored
    env = {k: v for k, v in os.environ.items() if k != "APPLIANCE_TEST_HOOKS"}
    second = _serve(tiny_model, d.data_dir, log, {**env, "APPLIANCE_TEST_FAULT": "decode:die:7"})
    assert second.wait(120) == DATA_DIR_BUSY_EXIT, log.read_text()[-2000:]
    text = log.read_text()
    assert f"another daemon (PID {d.proc.pid}) already serves the data folder {d.data_dir}" \
        in text, text[-2000:]
    assert "serving" not in text  # nothing loaded, nothing listened
    assert "ignoring APPLIANCE_TEST_FAULT and APPLIANCE_TEST_STORE_FAULT: fault hooks are " \
        "for the test suite only" in text
    assert httpx.get(d.url + "/health", timeout=10).status_code == 200  # the first serves on


def test_sighup_drains_like_sigterm_and_every_request_has_its_ledger_row(
        served: tuple[Daemon, dict[str, str]], tiny_model: Path) -> None:
    """A stream in flight and two requests queued behind it (one batch slot), a drain of
    1 s: whatever is still running then is cancelled by the engine, each handler ends its
    own answer (no traceback from the HTTP server's cancellation) and every request has
    its ledger row."""
    d, keys = served
    eos = json.loads((tiny_model / "config.json").read_text())["eos_token_id"]
    ban = {str(t): -100.0 for t in (eos if isinstance(eos, list) else [eos])}
    body = {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 5000,
            "logit_bias": ban}
    chunks: list[dict[str, Any]] = []
    with d.client(keys["bob"]) as bob, cf.ThreadPoolExecutor(2) as pool, \
            bob.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:  # the stream is running: its first token came
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
                break
        queued = [pool.submit(bob.post, "/v1/chat/completions", json=body) for _ in range(2)]
        wait_until(lambda: bob.get("/health").json()["queued"] == 2, 60, "two queued")
        d.proc.send_signal(signal.SIGHUP)
        for line in lines:
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
        answers = [f.result() for f in queued]
    assert d.proc.wait(120) == 0
    assert [a.status_code for a in answers] == [200, 200], [a.text[-300:] for a in answers]
    ids = {str(chunks[0]["id"]).split("-", 1)[1]}
    ids |= {a.json()["id"].split("-", 1)[1] for a in answers}
    finish = [c["choices"][0]["finish_reason"] for c in chunks
              if c.get("choices") and c["choices"][0].get("finish_reason")]
    # the stream was ended by its handler: a finish chunk, or the error event of a request
    # the drain cancelled
    assert len(finish) == 1 or "error" in chunks[-1], chunks[-3:]
    missing = ids - ledger_ids(d.data_dir)
    assert not missing, missing
    text = d.log.read_text()
    assert "SIGHUP: draining and stopping as for SIGTERM" in text
    assert "shut down cleanly" in text and "Traceback" not in text, text[-3000:]
    assert "Exception in ASGI application" not in text


def test_a_deleted_database_is_noticed_and_never_silently_replaced(
        served: tuple[Daemon, dict[str, str]], tiny_model: Path) -> None:
    first, keys = served  # stopped by SIGHUP above: the same household, served again
    assert first.proc.poll() is not None
    tmp_path = first.data_dir
    db = tmp_path / "appliance.db"
    backup = tmp_path / "appliance.db.backup"
    d = start_daemon(tiny_model, tmp_path, log_name="again.log")
    try:
        assert backup.exists() and backup.stat().st_mode & 0o077 == 0  # taken at start
        with d.client(keys["bob"]) as bob:
            db.unlink()

            def unavailable() -> bool:
                return httpx.get(d.url + "/health", timeout=10).status_code == 503

            wait_until(unavailable, 30, "/health 503")
            health = httpx.get(d.url + "/health", timeout=10).json()
            assert health["status"] == "unavailable"
            assert f"the database file {db} was deleted" in health["reason"]
            refused = bob.post("/me/keys", json={"name": "after"})
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "storage_unavailable"
            chat = bob.post("/v1/chat/completions", json=CHAT)
            assert chat.status_code == 503, chat.text
        assert not db.exists()  # nothing made a new file in its place
        assert d.terminate() == 0
    finally:
        if d.proc.poll() is None:
            d.kill()
    text = d.log.read_text()
    assert "CRITICAL" in text and "refusing every write" in text, text[-3000:]
    assert not db.exists()

    # the restart refuses an empty database while the backup exists, and says how to restore
    again = start_daemon(tiny_model, tmp_path, log_name="restart.log", wait=False)
    assert again.proc.wait(120) == DATABASE_LOST_EXIT
    said = again.log.read_text()
    assert not db.exists()
    assert f"the database {db} is missing but its last backup {backup} exists" in said, said
    restore = said.split("Restore it with `", 1)[1].split("`", 1)[0]
    subprocess.run(["sh", "-c", restore], check=True)
    assert shlex.split(restore)[-1] == str(db)

    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)  # as the restarted daemon sees it
    try:
        assert {r[0] for r in con.execute("SELECT name FROM users")} == {"alice", "bob"}
        # the backup is the one taken at start: bob's default key, not the one made after
        assert con.execute("SELECT name FROM api_keys WHERE user_id = (SELECT id FROM users "
                           "WHERE name = 'bob')").fetchall() == [("default",)]
        assert con.execute("PRAGMA quick_check").fetchone() == ("ok",)
    finally:
        con.close()
