"""Issue 52 item 16, small ones, through a live daemon: ``max_completion_tokens: 0`` refused
like ``max_tokens: 0``; job names refuse control and bidi-override characters; every /jobs
400 and 413 names its ``code`` (and the field, ``param``, where there is one); ``interval_s``
alone means an interval schedule and beside another schedule is refused; a long Ollama
name on the Models page is a 400 in words."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.app import MAX_BODY_BYTES
from tests.browser.support import browser
from tests.helpers import LiveServer, live_server, make_settings

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
JOB = {"name": "Boiler", "source": "text", "text": "The boiler is serviced on Friday.",
       "max_output_tokens": 16}


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[LiveServer]:
    with live_server(make_settings(tiny_model)) as s:
        yield s


def test_max_completion_tokens_0_is_refused_like_max_tokens_0(server: LiveServer) -> None:
    with server.client("bob") as bob:
        for field in ("max_tokens", "max_completion_tokens"):
            r = bob.post("/v1/chat/completions", json={**CHAT, field: 0})
            assert r.status_code == 400, (field, r.text)
            err = r.json()["error"]
            assert err["param"] == field and err["code"] == "invalid_value"
            assert f"'{field}' must be at least 1" in err["message"]
        ok = bob.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 2


@pytest.mark.parametrize("name", ["bad\x00name", "\u202eevil.exe", "a\x1b[31mred", "x\u2066y"])
def test_a_job_name_with_control_or_bidi_override_characters_is_refused(
        server: LiveServer, name: str) -> None:
    with server.client("bob") as bob:
        r = bob.post("/jobs", json={**JOB, "name": name})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "name" and err["code"] == "invalid_value"
        assert "may not contain the control character U+" in err["message"]


def test_every_jobs_400_and_413_says_its_code_and_field(server: LiveServer) -> None:
    with server.client("bob") as bob:
        for body, param in (({**JOB, "name": ""}, "name"),
                            ({**JOB, "source": "carrier pigeon"}, "source"),
                            ({**JOB, "text": ""}, "text"),
                            ({**JOB, "max_output_tokens": 1}, "max_output_tokens"),
                            ({**JOB, "schedule": "cron", "cron": "61 * * * *"}, "cron"),
                            ({**JOB, "schedule": "fortnightly-ish"}, "schedule")):
            r = bob.post("/jobs", json=body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert (err["param"], err["code"]) == (param, "invalid_value"), (body, err)
        big = bob.post("/jobs", json={**JOB, "text": "x" * (MAX_BODY_BYTES + 1)})
        assert big.status_code == 413
        assert big.json()["error"]["code"] == "request_too_large"
        made = bob.post("/jobs", json=JOB)
        assert made.status_code == 201, made.text
        edit = bob.patch(f"/jobs/{made.json()['id']}", json={"name": "x\x00"})
        assert edit.status_code == 400 and edit.json()["error"]["param"] == "name"


def test_interval_s_alone_means_an_interval_and_beside_another_schedule_is_refused(
        server: LiveServer) -> None:
    with server.client("bob") as bob:
        r = bob.post("/jobs", json={**JOB, "name": "Every two hours", "interval_s": 7200})
        assert r.status_code == 201, r.text
        schedule = r.json()["schedule"]
        assert (schedule["kind"], schedule["interval_s"]) == ("interval", 7200)
        job_id = r.json()["id"]
        for body in ({"schedule": "cron", "cron": "0 8 * * *", "interval_s": 7200},
                     {"schedule": "none", "interval_s": 7200},
                     {"cron": "0 8 * * *", "interval_s": 7200}):
            refused = bob.post("/jobs", json={**JOB, **body})
            assert refused.status_code == 400, (body, refused.text)
            err = refused.json()["error"]
            assert err["param"] == "interval_s" and "\"schedule\": \"interval\"" in err["message"]
            edit = bob.patch(f"/jobs/{job_id}", json=body)
            assert edit.status_code == 400 and edit.json()["error"]["param"] == "interval_s"
        # an edit sending interval_s alone keeps (or makes) it an interval schedule
        moved = bob.patch(f"/jobs/{job_id}", json={"interval_s": 10800})
        assert moved.status_code == 200, moved.text
        assert moved.json()["schedule"]["interval_s"] == 10800


def test_a_long_ollama_name_on_the_models_page_is_a_400_in_words(server: LiveServer) -> None:
    with browser(server.url, "alice") as alice:
        for name in ("m" * 300, "x:" + "t" * 300, "a" * 5000):
            r = alice.post("/manage/models", data={"source": name})
            assert r.status_code == 400, r.text[-500:]
            assert "is not an Ollama model name" in r.text


def test_only_refusals_in_words_are_400s_and_a_lone_surrogate_is_never_a_500(
        server: LiveServer) -> None:
    """The app maps its own refusals (store.errors.Invalid) to 400, no longer any
    ValueError; text that is not valid Unicode, which Python raises as one, stays a 4xx."""
    with server.client("bob") as bob:
        for path, raw in (("/v1/chat/completions",
                           b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}'),
                          ("/jobs", b'{"name": "x\\udfff", "source": "text", "text": "t"}'),
                          ("/me/keys", b'{"name": "k\\ud800"}')):
            r = bob.post(path, content=raw, headers={"Content-Type": "application/json"})
            assert 400 <= r.status_code < 500, (path, r.status_code, r.text[-300:])
    with server.client("alice") as alice:
        weight = alice.patch(f"/admin/users/{server.user_ids['bob']}", json={"weight": 1e9})
        assert weight.status_code == 400 and "weight must be" in weight.json()["error"]["message"]
