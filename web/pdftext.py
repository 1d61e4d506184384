"""The text of a PDF file attached in the chat (pypdf: pure Python, no system tools).

Only the text layer is read: a scanned PDF (pictures of pages) has none, and is refused
with a message saying so, as are encrypted, damaged and oversized files.

A PDF is code-like input: a 55 KB file whose 300 pages share one content stream of 1.9 M
operators keeps pypdf busy for hours. So :func:`read` runs :func:`extract` in a process of
its own (``python -m web.pdftext``), niced, under ``RLIMIT_CPU`` and ``RLIMIT_AS``, and
killed past its wall time or when the caller is cancelled (the person left); at most
``AT_ONCE`` such processes run, and none on the threads that prepare prompts.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import re
import resource
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

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


AT_ONCE = 2
"""PDFs read at once (each a process on its own core); more wait their turn."""
NICE = 10
"""Reading a PDF yields the CPU to the engine and the daemon's threads."""
NO_MEMORY_EXIT = 3


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
        except MemoryError:
            raise  # the reading process's limit: said as such, not as a bad page
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


@dataclass(frozen=True, slots=True)
class Limits:
    seconds: float = 60.0
    memory_mb: int = 768


_turns: asyncio.Semaphore | None = None


def _child_env() -> dict[str, str]:
    """The daemon's environment less its BLAS preload (not needed; it would count against
    the memory limit), with the folder that holds ``web`` on the path."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


async def read(data: bytes, name: str, limits: Limits) -> PdfText:
    """:func:`extract` in a process with a time and a memory limit; cancelling the caller
    kills it. Raises :class:`Unreadable` with a plain reason."""
    global _turns
    if len(data) > MAX_PDF_BYTES:
        return extract(data, name)  # refused before anything is parsed
    if _turns is None:
        _turns = asyncio.Semaphore(AT_ONCE)
    async with _turns:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "web.pdftext", str(limits.seconds), str(limits.memory_mb), name,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=_child_env(), start_new_session=True)
        try:
            out, err = await asyncio.wait_for(proc.communicate(data), limits.seconds)
        except TimeoutError:
            _kill(proc)
            raise _too_slow(name, limits) from None
        except BaseException:  # cancelled (the person left): the work ends with them
            _kill(proc)
            log.info("pdf: reading stopped, its request ended (pid %d)", proc.pid)
            raise
    return _answer(proc.returncode, out, err, name, limits)


def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            proc.kill()


def _too_slow(name: str, limits: Limits) -> Unreadable:
    log.info("pdf: reading stopped at its time limit (%g s)", limits.seconds)
    return Unreadable(f"Reading “{name}” took longer than {limits.seconds:g} s, so it was "
                      "stopped. Its pages are unusually costly to read; attach the part you "
                      "want to ask about, or paste its text into the message.")


def _answer(code: int | None, out: bytes, err: bytes, name: str, limits: Limits) -> PdfText:
    if code == 0:
        got = json.loads(out)
        if "error" in got:
            raise Unreadable(str(got["error"]))
        return PdfText(str(got["text"]), int(got["pages"]))
    if code in (-signal.SIGXCPU, -signal.SIGKILL):
        raise _too_slow(name, limits)
    if code == NO_MEMORY_EXIT:
        log.info("pdf: reading stopped at its memory limit (%d MiB)", limits.memory_mb)
        raise Unreadable(f"Reading “{name}” needs more than {limits.memory_mb} MB of memory, "
                         "so it was stopped. Attach the part you want to ask about, or paste "
                         "its text into the message.")
    log.warning("pdf: the reading process ended with status %s: %s", code,
                err.decode(errors="replace")[-300:])
    raise Unreadable(f"“{name}” could not be read as a PDF: the file is damaged.")


def _child(seconds: float, memory_mb: int, name: str) -> int:
    """The reading process: the PDF on stdin, JSON on stdout."""
    cpu = max(1, int(seconds + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    memory = memory_mb * 1024 * 1024
    for kind in (resource.RLIMIT_AS, resource.RLIMIT_DATA):
        try:  # macOS refuses RLIMIT_AS below its own: the data segment's limit instead
            resource.setrlimit(kind, (memory, memory))
            break
        except (ValueError, OSError):
            continue
    os.nice(NICE)
    data = sys.stdin.buffer.read()
    try:
        got = extract(data, name)
        answer: dict[str, object] = {"text": got.text, "pages": got.pages}
    except Unreadable as exc:
        answer = {"error": str(exc)}
    except MemoryError:
        return NO_MEMORY_EXIT
    sys.stdout.write(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(_child(float(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
