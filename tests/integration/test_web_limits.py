"""Chat under limits: busy (503), over quota (429), bad input (400), as clear notices."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.engine.request import RequestHandle
from appliance.store.models import LedgerEntry
from tests.browser.support import (
    FAILING_MAX_TOKENS,
    browser,
    slow_fault,
    slow_request,
    sse_events,
    stream_id,
)
from tests.helpers import LiveServer, live_server, make_settings, wait_until
from web import chat


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[LiveServer]:
    settings = make_settings(tiny_model, max_batch_size=1, max_queue_depth=1, ctx_size=512)
    with live_server(settings, fault=slow_fault) as s:
        yield s


def _slow(server: LiveServer, user: str) -> RequestHandle:
    return slow_request(server.engine, user, server.user_ids[user])


def _quota(server: LiveServer, who: str, **fields: str) -> None:
    with browser(server.url, "alice") as alice:
        r = alice.post(f"/manage/users/{server.user_ids[who]}", data=fields)
        assert r.status_code == 200 and "Saved." in r.text, r.text


def test_a_busy_server_answers_503_with_a_clear_notice(server: LiveServer) -> None:
    running = _slow(server, "alice")
    wait_until(lambda: server.engine.snapshot.active == 1, 10, "a running request")
    queued = _slow(server, "alice")
    try:
        wait_until(lambda: server.engine.snapshot.queued == 1, 10, "a full queue")
        with browser(server.url, "carol") as carol:
            r = carol.post("/chat/send", data={"message": "hello"})
        assert r.status_code == 503 and r.headers["retry-after"]
        assert 'class="notice error"' in r.text and "Server is busy" in r.text
        assert "sse-connect" not in r.text
    finally:
        server.engine.cancel(running)
        server.engine.cancel(queued)
        wait_until(lambda: server.engine.snapshot.active + server.engine.snapshot.queued == 0,
                   10, "idle")


def test_over_the_daily_quota_answers_429_with_the_reason(server: LiveServer) -> None:
    _quota(server, "carol", tokens_per_day="5")
    try:
        with browser(server.url, "carol") as carol:
            r = carol.post("/chat/send", data={"message": "hello"})
        assert r.status_code == 429
        assert "Over your quota" in r.text and "daily allowance of about 4 words" in r.text
        assert "tokens" not in r.text.split('">', 1)[1]  # words; the figures in the title
        assert 'title="0 of 5 tokens used today; this message needs ' in r.text
        assert "Over quota:" not in r.text  # said once, in plain words
        assert 'role="alert"' in r.text
    finally:
        _quota(server, "carol", tokens_per_day="")


def test_the_concurrency_quota_counts_running_requests(server: LiveServer) -> None:
    _quota(server, "carol", max_concurrent="1")
    handle = _slow(server, "carol")
    try:
        wait_until(lambda: server.engine.snapshot.active == 1, 10, "carol running")
        with browser(server.url, "carol") as carol:
            r = carol.post("/chat/send", data={"message": "again"})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert "Another answer of yours is still being written" in r.text
    finally:
        server.engine.cancel(handle)
        _quota(server, "carol", max_concurrent="")
        wait_until(lambda: server.engine.snapshot.active == 0, 10, "idle")


def test_the_output_quota_caps_the_answer(server: LiveServer) -> None:
    _quota(server, "carol", max_output_tokens="3")
    try:
        with browser(server.url, "carol") as carol:
            r = carol.post("/chat/send", data={"message": "say a lot"})
            carol.get(f"/chat/streams/{stream_id(r.text)}")

        def outputs() -> list[int]:
            with server.store.read_sessions() as s:
                return [e.output_tokens for e in s.query(LedgerEntry).filter_by(
                    user_id=server.user_ids["carol"], endpoint=chat.ENDPOINT)]
        wait_until(lambda: len(outputs()) == 1, 10, "ledger row")
        assert outputs()[0] <= 3
    finally:
        _quota(server, "carol", max_output_tokens="")


def test_an_answer_the_model_fails_on_says_so_and_is_not_kept(server: LiveServer) -> None:
    _quota(server, "carol", max_output_tokens=str(FAILING_MAX_TOKENS))  # the hook fails these
    try:
        with browser(server.url, "carol") as carol:
            r = carol.post("/chat/send", data={"message": "break, please"})
            cid = int(r.headers["hx-push-url"].rsplit("/", 1)[1])
            name, done = sse_events(carol.get(f"/chat/streams/{stream_id(r.text)}").text)[-1]
        assert name == "done" and "The model failed on this answer" in done
        assert 'role="alert"' in done
        with server.client("carol") as api:
            roles = [m["role"] for m in api.get(f"/conversations/{cid}").json()["messages"]]
        assert roles == ["user"]
    finally:
        _quota(server, "carol", max_output_tokens="")


def test_bad_messages_get_a_400_notice(server: LiveServer) -> None:
    with browser(server.url, "carol") as carol:
        r = carol.post("/chat/send", data={"message": "   "})
        assert r.status_code == 400 and "Type a message first" in r.text
        r = carol.post("/chat/send", data={"message": "many words " * 1400})
        assert r.status_code == 400 and "too long for the model" in r.text
        assert "maximum context length" in r.text  # the exact figures, as the tooltip
        r = carol.post("/chat/send", data={"message": "x", "conversation": "999999"})
        assert r.status_code == 404
