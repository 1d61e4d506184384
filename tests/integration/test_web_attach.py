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


PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256))
DOCX = b"PK\x03\x04\x14\x00\x06\x00" + bytes(range(32, 128)) * 4


def test_a_picture_or_word_file_is_refused_as_not_text_by_the_server(
        server: LiveServer) -> None:
    """Issue 54 item 4: the page refused binary files, but a caller who skipped its check
    (or an older page) had a PNG's bytes stored and sent to the model as a question."""
    with browser(server.url, "carol", htmx=False) as carol:
        for name, text in [("photo.png", "a picture's bytes"),  # named as a picture
                           ("notes.txt", PNG.decode("cp1252", "replace")),  # a PNG inside
                           ("letter.txt", DOCX.decode("latin-1")),  # a .docx renamed
                           ("blob.txt", "hello\x00\x01\x02world" * 10)]:
            r = carol.post("/chat/send", data={"message": "What is this?",
                                               "attachment": text, "attachment_name": name})
            assert r.status_code == 400, (name, r.text)
            error = r.json()["error"]
            assert error["code"] == "not_text" and error["param"] == "attachment", error
            assert f"“{name}” is not a text file" in error["message"]
            assert "Save it as text or PDF" in error["message"]
        # the attachment route reads PDFs; a picture or a Word file sent there is not text
        for name, data in [("photo.png", PNG), ("letter.docx", DOCX), ("x.bin", PNG)]:
            r = carol.post("/chat/attachments", files={"file": (name, data, "")})
            assert r.status_code == 400, (name, r.text)
            assert r.json()["error"]["code"] == "not_text", r.text
            assert "is not a text file" in r.json()["error"]["message"]
        # text in another encoding, with a form feed or a tab, is still text
        r = carol.post("/chat/send", data={"message": "Read this", "attachment_name": "old.txt",
                                           "attachment": "Café crème\f\tbrûlée\n" * 20})
        assert r.status_code == 200, r.text
    with browser(server.url, "carol") as page:  # the page hears it as a notice, in words
        r = page.post("/chat/send", data={"message": "What is this?", "attachment": "x",
                                          "attachment_name": "photo.jpg"})
        assert r.status_code == 400 and "“photo.jpg” is not a text file" in r.text
