"""Accessibility in Chromium: axe-core (vendored, pinned) finds no serious or critical
problem on any page, light or dark, desktop or phone; the keyboard reaches everything."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from tests.browser.conftest import DESKTOP, PHONE, SIZES, Tab, sign_in
from tests.browser.support import slow_fault
from tests.helpers import PASSWORD, LiveServer, live_server, make_settings

pytestmark = pytest.mark.browser

VENDOR = Path(__file__).resolve().parent / "vendor"
AXE = VENDOR / json.loads((VENDOR / "vendor.json").read_text())["axe-core"]["file"]


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[LiveServer]:
    settings = make_settings(tiny_model, max_batch_size=2, default_max_tokens=16)
    with live_server(settings, fault=slow_fault) as s:
        yield s


def _axe(page: Any) -> list[str]:
    """Serious and critical axe findings on the page as it is, one line each."""
    page.add_script_tag(path=str(AXE))  # the test's context bypasses the CSP for this
    found = page.evaluate("""async () => {
        const r = await axe.run(document, {resultTypes: ['violations']});
        return r.violations.filter(v => v.impact === 'serious' || v.impact === 'critical')
            .map(v => `${v.id} (${v.impact}): ` + v.nodes.map(n => n.target.join(' ')).join(', '));
    }""")
    return list(found)


def _focus_lands_on(page: Any, script: str, expected: str) -> None:
    """Autofocus happens at the page's next rendering update, which can come after the load
    event Playwright waits for: wait (up to 5 s) for focus to land, then say where it is."""
    with contextlib.suppress(PlaywrightTimeout):  # the assertion says where focus is instead
        page.wait_for_function(f"() => ({script}) === {json.dumps(expected)}", timeout=5000)
    assert page.evaluate(script) == expected


def _setup(server: LiveServer) -> int:
    with server.client("alice") as api:
        cid = int(api.post("/conversations", json={"title": "Dinner"}).json()["id"])
        api.post(f"/conversations/{cid}/messages", json={"role": "user", "content": "Ideas?"})
        api.post(f"/conversations/{cid}/messages", json={
            "role": "assistant",
            "content": "Try **pasta**:\n\n```python\nprint('boil water')\n```\n\n| a | b |\n"
                       "|---|---|\n| 1 | 2 |\n\nSee [a recipe](https://example.org)."})
        api.post("/me/keys", json={"name": "laptop"})
    with server.store.sessions.begin() as s:  # an edited question (‹ 2/2 ›), a file attached
        from appliance.store import branches
        from appliance.store import conversations as convs
        first = convs.list_messages(s, server.user_ids["alice"], cid)[0]
        branches.edit_question(s, server.user_ids["alice"], cid, first.id,
                               "Ideas?\n\nAttached file “pantry.txt”:\n\nLeeks, rice.")
        convs.add_message(s, server.user_ids["alice"], cid, "assistant", "Leek risotto.",
                          output_tokens=12).seconds = 1.5
    return cid


@pytest.mark.parametrize("scheme", ["light", "dark"])
@SIZES
def test_axe_finds_nothing_serious_on_any_page(chromium: Any, server: LiveServer,
                                               size: dict[str, int], scheme: str) -> None:
    cid = _setup(server)
    context = chromium.new_context(viewport=size, color_scheme=scheme, bypass_csp=True)
    page = context.new_page()
    page.goto(server.url + "/login")
    problems = {"/login": _axe(page)}
    page.fill("input[name=name]", "alice")
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url("**/chat")
    for path in ["/chat", f"/chat/{cid}", "/dashboard", "/keys", "/manage/users", "/manage/models",
                 "/settings", "/jobs/page", "/chat/999999", "/docs/home-assistant.md"]:
        page.goto(server.url + path)
        page.wait_for_load_state()
        problems[path] = _axe(page)
    context.close()
    assert {p: v for p, v in problems.items() if v} == {}


@SIZES
def test_the_keyboard_alone_logs_in_chats_and_logs_out(chromium: Any, server: LiveServer,
                                                       size: dict[str, int]) -> None:
    context = chromium.new_context(viewport=size)
    page = context.new_page()
    page.goto(server.url + "/login")
    _focus_lands_on(page, "document.activeElement.name", "name")  # focused on arrival
    page.keyboard.type("carol")
    page.keyboard.press("Tab")
    page.keyboard.type(PASSWORD)
    page.keyboard.press("Enter")
    page.wait_for_url("**/chat")
    _focus_lands_on(page, "document.activeElement.id", "message")  # ready to type
    page.keyboard.type("Hello from the keyboard")
    page.keyboard.press("Enter")
    page.wait_for_selector("#messages .msg.assistant:not(.streaming)")
    page.wait_for_selector("#send:enabled")
    # the first Tab stop of a page is the skip link, and focus is always visible
    page.goto(server.url + "/keys")  # a page without a field focused on arrival
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.className") == "skip-link"
    assert page.evaluate("getComputedStyle(document.activeElement).outlineStyle") != "none"
    page.keyboard.press("Enter")
    assert page.evaluate("document.activeElement.id") == "main"
    # on to Log out by Tab alone
    for _ in range(40):
        page.keyboard.press("Tab")
        said = page.evaluate("document.activeElement.textContent.trim()")
        if said == "Log out":
            break
        if said == "Menu":  # a phone: the header's links and Log out are in its Menu
            page.keyboard.press("Enter")
    else:
        pytest.fail("Log out is not reachable with Tab")
    page.keyboard.press("Enter")
    page.wait_for_url("**/login")
    context.close()


def test_focus_is_visible_on_every_control_of_the_chat(chromium: Any,
                                                       server: LiveServer) -> None:
    tab = Tab(chromium, server, "bob", DESKTOP)
    unseen = tab.page.evaluate("""() => {
        const out = [];
        for (const el of document.querySelectorAll('a, button, summary, input, textarea')) {
            if (el.type === 'hidden' || !el.getClientRects().length) { continue; }
            el.focus({focusVisible: true});
            const s = getComputedStyle(el);
            if (s.outlineStyle === 'none' || s.outlineWidth === '0px') {
                out.push(el.outerHTML.slice(0, 60));
            }
        }
        return out;
    }""")
    assert unseen == []
    tab.close()


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_axe_finds_nothing_serious_in_the_phone_menus_or_the_shared_marker(
        chromium: Any, server: LiveServer, scheme: str) -> None:
    """Issue 54 item 5: the phone's Menu, a conversation's "⋯" and the "Shared device"
    marker, open and shown, in both themes."""
    cid = _setup(server)
    context = chromium.new_context(viewport=PHONE, color_scheme=scheme, bypass_csp=True)
    page = context.new_page()
    sign_in(page, server.url, "alice", shared=True)
    page.goto(server.url + f"/chat/{cid}")
    assert page.locator("header .badge.shared").is_visible()
    page.click("#menu-button")
    problems = {"menu": _axe(page)}
    page.keyboard.press("Escape")
    page.click("#conv-head .conv-more")
    page.click("#conv-head summary:has-text('Export')")
    problems["conversation menu"] = _axe(page)
    context.close()
    assert {p: v for p, v in problems.items() if v} == {}
