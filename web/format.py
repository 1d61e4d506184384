"""Number and time formatting for the templates (``h`` in every template's context)."""

from __future__ import annotations

import time
from types import SimpleNamespace

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


def percent(part: float | None, whole: float | None) -> int:
    if not part or not whole:
        return 0
    return max(0, min(100, round(100 * part / whole)))


HELPERS = SimpleNamespace(md=markdown.render, bytes=fmt_bytes, ms=fmt_ms, num=fmt_num,
                          secs=fmt_secs, when=fmt_when, percent=percent)
