"""Where the web UI's files are, and the vendored scripts with their integrity hashes."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

WEB = Path(__file__).resolve().parent
STATIC = WEB / "static"
VENDOR_LOCK = STATIC / "vendor" / "vendor.json"
"""Written by ``scripts/vendor_assets.sh``: package, version, file, sha384."""


@dataclass(frozen=True, slots=True)
class Script:
    src: str
    integrity: str


@functools.cache
def vendor_scripts() -> tuple[Script, ...]:
    """htmx first, then its SSE extension (the order the browser must load them in), then
    highlight.js for code blocks in answers."""
    lock = json.loads(VENDOR_LOCK.read_text())
    order = ("htmx.org", "htmx-ext-sse", "@highlightjs/cdn-assets")
    return tuple(Script(f"/static/vendor/{lock[name]['file']}", lock[name]["integrity"])
                 for name in order)
