"""The text of an attached PDF, and the plain refusals (web.pdftext), on hand-made PDFs."""

from __future__ import annotations

import pytest

from tests.pdfs import locked_pdf, scanned_pdf, text_pdf
from web import pdftext
from web.pdftext import Unreadable, extract


def test_it_reads_every_page_in_order() -> None:
    got = extract(text_pdf([["First page", "more (in brackets)"], ["Second page"]]), "a.pdf")
    assert got.pages == 2
    assert got.text == "First page\nmore (in brackets)\n\nSecond page"


def test_a_pdf_with_an_empty_password_is_read() -> None:
    assert extract(locked_pdf(["open to all"], password=""), "a.pdf").text == "open to all"


@pytest.mark.parametrize(("data", "said"), [
    (scanned_pdf(), "no text to read"),
    (locked_pdf(["private"]), "protected with a password"),
    (text_pdf([["cut short"] * 20])[:200], "damaged"),
    (b"PK\x03\x04 a zip file", "not a PDF"),
])
def test_an_unreadable_pdf_is_refused_with_its_reason(data: bytes, said: str) -> None:
    with pytest.raises(Unreadable, match=said):
        extract(data, "x.pdf")


def test_the_bounds_are_pages_characters_and_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pdftext, "MAX_PAGES", 2)
    with pytest.raises(Unreadable, match="3 pages; a PDF can have at most 2"):
        extract(text_pdf([["a"], ["b"], ["c"]]), "x.pdf")
    monkeypatch.setattr(pdftext, "MAX_TEXT_CHARS", 50)
    with pytest.raises(Unreadable, match="more than 50 characters"):
        extract(text_pdf([["a long line of text " * 4]]), "x.pdf")
    monkeypatch.setattr(pdftext, "MAX_PDF_BYTES", 100)
    with pytest.raises(Unreadable, match="a PDF can be at most"):
        extract(text_pdf([["a"]]), "x.pdf")
