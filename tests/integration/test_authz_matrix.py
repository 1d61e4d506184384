"""Every route against anonymous, member and admin callers, and own versus other's data.

Expected codes: 401 without credentials, 403 for a member on admin routes, 404 for another
member's conversation or key (exactly like one that does not exist), never a leak.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import PASSWORD, LiveServer, live_server, make_settings


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[LiveServer]:
    with live_server(make_settings(tiny_model)) as s:
        yield s


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
OLLAMA = {"model": "tiny", "stream": False, "options": {"num_predict": 2}}

# (method, path, json body, expected for anonymous, member (bob), admin (alice))
MATRIX: list[tuple[str, str, object, int, int, int]] = [
    ("GET", "/health", None, 200, 200, 200),
    ("GET", "/login", None, 200, 200, 200),
    ("GET", "/schema", None, 401, 200, 200),
    ("GET", "/schema/openapi.json", None, 401, 200, 200),
    ("GET", "/schema/openapi.yaml", None, 401, 404, 404),  # GET /schema/{path}: JSON only
    ("GET", "/v1/models", None, 401, 200, 200),
    ("GET", "/v1/models/tiny", None, 401, 200, 200),
    ("POST", "/v1/chat/completions", CHAT, 401, 200, 200),
    ("POST", "/v1/completions", {"prompt": "a", "max_tokens": 2}, 401, 200, 200),
    ("GET", "/slots", None, 401, 403, 200),
    ("GET", "/metrics", None, 401, 403, 200),
    ("GET", "/v1/cache/stats", None, 401, 200, 200),
    ("GET", "/me", None, 401, 200, 200),
    ("GET", "/me/usage", None, 401, 200, 200),
    ("GET", "/me/keys", None, 401, 200, 200),
    ("POST", "/me/keys", {"name": "laptop"}, 401, 201, 201),
    ("GET", "/conversations", None, 401, 200, 200),
    ("POST", "/conversations", {"title": "t"}, 401, 201, 201),
    ("GET", "/admin/users", None, 401, 403, 200),
    ("POST", "/admin/users", {"name": "dave{n}", "password": "longenough1"}, 401, 403, 201),
    ("PATCH", "/admin/users/{carol}", {"weight": 2.0}, 401, 403, 200),
    ("GET", "/admin/users/{carol}/quota", None, 401, 403, 200),
    ("PUT", "/admin/users/{carol}/quota", {"tokens_per_day": 1000}, 401, 403, 200),
    ("GET", "/admin/keys", None, 401, 403, 200),
    ("POST", "/admin/users/{carol}/keys", {"name": "x"}, 401, 403, 201),
    ("GET", "/admin/usage", None, 401, 403, 200),
    ("PATCH", "/admin/keys/{carol}", {"default_class": None}, 401, 403, 404),  # no such key
    ("GET", "/jobs", None, 401, 200, 200),
    ("POST", "/jobs", {"name": "digest{n}", "source": "text", "text": "t"}, 401, 201, 201),
    ("POST", "/logout", {}, 401, 200, 200),
    # Ollama API (errors in Ollama's shape) and the voice hook: keys only.
    ("POST", "/api/chat", {**OLLAMA, "messages": CHAT["messages"]}, 401, 200, 200),
    ("POST", "/api/generate", {**OLLAMA, "prompt": "a"}, 401, 200, 200),
    ("GET", "/api/tags", None, 401, 200, 200),
    ("GET", "/api/ps", None, 401, 200, 200),
    ("POST", "/api/show", {"model": "tiny"}, 401, 200, 200),
    ("POST", "/api/pull", {"model": "tiny", "stream": False}, 401, 200, 200),
    ("GET", "/api/version", None, 200, 200, 200),
    ("POST", "/api/embed", {"model": "tiny", "input": "hi"}, 401, 200, 200),
    ("POST", "/api/embeddings", {"model": "tiny", "prompt": "hi"}, 401, 200, 200),
    ("POST", "/v1/embeddings", {"input": "hi"}, 401, 200, 200),  # public, as Ollama's (clients probe it)
    ("POST", "/hooks/voice", {"text": "hi", "max_tokens": 2}, 401, 200, 200),
    ("POST", "/admin/model", {"model": "nothing-here"}, 401, 403, 400),
    # Browser UI (web/). An anonymous visitor to a page is sent to /login (303); partials,
    # form posts and streams answer 401. A form post without htmx redirects (303) after it
    # succeeds. Streams and per-object routes: OWNED, tested in tests/integration/test_web_*.
    # `/` answers "Ollama is running" to API clients (httpx sends `Accept: */*`); a browser
    # (`Accept: text/html`) is redirected: tests/integration/test_ollama_api.py.
    ("GET", "/", None, 200, 200, 200),
    ("GET", "/chat", None, 303, 200, 200),
    ("GET", "/chat/list", None, 401, 200, 200),
    ("POST", "/chat/send", {"message": "hi"}, 401, 200, 200),
    ("GET", "/dashboard", None, 303, 200, 200),
    ("GET", "/keys", None, 303, 200, 200),
    ("POST", "/keys", {"name": "web"}, 401, 201, 201),
    ("GET", "/jobs/page", None, 303, 200, 200),
    ("GET", "/jobs/page/list", None, 401, 200, 200),
    ("GET", "/jobs/page/preview", None, 401, 200, 200),
    ("POST", "/jobs/page", {"name": "webjob{n}", "text": "t"}, 401, 303, 303),
    ("GET", "/manage/users", None, 303, 403, 200),
    ("POST", "/manage/users", {"name": "webuser{n}", "password": "longenough1"}, 401, 403, 303),
    ("POST", "/manage/users/{carol}", {"weight": "1.5"}, 401, 403, 303),
    ("GET", "/manage/models", None, 303, 403, 200),
    ("POST", "/manage/models", {"source": "ollama:nothing-here"}, 401, 403, 404),
    ("GET", "/settings", None, 303, 200, 200),
    ("POST", "/settings/preferences", {"theme": "system"}, 401, 303, 303),
    ("POST", "/settings/household", {"household_prompt": ""}, 401, 403, 303),
    ("GET", "/dashboard/history", None, 401, 200, 200),
    ("POST", "/manage/models/use", {"model": "nothing-here"}, 401, 403, 400),
    ("POST", "/keys/home-assistant", None, 401, 403, 201),
    ("POST", "/start/hide", None, 401, 403, 200),
    ("GET", "/docs/jobs.md", None, 303, 200, 200),
]


def _path(server: LiveServer, path: str) -> str:
    return path.replace("{carol}", str(server.user_ids["carol"]))


def _body(body: object, n: int) -> object:
    if isinstance(body, dict) and "name" in body and "{n}" in str(body["name"]):
        return {**body, "name": str(body["name"]).replace("{n}", str(n))}
    return body


@pytest.mark.parametrize("method, path, body, anon, member, admin", MATRIX,
                         ids=[f"{m} {p}" for m, p, *_ in MATRIX])
def test_route_answers_each_kind_of_caller(server: LiveServer, method: str, path: str,
                                           body: object, anon: int, member: int,
                                           admin: int) -> None:
    for n, (who, expected) in enumerate(((None, anon), ("bob", member), ("alice", admin))):
        with server.client(who) as c:
            r = c.request(method, _path(server, path), json=_body(body, n))
        assert r.status_code == expected, (who, r.text)
        if expected in (401, 403) and path.startswith("/api/"):
            assert isinstance(r.json()["error"], str)  # Ollama's shape
        elif expected in (401, 403):
            assert set(r.json()["error"]) >= {"message", "type"}


def test_the_matrix_covers_every_route(server: LiveServer) -> None:
    app = server.daemon.app
    covered = {(m, re.sub(r"\{\w+\}", "{}", p)) for m, p, *_ in MATRIX} | OWNED
    for route in app.routes:
        for method in getattr(route, "methods", ()):
            if method in ("HEAD", "OPTIONS"):
                continue
            path = re.sub(r"\{[^}]+\}", "{}", route.path)
            assert (method, path) in covered, f"{method} {route.path} is not in the matrix"


OWNED = {("GET", "/schema/{}"),  # probed by the /schema/openapi.yaml row above
         ("GET", "/v1/models/{}"),  # probed by the /v1/models/tiny row above
         ("GET", "/docs/{}"),  # probed by the /docs/jobs.md row above
         ("GET", "/conversations/{}"), ("PATCH", "/conversations/{}"),
         ("DELETE", "/conversations/{}"), ("POST", "/conversations/{}/messages"),
         ("DELETE", "/me/keys/{}"), ("DELETE", "/admin/keys/{}"), ("POST", "/login"),
         # web/: tests/integration/test_web_pages.py::test_owned_web_routes_answer_each_caller
         ("GET", "/chat/{}"), ("POST", "/chat/{}/delete"), ("GET", "/chat/streams/{}"),
         ("GET", "/chat/{}/export.md"), ("GET", "/chat/{}/export.json"),
         ("POST", "/chat/{}/continue"), ("POST", "/chat/{}/answers/{}/show/{}"),
         ("POST", "/chat/{}/questions/{}/show/{}"), ("GET", "/chat/{}/title"),
         ("POST", "/chat/streams/{}/stop"), ("GET", "/dashboard/stream"),
         # tests/integration/test_web_attach.py
         ("POST", "/chat/attachments"), ("GET", "/chat/readings/{}"),
         ("POST", "/chat/readings/{}/stop"),
         ("POST", "/keys/{}/revoke"), ("GET", "/static/{}"),
         # tests/integration/test_web_household.py and tests/browser/test_household_chat.py
         ("POST", "/chat/{}/rename"), ("POST", "/chat/{}/regenerate"), ("POST", "/chat/{}/edit"),
         ("POST", "/settings/password"),
         # jobs: tests/jobs/test_jobs_api.py::test_members_see_only_their_own_jobs_and_admins_see_all
         ("GET", "/jobs/{}"), ("PATCH", "/jobs/{}"), ("DELETE", "/jobs/{}"),
         ("POST", "/jobs/{}/run"), ("GET", "/jobs/{}/runs"), ("GET", "/jobs/{}/runs/{}"),
         ("POST", "/jobs/{}/runs/{}/cancel"),
         ("GET", "/jobs/page/{}"), ("GET", "/jobs/page/{}/history"),
         ("POST", "/jobs/page/{}/run"), ("POST", "/jobs/page/{}/{}"),
         ("POST", "/jobs/page/{}/runs/{}/cancel")}


def test_a_member_cannot_see_or_touch_another_members_conversation(server: LiveServer) -> None:
    with server.client("bob") as bob, server.client("carol") as carol, \
            server.client() as anon:
        cid = bob.post("/conversations", json={"title": "bob's plans"}).json()["id"]
        assert bob.post(f"/conversations/{cid}/messages",
                        json={"role": "user", "content": "secret"}).status_code == 201
        missing = carol.get("/conversations/999999")
        for method, path, body in (("GET", f"/conversations/{cid}", None),
                                   ("PATCH", f"/conversations/{cid}", {"title": "mine"}),
                                   ("DELETE", f"/conversations/{cid}", None),
                                   ("POST", f"/conversations/{cid}/messages",
                                    {"role": "user", "content": "x"})):
            r = carol.request(method, path, json=body)
            assert r.status_code == 404
            assert r.json()["error"]["message"] == missing.json()["error"]["message"]
            assert "secret" not in r.text and "bob" not in r.text
            assert anon.request(method, path, json=body).status_code == 401
        assert [c["id"] for c in carol.get("/conversations").json()] == []
        got = bob.get(f"/conversations/{cid}").json()
        assert got["title"] == "bob's plans" and got["messages"][0]["content"] == "secret"
        assert bob.delete(f"/conversations/{cid}").status_code == 204


def test_a_member_cannot_revoke_another_members_key(server: LiveServer) -> None:
    with server.client("bob") as bob, server.client("carol") as carol, \
            server.client("alice") as alice:
        prefix = bob.post("/me/keys", json={"name": "tablet"}).json()["prefix"]
        assert carol.delete(f"/me/keys/{prefix}").status_code == 404
        assert bob.delete("/admin/keys/" + prefix).status_code == 403
        assert alice.delete("/admin/keys/" + prefix).status_code == 204
        assert bob.delete(f"/me/keys/{prefix}").status_code == 204  # already revoked: idempotent
        assert anon_status(server, "DELETE", f"/me/keys/{prefix}") == 401


def anon_status(server: LiveServer, method: str, path: str) -> int:
    return httpx.request(method, server.url + path).status_code


def test_a_revoked_key_and_a_disabled_user_are_refused(server: LiveServer) -> None:
    with server.client("alice") as alice:
        made = alice.post("/admin/users", json={"name": "erin", "password": PASSWORD}).json()
        key = alice.post(f"/admin/users/{made['id']}/keys", json={"name": "k"}).json()
        with httpx.Client(base_url=server.url,
                          headers={"Authorization": f"Bearer {key['key']}"}) as erin:
            assert erin.get("/me").json()["name"] == "erin"
            alice.patch(f"/admin/users/{made['id']}", json={"disabled": True})
            assert erin.get("/me").status_code == 401
            alice.patch(f"/admin/users/{made['id']}", json={"disabled": False})
            assert erin.get("/me").status_code == 200
            alice.delete(f"/admin/keys/{key['prefix']}")
            assert erin.get("/me").status_code == 401


def test_a_browser_session_cannot_call_the_openai_api(server: LiveServer) -> None:
    with httpx.Client(base_url=server.url) as browser:
        login(browser, "bob")
        assert browser.get("/me").status_code == 200
        r = browser.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 401
        assert "Bearer" in r.json()["error"]["message"]


def login(browser: httpx.Client, name: str, password: str = PASSWORD) -> httpx.Response:
    browser.get("/login")
    token = browser.cookies.get("csrftoken")
    # the first login re-hashes the test's cheap argon2 hash with the real parameters: on
    # a loaded shared machine that takes longer than httpx's default 5 s
    return browser.post("/login", data={"name": name, "password": password,
                                        "_csrf_token": token or ""}, timeout=120)
