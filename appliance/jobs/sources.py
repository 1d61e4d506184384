"""What a job reads: pasted text, a fetched page or feed, or the owner's recent chats.

HTML becomes text with trafilatura (main content, no menus); feeds are parsed by
feedparser, and only items not seen by an earlier run are used (their ids are the job's
``cursor``, saved when a run succeeds). Every source is capped at ``document_max_bytes``.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

import feedparser
import trafilatura
from sqlalchemy import select
from sqlalchemy.orm import Session

from appliance.jobs.fetch import Fetched, FetchError
from appliance.store.models import Conversation, Message

SEEN_KEEP = 2000
FEED_TYPES = ("rss", "atom", "xml")


class SourceError(Exception):
    """The source could not be read; the message is the run's recorded reason."""


@dataclass(slots=True)
class Document:
    text: str
    kind: str  # text | html | feed | conversations
    items: int = 0
    cursor: dict[str, Any] = field(default_factory=dict)
    """The job's cursor to save once the run succeeds (empty: leave it as it is)."""


def looks_like_html(text: str) -> bool:
    head = text.lstrip()[:512].lower()
    return head.startswith(("<!doctype html", "<html")) or "<body" in head or "<p>" in head


def html_to_text(html: str) -> str:
    text = trafilatura.extract(html, include_comments=False, include_tables=True,
                               favor_recall=True)
    if not text:  # pages with almost no prose: take every text node rather than nothing
        text = trafilatura.html2txt(html) or ""
    return text.strip()


def cap(text: str, max_bytes: int) -> str:
    data = text.encode()
    if len(data) <= max_bytes:
        return text
    raise SourceError(f"the document is {len(data)} bytes, over the {max_bytes}-byte limit "
                      "(jobs.document_max_bytes)")


def from_text(source: str, max_bytes: int) -> Document:
    if looks_like_html(source):
        return Document(cap(html_to_text(source), max_bytes), "html")
    return Document(cap(source.strip(), max_bytes), "text")


def _is_feed(fetched: Fetched) -> bool:
    ctype = fetched.content_type.lower()
    if any(t in ctype for t in FEED_TYPES):
        return True
    head = fetched.body[:512].lstrip().lower()
    return head.startswith(b"<?xml") or head.startswith((b"<rss", b"<feed"))


def _entry_id(entry: Any) -> str:
    return str(entry.get("id") or entry.get("link") or entry.get("title") or "")[:500]


def feed_document(body: bytes, cursor: dict[str, Any], max_bytes: int) -> Document:
    parsed = feedparser.parse(body)
    if parsed.bozo and not parsed.entries:
        raise SourceError("the feed could not be parsed: "
                          f"{type(parsed.get('bozo_exception')).__name__}")
    seen = list(cursor.get("seen", []))
    known = set(seen)
    parts: list[str] = []
    new_ids: list[str] = []
    for entry in parsed.entries:
        eid = _entry_id(entry)
        if not eid or eid in known:
            continue
        new_ids.append(eid)
        summary = entry.get("summary") or ""
        if entry.get("content"):
            summary = entry["content"][0].get("value") or summary
        body_text = html_to_text(summary) if "<" in summary else summary.strip()
        when = entry.get("published") or entry.get("updated") or ""
        parts.append(f"## {entry.get('title', '(untitled)')}\n{when}\n{body_text}".strip())
    title = parsed.feed.get("title", "")
    text = (f"# {title}\n\n" if title and parts else "") + "\n\n".join(parts)
    return Document(cap(text, max_bytes), "feed", len(parts),
                    {"seen": (seen + new_ids)[-SEEN_KEEP:]})


def from_fetched(fetched: Fetched, cursor: dict[str, Any], max_bytes: int) -> Document:
    if not 200 <= fetched.status < 300:
        raise FetchError(f"the server answered HTTP {fetched.status}")
    if _is_feed(fetched):
        return feed_document(fetched.body, cursor, max_bytes)
    text = fetched.body.decode("utf-8", errors="replace")
    if "html" in fetched.content_type.lower() or looks_like_html(text):
        return Document(cap(html_to_text(text), max_bytes), "html")
    if "json" in fetched.content_type.lower():  # e.g. Home Assistant's /api/logbook
        with contextlib.suppress(ValueError):
            text = json.dumps(json.loads(text), indent=1, ensure_ascii=False)
    return Document(cap(text.strip(), max_bytes), "text")


def conversations_since(session: Session, user_id: int, since: float, until: float,
                        max_bytes: int) -> Document:
    """The owner's messages written in ``(since, until]``, grouped by conversation."""
    rows = session.execute(
        select(Conversation.title, Message.conversation_id, Message.role, Message.content)
        .join(Conversation, Conversation.id == Message.conversation_id)
        .where(Conversation.user_id == user_id, Message.created_at > since,
               Message.created_at <= until)
        .order_by(Message.conversation_id, Message.id)).all()
    parts: list[str] = []
    current = None
    for title, cid, role, content in rows:
        if cid != current:
            parts.append(f"\n## Conversation: {title or 'untitled'}")
            current = cid
        parts.append(f"{role}: {content}")
    return Document(cap("\n".join(parts).strip(), max_bytes), "conversations",
                    len({r[1] for r in rows}), {"since": until})
