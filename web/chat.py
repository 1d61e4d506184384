"""Chat pages: conversations, sending a message, the answer streamed over SSE, stop.

How a token reaches the browser: ``send`` submits the request to the engine (so busy and
over-quota answer at once, as 503/429 notices) and returns the user's message plus an
answer bubble that opens ``/chat/streams/<sid>``; that stream relays each token as an
escaped text fragment (htmx appends it), then a ``done`` event with the whole answer as
safe Markdown. Stop, a closed tab or a vanished stream cancel the request in the engine.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any, cast

import anyio
from litestar import Request, Response, get, post
from litestar.params import FromPath, FromQuery
from litestar.response import Redirect, Template
from markupsafe import escape
from sqlalchemy.exc import DatabaseError

from appliance.api.errors import bad_request
from appliance.service.chat_format import Turn, text_chars, text_prompt
from appliance.service.checks import DEFAULTS, check_prompt_size
from appliance.service.engine_client import Event, FinishEvent, TokenEvent
from appliance.service.errors import InvalidRequest, OverQuota
from appliance.service.generation import Generation, off_loop, submit
from appliance.service.services import Services
from appliance.store import branches, preferences, versions
from appliance.store import conversations as convs
from appliance.store.errors import NotFound
from appliance.store.faults import storage_fault
from appliance.vocab import FinishReason, Klass
from web import attach, sse, titles
from web.common import PAGE, base_context, form_fields, is_htmx, me, page, services, web_state
from web.plain import PlainRefusal, plain_refusal, too_long
from web.state import LiveAnswer, WebState

log = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = 16_000
ENDPOINT = "/chat/send"
"""The endpoint name chat requests carry into the ledger."""


PAGE_SIZE = 50
"""Conversations per page of the list; scrolling to its end loads the next page."""


@dataclass(frozen=True, slots=True)
class ConvView:
    id: int
    title: str
    updated_at: float = 0.0
    snippet: tuple[str, str, str] | None = None
    """A search: the words around the match (before, match, after)."""


@dataclass(frozen=True, slots=True)
class MessageView:
    role: str
    content: str
    finish_reason: str | None = None
    id: int = 0
    place: versions.Place | None = None
    """An answer with earlier versions, or an edited question (a branch): which one is
    shown, of how many."""
    created_at: float | None = None
    speed: str = ""
    """An answer: how fast it was written (shown on hover)."""


def speed_text(output_tokens: int | None, seconds: float | None) -> str:
    """"31 tokens in 2.4 s (12.9 tokens/s)"; "" when not known."""
    if not output_tokens or not seconds or seconds <= 0:
        return ""
    plural = "s" if output_tokens != 1 else ""
    return (f"{output_tokens} token{plural} in {seconds:.1f} s "
            f"({output_tokens / seconds:.1f} tokens/s)")


@dataclass(frozen=True, slots=True)
class Listing:
    """One page of a person's conversations, newest activity first."""

    conversations: list[ConvView]
    query: str = ""
    next_offset: int | None = None
    """Where the next page starts; None at the end."""


def _listing(svc: Services, user_id: int, query: str = "", offset: int = 0) -> Listing:
    with svc.store.read_sessions() as s:
        if query.strip():
            found = convs.search_conversations(s, user_id, query, limit=PAGE_SIZE + 1,
                                               offset=offset)
        else:
            found = convs.list_conversations(s, user_id, limit=PAGE_SIZE + 1, offset=offset)
        listed = [ConvView(c.id, c.title, c.updated_at,
                           convs.find_snippet(s, c.id, query) if query.strip() else None)
                  for c in found[:PAGE_SIZE]]
        more = offset + PAGE_SIZE if len(found) > PAGE_SIZE else None
        return Listing(listed, query.strip(), more)


def _load(svc: Services, user_id: int, cid: int | None
          ) -> tuple[Listing, ConvView | None, list[MessageView]]:
    listed = _listing(svc, user_id)
    if cid is None:
        return listed, None, []
    with svc.store.read_sessions() as s:
        c = convs.get_conversation(s, user_id, cid)
        if c is None:
            raise NotFound("conversation not found")
        path = convs.list_messages(s, user_id, cid)
        shown = {**versions.places(s, cid), **branches.places(s, path)}
        messages = [MessageView(m.role, m.content, m.finish_reason, m.id, shown.get(m.id),
                                m.created_at, speed_text(m.output_tokens, m.seconds))
                    for m in path]
        return listed, ConvView(c.id, c.title, c.updated_at), messages


@get("/", opt=PAGE)
async def home() -> Redirect:
    return Redirect("/chat", status_code=303)


@get("/chat", opt=PAGE)
async def chat_new(request: Request[Any, Any, Any]) -> Template:
    listed, _, _ = await anyio.to_thread.run_sync(_load, services(request), me(request).user_id,
                                                  None)
    return page(request, "chat.html", listing=listed, current=None, messages=[])


@get("/chat/{cid:int}", opt=PAGE)
async def chat_page(request: Request[Any, Any, Any], cid: FromPath[int]) -> Template:
    listed, current, messages = await anyio.to_thread.run_sync(
        _load, services(request), me(request).user_id, cid)
    rid, r = web_state(request).reading_in(cid, me(request).user_id) or (None, None)
    return page(request, "chat.html", listing=listed, current=current,
                messages=messages, rid=rid, r=r)


@get("/chat/list")
async def chat_list(request: Request[Any, Any, Any],
                    current: FromQuery[int | None] = None, q: FromQuery[str] = "",
                    offset: FromQuery[int] = 0) -> Template:
    """The conversation list (``q``: search titles and messages); ``offset`` > 0: only the
    items of that page, for the infinite list."""
    if current is None:  # htmx says which page asks: /chat/<id> marks that conversation
        found = re.search(r"/chat/(\d+)$", request.headers.get("hx-current-url", ""))
        current = int(found.group(1)) if found else None
    listed = await anyio.to_thread.run_sync(_listing, services(request), me(request).user_id,
                                            q[:200], max(offset, 0))
    return page(request, "_conv_items.html" if offset > 0 else "_conversations.html",
                listing=listed, current=ConvView(current, "") if current else None)


def _history(svc: Services, user_id: int, cid: int | None
             ) -> tuple[str, list[MessageView]]:
    """The system prompt (the person's own or the household's) and the conversation so far."""
    with svc.store.read_sessions() as s:
        system = preferences.system_prompt_for(s, user_id)
    return system, ([] if cid is None else _load(svc, user_id, cid)[2])


def model_turns(system: str, history: list[MessageView], text: str) -> list[Turn]:
    """What the model is sent: the system prompt, then strictly alternating turns. An
    answer stopped before its first word is left out, and a question left without an
    answer is joined to the next one, so two user turns never follow each other."""
    turns = [Turn("system", system)] if system else []
    for m in [*history, MessageView("user", text)]:
        if m.role == "assistant" and not m.content:
            continue
        if turns and turns[-1].role == m.role == "user":
            turns[-1] = Turn("user", f"{turns[-1].content}\n\n{m.content}")
            continue
        turns.append(Turn(m.role, m.content))
    return turns


def _title(question: str) -> str:
    """A new conversation's title until one is generated: the question, cut on a word."""
    return convs.cut_title(convs.question_text(question))


def _save_question(svc: Services, user_id: int, cid: int | None, text: str,
                   replace_from: int | None = None, edit_of: int | None = None
                   ) -> tuple[int, bool]:
    """Store the user's message (in a new conversation when ``cid`` is None); with
    ``replace_from``, first delete that message and the ones after it; with ``edit_of``,
    ask it on a new branch in place of that question (the old branch is kept)."""
    with svc.store.sessions.begin() as s:
        created = cid is None
        if cid is None:
            cid = convs.create_conversation(s, user_id, _title(text), auto_title=True).id
        elif edit_of is not None:
            branches.edit_question(s, user_id, cid, edit_of, text)
            return cid, created
        elif replace_from is not None:
            convs.delete_messages_from(s, user_id, cid, replace_from)
        if text:
            convs.add_message(s, user_id, cid, "user", text)
        return cid, created


def _with_attachment(fields: dict[str, str]) -> str:
    """The message with an attached file's text (read in the browser) after it."""
    text, attached = fields.get("message", "").strip(), fields.get("attachment", "").strip()
    if not attached or not text:
        return text
    name = " ".join(fields.get("attachment_name", "").split())[:120] or "file"
    if len(text) + len(attached) > MAX_MESSAGE_CHARS:
        raise bad_request(f"The attached file “{name}” is too long: {len(attached):,} "
                          f"characters, and a message with its file holds at most "
                          f"{MAX_MESSAGE_CHARS:,}.", param="attachment")
    return f"{text}\n\nAttached file “{name}”:\n\n{attached}"


def _checked(text: str) -> str:
    text = text.strip()
    if not text:
        raise bad_request("Type a message first.", param="message")
    if len(text) > MAX_MESSAGE_CHARS:
        raise bad_request(f"Messages are limited to {MAX_MESSAGE_CHARS} characters.",
                          param="message")
    return text


async def _start(request: Request[Any, Any, Any], cid: int | None, system: str,
                 before: list[MessageView], text: str, save: str,
                 replace_from: int | None = None, cont: MessageView | None = None,
                 again: MessageView | None = None, edit_of: int | None = None
                 ) -> tuple[str, int, bool]:
    """Submit ``before`` + the question ``text`` to the engine, then store what changed
    (``save``: the question, or "" when it is stored already). With ``cont``, an answer
    cut at its length limit, the model is given that answer's start to carry on from; with
    ``again``, the new answer takes that one's place and keeps it as an earlier version;
    with ``edit_of``, the question is a new branch beside that one. Returns the answer's
    stream id, the conversation and whether it was made now."""
    svc, who = services(request), me(request)
    turns = model_turns(system, before, text)
    try:
        check_prompt_size(svc.model, text_chars([t.content for t in turns]))
        prompt = await off_loop(svc, text_prompt, svc.model.tokenizer, turns)
        if cont is not None and cont.content:  # the answer so far, as the model's own words
            prompt = prompt + await off_loop(svc, _encode, svc.model.tokenizer, cont.content)
    except InvalidRequest as exc:
        raise too_long(exc, svc.model.ctx_limit) from None
    klass = min(who.klass, Klass.INTERACTIVE)  # the browser chats; voice is for assistants
    # submit() checks the user's quotas (429) and clamps the default max_tokens to them
    try:
        gen = await submit(svc, prompt, DEFAULTS, None, who, klass, ENDPOINT,
                           continues=cont is not None)
    except InvalidRequest as exc:
        raise too_long(exc, svc.model.ctx_limit) from None
    except OverQuota as exc:
        raise await plain_refusal(svc, who, exc, len(prompt)) from None
    try:
        saved, created = await anyio.to_thread.run_sync(_save_question, svc, who.user_id, cid,
                                                        save, replace_from, edit_of)
    except BaseException:
        gen.close()
        raise
    live = LiveAnswer(gen, who.user_id, saved, who=who)
    if cont is not None:
        live.prefix, live.rewrite = cont.content, cont.id
    elif again is not None:
        live.rewrite, live.keep_old = again.id, True
    return web_state(request).add_answer(live), saved, created


def _encode(tokenizer: Any, text: str) -> list[int]:
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


@post("/chat/send")
async def send(request: Request[Any, Any, Any]) -> Template:
    svc, who = services(request), me(request)
    fields = await form_fields(request)
    cid = int(fields["conversation"]) if fields.get("conversation", "").isdigit() else None
    attach.check_text(fields)
    if attach.needs_reading(fields, MAX_MESSAGE_CHARS):
        return await _read_first(request, fields, cid)
    text = _checked(_with_attachment(fields))
    system, history = await anyio.to_thread.run_sync(_history, svc, who.user_id, cid)
    try:
        sid, saved, created = await _start(request, cid, system, history, text, text)
    except PlainRefusal as exc:  # too long for the model with its file: read that first
        if exc.code != "context_length_exceeded" or not fields.get("attachment", "").strip():
            raise
        return await _read_first(request, fields, cid)
    # the list shows this conversation first now (newest activity first)
    headers = {"HX-Trigger-After-Settle": "conversations-changed"}
    if created:
        headers["HX-Push-Url"] = f"/chat/{saved}"
    title = _title(text)
    return page(request, "_exchange.html", headers=headers, question=text, sid=sid,
                cid=saved, current=ConvView(saved, title) if created else None,
                at=time.time())


async def _read_first(request: Request[Any, Any, Any], fields: dict[str, str],
                      cid: int | None) -> Template:
    """A question whose attached file is too long to send with it: the file is read in
    parts first (``web.attach``), then the question is answered from what was read."""
    svc, uid = services(request), me(request).user_id
    question = _checked(fields.get("message", ""))

    async def save(text: str) -> tuple[int, bool]:
        return await anyio.to_thread.run_sync(_save_question, svc, uid, cid, text)

    async def answer(saved: int) -> str:
        system, history = await anyio.to_thread.run_sync(_history, svc, uid, saved)
        q = _last_question(history)
        return (await _start(request, saved, system, history[:q], history[q].content, ""))[0]

    rid, r, saved, created = await attach.start(request, question, fields, save, answer)
    headers = {"HX-Trigger-After-Settle": "conversations-changed"}
    if created:
        headers["HX-Push-Url"] = f"/chat/{saved}"
    title = _title(question)
    return page(request, "_exchange.html", headers=headers, question=question, rid=rid, r=r,
                cid=saved, current=ConvView(saved, title) if created else None,
                at=time.time())


def _last_question(history: list[MessageView]) -> int:
    index = next((i for i in range(len(history) - 1, -1, -1)
                  if history[i].role == "user"), None)
    if index is None:
        raise bad_request("There is no question to answer again.")
    return index


@post("/chat/{cid:int}/regenerate")
async def regenerate(request: Request[Any, Any, Any], cid: FromPath[int]) -> Template:
    """Answer the last question again: a new answer streams, and takes the old one's place
    when it ends (the old one is kept as an earlier version, ``< 1/2 >``)."""
    svc, who = services(request), me(request)
    system, history = await anyio.to_thread.run_sync(_history, svc, who.user_id, cid)
    q = _last_question(history)
    if q + 2 == len(history) and history[q + 1].role == "assistant":  # kept as a version
        sid, _, _ = await _start(request, cid, system, history[:q], history[q].content, "",
                                 again=history[q + 1])
    elif q + 1 < len(history):
        sid, _, _ = await _start(request, cid, system, history[:q], history[q].content, "",
                                 replace_from=history[q + 1].id)
    else:
        sid, _, _ = await _start(request, cid, system, history[:q], history[q].content, "")
    return page(request, "_replay.html", messages=history[:q], question=history[q].content,
                sid=sid, cid=cid, current=None, qid=history[q].id, qplace=history[q].place,
                at=history[q].created_at,
                headers={"HX-Trigger-After-Settle": "conversations-changed"})


@post("/chat/{cid:int}/continue")
async def continue_answer(request: Request[Any, Any, Any], cid: FromPath[int]) -> Template:
    """Carry on an answer that stopped at its length limit: the model is given the answer
    so far and writes on; the new text is appended to the same answer."""
    svc, who = services(request), me(request)
    system, history = await anyio.to_thread.run_sync(_history, svc, who.user_id, cid)
    last = history[-1] if history else None
    if last is None or last.role != "assistant" or last.finish_reason != FinishReason.LENGTH:
        raise bad_request("Only an answer that stopped at its length limit can be continued.")
    q = _last_question(history)
    sid, _, _ = await _start(request, cid, system, history[:q], history[q].content, "",
                             cont=last)
    return page(request, "_continue.html", messages=history[:-1], prefix=last.content,
                sid=sid, cid=cid, current=None)


def _show(svc: Services, user_id: int, cid: int, mid: int, n: int) -> MessageView:
    with svc.store.sessions.begin() as s:
        m, place = versions.show_version(s, user_id, cid, mid, n)
        return MessageView(m.role, m.content, m.finish_reason, m.id, place, m.created_at,
                           speed_text(m.output_tokens, m.seconds))


@post("/chat/{cid:int}/answers/{mid:int}/show/{n:int}")
async def show_version(request: Request[Any, Any, Any], cid: FromPath[int],
                       mid: FromPath[int], n: FromPath[int]) -> Template:
    """Flip an answer to its version ``n``: that one is shown, and later turns follow it."""
    m = await anyio.to_thread.run_sync(_show, services(request), me(request).user_id, cid,
                                       mid, n)
    return page(request, "_answer.html", content=m.content, reason=m.finish_reason or "stop",
                error=None, cid=cid, mid=m.id, place=m.place, at=m.created_at, speed=m.speed)


def _flip(svc: Services, user_id: int, cid: int, qid: int, n: int) -> None:
    with svc.store.sessions.begin() as s:
        branches.show_branch(s, user_id, cid, qid, n)


@post("/chat/{cid:int}/questions/{qid:int}/show/{n:int}")
async def show_branch(request: Request[Any, Any, Any], cid: FromPath[int],
                      qid: FromPath[int], n: FromPath[int]) -> Template:
    """Flip an edited question to its version ``n``: the branch that starts there is shown,
    with its own later turns, and the title follows it."""
    svc, uid = services(request), me(request).user_id
    await anyio.to_thread.run_sync(_flip, svc, uid, cid, qid, n)
    _, current, messages = await anyio.to_thread.run_sync(_load, svc, uid, cid)
    return page(request, "_branch.html", messages=messages, cid=cid, current=current,
                headers={"HX-Trigger-After-Settle": "conversations-changed"})


@post("/chat/{cid:int}/edit")
async def edit(request: Request[Any, Any, Any], cid: FromPath[int]) -> Template:
    """Send an edited version of a question (``message_id``; the last one when absent): it
    is asked on a new branch beside the old one (which keeps its later turns, ``‹ 1/2 ›``),
    and answered."""
    svc, who = services(request), me(request)
    fields = await form_fields(request)
    text = _checked(fields.get("message", ""))
    system, history = await anyio.to_thread.run_sync(_history, svc, who.user_id, cid)
    wanted = fields.get("message_id", "")
    if wanted.isdigit():
        q = next((i for i, m in enumerate(history)
                  if m.id == int(wanted) and m.role == "user"), -1)
        if q < 0:
            raise NotFound("message not found")
    else:
        q = _last_question(history)
    text = _keep_file(history[q].content, text)
    sid, _, _ = await _start(request, cid, system, history[:q], text, text,
                             edit_of=history[q].id)
    _, current, messages = await anyio.to_thread.run_sync(_load, svc, who.user_id, cid)
    return page(request, "_replay.html", messages=messages[:q], question=text, sid=sid,
                cid=cid, current=current, qid=messages[q].id, qplace=messages[q].place,
                at=messages[q].created_at,
                headers={"HX-Trigger-After-Settle": "conversations-changed"})


def _keep_file(old: str, text: str) -> str:
    """An edited question keeps the file attached to the old one (the edit box shows the
    question only)."""
    file = old[len(convs.question_text(old)):]
    if not file or convs.ATTACHED in text:
        return text
    if len(text) + len(file) > MAX_MESSAGE_CHARS:
        raise bad_request(f"With its attached file the question would be longer than "
                          f"{MAX_MESSAGE_CHARS:,} characters.", param="message")
    return text + file


@get("/chat/streams/{sid:str}")
async def answer_stream(request: Request[Any, Any, Any], sid: FromPath[str]) -> Response[Any]:
    ws = web_state(request)
    answer = ws.connect(sid, me(request).user_id)
    if answer is None:  # unknown, someone else's, finished or already open: stop retrying
        return Response(b"", status_code=204)
    # the finished answer offers Copy and Regenerate (its conversation is known)
    ctx = {**base_context(request), "cid": answer.conversation_id}
    return sse.stream(_answer_events(ws, sid, answer, request.app.template_engine, ctx))


WAIT_POLL_S = 0.5
"""While an answer waits for a slot, how often its place in the queue is looked up."""


def waiting_text(ahead: int | None) -> str:
    """Where a waiting answer stands, from the scheduler's own order."""
    if ahead is None:
        return "Waiting for the model…"
    if ahead == 0:
        return "Next in line: the model is busy with other answers…"
    return f"{ahead} request{'s' if ahead != 1 else ''} ahead of you…"


async def _relay(gen: Generation) -> AsyncIterator[Event | str]:
    """The answer's events; before the first token, also its place in the queue as text
    (a new line whenever the place changes)."""
    events = cast(AsyncGenerator[Event, None], gen.events())
    told: str | None = None
    pending: asyncio.Task[Event] | None = None
    started = False
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(events))
            if started:
                await asyncio.wait({pending})
            else:
                await asyncio.wait({pending}, timeout=WAIT_POLL_S)
            if not pending.done():
                text = waiting_text(gen.ahead())
                if text != told:
                    told = text
                    yield text
                continue
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            started = started or isinstance(event, TokenEvent)
            yield event
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
        await events.aclose()


async def _answer_events(ws: WebState, sid: str, answer: LiveAnswer, templates: Any,
                         ctx: dict[str, Any]) -> AsyncIterator[bytes]:
    parts: list[str] = []
    finish: FinishEvent | None = None
    saved = False
    try:
        async for event in _relay(answer.gen):
            if isinstance(event, str):
                yield sse.event("wait", str(escape(event)))
            elif isinstance(event, TokenEvent):
                if answer.first_token_at is None:
                    answer.first_token_at = time.monotonic()
                if event.text:
                    parts.append(event.text)
                    yield sse.event("token", str(escape(event.text)))
            else:
                finish = event
                parts.append(event.text)
        answer.finished_at = time.monotonic()
        # stored before the page hears it ended, so a reload right after shows it
        with anyio.CancelScope(shield=True):
            view, first = await anyio.to_thread.run_sync(_save_answer, ws.services, answer,
                                                         "".join(parts), finish)
        saved = True
        naming = first is not None and titles.start(ws, answer, first)
        html = templates.get_template("_answer.html").render(
            **ctx, content=answer.prefix + "".join(parts),
            mid=view.id if view else None, place=view.place if view else None,
            at=view.created_at if view else None, speed=view.speed if view else "",
            naming=naming, reason=finish.reason if finish else FinishReason.CANCELLED,
            error=finish.error if finish else None)
        yield sse.event("done", html)
    finally:
        ws.done(sid)
        if not saved:  # the stream went away first: keep what was said all the same
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(_save_answer, ws.services, answer,
                                               "".join(parts), finish)


NOTED = frozenset({FinishReason.CANCELLED, FinishReason.LENGTH, FinishReason.QUOTA})
"""Finish reasons whose note is kept with the answer (shown again after a reload)."""


def _save_answer(svc: Services, answer: LiveAnswer, text: str, finish: FinishEvent | None
                 ) -> tuple[MessageView | None, titles.FirstTurn | None]:
    """Keep what was said, even when stopped (an answer stopped before its first word is
    kept empty, so the conversation still shows it was stopped); an answer that failed is
    not kept. Returns the answer as shown, and the branch's first turn when this answer
    completed it and the branch has no generated title yet."""
    reason = finish.reason if finish is not None else FinishReason.CANCELLED
    if reason is FinishReason.ERROR or (not text and reason not in NOTED):
        return None, None
    usage = finish.usage if finish is not None else None
    text = answer.prefix + text  # the new text begins with its own space (``continues``)
    prompt = usage.prompt_tokens if usage else None
    output = usage.completion_tokens if usage else None
    noted = reason if reason in NOTED else None
    try:
        with svc.store.sessions.begin() as s:
            if answer.rewrite is not None:  # in the old one's place (kept, or grown)
                m = versions.rewrite_answer(s, answer.user_id, answer.conversation_id,
                                            answer.rewrite, text, keep_old=answer.keep_old,
                                            finish_reason=noted, prompt_tokens=prompt,
                                            output_tokens=output)
            else:
                m = convs.add_message(s, answer.user_id, answer.conversation_id,
                                      "assistant", text, prompt_tokens=prompt,
                                      output_tokens=output, finish_reason=noted)
            m.seconds = answer.writing_s()
            view = MessageView(m.role, m.content, m.finish_reason, m.id,
                               versions.places(s, answer.conversation_id).get(m.id),
                               m.created_at, speed_text(m.output_tokens, m.seconds))
            return view, titles.first_turn(s, answer.user_id, answer.conversation_id, m)
    except NotFound:  # the conversation was deleted meanwhile
        pass
    except DatabaseError as exc:  # streamed already: nobody to answer 503; one line, no trace
        if storage_fault(exc) is None:
            raise
        log.warning("chat: answer in conversation %d (user_id=%d) not saved: the database "
                    "takes no writes (%s)", answer.conversation_id, answer.user_id,
                    storage_fault(exc))
    return None, None


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


def _rename(svc: Services, user_id: int, cid: int, title: str) -> ConvView:
    with svc.store.sessions.begin() as s:
        convs.rename_conversation(s, user_id, cid, title)
        c = convs.get_conversation(s, user_id, cid)
        assert c is not None
        return ConvView(c.id, c.title, c.updated_at)


@post("/chat/{cid:int}/rename", status_code=200)
async def rename(request: Request[Any, Any, Any], cid: FromPath[int]) -> Response[Any]:
    title = " ".join((await form_fields(request)).get("title", "").split())
    if not title:
        raise bad_request("Type a title first.", param="title")
    current = await anyio.to_thread.run_sync(_rename, services(request), me(request).user_id,
                                             cid, title)
    if not is_htmx(request):
        return Redirect(f"/chat/{cid}", status_code=303)
    return page(request, "_conv_head.html", current=current, oob=False,
                headers={"HX-Trigger-After-Settle": "conversations-changed"})


ROUTES = [home, rename, regenerate, continue_answer, show_version, show_branch, edit, chat_new,
          chat_page, chat_list, send, answer_stream, stop, delete, *attach.ROUTES,
          *titles.ROUTES]
