"""Attachments over HTTP: who may send a PDF, watch a reading or stop it (web.attach)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.browser.support import browser, slow_fault
from tests.helpers import LiveServer, live_server, make_settings, wait_until
from tests.pdfs import text_pdf


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[LiveServer]:
    with live_server(make_settings(tiny_model, default_max_tokens=40), fault=slow_fault) as s:
        yield s


def test_only_its_owner_watches_or_stops_a_reading(server: LiveServer) -> None:
    readings = server.daemon.app.state.web.readings
    with browser(server.url, "bob") as bob, browser(server.url, "carol") as carol, \
            httpx.Client(base_url=server.url) as anon:
        pdf = {"file": ("a.pdf", text_pdf([["Hello"]]), "application/pdf")}
        assert anon.post("/chat/attachments", files=pdf).status_code == 401
        assert bob.post("/chat/attachments", files=pdf).json()["text"] == "Hello"
        r = bob.post("/chat/send", data={  # bob's requests decode slowly (test hook)
            "message": "Sum it up", "attachment": "plenty of words here. " * 900,
            "attachment_name": "long.txt"})
        assert r.status_code == 200, r.text
        rid = re.search(r'sse-connect="/chat/readings/([\w-]+)"', r.text).group(1)
        assert readings[rid].state == "reading"
        assert anon.get(f"/chat/readings/{rid}").status_code == 401
        assert anon.post(f"/chat/readings/{rid}/stop").status_code == 401
        assert carol.get(f"/chat/readings/{rid}").status_code == 204  # not hers: nothing
        assert carol.post(f"/chat/readings/{rid}/stop").status_code == 204
        assert readings[rid].state == "reading"
        again = bob.post("/chat/send", data={  # one reading at a time per person
            "message": "And this", "attachment": "more words. " * 2000,
            "attachment_name": "other.txt"})
        assert again.status_code == 429 and "being read already" in again.text
        assert bob.post(f"/chat/readings/{rid}/stop").status_code == 204
        wait_until(lambda: readings[rid].state == "stopped", 10, "the reading stopped")
        assert bob.get("/chat/readings/nope").status_code == 204
        assert bob.post("/chat/readings/nope/stop").status_code == 204
