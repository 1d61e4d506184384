"""Issue 38: the chat page's rough edges, at desktop and phone sizes, in Chromium.

Each test names the defect it guards against; every one ran red before its fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.browser.conftest import (
    SHOTS,
    SIZES,
    Tab,
    conv_menu,
    go_by_header,
    open_menu,
    shot,
)
from tests.browser.support import add_conversation
from tests.helpers import LiveServer

pytestmark = pytest.mark.browser

"""A folder: when set, the tests leave screenshots of what they checked there."""


@pytest.fixture(scope="module")
def server(chat_server: LiveServer) -> LiveServer:
    return chat_server






FOCUSED = "() => { const a = document.activeElement; return a ? (a.id || a.tagName) : ''; }"


# ---- 1. focus after Regenerate ----
@SIZES
def test_after_regenerate_by_keyboard_focus_is_on_the_message_box_not_the_page(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    cid = add_conversation(server, "carol", "Focus", [("user", "Say hi"), ("assistant", "Hi!")])
    tab = Tab(chromium, server, "carol", size)
    page = tab.page
    tab.goto(f"/chat/{cid}")
    page.focus(".msg.assistant .regen button")
    page.keyboard.press("Enter")
    page.wait_for_function("() => !document.querySelector('#messages').textContent"
                           ".includes('Hi!')")
    page.wait_for_selector("#messages .msg.assistant:not(.streaming)")
    assert page.evaluate(FOCUSED) == "message"
    shot(tab, "regenerate-focus", size)
    tab.close()


# ---- 2. the address bar after Delete ----
@SIZES
def test_after_delete_the_address_bar_no_longer_shows_the_deleted_conversation(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    tab = Tab(chromium, server, "carol", size)
    page = tab.page
    page.fill("#message", "Something to delete")
    page.click("#send")
    page.wait_for_selector("#messages .msg.assistant:not(.streaming)")
    page.wait_for_url("**/chat/*")
    cid = page.url.rsplit("/", 1)[1]
    page.once("dialog", lambda d: d.accept())
    conv_menu(page)
    page.click("#conv-head button:has-text('Delete')")
    page.wait_for_function("() => !document.querySelector('#conv-head .conv-actions')")
    assert not page.url.endswith(f"/chat/{cid}"), page.url
    assert page.evaluate("location.pathname") == "/chat"
    assert page.locator(f"#conversation-list a[href='/chat/{cid}']").count() == 0
    shot(tab, "deleted", size)
    page.go_back()  # the deleted conversation's entry was replaced: no way back to a 404
    page.wait_for_load_state()
    assert page.evaluate("location.pathname") != f"/chat/{cid}"
    tab.close()


# ---- 3. a long paste ----
@SIZES
def test_a_long_paste_is_kept_whole_with_a_counter_and_a_plain_too_long(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    tab = Tab(chromium, server, "carol", size)
    page = tab.page
    count = page.locator("#message-count")
    page.fill("#message", "short")
    assert count.is_hidden()
    page.fill("#message", "a" * 13_000)  # 80 % of 16,000 and more: counted
    assert count.is_visible() and count.inner_text() == "13,000 of 16,000 characters"
    assert page.locator("#send").is_enabled()
    page.fill("#message", "b" * 50_000)
    assert page.evaluate("document.getElementById('message').value.length") == 50_000
    page.wait_for_selector("#message-count.over")
    assert "50,000 characters, 34,000 over the limit of 16,000" in count.inner_text()
    assert page.locator("#send").is_disabled()
    page.evaluate("""() => { window.__sent = 0;
        document.body.addEventListener('htmx:beforeRequest', () => window.__sent++); }""")
    page.focus("#message")
    page.keyboard.press("Enter")  # sends synchronously when it sends at all
    assert page.evaluate("window.__sent") == 0
    shot(tab, "too-long", size)
    page.fill("#message", "c" * 16_000)
    assert not page.locator("#message-count.over").count()
    assert page.locator("#send").is_enabled()
    tab.close()


# ---- 4. words, not tokens ----
def _set_quota(server: LiveServer, who: str, **limits: str) -> None:
    from tests.browser.support import browser
    with browser(server.url, "alice") as alice:
        r = alice.post(f"/manage/users/{server.user_ids[who]}", data=limits)
        assert r.status_code == 200, r.text


@SIZES
def test_too_long_and_quota_notices_speak_of_words_with_tokens_in_the_tooltip(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    tab = Tab(chromium, server, "carol", size)
    page = tab.page
    notice = page.locator("#chat-notice .notice.error")
    page.fill("#message", "many words " * 1400)  # more than the model's whole context
    page.click("#send")
    notice.wait_for()
    assert "too long for the model" in notice.inner_text()
    assert "token" not in notice.inner_text()
    assert "tokens" in (notice.get_attribute("title") or "")
    shot(tab, "too-long-for-model", size)
    _set_quota(server, "carol", max_prompt_tokens="20")
    try:
        page.fill("#message", "A question of a good many words, more than twenty tokens, "
                              "to be sure it goes over that small limit of this person.")
        page.click("#send")
        page.wait_for_selector("#chat-notice .notice.error:has-text('per message')")
        text = notice.inner_text()
        assert "about 20 words per message" in text or "about 15 words per message" in text
        assert "token" not in text
        assert "your limit is 20 tokens per message" in (notice.get_attribute("title") or "")
        shot(tab, "over-prompt-quota", size)
    finally:
        _set_quota(server, "carol", max_prompt_tokens="")
    tab.problems = [p for p in tab.problems if "status of 4" not in p]  # the browser's own
    tab.close()


# ---- 5. a skip link to the message box ----
LANDMARKS = """() => Array.from(document.querySelectorAll(
        'header, nav, main, aside, section[aria-labelledby], form[role=search]'))
    .map(el => el.tagName.toLowerCase() + (el.getAttribute('aria-label')
        ? ':' + el.getAttribute('aria-label') : ''))"""


@SIZES
def test_one_tab_and_enter_reach_the_message_box_past_three_conversations(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    for i in range(3):
        add_conversation(server, "bob", f"Talk {i}", [("user", f"Q{i}"), ("assistant", "A")])
    tab = Tab(chromium, server, "bob", size)
    page = tab.page
    first = page.evaluate("""() => Array.from(document.querySelectorAll(
        'a[href], button, input:not([type=hidden]), textarea, select, summary, [tabindex]'))
        .filter(el => el.tabIndex >= 0)[0].textContent""")
    assert first == "Skip to message box"  # the first Tab stop from the top of the page
    page.focus(".skip-link")
    assert page.evaluate("getComputedStyle(document.activeElement).top") != "-64px"  # shown
    shot(tab, "skip-link", size)
    page.keyboard.press("Enter")
    assert page.evaluate(FOCUSED) == "message"
    marks = page.evaluate(LANDMARKS)
    assert marks.index("header") < marks.index("main") < marks.index("aside:Conversations")
    assert page.locator("section.conversation").get_attribute("aria-labelledby") == "chat-title"
    tab.close()


# ---- 6. a one-line header on a phone ----
@SIZES
def test_the_header_is_one_line_on_a_phone_with_every_link_in_reach(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    tab = Tab(chromium, server, "alice", size)  # an admin: the most links
    page = tab.page
    height = page.evaluate("document.querySelector('header.top').getBoundingClientRect()"
                           ".height")
    assert height <= 64, height
    shot(tab, "header", size)
    assert page.evaluate("document.documentElement.scrollWidth") <= size["width"]
    open_menu(page)  # a phone's links are in its Menu (issue 54)
    assert page.locator("header .logout button").is_visible()
    go_by_header(page, "a:has-text('Settings')")
    page.wait_for_url("**/settings")
    assert page.evaluate("document.querySelector('header.top').getBoundingClientRect()"
                         ".height") <= 64
    tab.close()


# ---- 7. no stale "Saved." beside a refused value ----
@SIZES
def test_a_refused_weight_replaces_the_saved_status_with_the_reason(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    tab = Tab(chromium, server, "alice", size)
    page = tab.page
    tab.goto("/manage/users")
    card = f"#user-{server.user_ids['carol']}"
    page.fill(f"{card} input[name=weight]", "2")
    page.click(f"{card} button[type=submit]")
    page.wait_for_selector(f"{card} .notice.ok:has-text('Saved.')")
    page.fill(f"{card} input[name=weight]", "0")  # below the minimum: the browser refuses
    page.click(f"{card} button[type=submit]")
    page.wait_for_selector(f"{card} .notice.error")
    assert page.locator(f"{card} .notice").count() == 1
    assert page.locator(f"{card} .notice.ok").count() == 0
    assert page.locator(f"{card} .notice.error").inner_text().startswith("Not saved. Weight:")
    page.locator(f"{card} .notice.error").scroll_into_view_if_needed()
    shot(tab, "refused-weight", size)
    page.click(f"{card} button[type=submit]")  # again: still one reason, not two
    assert page.locator(f"{card} .notice").count() == 1
    assert page.locator(f"{card} .notice").inner_text().count("Weight:") == 1
    page.fill(f"{card} input[name=weight]", "1")
    page.click(f"{card} button[type=submit]")
    page.wait_for_selector(f"{card} .notice.ok:has-text('Saved.')")
    assert page.locator(f"{card} .notice").count() == 1
    tab.close()


# ---- 8. every column of the keys table has a name ----
EMPTY_HEADERS = """() => Array.from(document.querySelectorAll('th'))
    .filter(th => th.textContent.trim() === '' && !th.getAttribute('aria-label'))
    .map(th => th.closest('table').className)"""


@SIZES
def test_the_keys_table_has_no_empty_header_cell(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    tab = Tab(chromium, server, "bob", size)
    page = tab.page
    tab.goto("/keys")
    page.fill("input[name=name]", "laptop")
    page.click("button:has-text('Create key')")
    page.wait_for_selector("tr.key")
    assert page.evaluate(EMPTY_HEADERS) == []
    last = page.locator("table.keys th").last
    assert last.text_content() == "Revoke"
    box = last.locator(".visually-hidden").bounding_box()  # read aloud, not shown
    assert box is not None and box["width"] <= 1
    # and the hidden label stays inside the table's scroller: the page is no wider
    assert page.evaluate("document.documentElement.scrollWidth") <= size["width"]
    shot(tab, "keys", size)
    tab.close()


# ---- 10. a disabled account is told why it was logged out ----
@SIZES
def test_a_disabled_user_is_sent_to_a_login_page_that_says_why(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    from tests.helpers import PASSWORD
    name = f"fay{size['width']}"
    with server.client("alice") as api:
        made = api.post("/admin/users", json={"name": name, "password": PASSWORD}).json()
    tab = Tab(chromium, server, name, size)
    page = tab.page
    with server.client("alice") as api:
        assert api.patch(f"/admin/users/{made['id']}", json={"disabled": True}).is_success
    page.fill("#message", "Hello?")
    page.click("#send")  # an htmx request: sent on to the login page
    page.wait_for_url("**/login*")
    notice = page.locator(".login .notice.error")
    assert notice.inner_text() == "This account is disabled; ask an admin."
    shot(tab, "disabled-login", size)
    tab.goto("/chat")  # a whole page: the same
    page.wait_for_url("**/login*")
    assert notice.inner_text() == "This account is disabled; ask an admin."
    with server.client("alice") as api:  # enabled again: the old session stays over
        assert api.patch(f"/admin/users/{made['id']}", json={"disabled": False}).is_success
    tab.goto("/chat")
    page.wait_for_url("**/login*")  # its session was ended: said so, not "disabled"
    assert "disabled" not in (notice.inner_text() if notice.count() else "")
    tab.problems = [p for p in tab.problems if "status of 401" not in p]  # the browser's own
    tab.close()


# ---- 11. Continue an answer cut at its length limit ----
@SIZES
def test_continue_appends_to_an_answer_that_stopped_at_its_length_limit(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    from tests.helpers import wait_until
    tab = Tab(chromium, server, "carol", size)
    page = tab.page
    page.fill("#message", "Tell me a long story")
    page.click("#send")
    page.wait_for_selector("#messages .msg.assistant.length:not(.streaming)")  # 40 tokens
    page.wait_for_url("**/chat/*")
    cid = int(page.url.rsplit("/", 1)[1])

    def stored() -> list[dict[str, Any]]:
        with server.client("carol") as api:
            return list(api.get(f"/conversations/{cid}").json()["messages"])
    wait_until(lambda: len(stored()) == 2, 10, "the first answer stored")
    first = stored()[1]["content"]
    shot(tab, "continue-before", size)
    page.click(".msg.assistant .actions button:has-text('Continue')")
    page.wait_for_selector("#messages .msg.assistant.streaming")
    page.wait_for_selector("#messages .msg.assistant:not(.streaming)")
    assert page.locator(".msg.assistant").count() == 1  # the same answer, longer
    assert page.evaluate(FOCUSED) == "message"
    wait_until(lambda: len(stored()) == 2 and stored()[1]["content"] != first, 10,
               "the continued answer stored in place of the first")
    assert stored()[1]["content"].startswith(first)
    shot(tab, "continue-after", size)
    tab.close()


# ---- 12. export a conversation ----
@SIZES
def test_a_conversation_downloads_as_markdown_and_json_for_its_owner_only(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    import json

    from tests.browser.support import browser
    cid = add_conversation(server, "carol", "Soup plans", [
        ("user", "What soup tonight?"), ("assistant", "Leek and **potato**.")])
    tab = Tab(chromium, server, "carol", size)
    page = tab.page
    tab.goto(f"/chat/{cid}")
    conv_menu(page)  # a phone's Export is in "⋯"
    page.click("#conv-head summary:has-text('Export')")
    shot(tab, "export", size)
    with page.expect_download() as got:
        page.click("#conv-head a:has-text('Markdown')")
    md = Path(got.value.path()).read_text()
    assert got.value.suggested_filename == f"soup-plans-{cid}.md"
    assert md.startswith("# Soup plans\n")
    assert "## carol\n\nWhat soup tonight?" in md and "Leek and **potato**." in md
    with page.expect_download() as got:
        page.click("#conv-head a:has-text('JSON')")
    data = json.loads(Path(got.value.path()).read_text())
    assert data["title"] == "Soup plans"
    assert [(m["role"], m["content"]) for m in data["messages"]] == [
        ("user", "What soup tonight?"), ("assistant", "Leek and **potato**.")]
    tab.close()
    with browser(server.url, "bob", htmx=False) as bob:  # not bob's: as if it did not exist
        for ext in ("md", "json"):
            assert bob.get(f"/chat/{cid}/export.{ext}").status_code == 404


# ---- 13. a shared device forgets its person ----
@SIZES
def test_a_shared_device_login_is_a_browser_session_that_ends_when_idle(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    import time

    from sqlalchemy import select

    from appliance.store.models import WebSession
    from tests.helpers import PASSWORD
    context = chromium.new_context(viewport=size)
    page = context.new_page()
    page.goto(server.url + "/login")
    page.fill("input[name=name]", "carol")
    page.fill("input[name=password]", PASSWORD)
    page.check("input[name=shared]")
    assert "10 minutes" in page.locator("label:has(input[name=shared])").inner_text()
    page.screenshot(path=f"{SHOTS}/shared-login-{size['width']}.png") if SHOTS else None
    page.click("button[type=submit]")
    page.wait_for_url("**/chat")
    cookie = next(c for c in context.cookies() if c["name"] == "appliance_session")
    assert cookie["expires"] == -1  # no "remember me": gone when the browser closes

    def row() -> WebSession:
        with server.store.read_sessions() as s:
            rows = [w for w in s.scalars(select(WebSession)) if w.user_id ==
                    server.user_ids["carol"] and w.expires_at < time.time() + 3600]
            assert len(rows) == 1
            return rows[0]
    assert abs(row().expires_at - (time.time() + 600)) < 30  # 10 minutes from now
    page.fill("#message", "Is the oven still on?")  # typed, then the tablet lay idle
    with server.store.sessions.begin() as s:  # 11 minutes passed
        s.get(WebSession, row().token_hash).expires_at = time.time() - 60
    page.click("#send")
    # issue 54: the login page says why, and the typed question is still there after it
    page.wait_for_url("**/login?reason=expired")
    assert page.locator(".login .notice").inner_text() == \
        "Your session ended; log in again, your draft is kept."
    page.fill("input[name=name]", "carol")
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url("**/chat")
    assert page.input_value("#message") == "Is the oven still on?"
    page.reload()  # put back once, not again and again
    assert page.input_value("#message") == ""
    context.close()


# ---- 14. a stopped answer survives a reload ----
@SIZES
def test_a_stopped_answer_keeps_its_words_and_its_note_after_a_reload(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    tab = Tab(chromium, server, "bob", size)  # bob's answers decode slowly (test hook)
    page = tab.page
    page.fill("#message", "Write me a long poem")
    page.click("#send")
    page.wait_for_function("() => (document.querySelector('.msg.streaming .body.live') || "
                           "{textContent: ''}).textContent.length > 3")
    page.click(".msg.streaming .stop")
    page.wait_for_selector("#messages .msg.assistant.cancelled:not(.streaming)")
    said = page.locator(".msg.assistant .body").inner_text()
    page.reload()  # at once: what was said is stored before the page is told it ended
    answer = page.locator(".msg.assistant")
    assert answer.count() == 1
    assert "Stopped." in answer.inner_text()
    assert answer.locator(".body").inner_text() == said
    shot(tab, "stopped-reload", size)
    tab.close()


# ---- 15. answer versions ----
@SIZES
def test_regenerate_keeps_the_earlier_answer_to_flip_back_to(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    cid = add_conversation(server, "carol", "Versions", [
        ("user", "Name a colour"), ("assistant", "First answer: teal.")])
    tab = Tab(chromium, server, "carol", size)
    page = tab.page
    tab.goto(f"/chat/{cid}")
    assert page.locator(".versions").count() == 0  # one version: no flipping
    page.click(".msg.assistant .actions button:has-text('Regenerate')")
    page.wait_for_selector("#messages .msg.assistant:not(.streaming) .version-count")
    count = page.locator(".msg.assistant .version-count")
    assert count.inner_text() == "2/2"
    assert "First answer" not in page.locator(".msg.assistant").inner_text()
    shot(tab, "versions", size)
    page.click(".msg.assistant button[aria-label='Earlier version']")
    page.wait_for_selector(".msg.assistant .version-count:has-text('1/2')")
    assert "First answer: teal." in page.locator(".msg.assistant .body").inner_text()
    assert page.locator(".msg.assistant button[aria-label='Earlier version']").is_disabled()
    page.reload()  # the choice is kept: it is the answer later turns follow
    assert count.inner_text() == "1/2"
    assert "First answer: teal." in page.locator(".msg.assistant .body").inner_text()
    with server.client("carol") as api:
        stored = api.get(f"/conversations/{cid}").json()["messages"]
    assert [m["content"] for m in stored] == ["Name a colour", "First answer: teal."]
    page.click(".msg.assistant button[aria-label='Later version']")
    page.wait_for_selector(".msg.assistant .version-count:has-text('2/2')")
    assert "First answer" not in page.locator(".msg.assistant").inner_text()
    tab.close()


# ---- 16. edit any earlier question ----
@SIZES
def test_editing_an_earlier_question_answers_it_again_on_a_new_branch(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    from tests.helpers import wait_until
    cid = add_conversation(server, "carol", "Two turns", [
        ("user", "First question"), ("assistant", "First answer"),
        ("user", "Second question"), ("assistant", "Second answer")])
    tab = Tab(chromium, server, "carol", size)
    page = tab.page
    tab.goto(f"/chat/{cid}")
    first = page.locator(".msg.user").first
    first.locator("summary:has-text('Edit')").click()
    first.locator("textarea[name=message]").fill("First question, put better")
    shot(tab, "edit-earlier", size)
    first.locator("button:has-text('Send again')").click()
    page.wait_for_function("() => !document.querySelector('#messages').textContent"
                           ".includes('Second question')")
    page.wait_for_selector("#messages .msg.assistant:not(.streaming)")
    assert page.locator(".msg.user").count() == 1
    assert page.locator(".msg.assistant").count() == 1
    assert "First question, put better" in page.locator(".msg.user .body").inner_text()

    def kept() -> list[str]:
        with server.client("carol") as api:
            return [m["role"] for m in api.get(f"/conversations/{cid}").json()["messages"]]
    # the branch shown (the old one, with its later turns, is one flip away: issue 54)
    wait_until(lambda: kept() == ["user", "assistant"], 10, "the new branch shown")
    tab.close()


# ---- 9. no inline styles on the failure paths ----
CSP_REFUSALS = ("Content Security Policy", "inline style")


@SIZES
def test_the_failure_paths_log_no_content_security_policy_errors(
        chromium: Any, server: LiveServer, size: dict[str, int], tmp_path: Path) -> None:
    from tests.browser.support import FAILING_MAX_TOKENS
    tab = Tab(chromium, server, "carol", size)
    page = tab.page

    def shoot(name: str) -> None:  # as a person looks at it; the caret kept (no style)
        page.screenshot(path=str(tmp_path / f"{name}.png"), caret="initial")

    page.fill("#message", "many words " * 1400)  # 400: too long for the model
    page.click("#send")
    page.wait_for_selector("#chat-notice .notice.error")
    shoot("too-long")
    _set_quota(server, "carol", max_prompt_tokens="20")  # 429: over a quota
    try:
        page.fill("#message", "A question of a good many words, more than twenty tokens, "
                              "to be sure it goes over that small limit of this person.")
        page.click("#send")
        page.wait_for_selector("#chat-notice .notice.error:has-text('per message')")
        shoot("quota")
    finally:
        _set_quota(server, "carol", max_prompt_tokens="")
    _set_quota(server, "carol", max_output_tokens=str(FAILING_MAX_TOKENS))  # a failed answer
    try:
        page.fill("#message", "Hello")
        page.click("#send")
        page.wait_for_selector("#messages .msg.assistant.error")
        shoot("failed-answer")
    finally:
        _set_quota(server, "carol", max_output_tokens="")
    page.route("**/chat/send", lambda route: route.abort("internetdisconnected"))
    page.fill("#message", "Offline")  # the connection lost
    page.click("#send")
    page.wait_for_selector("#chat-notice .notice.error:has-text('cannot be reached')")
    shoot("offline")
    page.unroute("**/chat/send")
    tab.goto("/chat/999999")  # a conversation that is not there
    shoot("not-found")
    refused = [p for p in tab.problems if any(w in p for w in CSP_REFUSALS)]
    assert refused == []
    tab.problems = []  # the refusals' own status lines, the aborted request
    tab.close()


# ---- 17. attach a file ----
@SIZES
def test_a_markdown_or_html_file_is_attached_to_the_message_as_its_text(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    from tests.helpers import wait_until
    tab = Tab(chromium, server, "carol", size)
    page = tab.page
    page.set_input_files("#attach", files=[{
        "name": "list.html", "mimeType": "text/html",
        "buffer": b"<h1>Shopping</h1><p>Milk <b>and</b> bread</p>"}])
    page.wait_for_selector("#attached:has-text('list.html')")
    shot(tab, "attached", size)
    page.fill("#message", "What is on this list?")
    page.click("#send")
    page.wait_for_selector("#messages .msg.assistant:not(.streaming)")
    assert page.locator("#attached").is_hidden()  # sent with it, then cleared
    # collapsed under its name (issue 54); the text is there when opened
    assert page.locator(".msg.user .attached-file summary").inner_text().startswith(
        "📎 list.html (")
    question = page.locator(".msg.user").text_content() or ""
    assert "Milk and bread" in question
    assert "<b>" not in question
    page.wait_for_url("**/chat/*")
    cid = page.url.rsplit("/", 1)[1]
    with server.client("carol") as api:
        wait_until(lambda: len(api.get(f"/conversations/{cid}").json()["messages"]) == 2, 10,
                   "stored")
        stored = api.get(f"/conversations/{cid}").json()["messages"][0]["content"]
    assert stored.startswith("What is on this list?") and "Milk and bread" in stored
    page.set_input_files("#attach", files=[{  # too large to attach at all: said, not cut
        "name": "huge.md", "mimeType": "text/markdown", "buffer": b"word " * 220_000}])
    page.wait_for_selector("#chat-notice .notice.error:has-text('too large to attach')")
    assert page.locator("#attached").is_hidden()
    # (a file longer than one message is read in parts: tests/browser/test_chat_attach.py)
    tab.close()


# ---- issue 54, item 5: Esc, and focus after Stop, Send and version flips ----
@SIZES
def test_escape_stops_an_answer_and_closes_panels_and_focus_returns_to_the_box(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    """Esc neither stopped an answer nor closed Rename/Edit/Export; after Stop, a mouse Send
    or a flip of answer versions, focus fell to the page."""
    tab = Tab(chromium, server, "bob", size)  # bob's answers decode slowly (test hook)
    page = tab.page
    page.fill("#message", "Write me a long poem")
    page.click("#send")  # with the mouse
    page.wait_for_selector(".msg.streaming .body.live")
    page.wait_for_function("() => document.activeElement && "
                           "document.activeElement.id === 'message'")
    page.locator("#chat-title").click()  # focus away from the box
    page.keyboard.press("Escape")
    page.wait_for_selector("#messages .msg.assistant.cancelled:not(.streaming)")
    page.wait_for_function("() => document.activeElement && "
                           "document.activeElement.id === 'message'")
    # a mouse Stop: focus to the box too
    page.fill("#message", "And another one")
    page.press("#message", "Enter")
    page.wait_for_selector(".msg.streaming .body.live")
    page.click(".msg.streaming .stop")
    page.wait_for_selector(".msg.assistant.cancelled >> nth=1")
    page.wait_for_function("() => document.activeElement && "
                           "document.activeElement.id === 'message'")
    conv_menu(page)  # a phone's Rename and Export are in "⋯"
    for panel in ("rename", "export"):
        page.click(f"details.{panel} summary")
        assert page.locator(f"details.{panel}[open]").count() == 1
        page.keyboard.press("Escape")
        assert page.locator(f"details.{panel}[open]").count() == 0
    page.keyboard.press("Escape")  # a phone: then "⋯" closes (a desktop: nothing to do)
    assert page.locator("#conv-head .conv-actions.open").count() == 0
    page.locator(".msg.user details.edit summary").first.click()
    page.locator(".msg.user details.edit textarea").first.focus()
    page.keyboard.press("Escape")
    assert page.locator("details.edit[open]").count() == 0
    tab.close()
    # version flips, with the mouse
    cid = add_conversation(server, "carol", "Flip", [("user", "Say hi"), ("assistant", "Hi!")])
    tab = Tab(chromium, server, "carol", size)
    page = tab.page
    tab.goto(f"/chat/{cid}")
    page.click(".msg.assistant .regen button")
    page.wait_for_selector("#messages .msg.assistant:not(.streaming) [aria-label='Earlier version']")
    page.click("[aria-label='Earlier version']")
    page.wait_for_selector(".msg.assistant:has-text('Hi!')")
    assert page.evaluate(FOCUSED) == "message"
    tab.close()
