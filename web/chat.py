"""Chat pages: conversations, sending a message, the answer streamed over SSE, stop.

How a token reaches the browser: ``send`` submits the request to the engine (so busy and
over-quota answer at once, as 503/429 notices) and returns the user's message plus an
answer bubble that opens ``/chat/streams/<sid>``; that stream relays each token as an
escaped text fragment (htmx appends it), then a ``done`` event with the whole answer as
safe Markdown. Stop, a closed tab or a vanished stream cancel the request in the engine.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
from litestar import Request, Response, get, post
from litestar.params import FromPath, FromQuery
from litestar.response import Redirect, Template
from markupsafe import escape

from appliance.api.errors import bad_request
from appliance.api.schemas import ChatMessage, SamplingFields
from appliance.api.service import Services, chat_prompt, submit
from appliance.engine.request import FinishEvent, TokenEvent
from appliance.sched.classes import Klass
from appliance.store import conversations as convs
from appliance.store.errors import NotFound
from web import sse
from web.common import PAGE, base_context, form_fields, is_htmx, me, page, services, web_state
from web.state import LiveAnswer, WebState

MAX_MESSAGE_CHARS = 16_000
TITLE_CHARS = 60
ENDPOINT = "/chat/send"
"""The endpoint name chat requests carry into the ledger."""


@dataclass(frozen=True, slots=True)
class ConvView:
    id: int
    title: str


@dataclass(frozen=True, slots=True)
class MessageView:
    role: str
    content: str


def _load(svc: Services, user_id: int, cid: int | None
          ) -> tuple[list[ConvView], ConvView | None, list[MessageView]]:
    with svc.store.read_sessions() as s:
        listed = [ConvView(c.id, c.title) for c in convs.list_conversations(s, user_id)]
        if cid is None:
            return listed, None, []
        c = convs.get_conversation(s, user_id, cid)
        if c is None:
            raise NotFound("conversation not found")
        messages = [MessageView(m.role, m.content) for m in convs.list_messages(s, user_id, cid)]
        return listed, ConvView(c.id, c.title), messages


@get("/", opt=PAGE)
async def home() -> Redirect:
    return Redirect("/chat", status_code=303)


@get("/chat", opt=PAGE)
async def chat_new(request: Request[Any, Any, Any]) -> Template:
    listed, _, _ = await anyio.to_thread.run_sync(_load, services(request), me(request).user_id,
                                                  None)
    return page(request, "chat.html", conversations=listed, current=None, messages=[])


@get("/chat/{cid:int}", opt=PAGE)
async def chat_page(request: Request[Any, Any, Any], cid: FromPath[int]) -> Template:
    listed, current, messages = await anyio.to_thread.run_sync(
        _load, services(request), me(request).user_id, cid)
    return page(request, "chat.html", conversations=listed, current=current,
                messages=messages)


@get("/chat/list")
async def chat_list(request: Request[Any, Any, Any],
                    current: FromQuery[int | None] = None) -> Template:
    if current is None:  # htmx says which page asks: /chat/<id> marks that conversation
        found = re.search(r"/chat/(\d+)$", request.headers.get("hx-current-url", ""))
        current = int(found.group(1)) if found else None
    listed, _, _ = await anyio.to_thread.run_sync(_load, services(request), me(request).user_id,
                                                  None)
    return page(request, "_conversations.html", conversations=listed,
                current=ConvView(current, "") if current else None)


def _history(svc: Services, user_id: int, cid: int | None) -> list[MessageView]:
    if cid is None:
        return []
    return _load(svc, user_id, cid)[2]


def _save_question(svc: Services, user_id: int, cid: int | None, text: str) -> tuple[int, bool]:
    """Store the user's message (in a new conversation when ``cid`` is None)."""
    with svc.store.sessions.begin() as s:
        created = cid is None
        if cid is None:
            title = " ".join(text.split())[:TITLE_CHARS]
            cid = convs.create_conversation(s, user_id, title).id
        convs.add_message(s, user_id, cid, "user", text)
        return cid, created


@post("/chat/send")
async def send(request: Request[Any, Any, Any]) -> Template:
    svc, who = services(request), me(request)
    fields = await form_fields(request)
    text = fields.get("message", "").strip()
    if not text:
        raise bad_request("Type a message first.", param="message")
    if len(text) > MAX_MESSAGE_CHARS:
        raise bad_request(f"Messages are limited to {MAX_MESSAGE_CHARS} characters.",
                          param="message")
    cid = int(fields["conversation"]) if fields.get("conversation", "").isdigit() else None
    history = await anyio.to_thread.run_sync(_history, svc, who.user_id, cid)
    turns = [ChatMessage(role=m.role, content=m.content) for m in history]
    turns.append(ChatMessage(role="user", content=text))
    prompt = chat_prompt(svc.model.tokenizer, turns)
    klass = min(who.klass, Klass.INTERACTIVE)  # the browser chats; voice is for assistants
    # submit() checks the user's quotas (429) and clamps the default max_tokens to them
    gen = await submit(svc, prompt, SamplingFields(), None, who, klass, ENDPOINT)
    try:
        saved, created = await anyio.to_thread.run_sync(_save_question, svc, who.user_id, cid,
                                                        text)
    except BaseException:
        gen.close()
        raise
    sid = web_state(request).add_answer(LiveAnswer(gen, who.user_id, saved))
    headers = {"HX-Push-Url": f"/chat/{saved}",
               "HX-Trigger-After-Settle": "conversations-changed"} \
        if created else {}
    return page(request, "_exchange.html", headers=headers, question=text, sid=sid,
                cid=saved, title=" ".join(text.split())[:TITLE_CHARS] if created else None)


@get("/chat/streams/{sid:str}")
async def answer_stream(request: Request[Any, Any, Any], sid: FromPath[str]) -> Response[Any]:
    ws = web_state(request)
    answer = ws.connect(sid, me(request).user_id)
    if answer is None:  # unknown, someone else's, finished or already open: stop retrying
        return Response(b"", status_code=204)
    return sse.stream(_answer_events(ws, sid, answer, request.app.template_engine,
                                     base_context(request)))


async def _answer_events(ws: WebState, sid: str, answer: LiveAnswer, templates: Any,
                         ctx: dict[str, Any]) -> AsyncIterator[bytes]:
    parts: list[str] = []
    finish: FinishEvent | None = None
    try:
        async for event in answer.gen.events():
            if isinstance(event, TokenEvent):
                if event.text:
                    parts.append(event.text)
                    yield sse.event("token", str(escape(event.text)))
            else:
                finish = event
                parts.append(event.text)
        html = templates.get_template("_answer.html").render(
            **ctx, content="".join(parts), reason=finish.reason if finish else "cancelled",
            error=finish.error if finish else None)
        yield sse.event("done", html)
    finally:
        ws.done(sid)
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(_save_answer, ws.services, answer,
                                           "".join(parts), finish)


def _save_answer(svc: Services, answer: LiveAnswer, text: str,
                 finish: FinishEvent | None) -> None:
    """Keep what was said, even when stopped; an answer that failed is not kept."""
    if not text or (finish is not None and finish.reason == "error"):
        return
    usage = finish.usage if finish is not None else None
    try:
        with svc.store.sessions.begin() as s:
            convs.add_message(s, answer.user_id, answer.conversation_id, "assistant", text,
                              prompt_tokens=usage.prompt_tokens if usage else None,
                              output_tokens=usage.completion_tokens if usage else None)
    except NotFound:  # the conversation was deleted meanwhile
        pass


@post("/chat/streams/{sid:str}/stop", status_code=204)
async def stop(request: Request[Any, Any, Any], sid: FromPath[str]) -> None:
    """Cancel the answer in the engine; its stream then ends with what was said so far.
    Stopping an answer that is gone (or not yours) does nothing."""
    web_state(request).stop(sid, me(request).user_id)


def _delete(svc: Services, user_id: int, cid: int) -> None:
    with svc.store.sessions.begin() as s:
        convs.delete_conversation(s, user_id, cid)


@post("/chat/{cid:int}/delete", status_code=200)
async def delete(request: Request[Any, Any, Any], cid: FromPath[int]) -> Response[Any]:
    await anyio.to_thread.run_sync(_delete, services(request), me(request).user_id, cid)
    if is_htmx(request):
        return Response(b"", headers={"HX-Redirect": "/chat"})
    return Redirect("/chat", status_code=303)


ROUTES = [home, chat_new, chat_page, chat_list, send, answer_stream, stop, delete]
