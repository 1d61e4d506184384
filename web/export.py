"""A conversation as a file to keep: Markdown to read, JSON for programs. Only its owner
can fetch it (another person's conversation is a 404, as everywhere else)."""

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
from web.common import me, services


def _export(svc: Services, user_id: int, cid: int) -> dict[str, Any]:
    with svc.store.read_sessions() as s:
        c = convs.get_conversation(s, user_id, cid)
        if c is None:
            raise NotFound("conversation not found")
        return {"id": c.id, "title": c.title, "created_at": c.created_at,
                "updated_at": c.updated_at, "model": svc.model.name,
                "messages": [{"role": m.role, "content": m.content,
                              "created_at": m.created_at,
                              "finish_reason": m.finish_reason}
                             for m in convs.list_messages(s, user_id, cid)]}


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
    for m in data["messages"]:
        out += [f"## {who if m['role'] == 'user' else data['model']}", "",
                m["content"].strip() or "*(no words)*", ""]
        if m["finish_reason"] in NOTES:
            out += [f"*{NOTES[m['finish_reason']]}*", ""]
    return "\n".join(out)


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
