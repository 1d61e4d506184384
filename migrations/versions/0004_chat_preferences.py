"""chat preferences

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30

Why an answer ended (its note survives a reload); each person's default system prompt and
theme; household-wide settings (the admins' default system prompt).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("messages", schema=None) as batch_op:
        batch_op.add_column(sa.Column("finish_reason", sa.String(length=16), nullable=True))
    op.create_table(
        "user_preferences",
        sa.Column("user_id", sa.Integer(), nullable=False),
        sa.Column("system_prompt", sa.Text(), nullable=False),
        sa.Column("theme", sa.String(length=8), nullable=False),
        sa.CheckConstraint("theme IN ('system', 'light', 'dark')",
                           name=op.f("ck_user_preferences_theme")),
        sa.ForeignKeyConstraint(["user_id"], ["users.id"],
                                name=op.f("fk_user_preferences_user_id_users"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("user_id", name=op.f("pk_user_preferences")),
    )
    op.create_table(
        "household_settings",
        sa.Column("key", sa.String(length=64), nullable=False),
        sa.Column("value", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_household_settings")),
    )


def downgrade() -> None:
    op.drop_table("household_settings")
    op.drop_table("user_preferences")
    with op.batch_alter_table("messages", schema=None) as batch_op:
        batch_op.drop_column("finish_reason")
