"""Issue 54: an edited question keeps the old thread as a branch; titles, times, snippets.

One walk per size on the demo model (its greedy words make a real generated title): ask,
see the title written, ask again, regenerate, edit the first question, flip back and
forth, export, search. Each check ran red before its change.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from appliance.store import conversations as convs
from appliance.store.models import Message
from tests.browser.conftest import PHONE, SIZES, Tab, shot
from tests.browser.support import add_conversation
from tests.helpers import LiveServer, live_server, make_settings, wait_until

pytestmark = pytest.mark.browser

SUFFIX = " · The appliance"


@pytest.fixture(scope="module")
def server(demo_model: Path) -> Iterator[LiveServer]:
    with live_server(make_settings(demo_model, max_batch_size=2, default_max_tokens=12,
                                   chat_titles=True)) as s:
        yield s


def _title(server: LiveServer, cid: int) -> str:
    with server.client("carol") as api:
        return str(api.get(f"/conversations/{cid}").json()["title"])


def _settled(page: Any) -> None:
    page.wait_for_function("() => !document.querySelector('#messages .streaming')")


@SIZES
def test_an_edited_question_keeps_its_old_branch_for_flips_export_and_search(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    tag = f"w{size['width']}"
    tab = Tab(chromium, server, "carol", size)
    page = tab.page
    question = f"Please plan a leek soup {tag} for four people tonight with potatoes and cream"
    page.fill("#message", question)
    page.click("#send")
    page.wait_for_url("**/chat/*")
    cid = int(page.url.rsplit("/", 1)[1])
    page.wait_for_selector("#messages .msg.assistant:not(.streaming)")

    # the title: the question cut on a word, then the one the model wrote; the tab follows
    cut = convs.cut_title(question)
    assert cut.endswith("…") and question.startswith(cut[:-1])
    wait_until(lambda: _title(server, cid) != cut, 30, "a generated title")
    named = _title(server, cid)
    page.wait_for_function("t => document.title === t", arg=named + SUFFIX)
    assert page.inner_text("#chat-title") == named

    # message times, and the answer's speed on hover
    clock = re.compile(r"^\d\d:\d\d$")
    assert clock.match(page.locator(".msg.user .who time").first.inner_text())
    assert clock.match(page.locator(".msg.assistant .who time").first.inner_text())
    assert "tokens/s" in (page.locator(".msg.assistant .who time").first
                          .get_attribute("title") or "")

    # a second turn, its answer regenerated (two versions), then the first question edited
    page.fill("#message", f"And bread {tag}?")
    page.click("#send")
    page.wait_for_function("() => document.querySelectorAll('.msg.assistant').length === 2")
    _settled(page)
    page.locator(".msg.assistant").nth(1).locator(".regen button").click()
    page.wait_for_selector(".msg.assistant .versions .version-count:has-text('2/2')")
    _settled(page)
    first = page.locator(".msg.user").first
    first.locator("summary:has-text('Edit')").click()
    first.locator("textarea[name=message]").fill(f"Pea soup {tag} instead")
    first.locator("button:has-text('Send again')").click()
    page.wait_for_selector(".msg.user .branches .version-count:has-text('2/2')")
    _settled(page)
    assert page.locator(".msg.user").count() == 1
    assert clock.match(page.locator(".msg.user .who time").inner_text())

    # ‹ : the old branch, with its later turns and the answer's two versions
    page.click(".branches button[aria-label='Earlier version of this question']")
    page.wait_for_selector(".msg.user .branches .version-count:has-text('1/2')")
    assert page.locator(".msg.user").count() == 2
    assert f"And bread {tag}?" in page.locator(".msg.user").nth(1).inner_text()
    assert page.locator(".msg.assistant .versions .version-count").inner_text() == "2/2"
    shot(tab, "branches", size)
    page.wait_for_function("t => document.title === t", arg=named + SUFFIX)
    assert page.inner_text("#chat-title") == named

    # the export holds both branches
    md = page.request.get(f"{server.url}/chat/{cid}/export.md").text()
    assert f"And bread {tag}?" in md and f"Pea soup {tag} instead" in md
    data = json.loads(page.request.get(f"{server.url}/chat/{cid}/export.json").text())
    assert len(data["other_branches"]) == 1

    # › : the new branch again; search finds a turn that lives only on the old one
    page.click(".branches button[aria-label='Later version of this question']")
    page.wait_for_selector(".msg.user .branches .version-count:has-text('2/2')")
    assert page.locator(".msg.user").count() == 1
    if size == PHONE:
        page.click("details.conversations summary")
    page.fill("#conv-q", f"bread {tag}")
    page.wait_for_selector("#conversation-list .snippet mark")
    found = page.locator("#conversation-list a")
    assert found.count() == 1 and found.get_attribute("href") == f"/chat/{cid}"
    assert found.locator("mark").inner_text() == f"bread {tag}"
    tab.close()


@SIZES
def test_continue_joins_words_and_an_attached_file_is_collapsed(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    cid = add_conversation(server, "carol", "", [
        ("user", "Which lights?\n\nAttached file “rooms.txt”:\n\nKitchen, den, garage."),
        ("assistant", "I will turn on the")])
    with server.store.sessions.begin() as s:  # as if it had stopped at its length limit
        m = s.get(Message, max(m.id for m in s.query(Message).filter_by(conversation_id=cid)))
        assert m is not None
        m.finish_reason = "length"
    tab = Tab(chromium, server, "carol", size)
    page = tab.page
    tab.goto(f"/chat/{cid}")
    bubble = page.locator(".msg.user")
    assert bubble.locator(".attached-file summary").inner_text() == "📎 rooms.txt (21 characters)"
    assert not bubble.locator("details.attached-file .body").is_visible()  # collapsed
    page.click(".msg.assistant .actions button:has-text('Continue')")
    page.wait_for_selector("#messages .msg.assistant.streaming")
    _settled(page)
    text = page.locator(".msg.assistant .body").inner_text()
    assert text.startswith("I will turn on the ") and not text.startswith("I will turn on the  ")
    tab.close()
