"""Issue 12: the chat a family keeps using, at desktop and phone sizes, in Chromium.

Each test names the defect it guards against; every one ran red before its fix.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.browser.conftest import SIZES, Tab, conv_menu, go_by_header, log_out
from tests.browser.support import add_conversation
from tests.helpers import LiveServer

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def server(chat_server: LiveServer) -> LiveServer:
    return chat_server




# ---- 1. privacy ----
@SIZES
def test_back_after_log_out_shows_the_login_page_and_nothing_of_the_conversation(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    secret = "our surprise party for grandma is on the 14th"
    cid = add_conversation(server, "carol", "Party plans", [("user", secret),
                                                         ("assistant", "Noted.")])
    tab = Tab(chromium, server, "carol", size)
    page = tab.page
    tab.goto(f"/chat/{cid}")
    assert secret in page.content()
    log_out(page)
    page.wait_for_url("**/login")
    page.go_back()
    page.wait_for_load_state()
    assert page.url.endswith("/login")
    assert secret not in page.content()
    assert "Party plans" not in page.content()
    assert page.evaluate("sessionStorage.getItem('htmx-history-cache')") is None
    tab.close()


# ---- 2. new messages in view ----
IN_VIEW = """(sel) => {
    const all = document.querySelectorAll(sel);
    const el = all[all.length - 1];
    if (!el) { return false; }
    const r = el.getBoundingClientRect();
    const box = document.getElementById('messages').getBoundingClientRect();
    return r.bottom > Math.max(0, box.top) && r.top < Math.min(window.innerHeight, box.bottom);
}"""
HEADER_IN_VIEW = """() => {
    const r = document.querySelector('header.top').getBoundingClientRect();
    return r.top >= 0 && r.bottom <= window.innerHeight && window.scrollY === 0;
}"""


def _long_conversation(server: LiveServer, who: str) -> int:
    turns: list[tuple[str, str]] = []
    for i in range(14):  # tall on screen, short in tokens (the context is small)
        turns += [("user", f"Question {i}"),
                  ("assistant", f"Answer {i}.\n\n" + "\n".join(f"- {j}" for j in range(8)))]
    return add_conversation(server, who, "A long talk", turns)


@SIZES
def test_opening_a_conversation_shows_its_end_with_the_header_still_in_view(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    cid = _long_conversation(server, "carol")
    tab = Tab(chromium, server, "carol", size)
    page = tab.page
    assert page.evaluate(HEADER_IN_VIEW)  # a new chat opens at the top
    tab.goto(f"/chat/{cid}")
    page.wait_for_function(IN_VIEW, arg=".msg.assistant")
    assert "Answer 13." in page.locator(".msg.assistant").last.inner_text()
    assert page.evaluate(HEADER_IN_VIEW)
    tab.close()


@SIZES
def test_after_send_the_question_and_its_answer_are_in_view(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    cid = _long_conversation(server, "carol")
    tab = Tab(chromium, server, "carol", size)
    page = tab.page
    tab.goto(f"/chat/{cid}")
    page.evaluate("document.getElementById('messages').scrollTop = 0")  # reading old turns
    page.fill("#message", "And the newest question?")
    page.click("#send")
    page.wait_for_selector("#messages .msg.assistant:not(.streaming) >> nth=14")
    assert "And the newest question?" in page.locator(".msg.user").last.inner_text()
    assert page.evaluate(IN_VIEW, ".msg.user")
    assert page.evaluate(IN_VIEW, ".msg.assistant")
    assert page.evaluate(HEADER_IN_VIEW)
    tab.close()


# ---- 3. phone layout ----
PAGES = ["/chat", "/dashboard", "/keys", "/manage/users", "/settings", "/jobs/page"]
TOO_SMALL = """() => {
    const out = [];
    for (const el of document.querySelectorAll(
            'a, button, summary, select, textarea, input:not([type=hidden])')) {
        if (el.closest('.md, .body, p, td, .skip-link')) { continue; }  // links inside text
        const label = el.closest('label');  // a radio's or checkbox's target is its label
        if (label && (el.type === 'radio' || el.type === 'checkbox')
            && label.getBoundingClientRect().height >= 44) { continue; }
        const r = el.getBoundingClientRect();
        const style = getComputedStyle(el);
        if (r.width === 0 || r.height === 0 || style.visibility === 'hidden') { continue; }
        if (r.height < 44 || r.width < 44) {
            out.push(`${el.tagName.toLowerCase()} "${(el.textContent || el.name || '').trim()}"`
                     + ` ${Math.round(r.width)}x${Math.round(r.height)}`);
        }
    }
    return out;
}"""


def _pages(tab: Tab) -> Iterator[str]:
    for path in PAGES:
        r = tab.page.goto(tab.server.url + path)
        if r is not None and r.status == 404:
            continue  # a page this build does not have yet
        for details in tab.page.locator("details").all():  # opened, as a person would
            if not details.evaluate("d => d.open"):
                details.locator("summary").first.click()
        yield path


def test_no_page_is_wider_than_a_390_px_phone(chromium: Any, server: LiveServer) -> None:
    from tests.browser.conftest import PHONE
    cid = _long_conversation(server, "alice")
    tab = Tab(chromium, server, "alice", PHONE)
    for path in [*_pages(tab), f"/chat/{cid}"]:
        if path.startswith("/chat/"):
            tab.goto(path)
            tab.page.locator("details.conversations summary").click()
        width = tab.page.evaluate("document.documentElement.scrollWidth")
        assert width <= 390, f"{path} is {width}px wide"
        send = tab.page.locator("#send")
        if send.count():
            box = send.bounding_box()
            assert box is not None and box["x"] + box["width"] <= 390, path
    tab.close()


def test_every_tap_target_on_a_phone_is_at_least_44_px(chromium: Any,
                                                       server: LiveServer) -> None:
    from tests.browser.conftest import PHONE
    _long_conversation(server, "alice")
    tab = Tab(chromium, server, "alice", PHONE)
    small = {path: tab.page.evaluate(TOO_SMALL) for path in _pages(tab)}
    assert {p: s for p, s in small.items() if s} == {}
    tab.close()


# ---- 4. plain words for quotas and the queue ----
def _set_quota(server: LiveServer, who: str, **limits: str) -> None:
    from tests.browser.support import browser
    with browser(server.url, "alice") as alice:
        r = alice.post(f"/manage/users/{server.user_ids[who]}", data=limits)
        assert r.status_code == 200, r.text


@SIZES
def test_while_slots_are_busy_the_chat_says_how_many_requests_are_ahead(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    from appliance.vocab import Klass
    from tests.browser.support import slow_request
    from tests.helpers import wait_until

    engine = server.engine
    # voice goes before carol's chat whatever the counters (and running voice requests
    # are never preempted for it)
    busy = [slow_request(engine, "alice", server.user_ids["alice"], Klass.VOICE)
            for _ in range(2)]
    wait_until(lambda: engine.snapshot.active == 2, 10, "both slots busy")
    ahead = [slow_request(engine, "alice", server.user_ids["alice"], Klass.VOICE)
             for _ in range(2)]
    tab = Tab(chromium, server, "carol", size)
    page = tab.page
    try:
        wait_until(lambda: engine.snapshot.queued == 2, 10, "two queued voice requests")
        page.fill("#message", "Are you there?")
        page.click("#send")
        waiting = page.locator(".msg.streaming .waiting")
        wait_until(lambda: waiting.count() == 1 and
                   waiting.inner_text() == "2 requests ahead of you…", 20,
                   "two ahead")
        engine.cancel(ahead.pop())
        wait_until(lambda: waiting.inner_text() == "1 request ahead of you…", 20, "one ahead")
        assert waiting.is_visible()
    finally:
        for h in busy + ahead:
            engine.cancel(h)
        page.wait_for_selector("#messages .msg.assistant:not(.streaming)")
        tab.close()


@SIZES
def test_a_refusal_is_one_plain_notice_with_used_of_allowed_and_the_reset_time(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    import re

    tab = Tab(chromium, server, "bob", size)
    page = tab.page
    page.fill("#message", "Hi")
    page.click("#send")
    page.wait_for_selector("#messages .msg.assistant:not(.streaming)")
    with server.client("bob") as api:
        from tests.helpers import wait_until
        wait_until(lambda: api.get("/me/usage").json()["last_day"]["total_tokens"] > 0, 10,
                   "bob's usage in the ledger")
        used = api.get("/me/usage").json()["last_day"]["total_tokens"]
    _set_quota(server, "bob", tokens_per_day=str(used))
    try:
        tab.goto("/chat")
        for _ in range(3):  # asking again does not pile notices up
            page.fill("#message", "Once more")
            page.click("#send")
            page.wait_for_selector("#chat-notice .notice.error")
        notices = page.locator(".notice")
        assert notices.count() == 1
        text = notices.inner_text()
        assert re.search(r"All of today's allowance \(about [\d,]+ words?\) is used — "
                         r"resets (tomorrow )?at \d\d:\d\d\.", text), text
        assert f"{used:,} of {used:,} tokens used today" in notices.get_attribute("title")
        assert "Over quota:" not in text and "24h" not in text
        assert page.input_value("#message") == "Once more"  # kept to send again later
    finally:
        _set_quota(server, "bob", tokens_per_day="")
    page.click("#send")
    page.wait_for_selector("#messages .msg.assistant:not(.streaming)")
    assert page.locator("#chat-notice .notice").count() == 0  # gone once it worked
    tab.problems = [p for p in tab.problems if "status of 429" not in p]  # the browser's own
    tab.close()


# ---- 6. smaller things ----
@SIZES
def test_a_switched_off_account_is_told_so_not_wrong_password(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    from tests.helpers import PASSWORD
    with server.client("alice") as api:
        made = api.post("/admin/users", json={"name": f"erin-{size['width']}",
                                              "password": PASSWORD}).json()
        api.patch(f"/admin/users/{made['id']}", json={"disabled": True})
    context = chromium.new_context(viewport=size)
    page = context.new_page()
    page.goto(server.url + "/login")
    page.fill("input[name=name]", made["name"])
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    assert "switched off" in page.locator(".notice.error").inner_text()
    page.fill("input[name=name]", made["name"])
    page.fill("input[name=password]", "not the password")
    page.click("button[type=submit]")
    assert page.locator(".notice.error").inner_text() == "Wrong name or password."
    context.close()


@SIZES
def test_the_users_page_keeps_what_was_typed_and_names_the_field_plainly(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    tab = Tab(chromium, server, "alice", size)
    page = tab.page
    tab.goto("/manage/users")
    card = f"#user-{server.user_ids['carol']}"
    page.fill(f"{card} input[name=tokens_per_day]", "500")
    page.fill(f"{card} input[name=max_concurrent]", "two")
    page.click(f"{card} button[type=submit]")
    notice = page.wait_for_selector(f"{card} .notice.error")
    assert notice is not None
    assert notice.inner_text().startswith("Concurrent requests must be a whole number")
    assert page.input_value(f"{card} input[name=max_concurrent]") == "two"
    assert page.input_value(f"{card} input[name=tokens_per_day]") == "500"
    page.click("summary:has-text('Add a user')")
    page.fill("#users-panel form input[name=name]", "bad name!")
    page.fill("#users-panel form input[name=password]", "long enough password")
    page.fill("#users-panel form input[name=weight]", "3")
    page.click("#users-panel form button:has-text('Add user')")
    page.wait_for_selector("#users-panel > .notice.error")
    assert page.input_value("#users-panel form input[name=name]") == "bad name!"
    assert page.input_value("#users-panel form input[name=weight]") == "3"
    assert "user name must be" in page.locator("#users-panel > .notice.error").inner_text()
    tab.problems = [p for p in tab.problems if "status of 400" not in p]  # the browser's own
    tab.close()


@SIZES
def test_members_change_their_own_password_on_the_settings_page(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    from tests.helpers import PASSWORD
    name = f"hana{size['width']}"
    with server.client("alice") as api:
        api.post("/admin/users", json={"name": name, "password": PASSWORD})
    tab = Tab(chromium, server, name, size)
    page = tab.page
    go_by_header(page, "a:has-text('Settings')")
    page.fill("input[name=current_password]", PASSWORD)
    page.fill("input[name=new_password]", "brand new secret")
    page.fill("input[name=repeat_password]", "brand new secret")
    page.click("button:has-text('Change password')")
    page.wait_for_selector(".notice.ok")
    log_out(page)
    page.fill("input[name=name]", name)
    page.fill("input[name=password]", "brand new secret")
    page.click("button[type=submit]")
    page.wait_for_url("**/chat")
    tab.close()


@SIZES
def test_the_dashboard_reconnects_quietly(chromium: Any, server: LiveServer,
                                          size: dict[str, int],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from web import dashboard
    monkeypatch.setattr(dashboard, "LIFETIME_S", 0.6)  # streams end (and reopen) quickly
    tab = Tab(chromium, server, "alice", size)
    page = tab.page
    tab.goto("/dashboard")
    page.evaluate("""() => { window.__opened = 0;
        const Orig = window.EventSource;
        window.EventSource = function (url, init) { window.__opened++; return new Orig(url, init); };
    }""")
    page.wait_for_function("() => window.__opened >= 3", timeout=20_000)
    assert page.locator("#live-dot").inner_text() == "live"
    tab.close()  # and no error was logged on any of those reconnects


# ---- 5. conversations and answers ----
@SIZES
def test_rename_search_and_delete_without_a_reload(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    tab = Tab(chromium, server, "carol", size)
    page = tab.page
    page.evaluate("window.__sameDocument = true")
    page.fill("#message", "A question about zucchini")
    page.click("#send")
    page.wait_for_selector("#messages .msg.assistant:not(.streaming)")
    assert page.locator("#conv-head button:has-text('Delete')").count() == 1  # no reload
    conv_menu(page)  # a phone's Rename and Delete are in "⋯"
    page.click("#conv-head summary:has-text('Rename')")
    page.fill("#conv-head input[name=title]", "Garden ideas")
    page.click("#conv-head button:has-text('Save')")
    page.wait_for_selector("#chat-title:has-text('Garden ideas')")
    if size["width"] < 720:
        page.click("details.conversations summary")
    page.wait_for_selector("#conversation-list a:has-text('Garden ideas')")
    page.fill("#conv-q", "zucchini")  # text of a message, not of the title
    page.wait_for_function("() => document.querySelectorAll('#conversation-list a').length"
                           " === 1")
    assert "Garden ideas" in page.locator("#conversation-list a").inner_text()
    assert page.locator("#conversation-list time").count() == 1  # dated
    assert page.evaluate("window.__sameDocument") is True
    page.once("dialog", lambda d: d.accept())
    conv_menu(page)
    page.click("#conv-head button:has-text('Delete')")
    page.wait_for_url("**/chat")
    tab.close()


@SIZES
def test_copy_regenerate_and_edit_the_last_question(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    cid = add_conversation(server, "carol", "Code", [
        ("user", "How do I print?"),
        ("assistant", "Like this:\n\n```python\nprint('hi')\n```")])
    tab = Tab(chromium, server, "carol", size)
    tab.context.grant_permissions(["clipboard-read", "clipboard-write"])
    page = tab.page
    tab.goto(f"/chat/{cid}")
    page.wait_for_selector(".md pre code.hljs")  # highlighted by the vendored highlight.js
    page.click(".md pre .copy-code")
    assert page.evaluate("navigator.clipboard.readText()") == "print('hi')"
    page.click(".msg.assistant .actions button:has-text('Copy')")
    assert "Like this:" in page.evaluate("navigator.clipboard.readText()")
    page.click(".msg.assistant .actions button:has-text('Regenerate')")
    page.wait_for_function("() => !document.querySelector('#messages').textContent"
                           ".includes('Like this:')")
    page.wait_for_selector("#messages .msg.assistant:not(.streaming)")
    assert page.locator(".msg.user").count() == 1 and page.locator(".msg.assistant").count() == 1
    assert "Like this:" not in page.locator(".msg.assistant").inner_text()
    page.click(".msg.user summary:has-text('Edit')")
    page.fill(".msg.user textarea[name=message]", "How do I print twice?")
    page.click(".msg.user button:has-text('Send again')")
    page.wait_for_function("() => document.querySelector('.msg.user .body').textContent"
                           ".includes('twice')")
    page.wait_for_selector("#messages .msg.assistant:not(.streaming)")
    assert page.locator(".msg.user").count() == 1
    assert "How do I print twice?" in page.locator(".msg.user .body").inner_text()

    def kept() -> list[dict[str, Any]]:
        with server.client("carol") as api:
            return list(api.get(f"/conversations/{cid}").json()["messages"])
    from tests.helpers import wait_until
    wait_until(lambda: len(kept()) == 2, 10, "the new answer stored")
    assert [m["role"] for m in kept()] == ["user", "assistant"]
    assert kept()[0]["content"] == "How do I print twice?"
    tab.close()


def test_a_new_api_key_can_be_copied(chromium: Any, server: LiveServer) -> None:
    tab = Tab(chromium, server, "bob")
    tab.context.grant_permissions(["clipboard-read", "clipboard-write"])
    page = tab.page
    tab.goto("/keys")
    page.fill("input[name=name]", "script")
    page.click("button:has-text('Create key')")
    page.click("button:has-text('Copy key')")
    assert page.evaluate("navigator.clipboard.readText()") == \
        page.locator("#new-key").inner_text()
    tab.close()
