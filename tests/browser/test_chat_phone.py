"""Issue 54, item 5 (and major 3): the phone's header and title, and read-aloud, desktop and
phone. Each test failed before its feature: the phone header hid who was logged in and put
Jobs, Keys, Users, Models and Settings in a sideways scroll with no sign of a shared device;
a long title wrapped to six lines beside Rename/Export/Delete (349 of 844 px left for the
messages); answers could not be read aloud.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.browser.conftest import SIZES, Tab, shot, sign_in
from tests.browser.support import add_conversation
from tests.helpers import LiveServer

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def server(chat_server: LiveServer) -> LiveServer:
    return chat_server


FOCUSED = "() => document.activeElement && (document.activeElement.id || " \
          "document.activeElement.textContent.trim())"
LINKS = ["Chat", "Dashboard", "Jobs", "Keys", "Users", "Models", "Settings"]


def _fits(page: Any, width: int) -> None:
    assert page.evaluate("document.documentElement.scrollWidth") <= width
    height = page.evaluate("document.querySelector('header.top').getBoundingClientRect().height")
    assert height <= 64, height


@SIZES
def test_the_header_shows_who_is_logged_in_and_a_menu_for_every_link(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    tab = Tab(chromium, server, "alice", size)  # an admin: the most links
    page = tab.page
    _fits(page, size["width"])
    assert page.locator("header .who").is_visible()
    assert page.locator("header .who").inner_text() == "alice"
    assert page.locator("header .badge.shared").count() == 0  # not a shared login
    links = page.locator("header nav a")
    if size["width"] >= 720:  # a desktop: every link in the header's row, no Menu
        assert page.locator("#menu-button").is_hidden()
        assert [links.nth(i).inner_text() for i in range(links.count())] == LINKS
        assert all(links.nth(i).is_visible() for i in range(links.count()))
        tab.close()
        return
    # a phone: the links are not half-hidden in a sideways scroll but behind Menu
    menu = page.locator("#menu-button")
    assert menu.is_visible() and menu.get_attribute("aria-expanded") == "false"
    assert not any(links.nth(i).is_visible() for i in range(links.count()))
    menu.click()
    assert menu.get_attribute("aria-expanded") == "true"
    assert [links.nth(i).inner_text() for i in range(links.count())] == LINKS
    for i in range(links.count()):  # every link whole on the screen, a 44 px target
        box = links.nth(i).bounding_box()
        assert box and box["x"] >= 0 and box["x"] + box["width"] <= size["width"], box
        assert box["height"] >= 44, box
    assert page.locator("header .logout button").is_visible()
    assert page.evaluate(FOCUSED) == "Chat"  # focus moved into the menu
    shot(tab, "phone-menu", size)
    page.keyboard.press("Escape")  # closes, and focus goes back to Menu
    assert menu.get_attribute("aria-expanded") == "false"
    assert page.evaluate(FOCUSED) == "menu-button"
    assert not links.nth(0).is_visible()
    page.keyboard.press("Enter")  # the keyboard opens it too, and Tab walks it
    assert page.evaluate(FOCUSED) == "Chat"
    page.keyboard.press("Tab")
    assert page.evaluate(FOCUSED) == "Dashboard"
    page.locator("#message").click()  # a tap elsewhere closes it
    assert menu.get_attribute("aria-expanded") == "false"
    menu.click()
    page.click("header nav a:has-text('Models')")
    page.wait_for_url("**/manage/models")
    _fits(page, size["width"])
    assert page.locator("header .who").inner_text() == "alice"
    tab.close()


@SIZES
def test_a_shared_device_login_is_marked_in_the_header(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    context = chromium.new_context(viewport=size)
    page = context.new_page()
    sign_in(page, server.url, "carol", shared=True)
    marker = page.locator("header .badge.shared")
    assert marker.is_visible() and marker.inner_text() == "Shared device"
    assert "10 minutes" in (marker.get_attribute("title") or "")
    assert page.locator("header .who").is_visible()
    assert page.locator("header .who").inner_text() == "carol"
    _fits(page, size["width"])
    if size["width"] < 720:
        assert page.locator("#menu-button").is_visible()
    page.goto(server.url + "/settings")  # on every page, not only the chat
    assert page.locator("header .badge.shared").is_visible()
    context.close()


LONG_TITLE = ("Planning the summer holiday for the whole family with the grandparents, "
              "the dog and the camper van across three countries")


@SIZES
def test_a_long_title_is_one_line_and_the_messages_keep_most_of_the_phone(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    cid = add_conversation(server, "carol", LONG_TITLE, [
        ("user", "Where first?"), ("assistant", "The coast, then the mountains.")])
    tab = Tab(chromium, server, "carol", size)
    page = tab.page
    tab.goto(f"/chat/{cid}")
    title = page.locator("#chat-title")
    assert title.inner_text() == LONG_TITLE  # whole in the page; cut only on the screen
    actions = page.locator("#conv-head .conv-actions")
    if size["width"] >= 720:
        assert page.locator("#conv-head .conv-more").is_hidden()
        assert actions.locator("summary:has-text('Rename')").is_visible()
        tab.close()
        return
    line = page.evaluate("parseFloat(getComputedStyle(document.getElementById('chat-title'))"
                         ".lineHeight)")
    assert (title.bounding_box() or {})["height"] <= line + 2  # one line, with "…"
    assert page.evaluate("(() => { const t = document.getElementById('chat-title');"
                         " return t.scrollWidth > t.clientWidth; })()")
    assert title.get_attribute("title") == LONG_TITLE  # the whole of it, on a long press
    share = page.evaluate("document.getElementById('messages').getBoundingClientRect().height"
                          " / window.innerHeight")
    assert share >= 0.70, share
    shot(tab, "phone-title", size)
    # Rename, Export and Delete are in "⋯", and work from there
    more = page.locator("#conv-head .conv-more")
    assert more.is_visible() and actions.is_hidden()
    more.click()
    assert more.get_attribute("aria-expanded") == "true"
    for name in ("Rename", "Export", "Delete"):
        item = actions.locator(f"summary:has-text('{name}'), button:has-text('{name}')")
        box = item.bounding_box()
        assert item.is_visible() and box and box["x"] + box["width"] <= size["width"], name
    page.keyboard.press("Escape")
    assert actions.is_hidden() and page.evaluate(FOCUSED) == "⋯"
    more.click()
    page.click("#conv-head summary:has-text('Rename')")
    page.fill("#conv-head input[name=title]", "Summer")
    page.click("#conv-head button:has-text('Save')")
    page.wait_for_selector("#chat-title:has-text('Summer')")
    tab.close()


FAKE_SPEECH = """() => {
    window.__spoken = []; window.__cancels = 0;
    const voices = [{name: 'Cloud', lang: 'en-US', localService: false, default: true},
                    {name: 'Local French', lang: 'fr-FR', localService: true, default: false},
                    {name: 'Local', lang: 'en-GB', localService: true, default: false}];
    window.SpeechSynthesisUtterance = function (text) { this.text = text; };
    Object.defineProperty(window, 'speechSynthesis', {configurable: true, value: {
        getVoices: () => voices,
        cancel: () => { window.__cancels += 1; },
        speak: (u) => { window.__spoken.push({text: u.text, voice: u.voice && u.voice.name});
                        window.__last = u; }}});
}"""
NO_SPEECH = """() => { delete window.speechSynthesis; delete Window.prototype.speechSynthesis;
                      delete window.SpeechSynthesisUtterance; }"""


@SIZES
def test_an_answer_is_read_aloud_with_a_local_voice_where_the_browser_speaks(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    cid = add_conversation(server, "carol", "Soup", [
        ("user", "A soup?"), ("assistant", "Leek and **potato** soup."),
        ("user", "And bread?"), ("assistant", "A sourdough loaf.")])
    context = chromium.new_context(viewport=size)
    context.add_init_script(f"({FAKE_SPEECH})()")
    page = context.new_page()
    sign_in(page, server.url, "carol")
    page.goto(server.url + f"/chat/{cid}")
    buttons = page.locator(".msg.assistant [data-speak]")
    assert buttons.count() == 2 and buttons.first.is_visible()
    assert buttons.first.inner_text() == "Read aloud"
    buttons.first.click()
    spoken = page.evaluate("window.__spoken")
    # the answer's words (not its markup), in the local voice of the page's language
    assert spoken == [{"text": "Leek and potato soup.", "voice": "Local"}], spoken
    assert buttons.first.inner_text() == "Stop reading"
    buttons.nth(1).click()  # another answer: the first stops, the second is read
    assert buttons.first.inner_text() == "Read aloud"
    assert page.evaluate("window.__spoken[1].text") == "A sourdough loaf."
    buttons.nth(1).click()  # pressed again: stops
    assert buttons.nth(1).inner_text() == "Read aloud"
    assert page.evaluate("window.__spoken.length") == 2
    buttons.first.click()
    page.evaluate("window.__last.onend()")  # read to the end: the button says so
    assert buttons.first.inner_text() == "Read aloud"
    context.close()
    # a browser without speech: no button that cannot work
    context = chromium.new_context(viewport=size)
    context.add_init_script(f"({NO_SPEECH})()")
    page = context.new_page()
    sign_in(page, server.url, "carol")
    page.goto(server.url + f"/chat/{cid}")
    assert page.evaluate("'speechSynthesis' in window") is False
    assert page.locator(".msg.assistant .copy").first.is_visible()
    assert page.locator(".msg.assistant [data-speak]").first.is_hidden()
    context.close()


@SIZES
def test_new_chat_opens_a_clean_chat_address(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    """Issue 54 minor 16: New chat was a GET form and went to "/chat?"."""
    cid = add_conversation(server, "carol", "Old talk", [("user", "Hi"), ("assistant", "Hello")])
    tab = Tab(chromium, server, "carol", size)
    page = tab.page
    tab.goto(f"/chat/{cid}")
    new = page.locator(".sidebar .new-chat")
    box = new.bounding_box()
    assert box and box["height"] >= 40, box
    new.click()
    page.wait_for_url("**/chat")
    assert page.url == server.url + "/chat"
    assert page.locator("#chat-title").inner_text() == "New chat"
    tab.close()
