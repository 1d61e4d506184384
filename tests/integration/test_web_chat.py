"""Chat in the browser: send, stream token by token over SSE, stop, history, hostile text."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from jinja2 import Environment, FileSystemLoader

from appliance.engine.request import FinishEvent, TokenEvent, Usage
from appliance.store.models import LedgerEntry
from appliance.vocab import FinishReason
from tests.browser.support import HOSTILE, browser, slow_fault, sse_events, stream_id
from tests.helpers import LiveServer, live_server, make_settings, wait_until
from web import chat
from web.assets import WEB
from web.format import HELPERS
from web.state import CONNECT_WITHIN_S, LiveAnswer, WebState


@pytest.fixture(scope="module")
def plain_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model without the demo flag (a model a user pulled)."""
    out = tmp_path_factory.mktemp("plain") / "plain-tiny"
    shutil.copytree(tiny_model, out)
    config = json.loads((out / "config.json").read_text())
    config.pop("appliance_demo", None)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def server(plain_model: Path) -> Iterator[LiveServer]:
    with live_server(make_settings(plain_model, default_max_tokens=48), fault=slow_fault) as s:
        yield s


def _messages(server: LiveServer, who: str, cid: int) -> list[dict[str, Any]]:
    with server.client(who) as c:
        return list(c.get(f"/conversations/{cid}").json()["messages"])


def test_a_message_streams_tokens_then_the_whole_answer_and_both_are_kept(
        server: LiveServer) -> None:
    with browser(server.url, "carol") as carol:
        r = carol.post("/chat/send", data={"message": "Hello there", "conversation": ""})
        assert r.status_code == 200
        cid = int(r.headers["hx-push-url"].rsplit("/", 1)[1])
        assert r.headers["hx-trigger-after-settle"] == "conversations-changed"
        assert "Hello there" in r.text and f'id="conversation-id" value="{cid}"' in r.text
        events = sse_events(carol.get(f"/chat/streams/{stream_id(r.text)}").text)
        names = [name for name, _ in events]
        assert names[-1] == "done" and names.count("done") == 1
        assert names.count("token") >= 2, "tokens arrive one by one before the answer"
        done = events[-1][1]
        assert done.startswith('<article class="msg assistant')
        assert "sse-connect" not in done  # the final bubble replaces the streaming one
        again = carol.post("/chat/send", data={"message": "More", "conversation": str(cid)})
        assert "hx-push-url" not in again.headers
        carol.get(f"/chat/streams/{stream_id(again.text)}")
    roles = [m["role"] for m in _messages(server, "carol", cid)]
    assert roles == ["user", "assistant", "user", "assistant"]
    with browser(server.url, "carol", htmx=False) as page:
        html = page.get(f"/chat/{cid}").text
        assert html.count('class="msg user"') == 2 and html.count("msg assistant") == 2
        assert "demo model" not in html  # a pulled model carries no demo label


def test_stop_cancels_the_generation_on_the_server(server: LiveServer) -> None:
    with browser(server.url, "bob") as bob:  # bob's requests decode slowly (test hook)
        r = bob.post("/chat/send", data={"message": "Go on and on"})
        sid = stream_id(r.text)
        seen: list[tuple[str, str]] = []

        def read() -> None:
            with bob.stream("GET", f"/chat/streams/{sid}") as s:
                body = ""
                for chunk in s.iter_text():
                    body += chunk
                    seen[:] = sse_events(body)

        reader = threading.Thread(target=read)
        reader.start()
        wait_until(lambda: sum(n == "token" for n, _ in seen) >= 2, 20, "first tokens")
        assert server.engine.snapshot.active == 1
        assert bob.post(f"/chat/streams/{sid}/stop").status_code == 204
        reader.join(20)
        assert not reader.is_alive()
    assert seen[-1][0] == "done" and "Stopped." in seen[-1][1]
    wait_until(lambda: server.engine.snapshot.active == 0, 10, "slot freed")
    wait_until(lambda: _ledger_reasons(server, "bob") == ["cancelled"], 10, "ledger row")


def _ledger_reasons(server: LiveServer, who: str) -> list[str]:
    with server.store.read_sessions() as s:
        return [e.finish_reason for e in s.query(LedgerEntry).filter_by(
            user_id=server.user_ids[who], endpoint=chat.ENDPOINT)]


def test_closing_the_page_cancels_the_answer(server: LiveServer) -> None:
    with browser(server.url, "bob") as bob:
        r = bob.post("/chat/send", data={"message": "Leave early"})
        before = server.engine.snapshot.cancelled_total
        with bob.stream("GET", f"/chat/streams/{stream_id(r.text)}") as s:
            for line in s.iter_lines():
                if line.startswith("event: token"):
                    break  # the tab closes mid-answer
    wait_until(lambda: server.engine.snapshot.cancelled_total > before, 10, "cancel")
    wait_until(lambda: server.engine.snapshot.active == 0, 10, "slot freed")


def test_an_answer_streams_only_to_its_owner_and_only_once(server: LiveServer) -> None:
    with browser(server.url, "carol") as carol, browser(server.url, "bob") as bob:
        sid = stream_id(carol.post("/chat/send", data={"message": "mine"}).text)
        assert bob.get(f"/chat/streams/{sid}").status_code == 204
        assert bob.post(f"/chat/streams/{sid}/stop").status_code == 204  # does nothing
        body = carol.get(f"/chat/streams/{sid}").text
        assert "Stopped." not in body and sse_events(body)[-1][0] == "done"
        assert carol.get(f"/chat/streams/{sid}").status_code == 204  # finished: no retry


def test_hostile_text_in_messages_and_titles_is_rendered_inert(server: LiveServer) -> None:
    with server.client("carol") as api:
        cid = api.post("/conversations", json={"title": HOSTILE}).json()["id"]
        api.post(f"/conversations/{cid}/messages", json={"role": "user", "content": HOSTILE})
        api.post(f"/conversations/{cid}/messages",
                 json={"role": "assistant", "content": f"**{HOSTILE}**\n- {HOSTILE}"})
    with browser(server.url, "carol", htmx=False) as carol:
        for html in (carol.get(f"/chat/{cid}").text, carol.get("/chat/list").text):
            assert "<script>window" not in html and "<img src=x" not in html
            assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in html
        sent = carol.post("/chat/send", data={"message": HOSTILE},
                          headers={"hx-request": "true"})
        assert "<script>window" not in sent.text and "<img src=x" not in sent.text
        carol.get(f"/chat/streams/{stream_id(sent.text)}")


class FakeGeneration:
    """Stands in for the engine: says exactly what a hostile model would say."""

    def __init__(self, pieces: list[str], reason: FinishReason = FinishReason.STOP) -> None:
        self.pieces, self.reason, self.closed = pieces, reason, False

    async def events(self) -> Any:
        for piece in self.pieces:
            yield TokenEvent(1, piece)
        yield FinishEvent(self.reason, Usage(3, len(self.pieces)))

    def close(self) -> None:
        self.closed = True

    def ahead(self) -> int | None:
        return None


def test_hostile_model_output_is_escaped_token_by_token_and_in_the_final_answer() -> None:
    gen = FakeGeneration(["<scr", "ipt>window.__pwned=1</script>", '"><img src=x ',
                          'onerror="window.__pwned=2">', "\n\n**done**"])
    ws = WebState.__new__(WebState)
    ws.answers = {}
    ws.services = SimpleNamespace(store=None)  # type: ignore[assignment]
    answer = LiveAnswer(gen, 1, 1)  # type: ignore[arg-type]
    templates = Environment(loader=FileSystemLoader(WEB / "templates"), autoescape=True)
    ctx = {"h": HELPERS, "model": SimpleNamespace(name="<b>model</b>", is_demo=False)}

    async def collect() -> list[bytes]:
        return [e async for e in chat._answer_events(ws, "sid", answer, templates, ctx)]

    saved: list[str] = []
    original = chat._save_answer
    def save(svc: Any, a: Any, text: str, finish: Any) -> tuple[None, None]:
        saved.append(text)
        return None, None  # (the stored message's id, its versions): none here
    chat._save_answer = save  # type: ignore[assignment]
    try:
        events = sse_events(b"".join(asyncio.run(collect())).decode())
    finally:
        chat._save_answer = original
    tokens = "".join(data for name, data in events if name == "token")
    assert "<" not in tokens and "&lt;scr" in tokens and "&lt;img src=x" in tokens
    done = events[-1][1]
    assert "<script" not in done and "<img" not in done and "<b>model" not in done
    assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in done
    assert "<strong>done</strong>" in done
    assert saved == ["".join(gen.pieces)]  # kept verbatim; escaped only when shown


@pytest.mark.parametrize("reason, note", [
    ("cancelled", "Stopped."), ("length", "reached its length limit"),
    ("quota", "daily token quota ran out"), ("error", "The model failed on this answer")])
def test_each_way_an_answer_ends_is_said_plainly(reason: str, note: str) -> None:
    html = Environment(loader=FileSystemLoader(WEB / "templates"), autoescape=True
                       ).get_template("_answer.html").render(
        h=HELPERS, model=SimpleNamespace(name="m"), content="partial", reason=reason,
        error=None)
    assert note in html and f"msg assistant {reason}" in html


def test_an_answer_nobody_opens_is_cancelled() -> None:
    ws = WebState.__new__(WebState)
    ws.answers = {}
    old = FakeGeneration([])
    sid = ws.add_answer(LiveAnswer(old, 1, 1, created=0.0))  # type: ignore[arg-type]
    ws._expire(CONNECT_WITHIN_S + 1.0)
    assert old.closed and sid not in ws.answers
