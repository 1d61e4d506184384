"""Quotas set by an admin, enforced on the running daemon: 429s with a reason and
Retry-After, and a running answer cut off with finish reason ``quota``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from appliance.engine.request import GenerationRequest
from tests.helpers import LiveServer, live_server, make_settings, wait_until

SLOW = 77_777


def _fault(request: GenerationRequest, phase: str) -> None:
    if request.max_tokens == SLOW:
        import time
        time.sleep(0.05)


@pytest.fixture()
def server(tiny_model: Path) -> Iterator[LiveServer]:
    with live_server(make_settings(tiny_model), fault=_fault) as s:
        yield s


def _set_quota(server: LiveServer, who: str, **limits: int | None) -> None:
    with server.client("alice") as alice:
        r = alice.put(f"/admin/users/{server.user_ids[who]}/quota", json=limits)
        assert r.status_code == 200, r.text


def _ask(c: httpx.Client, max_tokens: int | None = None, text: str = "hello",
         stream: bool = False) -> httpx.Response:
    body: dict[str, object] = {"messages": [{"role": "user", "content": text}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    ban = {str(t): -100.0 for t in range(0, 3)}  # the tiny model's special tokens
    return c.post("/v1/chat/completions", json={**body, "logit_bias": ban, "stream": stream})


def test_a_running_answer_stops_with_quota_and_the_next_request_gets_429(
        server: LiveServer) -> None:
    _set_quota(server, "carol", tokens_per_day=60)
    with server.client("carol") as carol:
        first = _ask(carol, max_tokens=500)
        assert first.status_code == 200
        body = first.json()
        assert body["choices"][0]["finish_reason"] == "quota"
        used = body["usage"]["total_tokens"]
        assert 60 <= used <= 61  # cut off within one tick's tokens
        again = _ask(carol, max_tokens=5)
        assert again.status_code == 429
        err = again.json()["error"]
        assert err["code"] == "tokens_per_day"
        assert "daily token quota of 60 tokens used; resets in" in err["message"]
        assert int(again.headers["retry-after"]) > 0
    with server.client("bob") as bob:  # other members are not affected
        assert _ask(bob, max_tokens=5).status_code == 200


def test_per_request_limits_are_refused_with_the_limit_named(server: LiveServer) -> None:
    _set_quota(server, "bob", max_prompt_tokens=20, max_output_tokens=10)
    with server.client("bob") as bob:
        long = _ask(bob, max_tokens=5, text="word " * 50)
        assert long.status_code == 429
        assert long.json()["error"]["code"] == "max_prompt_tokens"
        assert "retry-after" not in long.headers  # waiting does not help
        wide = _ask(bob, max_tokens=50)
        assert wide.status_code == 429
        assert "limit of 10 output tokens" in wide.json()["error"]["message"]
        default = _ask(bob)  # the server's default max_tokens is clamped, not refused
        assert default.status_code == 200
        assert default.json()["usage"]["completion_tokens"] <= 10


def test_the_concurrency_limit_refuses_a_second_request_in_flight(server: LiveServer) -> None:
    _set_quota(server, "bob", max_concurrent=1)
    with server.client("bob") as bob, server.client("bob") as bob2:
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": SLOW,
                "stream": True}
        with bob.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            next(lines)
            wait_until(lambda: server.engine.live_requests(str(server.user_ids["bob"])) == 1)
            second = _ask(bob2, max_tokens=2)
            assert second.status_code == 429
            assert second.json()["error"]["code"] == "max_concurrent"
            assert second.headers["retry-after"] == "1"
        wait_until(lambda: server.engine.live_requests(str(server.user_ids["bob"])) == 0)
        assert _ask(bob2, max_tokens=2).status_code == 200


def test_a_quota_of_zero_is_refused_by_the_admin_api(server: LiveServer) -> None:
    with server.client("alice") as alice:
        r = alice.put(f"/admin/users/{server.user_ids['bob']}/quota",
                      json={"tokens_per_day": 0})
        assert r.status_code == 400
        assert "must be >= 1 or null" in r.json()["error"]["message"]
