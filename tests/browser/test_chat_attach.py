"""Issue 38, attaching files: a PDF's text, and a long file read in parts (the jobs'
map-reduce) with progress, Stop, and a reload that finds what was done. Desktop and phone.

Each test names the defect it guards against; each failed before the feature: a PDF could
not be attached at all, and a file longer than one message was refused as "too long".
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from tests.browser.conftest import SIZES, Tab, shot
from tests.helpers import LiveServer, wait_until
from tests.pdfs import locked_pdf, scanned_pdf, text_pdf

pytestmark = pytest.mark.browser


WORDS = ["kettle", "garden", "window", "ledger", "oven", "basket", "river", "pencil",
         "lantern", "carpet", "orchard", "mirror", "blanket", "harbour", "violin", "meadow",
         "saucer", "ladder", "candle", "pocket"]


def _document(chars: int, seed: int = 7) -> str:
    """Prose-like text of about ``chars`` characters, in paragraphs."""
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < chars:
        sentence = " ".join(rng.choice(WORDS) for _ in range(12)).capitalize() + "."
        out.append(sentence + ("\n\n" if len(out) % 6 == 5 else " "))
        size += len(out[-1])
    return "".join(out).strip()


@pytest.fixture(scope="module")
def server(chat_server: LiveServer) -> LiveServer:
    return chat_server




WATCH = """() => { window.__said = []; window.__sendOff = [];
    new MutationObserver(() => document.querySelectorAll('.msg.reading .waiting')
        .forEach(p => { if (!window.__said.includes(p.textContent)) {
            window.__said.push(p.textContent);
            window.__sendOff.push(document.getElementById('send').disabled); } }))
      .observe(document.getElementById('messages'), {subtree: true, childList: true,
                                                     characterData: true}); }"""


def _conversation_id(tab: Tab) -> str:
    tab.page.wait_for_url("**/chat/*")
    return tab.page.url.rsplit("/", 1)[1]


# ---- PDF ----
@SIZES
def test_a_pdf_is_attached_as_its_text_and_unreadable_ones_are_refused_plainly(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    tab = Tab(chromium, server, "carol", size)
    page = tab.page
    pdf = text_pdf([["Minutes of the school board", "Budget: 4,200 euros for books"],
                    ["Next meeting on 12 March"]])
    page.set_input_files("#attach", files=[{"name": "minutes.pdf",
                                            "mimeType": "application/pdf", "buffer": pdf}])
    page.wait_for_selector("#attached:has-text('minutes.pdf (2 pages')")
    shot(tab, "pdf-attached", size)
    page.fill("#message", "What is the budget?")
    page.click("#send")
    page.wait_for_selector("#messages .msg.assistant:not(.streaming)")
    # the file's text is collapsed under its name (issue 54)
    assert page.locator(".msg.user .attached-file summary").inner_text().startswith(
        "📎 minutes.pdf (")
    question = page.locator(".msg.user").text_content() or ""
    assert "Budget: 4,200 euros for books" in question and "Next meeting on 12 March" in question
    assert page.locator("#attached").is_hidden()
    notice = page.locator("#chat-notice .notice.error")
    for name, data, said in [("scan.pdf", scanned_pdf(), "no text to read"),
                             ("locked.pdf", locked_pdf(["secret plans"]), "password"),
                             ("broken.pdf", pdf[: len(pdf) // 3], "damaged"),
                             ("fake.pdf", b"just some words, not a PDF", "not a PDF")]:
        page.set_input_files("#attach", files=[{"name": name, "mimeType": "application/pdf",
                                                "buffer": data}])
        page.wait_for_selector(f"#chat-notice .notice.error:has-text('{name}')")
        assert said in notice.inner_text(), (name, notice.inner_text())
        assert page.locator("#attached").is_hidden()  # nothing half-attached
        assert page.locator("#attachment").input_value() == ""
    shot(tab, "pdf-refused", size)
    tab.problems = [p for p in tab.problems if "status of 400" not in p]  # the refusals
    tab.close()


def test_a_pdf_too_large_is_refused_by_the_server_too(server: LiveServer) -> None:
    """The 20 MB bound holds for a caller that skips the page's own check."""
    from tests.browser.support import browser
    with browser(server.url, "carol", htmx=False) as client:
        big = text_pdf([["x"]]) + b"%" * (21 * 1024 * 1024)
        r = client.post("/chat/attachments", files={"file": ("big.pdf", big,
                                                             "application/pdf")})
        assert r.status_code in (400, 413), r.text
        r = client.post("/chat/attachments", files={"file": ("ok.pdf", text_pdf([["Hi there"]]),
                                                             "application/pdf")})
        assert r.status_code == 200 and r.json()["text"] == "Hi there", r.text


# ---- a long file, read in parts ----
@SIZES
def test_a_long_file_is_read_in_parts_with_progress_then_answered_and_kept(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    tab = Tab(chromium, server, "carol", size)
    page = tab.page
    doc = _document(20_000)
    page.set_input_files("#attach", files=[{"name": "history.md", "mimeType": "text/markdown",
                                            "buffer": doc.encode()}])
    page.wait_for_selector("#attached:has-text('read in parts')")
    page.evaluate(WATCH)
    page.fill("#message", "Which rooms does this talk about?")
    page.click("#send")
    page.wait_for_selector(".msg.reading .waiting")
    shot(tab, "reading", size)
    page.wait_for_selector("#messages .msg.assistant:not(.streaming):not(.reading)",
                           timeout=120_000)
    said = page.evaluate("window.__said")
    assert any(s.startswith("Reading part 2 of ") for s in said), said
    # one thing at a time: Send was off at every later step of the reading, as the observer
    # saw it (a look after the fact could be outrun by a fast reading; at the first step the
    # page turns Send off just after the reading's first words are swapped in)
    off = page.evaluate("window.__sendOff")
    assert len(off) > 1 and all(off[1:]), off
    parts = int(next(s for s in said if s.startswith("Reading part 1 of ")).split()[4])
    assert parts >= 3, said
    assert not page.locator("#chat-notice .notice").count()
    cid = _conversation_id(tab)
    page.reload()  # what was done is stored: the question now holds the file's summary
    question = page.locator(".msg.user").text_content() or ""
    assert page.locator(".msg.user .body").first.inner_text() == \
        "Which rooms does this talk about?"
    assert page.locator(".msg.user .attached-file summary").inner_text() == \
        f"📎 history.md ({len(doc):,} characters)"
    assert f"read in {parts} parts" in question
    assert doc[:200] not in question  # the summary took the file's place
    assert page.locator("#chat-title").inner_text() == "Which rooms does this talk about?"
    assert page.locator(".msg.assistant").count() == 1
    assert page.locator(".msg.reading").count() == 0
    with server.client("carol") as api:
        stored = api.get(f"/conversations/{cid}").json()["messages"]
    assert [m["role"] for m in stored] == ["user", "assistant"]
    shot(tab, "read-answered", size)
    tab.close()


@SIZES
def test_a_reading_survives_a_reload_and_stop_keeps_the_parts_read(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    tab = Tab(chromium, server, "bob", size)  # bob's requests decode slowly (test hook)
    page = tab.page
    # shorter than one message, but longer than the model's whole context
    doc = _document(9_000, seed=11)
    page.set_input_files("#attach", files=[{"name": "notes.txt", "mimeType": "text/plain",
                                            "buffer": doc.encode()}])
    page.wait_for_selector("#attached:has-text('notes.txt')")
    page.fill("#message", "Summarise my notes")
    page.click("#send")
    page.wait_for_selector(".msg.reading .waiting:has-text('Reading part 1 of')",
                           timeout=60_000)
    cid = _conversation_id(tab)
    page.reload()  # the reading goes on on the server; the page finds it again
    page.wait_for_selector(".msg.reading .waiting:has-text('Reading part 2 of')",
                           timeout=60_000)
    assert page.locator(".msg.reading .stop").is_visible()
    shot(tab, "reading-after-reload", size)
    page.click(".msg.reading .stop")
    page.wait_for_selector(".msg.assistant.cancelled:has-text('Stopped after reading')")
    assert page.locator(".msg.reading").count() == 0
    engine = server.engine
    wait_until(lambda: engine.snapshot.active == 0 and engine.snapshot.queued == 0, 10,
               "the part being read was cancelled in the engine")
    page.reload()
    question = page.locator(".msg.user").text_content() or ""
    assert "📎 notes.txt (" in question
    assert "reading stopped after 1 of" in question and "Part 1:" in question
    answer = page.locator(".msg.assistant")
    assert answer.count() == 1 and "Stopped." in answer.inner_text()
    assert page.locator(".msg.reading").count() == 0
    with server.client("bob") as api:
        stored = api.get(f"/conversations/{cid}").json()["messages"]
    assert [m["role"] for m in stored] == ["user", "assistant"]
    assert stored[1]["content"] == "" and "Part 1:" in stored[0]["content"]
    shot(tab, "reading-stopped", size)
    tab.close()


# ---- issue 54, item 4: reading as a person expects ----
@SIZES
def test_binary_files_are_refused_and_a_stop_before_anything_read_says_so(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    """A PNG and a .docx were "attached" as text, an old "too large" notice stayed up; a
    reading showed "0 of 1" with no time for minutes, and Stop before the first part was read
    said "notes on what was read are kept" and offered "Answer from what was read"."""
    tab = Tab(chromium, server, "bob", size)  # bob's requests decode slowly (test hook)
    page = tab.page
    page.set_input_files("#attach", files=[{"name": "big.txt", "mimeType": "text/plain",
                                            "buffer": b"a" * (1024 * 1024 + 1)}])
    page.wait_for_selector("#chat-notice .notice:has-text('too large')")
    png = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256))
    for name, mime, data in [("photo.png", "image/png", png),
                             ("letter.docx", "", b"PK\x03\x04\x14\x00\x06\x00" + bytes(64)),
                             ("blob.txt", "text/plain", b"hello\x00\x01\x02world")]:
        page.set_input_files("#attach", files=[{"name": name, "mimeType": mime,
                                                "buffer": data}])
        notice = page.locator("#chat-notice .notice")
        page.wait_for_selector(f"#chat-notice .notice:has-text('{name}')")
        assert notice.count() == 1 and "too large" not in notice.inner_text()
        assert "Save it as text or PDF" in notice.inner_text()
        assert page.locator("#attached").is_hidden()
        assert page.locator("#attachment").input_value() == ""
    # a text file that is not UTF-8 is still text
    page.set_input_files("#attach", files=[{"name": "old.txt", "mimeType": "text/plain",
                                            "buffer": "Café crème".encode("cp1252")}])
    page.wait_for_selector("#attached:has-text('old.txt')")
    assert page.locator("#attachment").input_value() == "Café crème"
    assert page.locator("#chat-notice .notice").count() == 0  # the refusal went with it
    doc = _document(9_000, seed=13)
    page.set_input_files("#attach", files=[{"name": "notes.txt", "mimeType": "text/plain",
                                            "buffer": doc.encode()}])
    page.wait_for_selector("#attached:has-text('notes.txt')")
    page.fill("#message", "What is in my notes?")
    page.click("#send")
    spent = page.locator(".msg.reading .spent")
    # inside the part: the share read and the time spent, which moves on by itself
    page.wait_for_selector(".msg.reading .spent:has-text('so far')", timeout=60_000)
    first = spent.inner_text()
    assert "% of this part read" in first or "this part read" in first, first
    page.wait_for_function("t => { const e = document.querySelector('.msg.reading .spent');"
                           " return e && e.textContent !== t; }", arg=first, timeout=10_000)
    assert page.locator(".msg.reading .waiting:has-text('Reading part 1 of')").count() == 1
    bar = page.locator(".msg.reading progress")
    value, most = float(bar.get_attribute("value") or "0"), float(bar.get_attribute("max") or "0")
    assert 0 < value <= 1 < most, (value, most)  # within the first part, not "0 of 1"
    page.click(".msg.reading .stop")
    stopped = page.locator(".msg.assistant.cancelled")
    page.wait_for_selector(".msg.assistant.cancelled:has-text('Nothing was read yet')")
    assert "notes on what was read" not in stopped.inner_text()
    assert page.locator("button:has-text('Answer from what was read')").count() == 0
    tab.close()


@SIZES
def test_a_binary_file_that_slips_past_the_page_is_refused_by_the_server_in_words(
        chromium: Any, server: LiveServer, size: dict[str, int]) -> None:
    """Issue 54 item 4: the page's own check was the only one; a tab with an older script
    (or none) had a picture's bytes stored and sent to the model as a question."""
    tab = Tab(chromium, server, "carol", size)
    page = tab.page
    # what an older page would send: a PNG's bytes read as text, past the page's check
    page.evaluate("""() => {
        document.getElementById('attachment').value = '\\u2030PNG\\r\\n\\u001a\\n' +
            '\\u0001\\u0002\\u0003\\u0004'.repeat(40);
        document.getElementById('attachment-name').value = 'photo.png'; }""")
    page.fill("#message", "What is in this picture?")
    page.click("#send")
    notice = page.locator("#chat-notice .notice")
    page.wait_for_selector("#chat-notice .notice:has-text('photo.png')")
    assert "is not a text file" in notice.inner_text()
    assert "Save it as text or PDF" in notice.inner_text()
    assert page.input_value("#message") == "What is in this picture?"  # kept, to send again
    assert page.locator("#messages .msg.user").count() == 0  # nothing stored or asked
    tab.problems = [p for p in tab.problems if "status of 400" not in p]  # the browser's own
    tab.close()
