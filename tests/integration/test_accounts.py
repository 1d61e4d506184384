"""Browser sessions, login throttling, CSRF, and the usage ledger through the real openai client."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from sqlalchemy import select

from appliance.cli_admin import db_path
from appliance.store.models import LedgerEntry
from tests.helpers import PASSWORD, LiveServer, live_server, make_settings, wait_until
from tests.integration.test_authz_matrix import login


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[LiveServer]:
    with live_server(make_settings(tiny_model)) as s:
        yield s


def test_the_session_id_rotates_at_login_and_logout_ends_it(server: LiveServer) -> None:
    with httpx.Client(base_url=server.url) as browser:
        assert login(browser, "bob").status_code == 303
        first = browser.cookies.get("appliance_session")
        assert browser.get("/me").json()["name"] == "bob"
        assert login(browser, "bob").status_code == 303
        second = browser.cookies.get("appliance_session")
        assert first and second and first != second
        with httpx.Client(base_url=server.url, cookies={"appliance_session": first}) as stale:
            assert stale.get("/me").status_code == 401  # the old id is gone
        csrf = browser.cookies.get("csrftoken") or ""
        assert browser.post("/logout", headers={"x-csrftoken": csrf}).status_code == 303
        with httpx.Client(base_url=server.url, cookies={"appliance_session": second}) as old:
            assert old.get("/me").status_code == 401


def test_a_wrong_password_is_refused_and_failures_are_throttled(server: LiveServer) -> None:
    with httpx.Client(base_url=server.url) as browser:
        for _ in range(5):
            assert login(browser, "carol", "not the password").status_code == 401
        r = login(browser, "carol", PASSWORD)  # even the right password waits now
        assert r.status_code == 429
        assert int(r.headers["retry-after"]) > 0
        assert "Too many failed logins" in r.json()["error"]["message"]
        assert login(browser, "bob").status_code == 303  # other accounts are unaffected


def test_a_cookie_request_without_the_csrf_token_is_refused(server: LiveServer) -> None:
    with httpx.Client(base_url=server.url) as browser:
        login(browser, "bob")
        r = browser.post("/conversations", json={"title": "x"})
        assert r.status_code == 403
        csrf = browser.cookies.get("csrftoken") or ""
        ok = browser.post("/conversations", json={"title": "x"}, headers={"x-csrftoken": csrf})
        assert ok.status_code == 201


def test_a_login_without_the_csrf_token_is_refused(server: LiveServer) -> None:
    r = httpx.post(server.url + "/login", data={"name": "bob", "password": PASSWORD})
    assert r.status_code == 403


def test_the_ledger_row_carries_the_member_and_matches_the_returned_usage(
        server: LiveServer) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.keys["bob"],
                           max_retries=0)
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "count"}], max_tokens=7,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None
    rid = chunks[0].id.removeprefix("chatcmpl-")
    server.writer.flush()
    with server.store.read_sessions() as s:
        row = s.scalars(select(LedgerEntry).where(LedgerEntry.request_id == rid)).one()
        assert row.user_id == server.user_ids["bob"]
        assert row.api_key_id is not None
        assert row.klass == "interactive"
        assert row.endpoint == "/v1/chat/completions"
        assert row.prompt_tokens == usage.prompt_tokens
        assert row.output_tokens == usage.completion_tokens
        assert row.finish_reason in ("stop", "length")
        assert row.ttft_ms is not None and row.ttft_ms >= 0
        assert row.queued_at <= row.admitted_at <= row.first_token_at <= row.finished_at


def test_a_member_asking_above_their_class_is_refused(server: LiveServer) -> None:
    with server.client("bob") as bob:
        r = bob.post("/v1/chat/completions", headers={"x-appliance-class": "voice"},
                     json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
        assert r.status_code == 403
        assert "above your maximum" in r.json()["error"]["message"]
        ok = bob.post("/v1/chat/completions", headers={"x-appliance-class": "background"},
                      json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
        assert ok.status_code == 200


def test_usage_endpoint_counts_my_requests(server: LiveServer) -> None:
    with server.client("carol") as carol:
        carol.post("/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 3})
        server.writer.flush()
        wait_until(lambda: carol.get("/me/usage").json()["last_day"]["requests"] >= 1)
        assert carol.get("/me/usage").json()["last_hour"]["output_tokens"] >= 1


def test_the_database_is_a_wal_file_with_an_intact_schema(server: LiveServer,
                                                          tiny_model: Path) -> None:
    path = Path(server.store.engine.url.database or "")
    con = sqlite3.connect(path)
    try:
        assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        con.close()
    assert db_path(make_settings(tiny_model)).name == "appliance.db"


def test_fairness_counters_survive_a_restart(tiny_model: Path) -> None:
    from appliance.daemon import build_daemon
    from appliance.store import limits
    from tests.helpers import wait_until as _wait

    settings = make_settings(tiny_model)
    with live_server(settings) as s:
        with s.client("bob") as bob:
            bob.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "x"}], "max_tokens": 5})
        bob_key = str(s.user_ids["bob"])
        _wait(lambda: s.engine.snapshot.counters.get(bob_key, 0) > 0, what="bob's counter")
    again = build_daemon(settings, secret="x" * 32, drain_timeout=1)  # the same data folder
    try:
        with again.store.read_sessions() as session:
            saved = limits.load_counters(session)[s.user_ids["bob"]]
        assert saved > 0
        # the idle engine publishes a snapshot at least every half second
        _wait(lambda: again.engine.snapshot.counters.get(bob_key) == saved,
              what="restored counter")
    finally:
        again.close()
