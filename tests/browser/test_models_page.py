"""The admin's Models page in headless Chromium: a model brought in from this machine's
Ollama store by the form (htmx swaps the panel in), listed after, and a refusal as text."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.browser.conftest import SIZES, Tab, go_by_header, shot
from tests.gguf_files import ollama_store
from tests.helpers import LiveServer, live_server, make_settings

pytestmark = pytest.mark.browser
playwright = pytest.importorskip("playwright.sync_api")


@pytest.fixture()
def server(tiny_model: Path) -> Iterator[LiveServer]:
    with live_server(make_settings(tiny_model)) as s:
        yield s


@SIZES
def test_an_admin_imports_an_ollama_model_from_the_page(
        chromium: Any, server: LiveServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        size: dict[str, int]) -> None:
    monkeypatch.setenv("OLLAMA_MODELS", str(ollama_store(tmp_path / "ollama")))
    tab = Tab(chromium, server, "alice", viewport=size)
    go_by_header(tab.page, "a[href='/manage/models']")  # a phone: through its Menu
    tab.page.wait_for_url("**/manage/models")
    assert "tiny-q8" not in tab.page.inner_text("#models-panel")
    tab.page.fill("input[name=source]", "nothing-here:7b")
    tab.page.click("#models-panel form.bring-in button[type=submit]")
    refusal = tab.page.wait_for_selector("#models-panel .notice.error")
    assert "no Ollama model 'nothing-here:7b'" in refusal.inner_text()
    assert tab.page.input_value("input[name=source]") == "nothing-here:7b"  # kept as typed
    tab.page.fill("input[name=source]", "tiny:q8")
    tab.page.click("#models-panel form.bring-in button[type=submit]")
    done = tab.page.wait_for_selector("#models-panel .notice.ok", timeout=120_000)
    assert "Imported tiny-q8. Choose “Serve this”" in done.inner_text()
    assert "tiny-q8" in tab.page.inner_text("#models-panel table")
    assert (server.daemon.settings.models_dir / "tiny-q8" / "config.json").is_file()
    tab.problems = [p for p in tab.problems if "404" not in p]  # the refusal's own status
    shot(tab, "models", size)
    tab.close()
