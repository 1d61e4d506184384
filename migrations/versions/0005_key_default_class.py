"""api key default class

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30

``api_keys.default_class``: the class a key's requests run in when they do not ask for one
(NULL: the key's maximum). Home Assistant cannot send headers, so its key is made ``voice``.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.add_column(sa.Column("default_class", sa.String(length=16), nullable=True))
        batch_op.create_check_constraint(
            "default_class", "default_class IN ('voice', 'interactive', 'background')")


def downgrade() -> None:
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.drop_constraint(op.f("ck_api_keys_default_class"), type_="check")
        batch_op.drop_column("default_class")
