"""conversation branches

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06

Editing an earlier question keeps the old thread as a branch: ``messages.parent_id`` makes a
conversation a tree, ``messages.shown`` marks the branch shown among siblings, and
``messages.title`` holds a branch's generated title; ``messages.seconds`` how long an
answer took to write (its speed, shown on hover). ``conversations.title_auto`` says the
title follows the shown branch (not a name a person gave it).

Existing conversations become one branch each (every message the child of the one before),
so nothing changes for them; a title still equal to the old cut of the first question
(60 characters) follows the branch from now on, any other title was given and is kept.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD_TITLE_CHARS = 60
"""How long the web chat's title of a new conversation was before this revision."""


def upgrade() -> None:
    with op.batch_alter_table("messages", schema=None) as batch_op:
        batch_op.add_column(sa.Column("parent_id", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("shown", sa.Boolean(), nullable=False,
                                      server_default=sa.true()))
        batch_op.add_column(sa.Column("seconds", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("title", sa.String(length=200), nullable=True))
        batch_op.create_index(batch_op.f("ix_messages_parent_id"), ["parent_id"], unique=False)
        batch_op.create_foreign_key(batch_op.f("fk_messages_parent_id_messages"), "messages",
                                    ["parent_id"], ["id"], ondelete="CASCADE")
    with op.batch_alter_table("conversations", schema=None) as batch_op:
        batch_op.add_column(sa.Column("title_auto", sa.Boolean(), nullable=False,
                                      server_default=sa.false()))
    _link_existing(op.get_bind())
    with op.batch_alter_table("messages", schema=None) as batch_op:
        batch_op.alter_column("shown", server_default=None)
    with op.batch_alter_table("conversations", schema=None) as batch_op:
        batch_op.alter_column("title_auto", server_default=None)


def _link_existing(conn: sa.Connection) -> None:
    """Each message the child of the one before it; titles made from the first question
    follow the branch."""
    rows = conn.execute(sa.text(
        "SELECT id, conversation_id, role, content FROM messages "
        "ORDER BY conversation_id, id")).all()
    previous: dict[int, int] = {}
    first_question: dict[int, str] = {}
    for mid, cid, role, content in rows:
        if cid in previous:
            conn.execute(sa.text("UPDATE messages SET parent_id = :p WHERE id = :m"),
                         {"p": previous[cid], "m": mid})
        previous[cid] = mid
        if role == "user" and cid not in first_question:
            first_question[cid] = content
    for cid, question in first_question.items():
        old = " ".join(question.split())[:OLD_TITLE_CHARS]
        conn.execute(sa.text("UPDATE conversations SET title_auto = 1 "
                             "WHERE id = :c AND (title = :t OR title = '')"),
                     {"c": cid, "t": old})


def downgrade() -> None:
    """Back to one thread per conversation: the shown branch stays, other branches go."""
    conn = op.get_bind()
    conn.execute(sa.text(
        "WITH RECURSIVE hidden(id) AS (SELECT id FROM messages WHERE shown = 0 "
        "UNION SELECT m.id FROM messages m JOIN hidden h ON m.parent_id = h.id) "
        "DELETE FROM messages WHERE id IN (SELECT id FROM hidden)"))
    conn.execute(sa.text("DELETE FROM answer_versions WHERE message_id NOT IN "
                         "(SELECT id FROM messages)"))
    with op.batch_alter_table("conversations", schema=None) as batch_op:
        batch_op.drop_column("title_auto")
    with op.batch_alter_table("messages", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("fk_messages_parent_id_messages"),
                                 type_="foreignkey")
        batch_op.drop_index(batch_op.f("ix_messages_parent_id"))
        batch_op.drop_column("title")
        batch_op.drop_column("seconds")
        batch_op.drop_column("shown")
        batch_op.drop_column("parent_id")
