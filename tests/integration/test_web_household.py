"""Issue 12 over HTTP: private caching, conversations, notes that survive a reload, plain
refusals, settings, and what the model is sent."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.browser.support import browser, slow_fault, sse_events, stream_id
from tests.helpers import PASSWORD, LiveServer, live_server, make_settings
from web.chat import PAGE_SIZE, MessageView, model_turns


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[LiveServer]:
    with live_server(make_settings(tiny_model, default_max_tokens=24), fault=slow_fault) as s:
        yield s


def _conversation(server: LiveServer, who: str, title: str, text: str = "") -> int:
    with server.client(who) as api:
        cid = int(api.post("/conversations", json={"title": title}).json()["id"])
        if text:
            api.post(f"/conversations/{cid}/messages", json={"role": "user", "content": text})
    return cid


def test_signed_in_pages_are_never_stored_by_the_browser(server: LiveServer) -> None:
    cid = _conversation(server, "alice", "private")
    with browser(server.url, "alice", htmx=False) as alice:
        for path in ["/chat", f"/chat/{cid}", "/chat/list", "/dashboard", "/keys",
                     "/manage/users", "/settings"]:
            r = alice.get(path)
            assert r.status_code == 200, path
            assert r.headers["cache-control"] == "no-store", path


def test_the_list_searches_titles_and_messages_of_ones_own_conversations_only(
        server: LiveServer) -> None:
    _conversation(server, "bob", "Bike repair", "the chain keeps slipping")
    _conversation(server, "bob", "Dinner", "something with 100% tomatoes_and basil")
    _conversation(server, "carol", "Bike for carol", "chain")
    with browser(server.url, "bob") as bob:
        assert "Bike repair" in bob.get("/chat/list", params={"q": "bike"}).text
        found = bob.get("/chat/list", params={"q": "CHAIN"}).text
        assert "Bike repair" in found and "Bike for carol" not in found
        assert "Dinner" in bob.get("/chat/list", params={"q": "100% tomatoes_"}).text
        assert "Dinner" not in bob.get("/chat/list", params={"q": "100%%"}).text
        assert "Nothing matches" in bob.get("/chat/list", params={"q": "zebra"}).text


def test_the_list_goes_on_past_a_page_newest_activity_first(server: LiveServer) -> None:
    with server.client("carol") as api:
        ids = [int(api.post("/conversations", json={"title": f"talk {i}"}).json()["id"])
               for i in range(PAGE_SIZE + 5)]
        api.post(f"/conversations/{ids[0]}/messages", json={"role": "user", "content": "back"})
    with browser(server.url, "carol") as carol:
        first = carol.get("/chat/list").text
        assert first.index(f'href="/chat/{ids[0]}"') < first.index(f'href="/chat/{ids[-1]}"')
        assert f'offset={PAGE_SIZE}' in first and 'hx-trigger="revealed"' in first
        rest = carol.get("/chat/list", params={"offset": PAGE_SIZE}).text
        assert not rest.lstrip().startswith("<ul")
        shown = first.count('href="/chat/') + rest.count('href="/chat/')
        assert shown >= PAGE_SIZE + 5 and f'href="/chat/{ids[1]}"' in rest


def test_a_conversation_is_renamed_inline(server: LiveServer) -> None:
    cid = _conversation(server, "carol", "old name")
    with browser(server.url, "carol") as carol:
        r = carol.post(f"/chat/{cid}/rename", data={"title": "  Holiday   plans "})
        assert r.status_code == 200 and "Holiday plans" in r.text
        assert r.headers["hx-trigger-after-settle"] == "conversations-changed"
        assert carol.post(f"/chat/{cid}/rename", data={"title": " "}).status_code == 400
    with browser(server.url, "bob") as bob:  # someone else's: as if it did not exist
        assert bob.post(f"/chat/{cid}/rename", data={"title": "mine"}).status_code == 404


def test_a_stopped_answer_keeps_its_note_after_a_reload(server: LiveServer) -> None:
    with browser(server.url, "bob") as bob:  # bob's answers decode slowly (test hook)
        r = bob.post("/chat/send", data={"message": "Tell me a long story"})
        sid = stream_id(r.text)
        cid = int(r.headers["hx-push-url"].rsplit("/", 1)[1])
        lines: list[str] = []
        with bob.stream("GET", f"/chat/streams/{sid}") as stream:
            for line in stream.iter_lines():
                lines.append(line)
                if line.startswith("event: token") and lines.count(line) == 1:
                    bob.post(f"/chat/streams/{sid}/stop")
        body = "\n".join(lines)
        assert "Stopped." in dict(sse_events(body))["done"]
        with browser(server.url, "bob", htmx=False) as page:
            html = page.get(f"/chat/{cid}").text
        assert "assistant cancelled" in html and "Stopped." in html
        assert 'id="conv-head"' in r.text and "Delete" in r.text  # no reload needed


def test_the_model_is_sent_alternating_turns_after_the_system_prompt() -> None:
    history = [MessageView("user", "My name is Ann."), MessageView("assistant", "", "cancelled"),
               MessageView("user", "Hello?"), MessageView("assistant", "Hi Ann."),
               MessageView("user", "Lost one")]
    turns = model_turns("Be brief.", history, "What is my name?")
    assert [t.role for t in turns] == ["system", "user", "assistant", "user"]
    assert turns[1].content == "My name is Ann.\n\nHello?"
    assert turns[3].content == "Lost one\n\nWhat is my name?"
    assert [t.role for t in model_turns("", [], "hi")] == ["user"]


def test_a_switched_off_account_with_the_right_password_is_told_so(
        server: LiveServer) -> None:
    with server.client("alice") as api:
        made = api.post("/admin/users", json={"name": "frank", "password": PASSWORD}).json()
        api.patch(f"/admin/users/{made['id']}", json={"disabled": True})
    with browser(server.url) as c:
        r = c.post("/login", json={"name": "frank", "password": PASSWORD})
        assert r.status_code == 403 and "switched off" in r.json()["error"]["message"]
        assert "session" not in r.cookies
        wrong = c.post("/login", json={"name": "frank", "password": "nope nope nope"})
        assert wrong.status_code == 401 and "switched off" not in wrong.text


def test_members_change_their_own_password(server: LiveServer) -> None:
    with server.client("alice") as api:
        api.post("/admin/users", json={"name": "gina", "password": PASSWORD})
    new = "a new long password"
    with browser(server.url, "gina") as gina:
        bad = gina.post("/settings/password", data={"current_password": "wrong wrong",
                                                    "new_password": new, "repeat_password": new})
        assert bad.status_code == 400 and "current password is not right" in bad.text
        typo = gina.post("/settings/password", data={
            "current_password": PASSWORD, "new_password": new, "repeat_password": new + "x"})
        assert typo.status_code == 400 and "not the same" in typo.text
        short = gina.post("/settings/password", data={
            "current_password": PASSWORD, "new_password": "short", "repeat_password": "short"})
        assert short.status_code == 400
        ok = gina.post("/settings/password", data={
            "current_password": PASSWORD, "new_password": new, "repeat_password": new})
        assert ok.status_code == 200 and "Password changed." in ok.text
    with browser(server.url, "gina", password=new) as again:
        assert again.get("/settings").status_code == 200


def test_persona_theme_and_the_household_default(server: LiveServer) -> None:
    with browser(server.url, "carol") as carol:
        r = carol.post("/settings/preferences", data={"system_prompt": "Talk like a pirate.",
                                                      "theme": "dark"})
        assert r.status_code == 200 and r.cookies.get("theme") == "dark"
        assert "Talk like a pirate." in carol.get("/settings").text
        assert 'data-theme="dark"' in carol.get("/settings").text
        assert carol.post("/settings/preferences", data={"theme": "pink"}).status_code == 400
    with browser(server.url, "carol") as elsewhere:  # another device: the theme follows her
        assert elsewhere.cookies.get("theme") == "dark"
        assert 'data-theme="dark"' in elsewhere.get("/settings").text
    with browser(server.url, "carol") as carol:
        long = carol.post("/settings/preferences", data={"system_prompt": "x" * 5000})
        assert long.status_code == 400 and "at most 4,000 characters" in long.text
        assert carol.post("/settings/household",
                          data={"household_prompt": "Be kind."}).status_code == 403
    with browser(server.url, "alice") as alice:
        assert alice.post("/settings/household",
                          data={"household_prompt": "Be kind."}).status_code == 200
        assert "Be kind." in alice.get("/settings").text
    from appliance.store import preferences
    with server.store.read_sessions() as s:
        assert preferences.system_prompt_for(s, server.user_ids["carol"]) == \
            "Talk like a pirate."
        assert preferences.system_prompt_for(s, server.user_ids["bob"]) == "Be kind."
