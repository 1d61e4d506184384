"""Shared by the browser tests: Debian's Chromium driven by Playwright, and a logged-in tab."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import PASSWORD, LiveServer

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--no-first-run"]
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
SIZES = pytest.mark.parametrize("size", [DESKTOP, PHONE], ids=["desktop", "phone"])
"""Run a test at desktop and at phone size."""


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    playwright = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip("Chromium is not installed (scripts/test.sh installs Debian's)")
    # The Playwright driver (node) and Chromium must not inherit the OpenBLAS preload that
    # scripts/test.sh sets for MLX: node fails to start threads with it.
    preload = os.environ.pop("LD_PRELOAD", None)
    try:
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            yield browser
            browser.close()
    finally:
        if preload is not None:
            os.environ["LD_PRELOAD"] = preload


class Tab:
    """A logged-in tab that records script errors and CSP violations."""

    def __init__(self, chromium: Any, server: LiveServer, who: str,
                 viewport: dict[str, int] = DESKTOP, color_scheme: str = "light") -> None:
        self.server = server
        self.context = chromium.new_context(viewport=viewport, color_scheme=color_scheme)
        self.page = self.context.new_page()
        self.problems: list[str] = []
        self.page.on("pageerror", lambda e: self.problems.append(f"error: {e}"))
        self.page.on("console", lambda m: self.problems.append(m.text)
                     if m.type == "error" else None)
        self.page.goto(server.url + "/chat")
        assert self.page.url.endswith("/login")  # sent there first
        self.page.fill("input[name=name]", who)
        self.page.fill("input[name=password]", PASSWORD)
        self.page.click("button[type=submit]")
        self.page.wait_for_url("**/chat")

    def goto(self, path: str) -> None:
        self.page.goto(self.server.url + path)

    def close(self) -> None:
        self.context.close()
        assert self.problems == [], self.problems


@pytest.fixture(scope="module")
def chat_server(tiny_model: Path) -> Iterator[LiveServer]:
    """The chat pages' daemon: two slots, short answers, and the fault hook that keeps some
    requests slow and makes others fail (tests.browser.support.slow_fault)."""
    from tests.browser.support import slow_fault
    from tests.helpers import live_server, make_settings

    settings = make_settings(tiny_model, max_batch_size=2, default_max_tokens=40)
    with live_server(settings, fault=slow_fault) as s:
        yield s


SHOTS = os.environ.get("APPLIANCE_SHOTS")
"""A folder to keep the chat tests' screenshots in (unset: none are taken)."""


def shot(tab: Any, name: str, size: dict[str, int]) -> None:
    if SHOTS:
        tab.page.screenshot(path=f"{SHOTS}/{name}-{size['width']}.png", caret="initial")


def sign_in(page: Any, url: str, who: str, shared: bool = False) -> None:
    """Through the login page, as ``who`` (``shared``: "this is a shared device")."""
    page.goto(url + "/login")
    page.fill("input[name=name]", who)
    page.fill("input[name=password]", PASSWORD)
    if shared:
        page.check("input[name=shared]")
    page.click("button[type=submit]")
    page.wait_for_url("**/chat")


def open_menu(page: Any) -> None:
    """On a phone the header's links and Log out are in its Menu: open it (a no-op on a
    desktop, where they are in the header's row)."""
    button = page.locator("#menu-button")
    if button.is_visible() and button.get_attribute("aria-expanded") != "true":
        button.click()


def go_by_header(page: Any, link: str) -> None:
    """Click a header link (``link``: a selector inside ``header nav``), through the Menu
    on a phone."""
    open_menu(page)
    page.click(f"header nav {link}")


def log_out(page: Any) -> None:
    open_menu(page)
    page.click("header .logout button")


def conv_menu(page: Any) -> None:
    """On a phone a conversation's Rename, Export and Delete are in its "⋯": open it (a
    no-op on a desktop)."""
    button = page.locator("#conv-head .conv-more")
    if button.is_visible() and button.get_attribute("aria-expanded") != "true":
        button.click()
