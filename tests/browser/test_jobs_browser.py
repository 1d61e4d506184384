"""The Jobs page in headless Chromium: create a job with the schedule picker, run it now,
watch its progress advance, read the output."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.browser.support import slow_fault
from tests.browser.test_web_browser import Page, shots  # noqa: F401 (fixtures; chromium: conftest.py)
from tests.helpers import LiveServer, live_server, make_settings

pytestmark = pytest.mark.browser

DOCUMENT = ("The garden club meets on Saturday. Bring gloves and seeds. "
            "The compost heap needs turning and the shed door sticks. ") * 40


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[LiveServer]:
    """bob's decode steps are slowed (test hook) and chunks are small: many stages to see."""
    settings = make_settings(tiny_model, chunk_tokens=96)
    with live_server(settings, fault=slow_fault) as s:
        yield s


def _done(page: Any) -> int:
    text = page.locator(".job-progress .progress-text").first.inner_text()
    match = re.match(r"(\d+) / (\d+|\?)", text)
    assert match, text
    return int(match.group(1))


def test_a_member_creates_a_job_runs_it_watches_progress_and_reads_the_output(
        chromium: Any, server: LiveServer, shots: Path) -> None:  # noqa: F811
    tab = Page(chromium, server, "bob")
    page = tab.page
    page.click("header nav a[href='/jobs/page']")
    page.wait_for_url("**/jobs/page")
    page.fill("input[name=name]", "Garden notes")
    page.fill("textarea[name=instructions]", "What needs doing in the garden?")
    page.fill("textarea[name=text]", DOCUMENT)
    page.fill("input[name=max_output_tokens]", "16")
    page.select_option("#job-schedule", "cron")
    page.fill("input[name=cron]", "0 7 * * *")
    page.wait_for_function("() => (document.querySelector('#schedule-preview') || "
                           "{textContent: ''}).textContent.includes('next:')")
    preview = page.locator("#schedule-preview").inner_text()
    assert "07:00" in preview and ("today" in preview or "tomorrow" in preview), preview
    page.fill("input[name=cron]", "0 7 * *")
    page.wait_for_selector("#schedule-preview .notice.error")
    page.fill("input[name=cron]", "0 7 * * *")
    page.click(".job-form button[type=submit]")
    page.wait_for_selector("article.job h3 a:text('Garden notes')")
    assert "next " in page.locator("article.job").first.inner_text()
    page.click("article.job .run-now")
    page.wait_for_selector("#jobs-list .job-progress progress")
    first = _done(page)
    page.wait_for_function(f"() => {{ const t = document.querySelector("
                           f"'.job-progress .progress-text'); return !t || "
                           f"parseInt(t.textContent) > {first}; }}", timeout=120_000)
    page.screenshot(path=str(shots / "jobs-desktop.png"), full_page=True, caret="initial")
    page.click("article.job a:text('History')")
    page.wait_for_url("**/jobs/page/*")
    page.wait_for_selector("article.run[data-status=done]", timeout=180_000)
    # the tiny test model's words are random tokens: the page shows the stored output,
    # rendered as safe Markdown
    from web.markdown import render

    job_id = int(page.url.rstrip("/").rsplit("/", 1)[1])
    with server.client("bob") as bob:
        run = bob.get(f"/jobs/{job_id}/runs").json()[0]
        stored = bob.get(f"/jobs/{job_id}/runs/{run['id']}").json()["output"]
    assert stored
    shown = page.locator("article.run[data-status=done] .output").first.inner_html()
    assert shown.strip() == str(render(stored)).strip()
    assert "requests" in page.locator("article.run[data-status=done]").first.inner_text()
    page.screenshot(path=str(shots / "job-history-desktop.png"), full_page=True, caret="initial")
    tab.close()
