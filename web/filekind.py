"""Whether an attached file is text: pictures, Word files, archives and other binary files
are refused at once, in words, by the server as well as by the page (``app.js``), so that a
caller who skips the page's check does not feed the model bytes read as text.

The browser sends a text file's contents decoded (UTF-8, else Windows-1252), so the checks
work on text: a name ending in a binary type, a known file signature at the start, a NUL, or
more than a few control or undecodable characters. docs/decisions/binary-attachments.md.
"""

from __future__ import annotations

import re

NOT_TEXT = "not_text"
"""The refusal's ``code`` on the wire."""

BINARY_NAME = re.compile(
    r"\.(docx?|docm|odt|ods|odp|rtf|pages|xlsx?|pptx?|key|numbers|epub|zip|gz|tgz|bz2|xz|7z|"
    r"rar|tar|png|jpe?g|gif|webp|heic|heif|avif|bmp|ico|tiff?|psd|svgz|mp3|m4a|wav|flac|ogg|"
    r"opus|mp4|m4v|mov|avi|mkv|webm|exe|dll|so|dylib|bin|iso|dmg|apk|sqlite|db)$",
    re.IGNORECASE)
"""Names that are never text; a .pdf is read by its own route (``web.pdftext``)."""

SIGNATURES = ("\x89PNG", "\ufffdPNG", "‰PNG", "GIF87a", "GIF89a", "\xff\xd8\xff", "ÿØÿ",
              "PK\x03\x04", "PK\x05\x06", "Rar!\x1a", "7z¼¯", "\x1f\x8b", "%PDF-", "\x7fELF")
"""File starts of pictures, zip containers (.docx, .xlsx), archives, PDFs and programs:
as raw bytes, as UTF-8 with replacement characters, and as Windows-1252 (what a browser's
fallback decoding makes of them)."""

SAMPLE_CHARS = 8192
"""How much of the start is looked at: a binary file shows itself in its first bytes."""
MAX_ODD_SHARE = 0.02
"""Share of control or undecodable characters above which a file is not text (text has
almost none; 2 % leaves room for a stray form feed or a damaged character)."""
_ODD = re.compile(r"[\x00-\x08\x0b\x0e-\x1f\x7f\ufffd]")


def refusal(name: str, text: str) -> str | None:
    """Why the file ``name`` with contents ``text`` cannot be attached, or None if it is
    text. The words match the page's own (``notRead`` in app.js)."""
    sample = text[:SAMPLE_CHARS]
    binary = (bool(BINARY_NAME.search(name.strip())) or "\x00" in sample
              or sample.lstrip("\ufeff").startswith(SIGNATURES)
              or len(_ODD.findall(sample)) > MAX_ODD_SHARE * max(len(sample), 1))
    if not binary:
        return None
    return (f"“{name}” is not a text file (a picture, a Word document or another binary "
            "file), so it cannot be attached. Save it as text or PDF and attach that.")


def is_pdf(name: str, data: bytes) -> bool:
    """Whether an upload to the PDF route claims to be a PDF (its name or its first bytes);
    anything else there is refused as not text before a PDF reader sees it."""
    return name.lower().endswith(".pdf") or b"%PDF-" in data[:1024]
