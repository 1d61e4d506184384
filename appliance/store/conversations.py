"""Chat history, strictly per user.

A conversation is a tree of messages (``parent_id``): editing an earlier question adds a
sibling and keeps the old one with its later turns. The *branch shown* starts at the shown
first question and follows, at each turn, the shown child; ``list_messages`` is that branch,
``all_messages`` every message of every branch (export, search).

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


CUT_TITLE_CHARS = 60
"""A title made from a question is cut to about this many characters, on a word."""


def cut_title(text: str, limit: int = CUT_TITLE_CHARS) -> str:
    """``text`` on one line, cut on a word boundary with "…" when longer than ``limit``
    (a single word longer than that is cut inside it)."""
    line = " ".join(text.split())
    if len(line) <= limit:
        return line
    head = line[:limit]
    space = limit if line[limit] == " " else head.rfind(" ")
    if space >= limit // 2:  # a word boundary not too far back
        head = head[:space]
    return head.rstrip(" ,;:.-–—") + "…"


def create_conversation(
    session: Session, user_id: int, title: str = "", *, now: float | None = None,
    auto_title: bool = False,
) -> Conversation:
    """``auto_title``: the title follows the branch shown (the chat's own conversations)."""
    stamp = time.time() if now is None else now
    conv = Conversation(
        user_id=user_id, title=_clean_title(title), created_at=stamp, updated_at=stamp,
        title_auto=auto_title,
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


SNIPPET_AROUND = 50
"""Characters of a search snippet on each side of the match."""


def snippet(content: str, text: str, around: int = SNIPPET_AROUND
            ) -> tuple[str, str, str] | None:
    """Where ``text`` first occurs in ``content`` (any case, any spacing): the words
    before it, the match itself and the words after it, each on one line, cut with "…"."""
    line, wanted = " ".join(content.split()), " ".join(text.split())
    at = line.lower().find(wanted.lower()) if wanted else -1
    if at < 0:
        return None
    end = at + len(wanted)
    before, after = line[max(0, at - around):at], line[end:end + around]
    if at > around:
        before = "…" + before.split(" ", 1)[-1] if " " in before else "…" + before
    if end + around < len(line):
        after = (after.rsplit(" ", 1)[0] if " " in after else after) + "…"
    return before, line[at:end], after


def find_snippet(session: Session, conversation_id: int, text: str
                 ) -> tuple[str, str, str] | None:
    """A snippet of the newest message of any branch that contains ``text``."""
    query = (select(Message.content)
             .where(Message.conversation_id == conversation_id,
                    Message.content.ilike(_like(" ".join(text.split())), escape="\\"))
             .order_by(Message.id.desc()).limit(5))
    for content in session.scalars(query):
        found = snippet(content, text)
        if found is not None:
            return found
    return None


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


def all_messages(session: Session, user_id: int, conversation_id: int) -> list[Message]:
    """Every message of every branch, oldest first; ``NotFound`` for another user's."""
    conv = _require(session, user_id, conversation_id)
    query = select(Message).where(Message.conversation_id == conv.id).order_by(Message.id)
    return list(session.scalars(query))


def branch(messages: list[Message], start: Message | None = None) -> list[Message]:
    """The branch shown, from all of a conversation's messages: from the first turn (or
    ``start``), the shown child each time (the newest child if none is marked)."""
    children: dict[int | None, list[Message]] = {}
    for m in messages:
        children.setdefault(m.parent_id, []).append(m)
    path: list[Message] = []
    kids = children.get(None, []) if start is None else [start]
    while kids:
        nxt = next((k for k in reversed(kids) if k.shown), kids[-1])
        path.append(nxt)
        kids = children.get(nxt.id, [])
    return path


def list_messages(session: Session, user_id: int, conversation_id: int) -> list[Message]:
    """The branch shown, in order; raises ``NotFound`` for another user's conversation."""
    return branch(all_messages(session, user_id, conversation_id))


def follow_branch(session: Session, conv: Conversation) -> None:
    """A title that follows the branch: its generated title, else its first question cut."""
    if not conv.title_auto:
        return
    path = branch(list(session.scalars(select(Message).where(
        Message.conversation_id == conv.id).order_by(Message.id))))
    first = next((m for m in path if m.role == "user"), None)
    if first is not None:
        conv.title = _clean_title(first.title or cut_title(question_text(first.content)))


ATTACHED = "\n\nAttached file “"
"""Where an attached file's text starts in a question (``web.chat`` writes it so)."""


def question_text(content: str) -> str:
    """A question without the text of the file attached to it."""
    return content.split(ATTACHED, 1)[0]


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
    """Append a message to the branch shown and bump the conversation's ``updated_at``."""
    if role not in MESSAGE_ROLES:
        raise Invalid(f"message role must be one of {', '.join(MESSAGE_ROLES)}")
    conv = _require(session, user_id, conversation_id)
    stamp = time.time() if now is None else now
    path = list_messages(session, user_id, conversation_id)
    message = Message(
        conversation_id=conv.id,
        parent_id=path[-1].id if path else None,
        shown=True,
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
    """Delete the message ``message_id`` of the branch shown and every later one of that
    branch, with whatever branches off them."""
    path = list_messages(session, user_id, conversation_id)
    at = next((i for i, m in enumerate(path) if m.id == message_id), None)
    if at is None:
        raise NotFound("message not found")
    session.delete(path[at])  # the database deletes its descendants (ON DELETE CASCADE)
    session.flush()
    session.expire_all()


def rename_conversation(session: Session, user_id: int, conversation_id: int, title: str) -> None:
    """A name a person gives: kept from now on, whichever branch is shown."""
    conv = _require(session, user_id, conversation_id)
    conv.title, conv.title_auto = _clean_title(title), False


def delete_conversation(session: Session, user_id: int, conversation_id: int) -> None:
    """Delete the conversation and its messages (ON DELETE CASCADE in the database)."""
    session.delete(_require(session, user_id, conversation_id))
    session.flush()
