"""Issue 37, storage faults, through the real ``appliance serve``: a full disk or a read-only
database loses no ledger row that was answered, refuses model requests (503
``storage_unavailable``) only once the backlog is full, answers state changes 503 (never
500, no traceback), says so on ``/health``, and is forgotten once the disk is back (no
connection stays read-only); a damaged database stops serve in one line with status 65,
which the systemd unit does not retry.

The faults are SQLite's own, from ``APPLIANCE_TEST_STORE_FAULT`` (a control file; see
``appliance.store.faults.install_test_fault``): ``PRAGMA max_page_count`` at the file's size
makes the pager answer SQLITE_FULL where a full disk does, and ``mode=ro`` is how SQLite
opens a file it may not write (chmod would not stop root, who runs the tests).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from appliance.store.faults import DATABASE_DAMAGED_EXIT, TEST_ENV
from tests.browser.support import browser
from tests.daemon import Daemon, cli, ledger_ids, make_household, start_daemon
from tests.helpers import wait_until

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def _health(d: Daemon) -> httpx.Response:
    return httpx.get(d.url + "/health", timeout=10)


def _wait_healthy(d: Daemon) -> None:
    """/health says ok again within 30 s; otherwise fail with its body and the log's tail."""
    try:
        wait_until(lambda: _health(d).json()["status"] == "ok", 30, "health ok again")
    except AssertionError:
        raise AssertionError(f"{_health(d).text}\n{d.log.read_text()[-6000:]}") from None


def _no_tracebacks(d: Daemon) -> str:
    log = d.log.read_text()
    assert "Traceback" not in log, log[-4000:]
    assert "dropped ledger row" not in log
    return log


def test_a_full_disk_loses_no_answered_row_and_refuses_only_past_the_backlog(
        tiny_model: Path, tmp_path: Path) -> None:
    keys = make_household(tmp_path)
    control = tmp_path / "store-fault"
    d = start_daemon(tiny_model, tmp_path, "--ledger-backlog", "5",
                     env={TEST_ENV: str(control)})
    answered: list[str] = []
    try:
        with d.client(keys["bob"]) as bob:
            first = bob.post("/v1/chat/completions", json=CHAT)
            assert first.status_code == 200
            answered.append(first.json()["id"].split("-", 1)[1])
            control.write_text("full")
            refused = None
            for _ in range(80):  # a few rows may still fit the file's last pages
                r = bob.post("/v1/chat/completions", json=CHAT)
                if r.status_code == 503:
                    refused = r
                    break
                assert r.status_code == 200, r.text
                answered.append(r.json()["id"].split("-", 1)[1])
            assert refused is not None, "never refused: the backlog is not bounded"
            err = refused.json()["error"]
            assert err["code"] == "storage_unavailable" and err["type"] == "server_error"
            assert "SQLITE_FULL" in err["message"]
            assert refused.headers["retry-after"].isdigit()
            model = bob.get("/v1/models").json()["data"][0]["id"]
            ollama = bob.post("/api/chat", json={**CHAT, "model": model, "stream": False})
            assert ollama.status_code == 503 and ollama.headers["retry-after"].isdigit()
            assert isinstance(ollama.json()["error"], str)
            health = _health(d)
            assert health.status_code == 503, health.text  # model requests are refused
            body = health.json()
            assert body["status"] == "unavailable" and "SQLITE_FULL" in body["reason"]
            assert body["storage"]["ledger_backlog"] >= 5

            control.write_text("")  # the disk has room again
            _wait_healthy(d)
            assert _health(d).json()["storage"]["ledger_backlog"] == 0
            again = bob.post("/v1/chat/completions", json=CHAT)
            assert again.status_code == 200
            answered.append(again.json()["id"].split("-", 1)[1])
        assert d.terminate() == 0
    finally:
        if d.proc.poll() is None:
            d.kill()
    assert len(answered) >= 6
    missing = set(answered) - ledger_ids(tmp_path)
    assert not missing, f"{len(missing)} of {len(answered)} answered requests have no row"
    log = _no_tracebacks(d)
    assert "SQLITE_FULL" in log


def test_a_read_only_database_answers_503_to_writes_and_nothing_fails_after_it(
        tiny_model: Path, tmp_path: Path) -> None:
    keys = make_household(tmp_path)
    control = tmp_path / "store-fault"
    d = start_daemon(tiny_model, tmp_path, env={TEST_ENV: str(control)})
    answered: list[str] = []
    try:
        with d.client(keys["bob"]) as bob, browser(d.url, "bob") as page:
            assert bob.post("/me/keys", json={"name": "before"}).status_code == 201
            control.write_text("readonly")
            for _ in range(3):  # below the backlog's bound: answered, rows kept
                r = bob.post("/v1/chat/completions", json=CHAT)
                assert r.status_code == 200, r.text
                answered.append(r.json()["id"].split("-", 1)[1])
            wait_until(lambda: _health(d).json()["storage"]["ledger_backlog"] == 3, 30,
                       "the three rows kept")
            health = _health(d)
            assert health.json()["status"] == "degraded"
            assert health.status_code == 200  # still serving: answers are recorded later
            assert "SQLITE_READONLY" in health.json()["reason"]
            for path, body in (("/me/keys", {"name": "during"}),
                               ("/conversations", {"title": "during"})):
                r = bob.post(path, json=body)
                assert r.status_code == 503, r.text
                err = r.json()["error"]
                assert err["code"] == "storage_unavailable" and "SQLITE_READONLY" in err["message"]
                assert r.headers["retry-after"].isdigit()
            with d.client(keys["alice"]) as alice:  # an admin's change
                bob_id = next(u["id"] for u in alice.get("/admin/users").json()
                              if u["name"] == "bob")
                r = alice.patch(f"/admin/users/{bob_id}", json={"weight": 2.0})
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "storage_unavailable"
                metrics = alice.get("/metrics").text
                assert "appliance_store_writable 0.0" in metrics
                assert "appliance_store_ledger_backlog 3.0" in metrics
            r = page.post("/settings/preferences", data={"theme": "dark"})  # a browser's
            assert r.status_code == 503 and "text/html" in r.headers["content-type"]
            assert "cannot save anything right now" in r.text

            control.write_text("")  # writable again: the very next write succeeds
            after = bob.post("/me/keys", json={"name": "after"})
            assert after.status_code == 201, after.text
            _wait_healthy(d)
        assert d.terminate() == 0
    finally:
        if d.proc.poll() is None:
            d.kill()
    missing = set(answered) - ledger_ids(tmp_path)
    assert not missing
    log = _no_tracebacks(d)
    faults = [line for line in log.splitlines() if "storage fault on " in line]
    assert len(faults) == 4 and all("user_id=" in f and "SQLITE_READONLY" in f for f in faults)


def _garbage(db: Path) -> None:
    db.write_bytes(b"not a database, a holiday photo" * 300)


def _torn(db: Path) -> None:
    """A sound header over pages that are not what they say (a torn write, a bad sector)."""
    data = bytearray(db.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    for start in range(page, len(data), page):
        data[start:start + 64] = b"\xff" * 64
    db.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_garbage, _torn])
def test_a_damaged_database_stops_serve_in_one_line_with_status_65(
        tiny_model: Path, tmp_path: Path, damage: object) -> None:
    cli(tmp_path, "migrate")
    db = tmp_path / "appliance.db"
    assert callable(damage)
    damage(db)
    env = {**os.environ, "APPLIANCE_DATA_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "appliance", "serve", "--model",
                          str(tiny_model), "--port", "9"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == DATABASE_DAMAGED_EXIT
    lines = [line for line in (out.stdout + out.stderr).splitlines()
             if "damaged" in line or "Traceback" in line or "Error" in line]
    assert len(lines) == 1, out.stdout + out.stderr
    assert str(db) in lines[0] and ".recover" in lines[0] and "backup" in lines[0]


def test_a_streamed_answer_that_cannot_be_saved_is_one_log_line_not_a_traceback(
        db_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The browser already has the answer (it streamed), so there is nobody to send a 503:
    the chat page's save says so in one line and the stream ends normally."""
    from types import SimpleNamespace
    from typing import Any, cast

    from appliance.engine.request import FinishEvent, Usage
    from appliance.store import conversations as convs
    from appliance.store import users
    from appliance.store.db import open_store
    from appliance.vocab import FinishReason
    from tests.helpers import FAST_HASHER
    from web.chat import _save_answer
    from web.state import LiveAnswer

    control = tmp_path / "store-fault"
    store = open_store(db_path, test_fault=control)
    try:
        with store.sessions.begin() as s:
            uid = users.create_user(s, "bob", "correct horse 12", hasher=FAST_HASHER).id
            cid = convs.create_conversation(s, uid, "t").id
        control.write_text("readonly")
        answer = LiveAnswer(gen=cast(Any, None), user_id=uid, conversation_id=cid)
        finish = FinishEvent(reason=FinishReason.STOP, usage=Usage(3, 2))
        with caplog.at_level("WARNING"):
            _save_answer(cast(Any, SimpleNamespace(store=store)), answer, "an answer", finish)
        lines = [r.getMessage() for r in caplog.records if "not saved" in r.getMessage()]
        assert len(lines) == 1 and "SQLITE_READONLY" in lines[0] and "an answer" not in lines[0]
    finally:
        store.close()
