"""Answer versions: Regenerate keeps the earlier answers, and a person can flip between them.

The version shown (and sent to the model with later turns) is the ``messages`` row itself;
the others are ``answer_versions`` rows. Versions are ordered by when they were written;
showing another one swaps its text, finish reason and time with the message row's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from appliance.store import conversations as convs
from appliance.store.errors import NotFound
from appliance.store.models import AnswerVersion, Message


@dataclass(frozen=True, slots=True)
class Place:
    """Which version of an answer is shown, of how many (1-based)."""

    shown: int
    total: int


def _answer(session: Session, user_id: int, cid: int, message_id: int) -> Message:
    if convs.get_conversation(session, user_id, cid) is None:  # someone else's: not found
        raise NotFound("conversation not found")
    m = session.get(Message, message_id)
    if m is None or m.conversation_id != cid or m.role != "assistant":
        raise NotFound("answer not found")
    return m


def rewrite_answer(session: Session, user_id: int, cid: int, message_id: int, content: str,
                   *, keep_old: bool, finish_reason: str | None,
                   prompt_tokens: int | None = None, output_tokens: int | None = None,
                   now: float | None = None) -> Message:
    """Put a new answer in place of ``message_id`` (a Regenerate, or a Continue's longer
    text); with ``keep_old`` the replaced one becomes an earlier version."""
    stamp = time.time() if now is None else now
    m = _answer(session, user_id, cid, message_id)
    if keep_old:
        session.add(AnswerVersion(message_id=m.id, content=m.content,
                                  finish_reason=m.finish_reason, created_at=m.created_at))
    m.content, m.finish_reason, m.created_at = content, finish_reason, stamp
    m.prompt_tokens, m.output_tokens = prompt_tokens, output_tokens
    m.conversation.updated_at = stamp
    session.flush()
    return m


def _ordered(session: Session, m: Message) -> list[Message | AnswerVersion]:
    others = list(session.scalars(select(AnswerVersion).where(
        AnswerVersion.message_id == m.id)))
    return sorted([m, *others], key=lambda v: (v.created_at, isinstance(v, Message)))


def places(session: Session, cid: int) -> dict[int, Place]:
    """For each answer of the conversation that has earlier versions: where it stands."""
    counted = session.execute(
        select(AnswerVersion.message_id, func.count()).join(
            Message, Message.id == AnswerVersion.message_id).where(
            Message.conversation_id == cid).group_by(AnswerVersion.message_id)).all()
    out = {}
    for mid, _ in counted:
        m = session.get(Message, mid)
        if m is not None:
            order = _ordered(session, m)
            out[mid] = Place(order.index(m) + 1, len(order))
    return out


def show_version(session: Session, user_id: int, cid: int, message_id: int,
                 n: int) -> tuple[Message, Place]:
    """Make version ``n`` (1-based, oldest first) the one shown and carried on from."""
    m = _answer(session, user_id, cid, message_id)
    order = _ordered(session, m)
    n = min(max(n, 1), len(order))
    target = order[n - 1]
    if isinstance(target, AnswerVersion):
        m.content, target.content = target.content, m.content
        m.finish_reason, target.finish_reason = target.finish_reason, m.finish_reason
        m.created_at, target.created_at = target.created_at, m.created_at
        m.seconds = None  # a kept version's speed is not kept: none rather than another's
        session.flush()
    return m, Place(n, len(order))
