"""Issue 38: the chat page's rough edges, at desktop and phone sizes, in Chromium.

Each test names the defect it guards against; every one ran red before its fix.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.browser.conftest import SIZES, Tab
from tests.browser.support import slow_fault
from tests.helpers import LiveServer, live_server, make_settings

pytestmark = pytest.mark.browser

SHOTS = os.environ.get("APPLIANCE_SHOTS")
"""A folder: when set, the tests leave screenshots of what they checked there."""


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[LiveServer]:
    settings = make_settings(tiny_model, max_batch_size=2, default_max_tokens=40)
    with live_server(settings, fault=slow_fault) as s:
        yield s


def _conversation(server: LiveServer, who: str, title: str,
                  turns: list[tuple[str, str]]) -> int:
    with server.client(who) as api:
        cid = int(api.post("/conversations", json={"title": title}).json()["id"])
        for role, text in turns:
            r = api.post(f"/conversations/{cid}/messages", json={"role": role, "content": text})
            assert r.status_code == 201, r.text
    return cid


def _shot(tab: Tab, name: str, size: dict[str, int]) -> None:
    if SHOTS:
        tab.page.screenshot(path=f"{SHOTS}/{name}-{size['width']}.png")


FOCUSED = "() => { const a = document.activeElement; return a ? (a.id || a.tagName) : ''; }"


# ---- 1. focus after Regenerate ----
@SIZES
def test_after_regenerate_by_keyboard_focus_is_on_the_message_box_not_the_page(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    cid = _conversation(server, "carol", "Focus", [("user", "Say hi"), ("assistant", "Hi!")])
    tab = Tab(chromium, server, "carol", size)
    page = tab.page
    tab.goto(f"/chat/{cid}")
    page.focus(".msg.assistant .regen button")
    page.keyboard.press("Enter")
    page.wait_for_function("() => !document.querySelector('#messages').textContent"
                           ".includes('Hi!')")
    page.wait_for_selector("#messages .msg.assistant:not(.streaming)")
    assert page.evaluate(FOCUSED) == "message"
    _shot(tab, "regenerate-focus", size)
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
    page.click("#conv-head button:has-text('Delete')")
    page.wait_for_function("() => !document.querySelector('#conv-head button')")
    assert not page.url.endswith(f"/chat/{cid}"), page.url
    assert page.evaluate("location.pathname") == "/chat"
    assert page.locator(f"#conversation-list a[href='/chat/{cid}']").count() == 0
    _shot(tab, "deleted", size)
    page.go_back()  # the deleted conversation's entry was replaced: no way back to a 404
    page.wait_for_load_state()
    assert page.evaluate("location.pathname") != f"/chat/{cid}"
    tab.close()
