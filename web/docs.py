"""The project's docs/ pages, served to signed-in people so that a "see docs/jobs.md" on a
page is a link that opens (docs/decisions/docs-pages.md). Only ``docs/NAME.md``
files, by name; rendered without raw HTML or images; relative links stay relative, so one
page's ``jobs.md`` opens ``/docs/jobs.md``."""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import anyio
from litestar import Request, get
from litestar.exceptions import NotFoundException
from litestar.params import FromPath
from litestar.response import Template
from markdown_it import MarkdownIt
from markupsafe import Markup

from web.common import PAGE, page

DOCS = Path(__file__).resolve().parent.parent / "docs"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*\.md$")

_md = MarkdownIt("commonmark", {"html": False}).enable("table").disable("image")


@lru_cache(maxsize=32)
def _render(path: Path, mtime: float) -> tuple[str, Markup]:
    text = path.read_text(encoding="utf-8")
    title = next((line.lstrip("# ").strip() for line in text.splitlines()
                  if line.startswith("# ")), path.stem)
    return title, Markup(_md.render(text))  # noqa: S704 - markdown-it escapes; no raw HTML


def doc_page(name: str) -> tuple[str, Markup]:
    """A docs page's title and HTML; NotFoundException for anything but docs/NAME.md."""
    path = DOCS / name
    if not NAME.match(name) or not path.is_file():
        raise NotFoundException(f"There is no page docs/{name}.")
    return _render(path, path.stat().st_mtime)


@get("/docs/{name:str}", opt=PAGE)
async def docs_page(request: Request[Any, Any, Any], name: FromPath[str]) -> Template:
    title, html = await anyio.to_thread.run_sync(doc_page, name)
    return page(request, "docs.html", title=title, html=html, name=name)


ROUTES = [docs_page]
