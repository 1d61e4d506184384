"""The web UI in headless Chromium (Debian's, driven by Playwright with executable_path).

Screenshots go to a temporary folder, or to ``$APPLIANCE_SCREENSHOTS`` (docs/web.md's come
from ``APPLIANCE_SCREENSHOTS=docs/screenshots pytest tests/browser``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from appliance.engine.request import RequestHandle
from tests.browser.conftest import DESKTOP, PHONE, Tab
from tests.browser.support import HOSTILE, slow_fault, slow_request
from tests.helpers import LiveServer, live_server, make_settings, wait_until

pytestmark = pytest.mark.browser
playwright = pytest.importorskip("playwright.sync_api")


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[LiveServer]:
    """Random weights: long, deterministic garbage answers that outlast the test's checks."""
    settings = make_settings(tiny_model, max_batch_size=2, default_max_tokens=120)
    with live_server(settings, fault=slow_fault) as s:
        yield s


@pytest.fixture(scope="module")
def demo_server(request: pytest.FixtureRequest, tiny_model: Path) -> Iterator[LiveServer]:
    """The bundled demo model when it is there (it reads better in screenshots)."""
    try:
        model = Path(request.getfixturevalue("demo_model"))
    except (AssertionError, pytest.FixtureLookupError):
        model = tiny_model
    settings = make_settings(model, max_batch_size=2, default_max_tokens=80)
    with live_server(settings, fault=slow_fault) as s:
        yield s


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = Path(os.environ.get("APPLIANCE_SCREENSHOTS") or tmp_path_factory.mktemp("shots"))
    out.mkdir(parents=True, exist_ok=True)
    return out


Page = Tab


def _slow(server: LiveServer, who: str) -> RequestHandle:
    return slow_request(server.engine, who, server.user_ids[who])


def test_a_chat_answer_streams_token_by_token_and_stop_cancels_it(
        chromium: Any, server: LiveServer) -> None:
    tab = Page(chromium, server, "bob")  # bob's requests decode slowly (test hook)
    page = tab.page
    assert page.locator("header .logout button").inner_text() == "Log out"
    assert server.engine.config.model_path.name in page.locator("header .model").inner_text()
    page.fill("#message", "What should we cook tonight?")
    page.press("#message", "Enter")
    live = page.locator(".msg.streaming .body.live")
    page.wait_for_function("() => (document.querySelector('.msg.streaming .body.live') || "
                           "{textContent: ''}).textContent.length > 0")
    first = len(live.text_content() or "")
    page.wait_for_function(f"() => document.querySelector('.msg.streaming .body.live')"
                           f".textContent.length > {first}")
    assert page.locator(".msg.streaming").count() == 1  # tokens came before the end
    assert page.is_disabled("#send")
    assert server.engine.snapshot.active == 1
    page.click(".msg.streaming .stop")
    page.wait_for_selector(".msg.assistant.cancelled .note")
    assert page.locator(".msg.streaming").count() == 0
    assert "Stopped." in page.locator(".msg.assistant.cancelled").inner_text()
    wait_until(lambda: server.engine.snapshot.active == 0, 10, "the slot freed on the server")
    page.wait_for_selector("#send:enabled")
    assert page.url.endswith(f"/chat/{page.input_value('#conversation-id')}")
    assert page.locator("#conversation-list a[aria-current=page]").count() == 1
    page.click("header .logout button")
    page.wait_for_url("**/login")
    tab.close()


def test_a_lost_answer_stream_says_so_and_sending_works_again(
        chromium: Any, server: LiveServer) -> None:
    tab = Page(chromium, server, "carol")
    page = tab.page
    page.evaluate("""() => {
        const html = '<article class="msg assistant streaming" id="answer-x" ' +
            'sse-connect="/chat/streams/gone" sse-close="done"><div class="body live" ' +
            'sse-swap="token" hx-swap="beforeend"></div><button class="stop">Stop</button>' +
            '</article>';
        document.getElementById('messages').insertAdjacentHTML('beforeend', html);
        htmx.process(document.getElementById('answer-x'));
    }""")
    page.wait_for_selector("#answer-x.interrupted .notice.error")
    assert page.locator("#answer-x .stop").count() == 0
    page.wait_for_selector("#send:enabled")
    tab.problems = [p for p in tab.problems  # htmx logs the failed stream, as expected
                    if p != "[object Event]" and "204" not in p]
    tab.close()


def test_the_dashboard_fills_a_slot_and_the_queue_rises_without_a_reload(
        chromium: Any, server: LiveServer) -> None:
    tab = Page(chromium, server, "alice")
    page = tab.page
    page.goto(server.url + "/dashboard")
    page.evaluate("window.__sameDocument = true")
    page.wait_for_selector('#active-count[data-value="0"]', state="attached")
    handles = [_slow(server, "carol")]
    try:
        page.wait_for_selector("#dash-slots tr.slot")
        assert "carol" in page.locator("#dash-slots tr.slot").inner_text()
        handles += [_slow(server, who) for who in ("bob", "carol", "bob")]
        page.wait_for_selector('#queued-count[data-value="2"]', state="attached")
        page.wait_for_selector('#active-count[data-value="2"]', state="attached")
        page.wait_for_selector('#dash-queue li[data-class="interactive"][data-count="2"]')
        assert page.evaluate("window.__sameDocument") is True  # updated in place, over SSE
    finally:
        for h in handles:
            server.engine.cancel(h)
    page.wait_for_selector('#active-count[data-value="0"]', state="attached")
    page.wait_for_selector('#queued-count[data-value="0"]', state="attached")
    tab.close()


def test_a_quota_set_on_the_users_page_is_enforced(chromium: Any, server: LiveServer) -> None:
    admin = Page(chromium, server, "alice")
    carol_id = server.user_ids["carol"]
    card = f"#user-{carol_id}"

    def set_daily(value: str) -> None:
        admin.page.goto(server.url + "/manage/users")
        admin.page.fill(f"{card} input[name=tokens_per_day]", value)
        admin.page.click(f"{card} button[type=submit]")
        admin.page.wait_for_selector(f"{card} .notice.ok")

    set_daily("1")
    carol = Page(chromium, server, "carol")
    try:
        carol.page.fill("#message", "Hello")
        carol.page.click("#send")
        notice = carol.page.wait_for_selector("#chat-notice .notice.error")
        assert notice is not None and "Over your quota" in notice.inner_text()
        assert carol.page.input_value("#message") == "Hello"  # kept to send again later
        carol.problems = [p for p in carol.problems if "429" not in p]  # the expected refusal
        set_daily("")
        carol.page.click("#send")
        carol.page.wait_for_selector("#messages .msg.assistant:not(.streaming)")
    finally:
        set_daily("")
    carol.close()
    admin.close()


def test_hostile_names_titles_and_answers_stay_inert_text(chromium: Any,
                                                          server: LiveServer) -> None:
    with server.client("carol") as api:
        cid = api.post("/conversations", json={"title": HOSTILE}).json()["id"]
        api.post(f"/conversations/{cid}/messages", json={"role": "user", "content": HOSTILE})
        api.post(f"/conversations/{cid}/messages",
                 json={"role": "assistant", "content": f"**Sure:** {HOSTILE}"})
        api.post("/me/keys", json={"name": HOSTILE})
    tab = Page(chromium, server, "carol")
    page = tab.page
    for path in (f"/chat/{cid}", "/keys"):
        page.goto(server.url + path)
        assert page.evaluate("typeof window.__pwned") == "undefined"
        assert page.locator("main img").count() == 0
        assert "<script>window.__pwned=1</script>" in page.locator("main").inner_text()
    page.goto(f"{server.url}/chat/{cid}")
    assert page.locator(".msg.assistant strong").first.inner_text() == "Sure:"
    tab.close()


def _fits(page: Any, name: str) -> None:
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= page.viewport_size["width"], f"{name} is {width}px wide"


def _shoot(page: Any, shots: Path, name: str, dark: bool = False) -> None:
    """Desktop and phone screenshots of the page as it is; no sideways scrolling on either.
    ``dark``: the dark theme too (``NAME-dark-desktop.png``, ``NAME-dark-phone.png``)."""
    for scheme in ("light", "dark") if dark else ("light",):
        page.emulate_media(color_scheme=scheme)
        for size, suffix in ((DESKTOP, "desktop"), (PHONE, "phone")):
            page.set_viewport_size(size)
            _fits(page, f"{name} at {suffix} width")
            stem = f"{name}-dark" if scheme == "dark" else name
            page.screenshot(path=str(shots / f"{stem}-{suffix}.png"), full_page=True,
                            caret="initial")  # hiding it injects a style the CSP refuses
    page.emulate_media(color_scheme="light")
    page.set_viewport_size(DESKTOP)


def test_every_page_fits_desktop_and_phone_screens(chromium: Any, demo_server: LiveServer,
                                                    shots: Path) -> None:
    server = demo_server
    carol = Page(chromium, server, "carol")
    for question in ("What can you do?", "Give me three tips for a tidy kitchen."):
        carol.page.fill("#message", question)
        carol.page.click("#send")
        carol.page.wait_for_selector("#messages .msg.assistant:not(.streaming) >> nth="
                                     + str(0 if question.startswith("What") else 1))
    carol.page.wait_for_selector("#send:enabled")
    _shoot(carol.page, shots, "chat", dark=True)
    carol.page.set_viewport_size(PHONE)  # the phone's Menu open (issue 54)
    carol.page.click("#menu-button")
    _fits(carol.page, "the phone's Menu")
    carol.page.screenshot(path=str(shots / "chat-menu-phone.png"), caret="initial")
    carol.page.keyboard.press("Escape")
    carol.page.set_viewport_size(DESKTOP)
    carol.page.goto(server.url + "/dashboard")
    _shoot(carol.page, shots, "dashboard-member")
    carol.close()

    alice = Page(chromium, server, "alice")
    alice.page.goto(server.url + "/dashboard")
    handles = [_slow(server, who) for who in ("bob", "carol", "bob", "carol")]
    try:
        alice.page.wait_for_selector('#queued-count[data-value="2"]', state="attached")
        alice.page.wait_for_timeout(1500)  # a few throughput samples for the chart
        _shoot(alice.page, shots, "dashboard", dark=True)
    finally:
        for h in handles:
            server.engine.cancel(h)
    for path, name in (("/manage/users", "users"), ("/keys", "keys"),
                       ("/manage/models", "models"), ("/settings", "settings")):
        alice.page.goto(server.url + path)
        _shoot(alice.page, shots, name)
    alice.close()
    login = chromium.new_page(viewport=PHONE)
    login.goto(server.url + "/login")
    _fits(login, "login")
    login.screenshot(path=str(shots / "login-phone.png"), caret="initial")
    login.close()
