"""Model answers as safe Markdown, rendered by markdown-it-py (CommonMark + tables).

Safety comes from the library's own switches, not from our parsing:
- raw HTML is off (``html=False``): any tag in the text is shown as text;
- images are off (``![x](y)`` stays text: an answer never makes the browser fetch anything);
- a link is a link only to ``http:``, ``https:`` or ``mailto:`` (never ``javascript:``,
  ``data:`` or ``file:``), and opens with ``rel="noopener noreferrer"`` in a new tab;
- code blocks keep their language as a ``language-*`` class, which the page's vendored
  highlight.js colours (its own file, no inline script; the CSP stays strict).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from markdown_it import MarkdownIt
from markdown_it.token import Token
from markupsafe import Markup

SAFE_LINK = re.compile(r"^(https?:|mailto:)", re.I)


def _validate_link(url: str) -> bool:
    return bool(SAFE_LINK.match(url.strip()))


def _link_open(renderer: Any, tokens: Sequence[Token], idx: int, options: Any,
               env: Any) -> str:
    token = tokens[idx]
    token.attrSet("rel", "noopener noreferrer")
    token.attrSet("target", "_blank")
    return str(renderer.renderToken(tokens, idx, options, env))


def _build() -> MarkdownIt:
    md = MarkdownIt("commonmark", {"html": False, "linkify": False, "typographer": False})
    md.enable(["table", "strikethrough"])
    md.disable(["image", "html_inline", "html_block"])
    md.validateLink = _validate_link  # type: ignore[method-assign]
    md.add_render_rule("link_open", _link_open)
    return md


_MD = _build()


def render(text: str) -> Markup:
    """Safe HTML for ``text`` (model output or a user's message)."""
    return Markup(_MD.render(text))
