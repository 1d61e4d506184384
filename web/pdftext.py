"""The text of a PDF file attached in the chat (pypdf: pure Python, no system tools).

Only the text layer is read: a scanned PDF (pictures of pages) has none, and is refused
with a message saying so, as are encrypted, damaged and oversized files. Blocking: call it
on a worker thread.
"""

from __future__ import annotations

import io
import logging
import re
from dataclasses import dataclass

from pypdf import PdfReader
from pypdf.errors import DependencyError, FileNotDecryptedError, PdfReadError

log = logging.getLogger(__name__)

MAX_PDF_BYTES = 20 * 1024 * 1024
"""A bigger file is refused before it is parsed (the text of 300 pages is far smaller)."""
MAX_PAGES = 300
MAX_TEXT_CHARS = 400_000
"""About 100,000 words: read in parts, that is some minutes of the model's background time."""
MIN_CHARS_PER_PAGE = 4
"""Fewer characters than this per page, on average: the PDF has no real text layer."""


class Unreadable(ValueError):
    """The file cannot be attached; the message is said to the person as it is."""


@dataclass(frozen=True, slots=True)
class PdfText:
    text: str
    pages: int


def _tidy(text: str) -> str:
    text = text.replace("\x00", "").replace("\r\n", "\n").replace("\r", "\n")
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def _open(data: bytes, name: str) -> PdfReader:
    try:
        reader = PdfReader(io.BytesIO(data), strict=False)
        # many PDFs are "encrypted" with an empty password only to forbid printing
        if reader.is_encrypted and not reader.decrypt(""):
            raise FileNotDecryptedError("a password is needed")
        return reader
    except (FileNotDecryptedError, DependencyError):
        raise Unreadable(f"“{name}” is protected with a password, so its text cannot be "
                         "read. Save a copy without the password and attach that.") from None
    except (PdfReadError, ValueError, KeyError, TypeError, IndexError, OSError):
        raise Unreadable(f"“{name}” could not be read as a PDF: the file is damaged or is "
                         "not a PDF.") from None


def extract(data: bytes, name: str) -> PdfText:
    """The text of every page, in order; raises :class:`Unreadable` with a plain reason."""
    if len(data) > MAX_PDF_BYTES:
        raise Unreadable(f"“{name}” is {len(data) / 1048576:.1f} MB; a PDF can be at most "
                         f"{MAX_PDF_BYTES // 1048576} MB.")
    if not data.lstrip()[:1024].startswith(b"%PDF-") and b"%PDF-" not in data[:1024]:
        raise Unreadable(f"“{name}” could not be read as a PDF: the file is damaged or is "
                         "not a PDF.")
    reader = _open(data, name)
    try:
        pages = len(reader.pages)
    except Exception:  # noqa: BLE001 - pypdf raises many kinds on a broken page tree
        raise Unreadable(f"“{name}” could not be read as a PDF: the file is damaged.") from None
    if pages > MAX_PAGES:
        raise Unreadable(f"“{name}” has {pages:,} pages; a PDF can have at most {MAX_PAGES}. "
                         "Attach the part you want to ask about.")
    texts, size = [], 0
    for number, page in enumerate(reader.pages, 1):
        try:
            text = page.extract_text() or ""
        except Exception as exc:  # noqa: BLE001 - one bad page: keep the others
            log.info("pdf: page %d of %d not read (%s)", number, pages, type(exc).__name__)
            text = ""
        texts.append(text)
        size += len(text)
        if size > MAX_TEXT_CHARS:
            raise Unreadable(f"“{name}” holds more than {MAX_TEXT_CHARS:,} characters of "
                             "text, more than the chat reads at once. Attach the part you "
                             "want to ask about.")
    text = _tidy("\n\n".join(texts))
    if len(re.sub(r"\s", "", text)) < MIN_CHARS_PER_PAGE * max(pages, 1):
        raise Unreadable(f"“{name}” has no text to read: it looks like scanned pages "
                         "(pictures of text). Attach a PDF with selectable text, or paste "
                         "the text into the message.")
    return PdfText(text, pages)
