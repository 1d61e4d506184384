"""job ids never reused

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04

``jobs`` and ``job_runs`` rebuilt with SQLite's AUTOINCREMENT: without it a new row takes
max(id) + 1, so after ``job rm`` (or pruning the newest runs) an id came back, and a webhook
receiver saw the same ``job_id``/``run_id`` for a different job. Rows keep their ids; the
counter starts from the largest id present (ids of rows deleted before this migration
cannot be known). Batch mode with the tables spelt out (as in 0003), so the rebuilt tables
keep every constraint and index.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _jobs(autoincrement: bool) -> sa.Table:
    return sa.Table(
        "jobs", sa.MetaData(),
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
                           name="ck_jobs_source_kind"),
        sa.CheckConstraint("schedule_kind IN ('none', 'cron', 'interval')",
                           name="ck_jobs_schedule_kind"),
        sa.ForeignKeyConstraint(["user_id"], ["users.id"], name="fk_jobs_user_id_users",
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_jobs"),
        sa.UniqueConstraint("user_id", "name", name="uq_jobs_user_id_name"),
        sa.Index("ix_jobs_user_id", "user_id"),
        sqlite_autoincrement=autoincrement,
    )


def _job_runs(autoincrement: bool) -> sa.Table:
    return sa.Table(
        "job_runs", sa.MetaData(),
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
                           "'cancelled', 'interrupted')", name="ck_job_runs_status"),
        sa.CheckConstraint("trigger IN ('schedule', 'manual', 'catch-up')",
                           name="ck_job_runs_trigger"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_job_runs_job_id_jobs",
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_job_runs"),
        sa.UniqueConstraint("job_id", "scheduled_for",
                            name="uq_job_runs_job_id_scheduled_for"),
        sa.Index("ix_job_runs_job_id", "job_id"),
        sa.Index("ix_job_runs_status", "status"),
        sqlite_autoincrement=autoincrement,
    )


def _rebuild(autoincrement: bool) -> None:
    for table in (_jobs(autoincrement), _job_runs(autoincrement)):
        with op.batch_alter_table(table.name, recreate="always", copy_from=table,
                                  table_kwargs={"sqlite_autoincrement": autoincrement}):
            pass


def upgrade() -> None:
    _rebuild(True)


def downgrade() -> None:
    _rebuild(False)
