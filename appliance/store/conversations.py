"""Chat history, strictly per user.

Every function takes the id of the user acting. A conversation that belongs to someone
else is treated exactly like one that does not exist: ``get_conversation`` returns None,
the others raise ``NotFound`` with the same message, so nobody can probe which ids exist.
Functions take a ``Session`` and never commit: the caller owns the transaction.
"""

from __future__ import annotations

import time

from sqlalchemy import select
from sqlalchemy.orm import Session

from appliance.store.errors import Invalid, NotFound
from appliance.store.models import MESSAGE_ROLES, Conversation, Message

TITLE_MAX = 200
MAX_MESSAGE_CHARS = 16_000
"""What one message posted through the API may hold: the web chat's own cap."""


def _clean_title(title: str) -> str:
    return " ".join(title.split())[:TITLE_MAX]


def create_conversation(
    session: Session, user_id: int, title: str = "", *, now: float | None = None
) -> Conversation:
    stamp = time.time() if now is None else now
    conv = Conversation(
        user_id=user_id, title=_clean_title(title), created_at=stamp, updated_at=stamp
    )
    session.add(conv)
    session.flush()
    return conv


def list_conversations(
    session: Session, user_id: int, *, limit: int = 100, offset: int = 0
) -> list[Conversation]:
    """The user's conversations, most recently updated first."""
    query = (
        select(Conversation)
        .where(Conversation.user_id == user_id)
        .order_by(Conversation.updated_at.desc(), Conversation.id.desc())
        .limit(limit)
        .offset(offset)
    )
    return list(session.scalars(query))


def _like(text: str) -> str:
    return "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def search_conversations(
    session: Session, user_id: int, text: str, *, limit: int = 100, offset: int = 0
) -> list[Conversation]:
    """The user's conversations whose title or any message contains ``text`` (any case),
    most recently updated first."""
    pattern = _like(" ".join(text.split()))
    in_messages = select(Message.conversation_id).where(
        Message.content.ilike(pattern, escape="\\"))
    query = (
        select(Conversation)
        .where(Conversation.user_id == user_id,
               Conversation.title.ilike(pattern, escape="\\") | Conversation.id.in_(in_messages))
        .order_by(Conversation.updated_at.desc(), Conversation.id.desc())
        .limit(limit)
        .offset(offset)
    )
    return list(session.scalars(query))


def get_conversation(session: Session, user_id: int, conversation_id: int) -> Conversation | None:
    """The conversation if it exists and belongs to ``user_id``; otherwise None."""
    query = select(Conversation).where(
        Conversation.id == conversation_id, Conversation.user_id == user_id
    )
    return session.scalars(query).one_or_none()


def _require(session: Session, user_id: int, conversation_id: int) -> Conversation:
    conv = get_conversation(session, user_id, conversation_id)
    if conv is None:
        raise NotFound("conversation not found")
    return conv


def list_messages(session: Session, user_id: int, conversation_id: int) -> list[Message]:
    """Messages in order; raises ``NotFound`` for another user's conversation."""
    conv = _require(session, user_id, conversation_id)
    query = select(Message).where(Message.conversation_id == conv.id).order_by(Message.id)
    return list(session.scalars(query))


def add_message(
    session: Session,
    user_id: int,
    conversation_id: int,
    role: str,
    content: str,
    *,
    prompt_tokens: int | None = None,
    output_tokens: int | None = None,
    finish_reason: str | None = None,
    now: float | None = None,
) -> Message:
    """Append a message and bump the conversation's ``updated_at``."""
    if role not in MESSAGE_ROLES:
        raise Invalid(f"message role must be one of {', '.join(MESSAGE_ROLES)}")
    conv = _require(session, user_id, conversation_id)
    stamp = time.time() if now is None else now
    message = Message(
        conversation_id=conv.id,
        role=role,
        content=content,
        created_at=stamp,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        finish_reason=finish_reason,
    )
    session.add(message)
    conv.updated_at = stamp
    session.flush()
    return message


def set_content(session: Session, user_id: int, conversation_id: int, message_id: int,
                content: str) -> None:
    """Replace a message's text (an attached file's summary taking the file's place)."""
    conv = _require(session, user_id, conversation_id)
    message = session.get(Message, message_id)
    if message is None or message.conversation_id != conv.id:
        raise NotFound("message not found")
    message.content = content
    session.flush()


def delete_messages_from(session: Session, user_id: int, conversation_id: int,
                         message_id: int) -> None:
    """Delete the message ``message_id`` and every later one of the conversation (to
    answer again, or to send an edited question)."""
    conv = _require(session, user_id, conversation_id)
    for m in session.scalars(select(Message).where(Message.conversation_id == conv.id,
                                                   Message.id >= message_id)):
        session.delete(m)
    session.flush()


def rename_conversation(session: Session, user_id: int, conversation_id: int, title: str) -> None:
    _require(session, user_id, conversation_id).title = _clean_title(title)


def delete_conversation(session: Session, user_id: int, conversation_id: int) -> None:
    """Delete the conversation and its messages (ON DELETE CASCADE in the database)."""
    session.delete(_require(session, user_id, conversation_id))
    session.flush()
