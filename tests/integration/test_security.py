"""Issue 13's security defects, each through a real server on loopback.

The server trusts 127.0.0.1 as a reverse proxy (``trusted_proxies``), so a test can speak
for clients at other addresses with ``X-Forwarded-For`` (the way a household's proxy does).
Personas: alice (admin), bob and carol (members).
"""

from __future__ import annotations

import sqlite3
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text

from tests.daemon import cli
from tests.helpers import PASSWORD, LiveServer, live_server, make_settings
from tests.integration.test_authz_matrix import login


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[LiveServer]:
    with live_server(make_settings(tiny_model, trusted_proxies="127.0.0.1")) as s:
        yield s


def browser(server: LiveServer, address: str = "127.0.0.1", **kw: object) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"X-Forwarded-For": address}, **kw)  # type: ignore[arg-type]


@contextmanager
def logged_in(server: LiveServer, who: str, address: str = "127.0.0.1") -> Iterator[httpx.Client]:
    with browser(server, address) as c:
        assert login(c, who).status_code == 303
        c.headers["x-csrftoken"] = c.cookies.get("csrftoken") or ""
        yield c


def error_shape(r: httpx.Response) -> dict[str, object]:
    body = r.json()
    assert set(body) == {"error"} and {"message", "type"} <= set(body["error"]), body
    return body["error"]


# ---- 4: the login throttle cannot be used to exhaust memory ----
def test_a_megabyte_user_name_is_a_400_in_each_login_shape(server: LiveServer) -> None:
    huge = "a" * (1 << 20)
    with browser(server, "10.4.0.1") as c:
        c.get("/login")
        token = c.cookies.get("csrftoken") or ""
        r = c.post("/login", data={"name": huge, "password": "x", "_csrf_token": token})
        assert r.status_code == 400 and "longer than 64" in r.text
        assert r.headers["content-type"].startswith("text/html") and "<form" in r.text
        r = c.post("/login", json={"name": huge, "password": "x"},
                   headers={"x-csrftoken": token})
        assert r.status_code == 400 and "longer than 64" in str(error_shape(r)["message"])
        r = c.post("/login", json={"name": "bob", "password": "p" * 5000},
                   headers={"x-csrftoken": token})
        assert r.status_code == 400
        # none of it counted as a failure: the same address still logs in
        assert login(c, "bob").status_code == 303


# ---- 5: nobody can lock the real user out from elsewhere ----
def test_an_attacker_is_throttled_but_the_real_user_logs_in_from_home(
        server: LiveServer) -> None:
    with browser(server, "10.5.0.66") as attacker:
        for _ in range(5):
            assert login(attacker, "carol", "guess-guess").status_code == 401
        r = login(attacker, "carol", PASSWORD)
        assert r.status_code == 429 and int(r.headers["retry-after"]) > 0
    with browser(server, "10.5.0.2") as carol:
        assert login(carol, "carol").status_code == 303


# ---- 7: CSRF is skipped only for a valid bearer key ----
def test_any_other_authorization_header_does_not_skip_csrf(server: LiveServer) -> None:
    with logged_in(server, "bob") as bob:
        bob.headers.pop("x-csrftoken")
        r = bob.post("/me/keys", json={"name": "forged"},
                     headers={"Authorization": "Basic Ym9iOng="})
        assert r.status_code == 403 and "CSRF" in str(error_shape(r)["message"])
    with server.client("bob") as api:  # a real key needs no CSRF token
        assert api.post("/conversations", json={"title": "t"}).status_code == 201


# ---- 8: a key acts only on keys up to its own class ----
def test_a_background_key_cannot_mint_list_or_revoke_higher_keys(server: LiveServer) -> None:
    with server.client("bob") as bob:
        interactive = bob.post("/me/keys", json={"name": "laptop"}).json()
        low = bob.post("/me/keys", json={"name": "cron", "max_class": "background"}).json()
    with httpx.Client(base_url=server.url,
                      headers={"Authorization": f"Bearer {low['key']}"}) as cron:
        r = cron.post("/me/keys", json={"name": "escalate", "max_class": "interactive"})
        assert r.status_code == 403 and "cannot create" in str(error_shape(r)["message"])
        made = cron.post("/me/keys", json={"name": "sibling"})
        assert made.status_code == 201 and made.json()["max_class"] == "background"
        listed = {k["prefix"] for k in cron.get("/me/keys").json()}
        assert low["prefix"] in listed and interactive["prefix"] not in listed
        assert cron.delete(f"/me/keys/{interactive['prefix']}").status_code == 404
        assert cron.post(f"/keys/{interactive['prefix']}/revoke").status_code == 404
        r = cron.post("/keys", json={"name": "web", "max_class": "interactive"})
        assert r.status_code == 403
    with server.client("bob") as bob:
        assert bob.get("/v1/models").status_code == 200  # the interactive key still works
        assert interactive["prefix"] in {k["prefix"] for k in bob.get("/me/keys").json()}


# ---- 9: the CLI's passwd and disable end sessions; --enable brings none back ----
def test_cli_passwd_and_disable_end_sessions_for_good(server: LiveServer) -> None:
    data_dir = Path(db_path_of(server)).parent
    with logged_in(server, "bob", "10.9.0.1") as bob:
        assert bob.get("/me").status_code == 200
        cli(data_dir, "user", "passwd", "bob", "--password-stdin", stdin=PASSWORD + "\n")
        assert bob.get("/me").status_code == 401
    with logged_in(server, "bob", "10.9.0.2") as bob:
        cli(data_dir, "user", "disable", "bob")
        assert bob.get("/me").status_code == 401
        cli(data_dir, "user", "disable", "bob", "--enable")
        assert bob.get("/me").status_code == 401  # the old session stays gone
    with logged_in(server, "bob", "10.9.0.3") as bob:
        assert bob.get("/me").status_code == 200


def db_path_of(server: LiveServer) -> str:
    return str(server.store.engine.url.database)


# ---- 10: authentication is a read; a locked database answers 503 + Retry-After ----
def test_an_external_write_lock_gives_503_on_writes_only_then_recovers(
        server: LiveServer) -> None:
    """Another process holds the database's write lock (``sqlite3 appliance.db`` with
    ``BEGIN EXCLUSIVE``; in WAL mode readers go on). Key authentication is a read, so keys
    keep working; a request that must write waits the busy timeout, then answers 503 with
    ``Retry-After``; the ledger row of a chat answered meanwhile is written after the lock."""
    def ledger_rows() -> int:
        with server.store.read_sessions() as s:
            return int(s.execute(text("SELECT count(*) FROM ledger")).scalar_one())

    before = ledger_rows()
    locker = sqlite3.connect(db_path_of(server), isolation_level=None, timeout=10)
    locker.execute("BEGIN EXCLUSIVE")
    try:
        with server.client("bob") as bob:
            assert bob.get("/me").status_code == 200  # was: a write transaction, then 500
            r = bob.post("/conversations", json={"title": "while locked"})
            assert r.status_code == 503, r.text
            assert int(r.headers["retry-after"]) > 0
            assert error_shape(r)["type"] == "overloaded"
            chat = bob.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert chat.status_code == 200
    finally:
        locker.execute("COMMIT")
        locker.close()
    with server.client("bob") as bob:
        assert bob.post("/conversations", json={"title": "after"}).status_code == 201
    server.writer.flush(30)
    assert ledger_rows() == before + 1  # nothing lost


# ---- 12: values past what the machine represents are 4xx, never 500 ----
@pytest.mark.parametrize("method, path, body", [
    ("GET", "/conversations/9223372036854775808", None),
    ("GET", "/conversations/99999999999999999999999", None),
    ("PATCH", "/admin/users/9223372036854775808", {"weight": 1.0}),
    ("GET", "/admin/users/9223372036854775808/quota", None),
    ("PUT", "/admin/users/{bob}/quota", {"tokens_per_day": 2**63}),
    ("PUT", "/admin/users/{bob}/quota", {"max_concurrent": 2**70}),
])
def test_huge_integers_are_client_errors(server: LiveServer, method: str, path: str,
                                         body: object) -> None:
    with server.client("alice") as alice:
        r = alice.request(method, path.replace("{bob}", str(server.user_ids["bob"])), json=body)
    assert 400 <= r.status_code < 500, r.text
    error_shape(r)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/conversations", "/me/keys",
                                  "/admin/users", "/login"])
def test_deeply_nested_json_is_a_400(server: LiveServer, path: str) -> None:
    nested = "[" * 100_000 + "]" * 100_000
    body = '{"messages": ' + nested + "}"
    with server.client("alice") as alice:
        r = alice.post(path, content=body, headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500, r.text


@pytest.mark.parametrize("path", ["/admin/users", "/admin/keys", "/slots", "/me/keys",
                                  "/conversations", "/v1/chat/completions"])
def test_options_on_guarded_routes_is_never_a_500(server: LiveServer, path: str) -> None:
    assert httpx.options(server.url + path).status_code == 401
    with server.client("bob") as bob:
        assert bob.options(path).status_code < 500


# ---- 13: no framing of any page; Secure cookie behind a trusted https proxy ----
def test_the_login_page_and_error_pages_forbid_framing(server: LiveServer) -> None:
    for r in (httpx.get(server.url + "/login"),
              httpx.get(server.url + "/nope", headers={"accept": "text/html"})):
        if r.headers.get("content-type", "").startswith("text/html"):
            assert "frame-ancestors 'none'" in r.headers["content-security-policy"]
            assert r.headers["x-frame-options"] == "DENY"
    assert "frame-ancestors 'none'" in httpx.get(
        server.url + "/login").headers["content-security-policy"]


def test_the_session_cookie_is_secure_behind_a_trusted_https_proxy(server: LiveServer) -> None:
    with browser(server, "10.13.0.1") as c:
        c.headers["X-Forwarded-Proto"] = "https"
        r = login(c, "bob")
        assert r.status_code == 303
        cookie = next(v for k, v in r.headers.multi_items()
                      if k == "set-cookie" and v.startswith("appliance_session="))
        assert "secure" in cookie.lower()
    with browser(server, "10.13.0.2") as plain:
        r = login(plain, "bob")
        cookie = next(v for k, v in r.headers.multi_items()
                      if k == "set-cookie" and v.startswith("appliance_session="))
        assert "secure" not in cookie.lower()


# ---- 15: strict quota types and bounds; the message cap; private database files ----
@pytest.mark.parametrize("body", [{"tokens_per_day": "10"}, {"tokens_per_day": 1e12},
                                  {"tokens_per_day": 10**12}, {"max_concurrent": 1.5},
                                  {"max_output_tokens": True}, {"max_concurrent": 0}])
def test_quota_fields_take_bounded_integers_only(server: LiveServer, body: object) -> None:
    uid = server.user_ids["carol"]
    with server.client("alice") as alice:
        r = alice.put(f"/admin/users/{uid}/quota", json=body)
        assert r.status_code == 400, r.text
        error_shape(r)
        assert alice.get(f"/admin/users/{uid}/quota").json()["tokens_per_day"] != 10


def test_a_message_longer_than_the_chat_cap_is_refused(server: LiveServer) -> None:
    with server.client("bob") as bob:
        cid = bob.post("/conversations", json={"title": "long"}).json()["id"]
        r = bob.post(f"/conversations/{cid}/messages",
                     json={"role": "user", "content": "x" * (1 << 20)})
        assert r.status_code == 400 and "16000" in str(error_shape(r)["message"])
        assert bob.post(f"/conversations/{cid}/messages",
                        json={"role": "user", "content": "x" * 16_000}).status_code == 201
        assert len(bob.get(f"/conversations/{cid}").json()["messages"]) == 1


def test_the_database_and_its_wal_are_private(server: LiveServer) -> None:
    with server.client("bob") as bob:
        assert bob.post("/conversations", json={"title": "w"}).status_code == 201
    base = Path(db_path_of(server))
    for f in (base, base.with_name(base.name + "-wal"), base.with_name(base.name + "-shm")):
        if f.exists():
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, f


def test_an_existing_world_readable_database_is_tightened(tmp_path: Path) -> None:
    from appliance.store.db import open_store

    path = tmp_path / "appliance.db"
    sqlite3.connect(path).close()
    path.chmod(0o644)
    open_store(path).close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
