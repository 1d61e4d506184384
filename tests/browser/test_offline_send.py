"""Issue 37, item 14: a message typed while the appliance cannot be reached is kept.

app.js emptied the box whenever a request "succeeded" with a status below 300, and a
network failure has status 0: the message was thrown away. And the "cannot be reached"
notice stayed after the appliance was back. Here every request of the tab fails (Playwright
aborts it, as a dropped Wi-Fi would), then the route is lifted. Desktop size.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.browser.conftest import DESKTOP, Tab
from tests.browser.support import slow_fault
from tests.helpers import LiveServer, live_server, make_settings

pytestmark = pytest.mark.browser

UNREACHABLE = "#chat-notice .notice.error:has-text('cannot be reached')"


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[LiveServer]:
    settings = make_settings(tiny_model, max_batch_size=2, default_max_tokens=8)
    with live_server(settings, fault=slow_fault) as s:
        yield s


def test_a_message_sent_while_offline_is_kept_and_the_notice_goes_when_back(
        chromium: Any, server: LiveServer) -> None:
    tab = Tab(chromium, server, "carol", viewport=DESKTOP)
    page = tab.page
    page.route("**/*", lambda route: route.abort("internetdisconnected"))
    page.fill("#message", "remember the milk")
    page.click("#send")
    page.wait_for_selector(UNREACHABLE)
    assert page.input_value("#message") == "remember the milk"
    assert "kept" in page.inner_text("#chat-notice")

    page.unroute("**/*")  # the connection is back: the notice goes without a click
    page.wait_for_selector(UNREACHABLE, state="detached", timeout=30_000)
    assert page.input_value("#message") == "remember the milk"
    tab.problems = []  # what Chromium and htmx logged about the aborted requests

    page.click("#send")  # sending again works and only then empties the box
    page.wait_for_selector("#messages .msg.user:has-text('remember the milk')")
    page.wait_for_function("document.getElementById('message').value === ''")
    tab.close()  # and nothing went wrong once the connection was back
