"""Number and time formatting for the templates (``h`` in every template's context)."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from types import SimpleNamespace

from appliance.vocab import DAY_S
from web import markdown


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "—"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def fmt_ms(ms: float | None) -> str:
    if ms is None:
        return "—"
    return f"{ms / 1000:.2f} s" if ms >= 1000 else f"{ms:.0f} ms"


def fmt_num(n: float | None) -> str:
    if n is None:
        return "—"
    if isinstance(n, float) and not n.is_integer():
        return f"{n:,.1f}"
    return f"{int(n):,}"


def fmt_secs(s: float | None) -> str:
    if s is None:
        return "—"
    if s < 60:
        return f"{s:.1f} s"
    m, sec = divmod(int(s), 60)
    return f"{m} min {sec:02d} s" if m < 60 else f"{m // 60} h {m % 60:02d} min"


def fmt_when(t: float | None) -> str:
    if t is None:
        return "never"
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def fmt_pct(p: float) -> str:
    """A share that is small but not nothing reads "0.3 %", not "0 %"."""
    if p <= 0:
        return "0 %"
    return f"{p:.1f} %" if p < 10 else f"{p:.0f} %"


def fmt_iso(t: float | None) -> str:
    return "" if t is None else time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t))


@dataclass(frozen=True, slots=True)
class Attached:
    """A question with a file's text after it, as the bubble shows it: collapsed."""

    question: str
    name: str
    chars: int
    text: str


_ATTACHED = re.compile(r"\n\nAttached file “(?P<name>[^”\n]*)”"
                       r"(?: \((?P<n>[\d,]+) characters\))?[:,]\s*(?P<text>.*)", re.DOTALL)


def attached(content: str) -> Attached | None:
    """The question and its attached file (``web.chat`` writes the file's text, ``web.attach``
    the size and what its reading left); None for a question without one."""
    found = _ATTACHED.search(content)
    if found is None:
        return None
    text = found.group("text")
    chars = int(found.group("n").replace(",", "")) if found.group("n") else len(text)
    return Attached(content[:found.start()], found.group("name"), chars, text)


def fmt_clock(t: float | None, now: float | None = None) -> str:
    """When a message was written: "14:05" today, "3 Mar 14:05" before."""
    if t is None:
        return ""
    now = time.time() if now is None else now
    when = time.localtime(t)
    if time.localtime(now)[:3] == when[:3]:
        return time.strftime("%H:%M", when)
    return f"{when.tm_mday} {time.strftime('%b %H:%M', when)}"


def fmt_day(t: float | None, now: float | None = None) -> str:
    """When, as a list shows it: "14:05" today, "Yesterday", "Mon" this week, "3 Mar"."""
    if t is None:
        return ""
    now = time.time() if now is None else now
    when, today = time.localtime(t), time.localtime(now)
    days = (time.mktime(today[:3] + (0, 0, 0, 0, 0, -1)) -
            time.mktime(when[:3] + (0, 0, 0, 0, 0, -1))) / DAY_S
    if days < 0.5:
        return time.strftime("%H:%M", when)
    if days < 1.5:
        return "Yesterday"
    if days < 6.5:
        return time.strftime("%a", when)
    return time.strftime("%-d %b" if when.tm_year == today.tm_year else "%-d %b %Y", when)


def percent(part: float | None, whole: float | None) -> int:
    if not part or not whole:
        return 0
    return max(0, min(100, round(100 * part / whole)))


HELPERS = SimpleNamespace(md=markdown.render, bytes=fmt_bytes, ms=fmt_ms, num=fmt_num,
                          secs=fmt_secs, when=fmt_when, percent=percent, iso=fmt_iso, pct=fmt_pct,
                          day=fmt_day, clock=fmt_clock,
                          attached=attached)
