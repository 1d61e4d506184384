"""The /jobs API through a live server: text jobs run now, url jobs against a local site
(feed items only once, webhook delivery), the network guard, authorization, bad input."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import LiveServer, live_server, make_settings
from tests.jobs.sites import Site, start_site


@pytest.fixture(scope="module")
def site() -> Iterator[Site]:
    s = start_site()
    yield s
    s.close()


@pytest.fixture(scope="module")
def other_site() -> Iterator[Site]:
    """A second origin (another port): where a cross-origin redirect leads."""
    s = start_site()
    yield s
    s.close()


@pytest.fixture(scope="module")
def server(tiny_model: Path, site: Site, other_site: Site) -> Iterator[LiveServer]:
    settings = make_settings(tiny_model,
                             url_allow=f"127.0.0.1:{site.port}, 127.0.0.1:{other_site.port}",
                             fetch_max_bytes=1 << 20, document_max_bytes=64 << 10)
    with live_server(settings) as s:
        yield s


def wait_run(c: httpx.Client, job_id: int, run_id: int, timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = c.get(f"/jobs/{job_id}/runs/{run_id}").json()
        if run["status"] not in ("pending", "running"):
            return run
        time.sleep(0.1)
    raise AssertionError(f"run {run_id} did not finish: {run}")


def make_job(c: httpx.Client, **fields: Any) -> dict[str, Any]:
    body = {"name": f"job {time.monotonic_ns()}", "max_output_tokens": 16, **fields}
    r = c.post("/jobs", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def run_now(c: httpx.Client, job_id: int) -> dict[str, Any]:
    r = c.post(f"/jobs/{job_id}/run")
    assert r.status_code == 202, r.text
    return wait_run(c, job_id, r.json()["id"])


def test_a_text_job_runs_now_and_its_output_and_ledger_rows_are_kept(server: LiveServer) -> None:
    with server.client("bob") as bob:
        job = make_job(bob, source="text", text="The boiler is serviced on Friday.",
                       instructions="Say what happens when.")
        assert job["schedule"]["description"] == "On demand"
        run = run_now(bob, job["id"])
        assert run["status"] == "done", run
        assert run["output"] and run["requests"] == 1
        assert run["progress"] == {"done": 1, "total": 1}
        server.writer.flush()
        from sqlalchemy import text
        with server.store.read_sessions() as s:
            rows = s.execute(text("SELECT request_id, klass, endpoint, user_id, prompt_tokens, "
                                  "output_tokens FROM ledger WHERE endpoint = 'job'")).all()
        mine = [r for r in rows if r[0] in run["request_ids"]]
        assert len(mine) == 1
        assert mine[0][1:4] == ("background", "job", server.user_ids["bob"])
        assert (mine[0][4], mine[0][5]) == (run["prompt_tokens"], run["output_tokens"])
        listed = bob.get(f"/jobs/{job['id']}/runs").json()
        assert [r["id"] for r in listed] == [run["id"]] and "output" not in listed[0]
    with server.client("alice") as alice:  # its latency is labelled as a job's
        metrics = alice.get("/metrics").text
    assert 'appliance_e2e_request_latency_seconds_count{api="jobs",class="background"}' \
        in metrics
    assert 'api="web",class="background"' not in metrics


def test_a_url_job_reads_a_feed_then_only_its_new_items_and_calls_the_webhook(
        server: LiveServer, site: Site) -> None:
    site.items[:] = [1, 2]
    site.hooks.clear()
    site.hook_failures = 1  # the first delivery attempt fails: retried
    with server.client("alice") as alice:
        job = make_job(alice, source="url", url=site.url + "/feed.atom",
                       webhook_url=site.url + "/hook")
        first = run_now(alice, job["id"])
        assert first["status"] == "done", first
        assert first["source_bytes"] > 0 and first["output"]
        deadline = time.monotonic() + 30
        while not site.hooks and time.monotonic() < deadline:
            time.sleep(0.05)
        assert site.hooks and site.hooks[0]["run_id"] == first["id"]
        assert site.hooks[0]["output"] == first["output"]
        while alice.get(f"/jobs/{job['id']}/runs/{first['id']}").json()["delivery"] is None:
            time.sleep(0.05)
        got = alice.get(f"/jobs/{job['id']}/runs/{first['id']}").json()
        assert got["delivery"] == "sent" and "attempt 2" in got["delivery_detail"]
        nothing = run_now(alice, job["id"])
        assert nothing["output"] == "Nothing new since the last run." and nothing["requests"] == 0
        site.items.append(3)
        third = run_now(alice, job["id"])
        assert third["status"] == "done" and third["requests"] == 1
        # only item 3 was read: far fewer bytes than the first run's two items
        assert 0 < third["source_bytes"] < first["source_bytes"]


def test_an_html_page_becomes_text_and_headers_are_sent_but_never_shown(
        server: LiveServer, site: Site) -> None:
    with server.client("alice") as alice:
        page = make_job(alice, source="url", url=site.url + "/page.html")
        run = run_now(alice, page["id"])
        assert run["status"] == "done", run
        assert 0 < run["source_bytes"] < 600  # the article, without the markup
        auth = make_job(alice, source="url", url=site.url + "/auth",
                        headers={"Authorization": "Bearer ha-token"})
        assert auth["source"]["headers"] == {"Authorization": "(set)"}
        assert "ha-token" not in alice.get(f"/jobs/{auth['id']}").text
        assert run_now(alice, auth["id"])["status"] == "done"
        edited = alice.patch(f"/jobs/{auth['id']}", json={"instructions": "List the lights."})
        assert edited.status_code == 200
        assert run_now(alice, auth["id"])["status"] == "done"  # headers kept by the edit
        cleared = alice.patch(f"/jobs/{auth['id']}", json={"headers": {}}).json()
        assert cleared["source"]["headers"] == {}
        failed = run_now(alice, auth["id"])
        assert failed["status"] == "error" and "HTTP 401" in failed["error"]


SECRETS = {"Authorization": "Bearer ha-token", "Cookie": "session=s3cret",
           "X-Api-Key": "k-123"}


def test_stored_headers_never_follow_a_redirect_to_another_origin(
        server: LiveServer, site: Site, other_site: Site) -> None:
    """Issue #37, item 2: a page that answers 302 to another host (here another port, so
    another origin) gets the job's token and cookie; the other host never sees them."""
    with server.client("alice") as alice:
        job = make_job(alice, source="url", url=site.url + "/redirect", headers=SECRETS)
        site.redirect_to = site.url + "/auth"  # same origin: the headers go along
        site.seen.clear()
        assert run_now(alice, job["id"])["status"] == "done"
        assert [p for p, _ in site.seen] == ["/redirect", "/auth"]
        assert all(h.get("Authorization") == "Bearer ha-token" and h.get("Cookie")
                   and h.get("X-Api-Key") for _, h in site.seen)
        site.redirect_to = other_site.url + "/auth"
        site.seen.clear()
        other_site.seen.clear()
        run = run_now(alice, job["id"])
    assert [p for p, _ in site.seen] == ["/redirect"]  # the job's own origin got them
    assert site.seen[0][1].get("Authorization") == "Bearer ha-token"
    assert [p for p, _ in other_site.seen] == ["/auth"]  # the redirect was followed...
    leaked = {k.lower() for k in other_site.seen[0][1]} & {k.lower() for k in SECRETS}
    assert leaked == set()  # ...without the job's headers
    assert run["status"] == "error" and "HTTP 401" in run["error"]


def test_a_member_cannot_reach_private_addresses(server: LiveServer, site: Site) -> None:
    with server.client("bob") as bob:
        for url in (site.url + "/feed.atom", "http://10.0.0.7/admin", "http://localhost:1/",
                    "http://[::1]:8123/", "http://169.254.169.254/latest/meta-data"):
            r = bob.post("/jobs", json={"name": "peek", "source": "url", "url": url})
            assert r.status_code == 400, (url, r.text)
            assert "public addresses only" in r.json()["error"]["message"]
        r = bob.post("/jobs", json={"name": "hook", "source": "text", "text": "x",
                                    "webhook_url": "http://192.168.1.1/"})
        assert r.status_code == 400
        assert bob.post("/jobs", json={"name": "ftp", "source": "url",
                                       "url": "file:///etc/passwd"}).status_code == 400


def test_run_time_checks_refuse_rebound_names_and_redirects_to_loopback(
        server: LiveServer, site: Site) -> None:
    """A name checked at creation can resolve elsewhere later (DNS rebinding): each run
    checks again. Rows are written directly to stand for jobs made while the name was
    public."""
    from appliance.store import jobs as store_jobs

    with server.store.sessions.begin() as s:
        ids = [store_jobs.create_job(s, server.user_ids["bob"], {
            "name": f"rebound {n}", "instructions": "x", "source_kind": "url", "url": url,
            "schedule_kind": "none", "max_output_tokens": 16}).id
            for n, url in enumerate((site.url + "/feed.atom", "http://10.1.2.3/"))]
    with server.client("bob") as bob:
        loop = run_now(bob, ids[0])
        assert loop["status"] == "error"
        assert "127.0.0.1 is a loopback address" in loop["error"]
        private = run_now(bob, ids[1])
        assert private["status"] == "error" and "10.1.2.3 is a private address" in private["error"]
    site.redirect_to = server.url + "/health"  # the appliance itself, another port
    with server.client("alice") as alice:
        job = make_job(alice, source="url", url=site.url + "/redirect")
        run = run_now(alice, job["id"])
        assert run["status"] == "error"
        assert "loopback" in run["error"] and "allow-list" in run["error"]


def test_size_caps_end_the_run_with_a_reason(server: LiveServer, site: Site) -> None:
    with server.client("alice") as alice:
        job = make_job(alice, source="url", url=site.url + "/huge")
        run = run_now(alice, job["id"])
        assert run["status"] == "error" and "1048576-byte limit" in run["error"], run
        r = alice.post("/jobs", json={"name": "tome", "source": "text", "text": "w " * 40000})
        assert r.status_code == 400 and "65536-byte limit" in r.json()["error"]["message"]


def test_members_see_only_their_own_jobs_and_admins_see_all(server: LiveServer) -> None:
    with server.client("bob") as bob, server.client("carol") as carol, \
            server.client("alice") as alice, server.client() as anon:
        job = make_job(bob, name="bob's digest", source="text", text="private notes")
        jid = job["id"]
        run = run_now(bob, jid)
        missing = carol.get("/jobs/999999")
        assert missing.status_code == 404
        for method, path, body in (
                ("GET", f"/jobs/{jid}", None), ("PATCH", f"/jobs/{jid}", {"paused": True}),
                ("DELETE", f"/jobs/{jid}", None), ("POST", f"/jobs/{jid}/run", None),
                ("GET", f"/jobs/{jid}/runs", None), ("GET", f"/jobs/{jid}/runs/{run['id']}", None),
                ("POST", f"/jobs/{jid}/runs/{run['id']}/cancel", None)):
            r = carol.request(method, path, json=body)
            assert r.status_code == 404, (method, path, r.text)
            assert r.json()["error"]["message"] == missing.json()["error"]["message"]
            assert anon.request(method, path, json=body).status_code == 401
        assert jid not in [j["id"] for j in carol.get("/jobs").json()]
        assert jid in [j["id"] for j in alice.get("/jobs").json()]
        assert alice.get(f"/jobs/{jid}/runs/{run['id']}").json()["output"] == run["output"]
        assert bob.get(f"/jobs/{jid}").json()["name"] == "bob's digest"
        # the Jobs page's own routes answer the same way
        for method, path in (("GET", f"/jobs/page/{jid}"), ("GET", f"/jobs/page/{jid}/history"),
                             ("POST", f"/jobs/page/{jid}/run"),
                             ("POST", f"/jobs/page/{jid}/pause"),
                             ("POST", f"/jobs/page/{jid}/delete"),
                             ("POST", f"/jobs/page/{jid}/runs/{run['id']}/cancel")):
            assert carol.request(method, path).status_code == 404, (method, path)
            assert anon.request(method, path).status_code in (303, 401)
        assert bob.get(f"/jobs/page/{jid}").status_code == 200
        assert bob.post(f"/jobs/page/{jid}/frobnicate").status_code == 404
        assert bob.get(f"/jobs/{jid}").json()["paused"] is False


BAD: list[tuple[str, str, object, int, str]] = [
    ("POST", "/jobs", None, 400, "empty"),
    ("POST", "/jobs", "{not json", 400, "Malformed JSON"),
    ("POST", "/jobs", "[1, 2]", 400, "Expected `object`"),
    ("POST", "/jobs", {"name": "x", "sorce": "text"}, 400, "sorce"),
    ("POST", "/jobs", {"source": "text", "text": "x"}, 400, "'name' is required"),
    ("POST", "/jobs", {"name": "x", "source": "ftp"}, 400, "'source' must be one of"),
    ("POST", "/jobs", {"name": "x", "source": "text"}, 400, "needs the document"),
    ("POST", "/jobs", {"name": "x", "source": "url"}, 400, "'url' is required"),
    ("POST", "/jobs", {"name": "x", "text": "t", "schedule": "cron", "cron": "7am"}, 400,
     "not understood; use a 5-field cron"),
    ("POST", "/jobs", {"name": "x", "text": "t", "schedule": "cron", "cron": "1 2 3"}, 400,
     "'every day at 7'"),
    ("POST", "/jobs", {"name": "x", "text": "t", "cron": "every monday at 25:00"}, 400,
     "not a time of day"),
    ("POST", "/jobs", {"name": "x", "text": "t", "schedule": "cron", "cron": "99 * * * *"}, 400,
     "not valid"),
    ("POST", "/jobs", {"name": "x", "text": "t", "schedule": "interval", "interval_s": 0}, 400,
     "interval_s"),
    ("POST", "/jobs", {"name": "x", "text": "t", "schedule": "fortnightly"}, 400,
     "'schedule' must be one of none, cron, interval, or a 5-field cron"),
    ("POST", "/jobs", {"name": "x", "text": "t", "max_output_tokens": 10**9}, 400,
     "max_output_tokens"),
    ("POST", "/jobs", {"name": "x", "text": "t", "max_output_tokens": "lots"}, 400, "Invalid"),
    ("POST", "/jobs", {"name": "x", "source": "url", "url": "http://h/",
                       "headers": {"Host": "x"}}, 400, "set by the appliance"),
    ("POST", "/jobs", {"name": "x" * 101, "text": "t"}, 400, "longer than"),
    ("PATCH", "/jobs/{id}", {}, 400, "Nothing to change"),
    ("PATCH", "/jobs/{id}", {"paused": "yes"}, 400, "Invalid"),
    ("PATCH", "/jobs/{id}", {"schedule": "cron"}, 400, "needs 'cron'"),
    ("GET", "/jobs/abc", None, 404, ""),
    ("GET", "/jobs/{id}/runs/999999", None, 404, "run not found"),
    ("POST", "/jobs/999999/run", None, 404, "job not found"),
    ("DELETE", "/jobs/999999", None, 404, "job not found"),
    ("POST", "/jobs/{id}/runs/999999/cancel", None, 404, "run not found"),
]


@pytest.mark.parametrize("method, path, body, status, words", BAD,
                         ids=[f"{m} {p} {n}" for n, (m, p, *_) in enumerate(BAD)])
def test_bad_input_gets_a_clear_4xx_and_changes_nothing(
        server: LiveServer, method: str, path: str, body: object, status: int,
        words: str) -> None:
    with server.client("carol") as carol:
        job = carol.get("/jobs").json()
        if not job:
            job = [make_job(carol, name="carol's", source="text", text="t")]
        jid = job[0]["id"]
        before = carol.get(f"/jobs/{jid}").json()
        kwargs: dict[str, Any] = {}
        if isinstance(body, str):
            kwargs["content"] = body
        elif body is not None:
            kwargs["json"] = body
        r = carol.request(method, path.replace("{id}", str(jid)), **kwargs)
        assert r.status_code == status, r.text
        assert words in r.json()["error"]["message"]
        after = carol.get(f"/jobs/{jid}").json()
        assert {k: v for k, v in after.items() if k != "schedule"} == \
            {k: v for k, v in before.items() if k != "schedule"}


def test_a_name_is_unique_per_owner(server: LiveServer) -> None:
    with server.client("carol") as carol, server.client("bob") as bob:
        make_job(carol, name="Morning feeds", source="text", text="t")
        r = carol.post("/jobs", json={"name": "Morning feeds", "source": "text", "text": "t"})
        assert r.status_code == 409
        make_job(bob, name="Morning feeds", source="text", text="t")


def test_the_job_scheduler_stops_before_the_engine_drains() -> None:
    """Litestar runs shutdown hooks last to first: the jobs' hook must run first."""
    from types import SimpleNamespace

    from appliance.app import create_app

    order: list[str] = []

    async def stop_jobs() -> None:
        order.append("jobs")

    jobs: Any = SimpleNamespace(start=lambda: None, stop=stop_jobs)
    services: Any = SimpleNamespace()
    app = create_app(services, "x" * 32, on_shutdown=[lambda: order.append("drain")],
                     jobs=jobs)
    assert app.on_shutdown[::-1][0] is stop_jobs


@pytest.mark.parametrize("fields, kind, cron, interval", [
    ({"schedule": "every day at 7"}, "cron", "0 7 * * *", None),
    ({"schedule": "cron", "cron": "@daily"}, "cron", "0 0 * * *", None),
    ({"cron": "every monday at 8:30"}, "cron", "30 8 * * 1", None),
    ({"schedule": "@weekly"}, "cron", "0 0 * * 0", None),
    ({"schedule": "cron", "cron": "every 2 hours"}, "cron", "0 */2 * * *", None),
    ({"schedule": "every 90 minutes"}, "interval", None, 5400),
])
def test_a_schedule_in_words_is_stored_as_the_cron_it_means(
        server: LiveServer, fields: dict[str, Any], kind: str, cron: str | None,
        interval: int | None) -> None:
    with server.client("bob") as bob:
        job = make_job(bob, source="text", text="t", **fields)
        assert (job["schedule"]["kind"], job["schedule"]["cron"],
                job["schedule"]["interval_s"]) == (kind, cron, interval)
        assert bob.delete(f"/jobs/{job['id']}").status_code in (200, 204)


def test_the_jobs_page_previews_a_schedule_in_words(server: LiveServer) -> None:
    with server.client("bob") as bob:
        r = bob.get("/jobs/page/preview", params={"schedule": "cron", "cron": "every day at 7"})
        assert r.status_code == 200 and "07:00" in r.text and "error" not in r.text
        bad = bob.get("/jobs/page/preview", params={"schedule": "cron", "cron": "teatime"})
        assert "every day at 7" in bad.text  # the error names what is accepted


def test_the_preview_refuses_an_interval_in_words_not_pythons(server: LiveServer) -> None:
    with server.client("bob") as bob:
        r = bob.get("/jobs/page/preview", params={"schedule": "interval", "interval_min": "ten"})
        assert r.status_code == 200 and "whole number of minutes" in r.text
        assert "invalid literal" not in r.text  # Python's own words never reach a page
