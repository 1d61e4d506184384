"""Every browser page and partial: who may see it, what it shows, how it is protected."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.browser.support import browser, sse_events
from tests.helpers import LiveServer, live_server, make_settings
from web.assets import STATIC, VENDOR_LOCK

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["/chat", "/dashboard", "/keys"]
ADMIN_PAGES = ["/manage/users"]


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[LiveServer]:
    with live_server(make_settings(tiny_model)) as s:
        yield s


def test_anonymous_visitors_are_sent_to_login(server: LiveServer) -> None:
    with httpx.Client(base_url=server.url) as anon:
        for path in ["/", *PAGES, *ADMIN_PAGES, "/chat/1"]:
            r = anon.get(path, headers={"accept": "text/html"})
            assert r.status_code == 303 and r.headers["location"] == "/login", path
        login = anon.get("/login")
        assert login.status_code == 200
        for field in ('name="name"', 'name="password"', 'name="_csrf_token"'):
            assert field in login.text
        assert "/logout" not in login.text


def test_anonymous_partials_and_streams_answer_401_and_tell_htmx_to_log_in(
        server: LiveServer) -> None:
    with httpx.Client(base_url=server.url, headers={"hx-request": "true"}) as anon:
        for method, path in [("GET", "/chat/list"), ("GET", "/dashboard/stream"),
                             ("GET", "/chat/streams/x"), ("POST", "/chat/send"),
                             ("GET", "/chat")]:
            r = anon.request(method, path)
            assert r.status_code == 401, path
            assert r.headers["hx-redirect"] == "/login"


def test_every_page_renders_for_a_member_with_the_model_and_a_logout_button(
        server: LiveServer) -> None:
    with browser(server.url, "bob", htmx=False) as bob:
        for path in PAGES:
            r = bob.get(path)
            assert r.status_code == 200, path
            assert r.headers["content-type"].startswith("text/html")
            assert 'action="/logout"' in r.text and ">bob<" in r.text
            assert server.engine.config.model_path.name in r.text
            assert "demo model" in r.text  # models made by the demo script say so
            assert 'href="/manage/users"' not in r.text  # members get no admin link
        assert bob.get("/chat/list").text.strip().startswith("<ul")
        r = bob.get("/", follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/chat"


def test_admin_pages_are_403_for_members_as_a_page_or_json(server: LiveServer) -> None:
    with browser(server.url, "bob", htmx=False) as bob:
        for path in ADMIN_PAGES:
            page = bob.get(path, headers={"accept": "text/html"})
            assert page.status_code == 403 and "Admins only" in page.text
            assert page.headers["content-type"].startswith("text/html")
            api = bob.get(path, headers={"accept": "application/json"})
            assert api.status_code == 403 and api.json()["error"]["message"] == "Admins only."
            form = bob.post(path, data={"name": "mallory", "password": "longenough1"})
            assert form.status_code == 403
    with browser(server.url, "alice", htmx=False) as alice:
        r = alice.get("/manage/users")
        assert r.status_code == 200 and 'href="/manage/users"' in r.text
        assert all(f'data-user-id="{uid}"' in r.text for uid in server.user_ids.values())


def test_owned_web_routes_answer_each_caller(server: LiveServer) -> None:
    """The routes the authorization matrix lists as OWNED (per-object and streams)."""
    with browser(server.url, "bob") as bob, browser(server.url, "carol") as carol, \
            httpx.Client(base_url=server.url) as anon:
        cid = bob.post("/conversations", json={"title": "bob's"}).json()["id"]
        assert bob.get(f"/chat/{cid}").status_code == 200
        assert carol.get(f"/chat/{cid}").status_code == 404
        assert carol.get(f"/chat/{cid}").status_code == carol.get("/chat/999999").status_code
        assert anon.get(f"/chat/{cid}").status_code == 303
        assert anon.post(f"/chat/{cid}/delete").status_code == 401
        for ext in ("md", "json"):  # the export is the owner's only
            assert bob.get(f"/chat/{cid}/export.{ext}").status_code == 200
            assert carol.get(f"/chat/{cid}/export.{ext}").status_code == 404
            assert anon.get(f"/chat/{cid}/export.{ext}").status_code == 401
        assert carol.post(f"/chat/{cid}/continue").status_code == 404
        assert anon.post(f"/chat/{cid}/continue").status_code == 401
        assert bob.post(f"/chat/{cid}/continue").status_code == 400  # nothing cut short
        mid = bob.post(f"/conversations/{cid}/messages",
                       json={"role": "assistant", "content": "an answer"}).json()["id"]
        assert bob.post(f"/chat/{cid}/answers/{mid}/show/1").status_code == 200
        assert carol.post(f"/chat/{cid}/answers/{mid}/show/1").status_code == 404
        assert anon.post(f"/chat/{cid}/answers/{mid}/show/1").status_code == 401
        qid = bob.post(f"/conversations/{cid}/messages",  # branches and titles (issue 54)
                       json={"role": "user", "content": "a question"}).json()["id"]
        assert bob.post(f"/chat/{cid}/questions/{qid}/show/1").status_code == 200
        assert carol.post(f"/chat/{cid}/questions/{qid}/show/1").status_code == 404
        assert anon.post(f"/chat/{cid}/questions/{qid}/show/1").status_code == 401
        assert bob.get(f"/chat/{cid}/title").status_code == 200
        assert carol.get(f"/chat/{cid}/title").status_code == 404
        assert anon.get(f"/chat/{cid}/title").status_code == 401
        assert carol.post(f"/chat/{cid}/delete").status_code == 404
        r = bob.post(f"/chat/{cid}/delete")
        assert r.status_code == 200 and r.headers["hx-redirect"] == "/chat"
        assert bob.get(f"/chat/{cid}").status_code == 404
        assert bob.get("/chat/streams/nope").status_code == 204
        assert anon.get("/chat/streams/nope").status_code == 401
        assert bob.post("/chat/streams/nope/stop").status_code == 204
        assert anon.post("/chat/streams/nope/stop").status_code == 401
        r = bob.get("/dashboard/stream", params={"frames": 1})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert {name for name, _ in sse_events(r.text)} >= {"summary", "slots", "users"}
        assert anon.get("/dashboard/stream").status_code == 401
        prefix = bob.post("/me/keys", json={"name": "k"}).json()["prefix"]
        assert carol.post(f"/keys/{prefix}/revoke").status_code == 404
        assert anon.post(f"/keys/{prefix}/revoke").status_code == 401
        assert bob.post(f"/keys/{prefix}/revoke").status_code == 200
        assert anon.get("/static/app.css").status_code == 200
        assert anon.get("/static/nope.css").status_code == 404


def test_cookie_form_posts_need_the_csrf_token(server: LiveServer) -> None:
    with browser(server.url, "alice", htmx=False) as alice:
        token = alice.headers.pop("x-csrftoken")
        r = alice.post("/keys", data={"name": "forged"}, headers={"accept": "text/html"})
        assert r.status_code == 403 and "CSRF" in r.text
        r = alice.post("/keys", data={"name": "genuine", "_csrf_token": token})
        assert r.status_code == 201 and "apl_" in r.text


def test_pages_carry_a_strict_content_security_policy(server: LiveServer) -> None:
    with browser(server.url, "bob", htmx=False) as bob:
        csp = bob.get("/chat").headers["content-security-policy"]
        assert "script-src 'self'" in csp and "unsafe-inline" not in csp
        assert "unsafe-eval" not in csp and "frame-ancestors 'none'" in csp
        page = bob.get("/dashboard").text
        assert "<script>" not in page and " on" + "click=" not in page  # nothing inline


def test_vendored_assets_are_served_locally_with_pinned_hashes_and_licenses(
        server: LiveServer) -> None:
    lock = json.loads(VENDOR_LOCK.read_text())
    assert {n: p["version"] for n, p in lock.items()} == {
        "htmx.org": "2.0.11", "htmx-ext-sse": "2.2.4", "@highlightjs/cdn-assets": "11.11.1"}
    with browser(server.url, "bob", htmx=False) as bob:
        page = bob.get("/chat").text
        for package in lock.values():
            path = STATIC / "vendor" / package["file"]
            digest = base64.b64encode(hashlib.sha384(path.read_bytes()).digest()).decode()
            assert package["integrity"] == f"sha384-{digest}"
            assert (path.parent / "LICENSE").stat().st_size > 100
            src = f'/static/vendor/{package["file"]}'
            assert f'src="{src}" integrity="{package["integrity"]}"' in page
            assert bob.get(src).content == path.read_bytes()
        assert "http://" not in page and "https://" not in page  # nothing from elsewhere
    check = subprocess.run([str(ROOT / "scripts" / "vendor_assets.sh"), "--check"],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_the_web_layer_does_not_import_mlx() -> None:
    code = ("import sys, web.routes, bench.dashboards; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')); "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
