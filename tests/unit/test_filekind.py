"""Which attached files are text (web.filekind): binary files refused, real text never."""

from __future__ import annotations

import pytest

from web import filekind

PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256))
JPEG = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + bytes(range(128, 256))
DOCX = b"PK\x03\x04\x14\x00\x06\x00\x08\x00" + b"[Content_Types].xml" + bytes(40)


@pytest.mark.parametrize("name,text", [
    ("photo.PNG", "anything"),
    ("letter.docx", "looks like words"),
    ("song.mp3", "ID3"),
    ("notes.txt", PNG.decode("cp1252", "replace")),
    ("notes.txt", PNG.decode("utf-8", "replace")),
    ("notes.txt", JPEG.decode("latin-1")),
    ("notes.txt", DOCX.decode("latin-1")),
    ("notes.md", "fine text\x00then a NUL"),
    ("data.txt", "".join(chr(i % 32) for i in range(1000))),
])
def test_it_refuses_pictures_word_files_and_binary_bytes(name: str, text: str) -> None:
    why = filekind.refusal(name, text)
    assert why is not None and f"“{name}” is not a text file" in why


@pytest.mark.parametrize("name,text", [
    ("notes.txt", "Buy leeks, rice and stock.\n\tThen cook.\r\n"),
    ("old.txt", "Café crème brûlée — 5 €\f" * 50),
    ("日記.md", "今日は雨でした。🌧️ Ein schöner Tag, ça va."),
    ("page.html", "<p>Hello</p>"),
    ("report.pdf", "Text a PDF's reader sent back"),
    ("readme", "no extension at all"),
    ("bom.txt", "\ufeffStarts with a byte-order mark"),
])
def test_it_keeps_text_in_any_language_and_encoding(name: str, text: str) -> None:
    assert filekind.refusal(name, text) is None


def test_the_pdf_route_knows_a_pdf_by_name_or_bytes() -> None:
    assert filekind.is_pdf("a.PDF", b"junk")
    assert filekind.is_pdf("upload", b"%PDF-1.7\n...")
    assert not filekind.is_pdf("photo.png", PNG)
