"""Branches: editing an earlier question keeps the old thread, and a person can flip back.

An edited question is a new sibling of the one edited (the same ``parent_id``), shown from
then on; the old one keeps its later turns and answer versions. Siblings are ordered by
when they were written; ``‹ 1/2 ›`` on a question says which of them the branch shown
takes. A title that follows the branch changes with it (``convs.follow_branch``).
"""

from __future__ import annotations

import time

from sqlalchemy import select
from sqlalchemy.orm import Session

from appliance.store import conversations as convs
from appliance.store.errors import NotFound
from appliance.store.models import Conversation, Message
from appliance.store.versions import Place


def _siblings(session: Session, m: Message) -> list[Message]:
    return list(session.scalars(select(Message).where(
        Message.conversation_id == m.conversation_id, Message.role == m.role,
        Message.parent_id.is_(None) if m.parent_id is None
        else Message.parent_id == m.parent_id).order_by(Message.id)))


def _question(session: Session, user_id: int, cid: int, message_id: int
              ) -> tuple[Conversation, Message]:
    conv = convs.get_conversation(session, user_id, cid)
    if conv is None:  # someone else's: not found
        raise NotFound("conversation not found")
    m = session.get(Message, message_id)
    if m is None or m.conversation_id != cid or m.role != "user":
        raise NotFound("message not found")
    return conv, m


def places(session: Session, path: list[Message]) -> dict[int, Place]:
    """For each question of the branch ``path`` that has siblings: where it stands."""
    out = {}
    for m in path:
        if m.role != "user":
            continue
        siblings = _siblings(session, m)
        if len(siblings) > 1:
            out[m.id] = Place(siblings.index(m) + 1, len(siblings))
    return out


def _show(session: Session, conv: Conversation, target: Message,
          siblings: list[Message]) -> None:
    for s in siblings:
        s.shown = s is target
    session.flush()
    convs.follow_branch(session, conv)
    session.flush()


def edit_question(session: Session, user_id: int, cid: int, message_id: int, content: str,
                  *, now: float | None = None) -> Message:
    """Ask ``content`` in place of the question ``message_id`` on a new branch: the old
    question stays, with everything after it, one flip away."""
    conv, old = _question(session, user_id, cid, message_id)
    stamp = time.time() if now is None else now
    new = Message(conversation_id=cid, parent_id=old.parent_id, role="user", content=content,
                  created_at=stamp, shown=True)
    session.add(new)
    session.flush()
    conv.updated_at = stamp
    _show(session, conv, new, _siblings(session, new))
    return new


def show_branch(session: Session, user_id: int, cid: int, message_id: int, n: int) -> Place:
    """Make the ``n``-th (1-based, oldest first) sibling of question ``message_id`` the one
    the branch shown takes, with the later turns it had."""
    conv, m = _question(session, user_id, cid, message_id)
    siblings = _siblings(session, m)
    n = min(max(n, 1), len(siblings))
    _show(session, conv, siblings[n - 1], siblings)
    return Place(n, len(siblings))


def set_title(session: Session, user_id: int, cid: int, message_id: int, title: str) -> bool:
    """Keep a title generated for the branch that starts with question ``message_id``;
    the conversation takes it while that branch is shown and no person named it. Returns
    whether the conversation's title changed."""
    conv, m = _question(session, user_id, cid, message_id)
    m.title = " ".join(title.split())[:convs.TITLE_MAX] or None
    before = conv.title
    convs.follow_branch(session, conv)
    session.flush()
    return conv.title != before
