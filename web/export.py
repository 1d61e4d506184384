"""A conversation as a file to keep: Markdown to read, JSON for programs. Only its owner
can fetch it (another person's conversation is a 404, as everywhere else). The branch
shown comes first; every branch an edit left behind follows it, so nothing is missing."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import anyio
from litestar import Request, Response, get
from litestar.params import FromPath

from appliance.service.services import Services
from appliance.store import conversations as convs
from appliance.store.errors import NotFound
from appliance.store.models import Message
from web.common import me, services


def _message(m: Message) -> dict[str, Any]:
    return {"id": m.id, "role": m.role, "content": m.content, "created_at": m.created_at,
            "finish_reason": m.finish_reason}


def other_branches(messages: list[Message]) -> list[tuple[Message | None, list[Message]]]:
    """The branches besides the one shown, each as (the turn it follows, its turns): one
    for every question that was edited away, following the turns it kept; every message
    is in the branch shown or in exactly one of these."""
    shown = {m.id for m in convs.branch(messages)}
    by_id = {m.id: m for m in messages}
    out, starts = [], [m for m in messages if m.id not in shown]
    taken: set[int] = set(shown)
    for start in starts:
        if start.id in taken:
            continue
        turns = convs.branch(messages, start)
        taken.update(t.id for t in turns)
        out.append((by_id.get(start.parent_id) if start.parent_id else None, turns))
    return out


def _export(svc: Services, user_id: int, cid: int) -> dict[str, Any]:
    with svc.store.read_sessions() as s:
        c = convs.get_conversation(s, user_id, cid)
        if c is None:
            raise NotFound("conversation not found")
        everything = convs.all_messages(s, user_id, cid)
        return {"id": c.id, "title": c.title, "created_at": c.created_at,
                "updated_at": c.updated_at, "model": svc.model.name,
                "messages": [_message(m) for m in convs.branch(everything)],
                "other_branches": [{"after": after.id if after else None,
                                    "messages": [_message(m) for m in turns]}
                                   for after, turns in other_branches(everything)]}


def _filename(title: str, cid: int, ext: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", title).strip("-").lower()[:60]
    return f"{slug or 'conversation'}-{cid}.{ext}"


NOTES = {"length": "(The answer reached its length limit.)", "cancelled": "(Stopped.)",
         "quota": "(The daily quota ran out; the answer was cut short.)"}


def markdown(data: dict[str, Any], who: str) -> str:
    """The conversation as Markdown: the title, then each turn under the speaker's name."""
    day = time.strftime("%Y-%m-%d %H:%M", time.localtime(data["updated_at"]))
    out = [f"# {data['title'] or 'Untitled'}", "", f"*Exported from the appliance; last "
           f"activity {day}.*", ""]
    out += _turns(data["messages"], who, data["model"])
    for n, other in enumerate(data.get("other_branches", []), 1):
        after = next((i for i, m in enumerate(_all(data), 1) if m["id"] == other["after"]),
                     None)
        where = f"after message {after}" if after else "from the start"
        out += ["---", "", f"# Other branch {n} ({where})", "",
                "*A question was edited; this is the conversation as it went before.*", ""]
        out += _turns(other["messages"], who, data["model"])
    return "\n".join(out)


def _all(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Messages in the order the file lists them (to say where a branch starts)."""
    return [*data["messages"], *(m for b in data.get("other_branches", [])
                                 for m in b["messages"])]


def _turns(messages: list[dict[str, Any]], who: str, model: str) -> list[str]:
    out: list[str] = []
    for m in messages:
        out += [f"## {who if m['role'] == 'user' else model}", "",
                m["content"].strip() or "*(no words)*", ""]
        if m["finish_reason"] in NOTES:
            out += [f"*{NOTES[m['finish_reason']]}*", ""]
    return out


@get("/chat/{cid:int}/export.md")
async def export_markdown(request: Request[Any, Any, Any], cid: FromPath[int]) -> Response[str]:
    who = me(request)
    data = await anyio.to_thread.run_sync(_export, services(request), who.user_id, cid)
    return Response(markdown(data, who.name), media_type="text/markdown; charset=utf-8",
                    headers={"Content-Disposition": "attachment; filename="
                             f"\"{_filename(data['title'], cid, 'md')}\""})


@get("/chat/{cid:int}/export.json")
async def export_json(request: Request[Any, Any, Any], cid: FromPath[int]) -> Response[bytes]:
    data = await anyio.to_thread.run_sync(_export, services(request), me(request).user_id, cid)
    body = json.dumps(data, ensure_ascii=False, indent=2).encode()
    return Response(body, media_type="application/json",
                    headers={"Content-Disposition": "attachment; filename="
                             f"\"{_filename(data['title'], cid, 'json')}\""})


ROUTES = [export_markdown, export_json]
