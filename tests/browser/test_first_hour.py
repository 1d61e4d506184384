"""The admin's first hour in headless Chromium (issue 54, items 2, 3, 6 and 7): the
getting-started checklist and the one-step key for Home Assistant; the Models page that
lists the served model wherever it lives and switches to another one (or keeps the old one
when the new one fails to load); the dashboard that greys out when the daemon stops; hints
beside the scheduler's fields and docs links that open."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from appliance.engine.model import DEMO_MODEL_DIR
from appliance.store.models import LedgerEntry
from tests.browser.conftest import DESKTOP, PHONE, SIZES, Tab, shot
from tests.helpers import LiveServer, live_server, make_settings, wait_until

pytestmark = pytest.mark.browser
playwright = pytest.importorskip("playwright.sync_api")


@pytest.fixture()
def fresh(tiny_model: Path) -> Iterator[LiveServer]:
    """A daemon of its own: the checklist's state (and the daemon itself) end with the test."""
    with live_server(make_settings(tiny_model, default_max_tokens=4)) as s:
        yield s


@SIZES
def test_the_first_hour_checklist_and_a_key_for_home_assistant(
        chromium: Any, fresh: LiveServer, size: dict[str, int]) -> None:
    tab = Tab(chromium, fresh, "alice", viewport=size)
    page = tab.page
    # the admin lands on the chat, and the checklist is there
    checklist = page.locator("#first-hour")
    assert checklist.is_visible()
    assert "1 of 3 done" in checklist.inner_text()  # the household is there already
    assert page.locator("#first-hour li[data-step=ha-key]").get_attribute("class") == "todo"
    # the Keys page's refusal says what to do
    page.click("#first-hour a[href='/keys#home-assistant']")
    page.wait_for_url("**/keys#home-assistant")
    page.fill("#keys-panel input[name=name]", "ha by hand")
    page.select_option("#keys-panel select[name=max_class]", "interactive")
    page.select_option("#keys-panel select[name=default_class]", "voice")
    page.click("button:has-text('Create key')")
    refusal = page.wait_for_selector("#keys-panel .notice.error").inner_text()
    assert "above the key's maximum" in refusal and "Make a key for Home Assistant" in refusal
    # one step: the key, the address and the values to type into Home Assistant
    page.click("button:has-text('Make a key for Home Assistant')")
    key = page.wait_for_selector("#ha-key").inner_text()
    assert key.startswith("apl_")
    assert page.inner_text("#ha-url") == fresh.url
    assert page.inner_text("#ha-model") == "tiny:latest"
    assert "maximum class voice" in page.inner_text(".ha-key .notice.ok")
    with httpx.Client(base_url=page.inner_text("#ha-url"), timeout=60,
                      headers={"Authorization": f"Bearer {key}"}) as ha:
        assert [m["name"] for m in ha.get("/api/tags").json()["models"]] == ["tiny:latest"]
        r = ha.post("/api/chat", json={"model": "tiny:latest", "stream": False,
                                       "messages": [{"role": "user", "content": "Lights?"}]})
        assert r.status_code == 200, r.text

    def classes() -> list[str]:
        with fresh.store.read_sessions() as s:
            return list(s.scalars(select(LedgerEntry.klass)).all())

    wait_until(lambda: classes() != [], what="the ledger row")
    assert classes() == ["voice"]  # HA asked for no class: it ran in voice
    shot(tab, "keys-home-assistant", size)
    page.reload()
    assert page.locator("#first-hour li[data-step=ha-key]").get_attribute("class") == "done"
    assert "2 of 3 done" in page.inner_text("#first-hour")
    # admin words: a hint beside every scheduler field, and docs links that open
    tab.goto("/manage/users")
    card = page.locator(".user-card").first
    assert card.locator(".hint").count() == 8
    assert "twice the share when the house is busy" in card.inner_text()
    tab.goto("/jobs/page")
    page.click("a[href='/docs/jobs.md']")
    page.wait_for_url("**/docs/jobs.md")
    assert page.locator("article.doc h1").count() == 1
    # hidden, it stays hidden
    page.click("#first-hour button:has-text('Hide this list')")
    page.wait_for_selector("#first-hour", state="detached")
    tab.goto("/chat")
    assert page.locator("#first-hour").count() == 0
    tab.problems = [p for p in tab.problems if "400" not in p]  # the refusal's own status
    tab.close()


@pytest.fixture(scope="module")
def models_server(tiny_model: Path) -> Iterator[LiveServer]:
    """The tiny model served from outside the models folder; in the folder, a copy of the
    demo model and a folder that is not a loadable model."""
    settings = make_settings(tiny_model, default_max_tokens=4)
    shutil.copytree(DEMO_MODEL_DIR, settings.models_dir / "household-demo")
    (settings.models_dir / "broken").mkdir()
    (settings.models_dir / "broken" / "config.json").write_text('{"model_type": "llama"}')
    with live_server(settings) as s:
        yield s


def _names(server: LiveServer) -> tuple[str, list[str]]:
    with server.client("bob") as api:
        return (api.get("/v1/models").json()["data"][0]["id"],
                [m["name"] for m in api.get("/api/tags").json()["models"]])


@SIZES
def test_an_admin_chooses_the_served_model_from_the_page(
        chromium: Any, models_server: LiveServer, size: dict[str, int]) -> None:
    before, _ = _names(models_server)
    target = "demo_model" if before == "household-demo" else "household-demo"
    tab = Tab(chromium, models_server, "alice", viewport=size)
    page = tab.page
    tab.goto("/manage/models")
    served = page.locator("tr.model-row.served")
    assert served.get_attribute("data-model") == before  # listed wherever it lives
    rows = page.inner_text("#models-panel table")
    assert "household-demo" in rows and "llama" in rows and "F32" in rows
    # a folder that does not load: the old model goes on serving, and the page says why
    page.click("button[aria-label='Serve broken']")
    error = page.wait_for_selector("#models-panel .notice.error").inner_text()
    assert "broken did not load" in error and f"{before} is still served" in error
    assert _names(models_server) == (before, [f"{before}:latest"])
    # another model: served at once, every client sees it, and it answers
    label = "demo" if target == "demo_model" else target
    page.click(f"button[aria-label='Serve {label}']")
    done = page.wait_for_selector("#models-panel .notice.ok", timeout=120_000)
    assert f"Now serving {target}." in done.inner_text()
    assert page.inner_text("#served-model").startswith(target)  # the header too
    assert page.locator("tr.model-row.served").get_attribute("data-model") == label
    assert _names(models_server) == (target, [f"{target}:latest"])
    with models_server.client("bob") as api:
        r = api.post("/v1/chat/completions", json={
            "model": target, "max_tokens": 4,
            "messages": [{"role": "user", "content": "Hello"}]})
        assert r.status_code == 200 and r.json()["model"] == target, r.text
    page.reload()  # the getting-started step is done: a model was chosen
    assert page.get_attribute("#first-hour li[data-step=model]", "class") == "done"
    tab.problems = [p for p in tab.problems if "422" not in p]  # the refusal's own status
    shot(tab, "models-switch", size)
    tab.close()


def test_the_dashboard_goes_grey_when_the_daemon_stops(
        chromium: Any, tiny_model: Path) -> None:
    tabs = []
    with live_server(make_settings(tiny_model)) as server:
        for size in (DESKTOP, PHONE):
            tab = Tab(chromium, server, "alice", viewport=size)
            tab.goto("/dashboard")
            tab.page.wait_for_selector("#dash-latency tr.latency-row[data-class=background]")
            assert tab.page.inner_text("#live-dot") == "live"
            tabs.append(tab)
    for tab in tabs:  # the daemon has stopped
        dot = tab.page.locator("#live-dot")
        wait_until(lambda dot=dot: "not answering since" in dot.inner_text(), timeout=20,
                   what="the dashboard to notice")
        assert re.fullmatch(r"not answering since \d\d:\d\d", dot.inner_text())
        assert "stale" in (tab.page.get_attribute("#dashboard", "class") or "")
        tab.context.close()  # its retries log refused connections until then: expected
        assert [p for p in tab.problems if "net::ERR_" not in p] == []
