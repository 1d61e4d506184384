"""background jobs

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30

Job definitions (owner, instructions, source, schedule, delivery) and their runs, one row per
(job, scheduled time).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("user_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("instructions", sa.Text(), nullable=False),
        sa.Column("source_kind", sa.String(length=16), nullable=False),
        sa.Column("source_text", sa.Text(), nullable=True),
        sa.Column("url", sa.String(length=2000), nullable=True),
        sa.Column("headers", sa.Text(), nullable=True),
        sa.Column("schedule_kind", sa.String(length=16), nullable=False),
        sa.Column("cron", sa.String(length=120), nullable=True),
        sa.Column("interval_s", sa.Integer(), nullable=True),
        sa.Column("max_output_tokens", sa.Integer(), nullable=False),
        sa.Column("webhook_url", sa.String(length=2000), nullable=True),
        sa.Column("paused", sa.Boolean(), nullable=False),
        sa.Column("cursor", sa.Text(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.CheckConstraint("source_kind IN ('text', 'url', 'conversations')",
                           name=op.f("ck_jobs_source_kind")),
        sa.CheckConstraint("schedule_kind IN ('none', 'cron', 'interval')",
                           name=op.f("ck_jobs_schedule_kind")),
        sa.ForeignKeyConstraint(["user_id"], ["users.id"], name=op.f("fk_jobs_user_id_users"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
        sa.UniqueConstraint("user_id", "name", name="uq_jobs_user_id_name"),
    )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_jobs_user_id"), ["user_id"], unique=False)

    op.create_table(
        "job_runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("scheduled_for", sa.Float(), nullable=False),
        sa.Column("trigger", sa.String(length=16), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=True),
        sa.Column("finished_at", sa.Float(), nullable=True),
        sa.Column("interrupted_at", sa.Float(), nullable=True),
        sa.Column("chunks_total", sa.Integer(), nullable=False),
        sa.Column("chunks_done", sa.Integer(), nullable=False),
        sa.Column("requests", sa.Integer(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("output_tokens", sa.Integer(), nullable=False),
        sa.Column("request_ids", sa.Text(), nullable=False),
        sa.Column("source_bytes", sa.Integer(), nullable=False),
        sa.Column("output", sa.Text(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("delivery", sa.String(length=16), nullable=True),
        sa.Column("delivery_detail", sa.Text(), nullable=True),
        sa.CheckConstraint("status IN ('pending', 'running', 'done', 'error', 'quota', "
                           "'cancelled', 'interrupted')", name=op.f("ck_job_runs_status")),
        sa.CheckConstraint("trigger IN ('schedule', 'manual', 'catch-up')",
                           name=op.f("ck_job_runs_trigger")),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_job_runs_job_id_jobs"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job_runs")),
        sa.UniqueConstraint("job_id", "scheduled_for",
                            name="uq_job_runs_job_id_scheduled_for"),
    )
    with op.batch_alter_table("job_runs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_job_runs_job_id"), ["job_id"], unique=False)
        batch_op.create_index("ix_job_runs_status", ["status"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("job_runs", schema=None) as batch_op:
        batch_op.drop_index("ix_job_runs_status")
        batch_op.drop_index(batch_op.f("ix_job_runs_job_id"))
    op.drop_table("job_runs")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_jobs_user_id"))
    op.drop_table("jobs")
