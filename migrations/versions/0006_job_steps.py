"""job steps

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04

The finished stages of a job run (a map step, a reduce group) with their outputs, kept while
the run can be retried: an interrupted run resumes from the stages not yet done instead of
asking (and charging) them again.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "job_steps",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(length=64), nullable=False),
        sa.Column("output", sa.Text(), nullable=False),
        sa.Column("request_id", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["job_runs.id"],
                                name=op.f("fk_job_steps_run_id_job_runs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job_steps")),
        sa.UniqueConstraint("run_id", "key", name="uq_job_steps_run_id_key"),
    )


def downgrade() -> None:
    op.drop_table("job_steps")
