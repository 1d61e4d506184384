"""The demo model's training text: ``appliance/demo/corpus.txt``, English prose paragraphs
from CPython 3.11.7's standard library (the reference documentation in
``Lib/pydoc_data/topics.py`` and the docstrings of the pure-Python modules under ``Lib/``),
Copyright (c) 2001-2023 Python Software Foundation, redistributed under the PSF License
Agreement for Python 3.11, whose notice is kept at the top of the file. The committed file is
what the build uses; :func:`make_corpus` re-creates it from the running interpreter's
standard library (byte-identical only on CPython 3.11.7)."""

from __future__ import annotations

import ast
import logging
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CORPUS_PATH = Path(__file__).resolve().parent / "corpus.txt"

CORPUS_HEADER = """\
# corpus.txt: training text for the appliance demo model.
#
# Source: CPython 3.11.7 standard library -- the reference documentation in
# Lib/pydoc_data/topics.py and docstrings of the pure-Python modules in Lib/.
# Changes made (PSF License clause 3): paragraphs were extracted, filtered to English prose
# (code, grammar, tables and examples removed), de-duplicated, and their line breaks joined,
# by appliance.demo.build.make_corpus().
#
# Copyright (c) 2001-2023 Python Software Foundation; All Rights Reserved.
# Redistributed under the PSF License Agreement for Python 3.11, reproduced below.
# Lines starting with '#' are not training text; paragraphs are separated by blank lines.
#
"""





def _is_prose(paragraph: str) -> bool:
    """Heuristic: a paragraph of English sentences, not code, grammar or a table."""
    lines = paragraph.splitlines()
    if any(line[:1].isspace() for line in lines):
        return False
    text = " ".join(line.strip() for line in lines)
    if len(text) < 60 or len(text) > 2000 or not text[0].isupper():
        return False
    if text[-1] not in ".!?" or text.endswith("::") or text.endswith(":"):
        return False
    if re.search(r">>>|\.\.\.\s|::=|\*\*\*|===|---|~~~|\\n|\{\}|\w\(\)|[{}<>|@$#`\\]", text):
        return False
    letters = sum(ch.isalpha() or ch == " " for ch in text)
    if letters / len(text) < 0.9:
        return False
    words = text.split()
    if len(words) < 10:
        return False
    odd = sum(1 for w in words if re.search(r"[_=\[\]()*]|\w\.\w", w))
    return odd / len(words) < 0.05 and text.isascii()


def _paragraphs(text: str) -> Iterator[str]:
    for block in re.split(r"\n\s*\n", text):
        block = block.strip("\n")
        if block and _is_prose(block):
            yield " ".join(line.strip() for line in block.splitlines())


def _docstrings(source: str) -> Iterator[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                yield doc


def _stdlib_files(stdlib: Path) -> list[Path]:
    skip = {"test", "tests", "idlelib", "lib2to3", "site-packages", "turtledemo", "pydoc_data"}
    files = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if skip.intersection(rel.parts) or rel.parts[0].startswith("config-"):
            continue
        files.append(path)
    return files


def _psf_license(stdlib: Path) -> str:
    """The PSF License Agreement section of CPython's LICENSE.txt, as '#' comment lines."""
    text = (stdlib / "LICENSE.txt").read_text(encoding="utf-8")
    start = text.index("PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2")
    end = text.index("BEOPEN.COM LICENSE AGREEMENT", start)
    lines = text[start:end].strip().splitlines()
    return "".join(f"# {line}".rstrip() + "\n" for line in lines)


def make_corpus(stdlib_dir: Path | None = None, max_chars: int = 1_200_000) -> str:
    """Re-create the text of ``corpus.txt`` from the interpreter's standard library."""
    stdlib = stdlib_dir or Path(sysconfig.get_paths()["stdlib"])
    header = CORPUS_HEADER + _psf_license(stdlib)
    topics_ns: dict[str, Any] = {}
    exec((stdlib / "pydoc_data" / "topics.py").read_text(encoding="utf-8"), topics_ns)
    sources = [topics_ns["topics"][key] for key in sorted(topics_ns["topics"])]
    for path in _stdlib_files(stdlib):
        sources.extend(_docstrings(path.read_text(encoding="utf-8", errors="replace")))
    seen: set[str] = set()
    kept: list[str] = []
    total = 0
    for text in sources:
        for para in _paragraphs(text):
            if para in seen:
                continue
            seen.add(para)
            kept.append(para)
            total += len(para) + 2
            if total >= max_chars:
                return header + "\n" + "\n\n".join(kept) + "\n"
    return header + "\n" + "\n\n".join(kept) + "\n"


def load_corpus(path: Path = CORPUS_PATH) -> list[str]:
    """The corpus paragraphs (header comment lines dropped)."""
    text = path.read_text(encoding="utf-8")
    body = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    return [p.strip() for p in body.split("\n\n") if p.strip()]
