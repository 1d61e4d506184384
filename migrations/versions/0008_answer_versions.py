"""answer versions

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-04

``answer_versions``: the earlier answers Regenerate keeps (``< 2/3 >`` in the chat). The
version shown is the ``messages`` row itself; the others live here, deleted with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "answer_versions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("message_id", sa.Integer(), nullable=False),
        sa.Column("content", sa.Text(), nullable=False),
        sa.Column("finish_reason", sa.String(length=16), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["message_id"], ["messages.id"],
                                name=op.f("fk_answer_versions_message_id_messages"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_answer_versions")),
    )
    with op.batch_alter_table("answer_versions", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_answer_versions_message_id"), ["message_id"],
                              unique=False)


def downgrade() -> None:
    with op.batch_alter_table("answer_versions", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_answer_versions_message_id"))
    op.drop_table("answer_versions")
