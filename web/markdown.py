"""Model answers as safe Markdown: escape everything first, then allow a tiny subset.

The subset: fenced code blocks, inline code, bold, italics, bullet and numbered lists,
headings (shown as bold lines), paragraphs and line breaks. No links, images or raw HTML.

Why not a Markdown library: the design fixes the dependency list, and the guarantee that
model output can never inject markup is easiest to see here: every piece of input text goes
through ``markupsafe.escape`` before anything else, and the only tags in the output are the
fixed literals below (no attribute ever carries input text).
"""

from __future__ import annotations

import re
from collections.abc import Generator, Iterator

from markupsafe import Markup, escape

_FENCE = re.compile(r"^\s{0,3}(```|~~~)")
_BULLET = re.compile(r"^\s{0,3}[-*+]\s+(.*)$")
_NUMBER = re.compile(r"^\s{0,3}\d{1,9}[.)]\s+(.*)$")
_HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
_BOLD = re.compile(r"\*\*(?=\S)(.+?)(?<=\S)\*\*|(?<!\w)__(?=\S)(.+?)(?<=\S)__(?!\w)")
_ITALIC = re.compile(r"(?<![\w*])\*(?=\S)(.+?)(?<=\S)\*(?![\w*])|(?<!\w)_(?=\S)(.+?)(?<=\S)_(?!\w)")


def render(text: str) -> Markup:
    """Safe HTML for ``text`` (model output or a user's message)."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return Markup("".join(_blocks(lines)))


def _blocks(lines: list[str]) -> Iterator[str]:
    i = 0
    para: list[str] = []
    while i < len(lines):
        line = lines[i]
        fence = _FENCE.match(line)
        if fence:
            yield from _paragraph(para)
            para = []
            code: list[str] = []
            i += 1
            while i < len(lines) and not lines[i].lstrip().startswith(fence.group(1)):
                code.append(lines[i])
                i += 1
            i += 1  # the closing fence (or the end of an unfinished answer)
            yield f"<pre><code>{escape(chr(10).join(code))}</code></pre>"
            continue
        if _BULLET.match(line) or _NUMBER.match(line):
            yield from _paragraph(para)
            para = []
            i = yield from _list(lines, i)
            continue
        heading = _HEADING.match(line)
        if heading:
            yield from _paragraph(para)
            para = []
            yield f'<p class="md-h"><strong>{_inline(heading.group(1))}</strong></p>'
        elif line.strip():
            para.append(line.strip())
        else:
            yield from _paragraph(para)
            para = []
        i += 1
    yield from _paragraph(para)


def _paragraph(lines: list[str]) -> Iterator[str]:
    if lines:
        yield "<p>" + "<br>".join(_inline(line) for line in lines) + "</p>"


def _list(lines: list[str], i: int) -> Generator[str, None, int]:
    """Consecutive items of one kind; a following indented line continues an item."""
    kind = _BULLET if _BULLET.match(lines[i]) else _NUMBER
    tag = "ul" if kind is _BULLET else "ol"
    items: list[str] = []
    while i < len(lines):
        m = kind.match(lines[i])
        if m:
            items.append(m.group(1).strip())
        elif lines[i].startswith((" ", "\t")) and lines[i].strip() and items:
            items[-1] += " " + lines[i].strip()
        else:
            break
        i += 1
    yield f"<{tag}>" + "".join(f"<li>{_inline(item)}</li>" for item in items) + f"</{tag}>"
    return i


def _inline(text: str) -> str:
    """Code spans verbatim (escaped); bold and italics elsewhere (escaped first)."""
    out: list[str] = []
    pos = 0
    for m in _CODE_SPAN.finditer(text):
        out.append(_emphasis(text[pos:m.start()]))
        out.append(f"<code>{escape(m.group(2).strip())}</code>")
        pos = m.end()
    out.append(_emphasis(text[pos:]))
    return "".join(out)


def _emphasis(text: str) -> str:
    safe = str(escape(text))
    safe = _BOLD.sub(lambda m: f"<strong>{m.group(1) or m.group(2)}</strong>", safe)
    return _ITALIC.sub(lambda m: f"<em>{m.group(1) or m.group(2)}</em>", safe)
