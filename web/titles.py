"""A short title for a conversation, written by the model after the first answer.

Until then (and whenever the model cannot), the title is the first question cut on a word
with "…". The title is asked for in the person's name as a ``background`` request, so it
never delays anyone's answer; the finished answer's bubble asks ``/chat/<id>/title``,
which waits for it (at most ``WAIT_S``) and swaps the heading and the tab's title.
A person's own name for the conversation (Rename) is never replaced.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from dataclasses import dataclass
from typing import Any

import anyio
from litestar import Request, get
from litestar.params import FromPath
from litestar.response import Template
from sqlalchemy.orm import Session

from appliance.service.chat_format import Turn, text_prompt
from appliance.service.checks import DEFAULTS
from appliance.service.errors import ServiceError
from appliance.service.generation import off_loop, submit
from appliance.service.identity import Principal
from appliance.service.services import Services
from appliance.store import branches
from appliance.store import conversations as convs
from appliance.store.errors import NotFound
from appliance.store.models import Message
from appliance.vocab import FinishReason, Klass
from web.common import me, page, services, web_state
from web.state import LiveAnswer, WebState

log = logging.getLogger(__name__)

ENDPOINT = "/chat/title"
"""The endpoint name title requests carry into the ledger."""
MAX_TOKENS = 16
"""A title is a few words; a model that rambles is cut here."""
WAIT_S = 60.0
"""How long a page waits for its title before it keeps the cut question."""
SHOWN_CHARS = 1_000
"""How much of the question and the answer the model is shown to name them."""
INSTRUCTION = ("Write a short title, at most six words, for a conversation that starts "
               "like this. Reply with the title only.")


@dataclass(frozen=True, slots=True)
class FirstTurn:
    """A branch's first question and answer, to be named."""

    conversation_id: int
    question_id: int
    question: str
    answer: str


def first_turn(session: Session, user_id: int, cid: int, answer: Message) -> FirstTurn | None:
    """The branch's first turn when ``answer`` just completed it, its title follows the
    branch, and it has no generated title yet; otherwise None."""
    conv = convs.get_conversation(session, user_id, cid)
    if conv is None or not conv.title_auto or not answer.content.strip():
        return None
    path = convs.list_messages(session, user_id, cid)
    if len(path) != 2 or path[0].role != "user" or path[1].id != answer.id or path[0].title:
        return None
    return FirstTurn(cid, path[0].id, convs.question_text(path[0].content), answer.content)


def clean(said: str) -> str:
    """The model's words as a title: its first line, without quotes, "Title:" or Markdown,
    cut on a word; "" when nothing is left worth showing."""
    said = re.sub(r"<[^<>]*>", " ", said)  # markup (a tool call, a tag) is no title
    line = next((ln for ln in said.splitlines() if ln.strip()), "")
    line = re.sub(r"^\W*title\s*:\s*", "", line.strip(), flags=re.IGNORECASE)
    line = re.split(r"[{\[]|\"\s*[,:]", line, maxsplit=1)[0]  # JSON after words is no title either
    line = line.strip(" \t#*_`\"'“”‘’«»").rstrip(" .!:;,\"'")
    title = convs.cut_title(line)
    return title if sum(ch.isalnum() for ch in title) >= 2 else ""


def start(ws: WebState, answer: LiveAnswer, turn: FirstTurn) -> bool:
    """Ask for the branch's title in the background; False when it cannot be asked."""
    if answer.who is None or not ws.services.chat_titles:
        return False
    cid = turn.conversation_id
    task = asyncio.get_running_loop().create_task(_name(ws.services, answer.who, turn))
    ws.naming[cid] = task
    task.add_done_callback(lambda t: ws.naming.pop(cid) if ws.naming.get(cid) is t else None)
    return True


async def _name(svc: Services, who: Principal, turn: FirstTurn) -> None:
    asked = (f"{INSTRUCTION}\n\nQuestion: {turn.question[:SHOWN_CHARS]}\n\n"
             f"Answer: {turn.answer[:SHOWN_CHARS]}")
    try:
        prompt = await off_loop(svc, text_prompt, svc.model.tokenizer, [Turn("user", asked)])
        gen = await submit(svc, prompt, DEFAULTS, MAX_TOKENS, who, Klass.BACKGROUND, ENDPOINT)
        said, finish = await gen.text()
    except ServiceError as exc:  # busy, over quota: the cut question stays
        log.info("chat: no title for conversation %d (user_id=%d): %s",
                 turn.conversation_id, who.user_id, type(exc).__name__)
        return
    title = clean(said)
    if finish.reason not in (FinishReason.STOP, FinishReason.LENGTH) or not title:
        return
    with contextlib.suppress(NotFound):  # deleted meanwhile
        await anyio.to_thread.run_sync(_keep, svc, who.user_id, turn, title)


def _keep(svc: Services, user_id: int, turn: FirstTurn, title: str) -> None:
    with svc.store.sessions.begin() as s:
        branches.set_title(s, user_id, turn.conversation_id, turn.question_id, title)


@dataclass(frozen=True, slots=True)
class Heading:
    """What the conversation's heading shows."""

    id: int
    title: str


def _current(svc: Services, user_id: int, cid: int) -> Heading:
    with svc.store.read_sessions() as s:
        c = convs.get_conversation(s, user_id, cid)
        if c is None:
            raise NotFound("conversation not found")
        return Heading(c.id, c.title)


@get("/chat/{cid:int}/title")
async def title(request: Request[Any, Any, Any], cid: FromPath[int]) -> Template:
    """The conversation's heading and the tab's title, once its title is generated (or
    at once when none is being written)."""
    task = web_state(request).naming.get(cid)
    if task is not None:
        await asyncio.wait({task}, timeout=WAIT_S)
    current = await anyio.to_thread.run_sync(_current, services(request),
                                             me(request).user_id, cid)
    return page(request, "_title.html", current=current,
                headers={"HX-Trigger-After-Settle": "conversations-changed"})


ROUTES = [title]
