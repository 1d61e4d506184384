"""SQLAlchemy rows for the appliance database (one SQLite file).

Conventions:
- every timestamp is a float of unix seconds (UTC by definition), never a datetime: the
  engine measures request times with ``time.time()`` and the ledger is queried by ranges, so
  one numeric representation everywhere avoids naive/aware datetime mix-ups in SQLite;
- enumerations (role, request class, message role) are short strings guarded by CHECK
  constraints, with the allowed values listed here as tuples;
- constraint names follow ``NAMING_CONVENTION`` so Alembic batch migrations on SQLite can
  address them.

Schema changes go through a new Alembic revision in ``migrations/versions``; the test suite
runs ``alembic check`` to catch drift between these models and the migrations.
"""

from __future__ import annotations

import time

from sqlalchemy import (
    CheckConstraint,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from appliance.vocab import CLASS_LABELS, Klass

ROLES: tuple[str, ...] = ("admin", "member")
# Request classes, highest priority first.

MESSAGE_ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
THEMES: tuple[str, ...] = ("system", "light", "dark")

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def _in(column: str, values: tuple[str, ...]) -> str:
    quoted = ", ".join(f"'{v}'" for v in values)
    return f"{column} IN ({quoted})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class User(Base):
    __tablename__ = "users"
    __table_args__ = (
        CheckConstraint(_in("role", ROLES), name="role"),
        CheckConstraint(_in("max_class", CLASS_LABELS), name="max_class"),
        CheckConstraint("weight > 0", name="weight_positive"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # NOCASE makes both the unique index and `name == ?` lookups case-insensitive
    # (ASCII letters only, which is what user names are validated to).
    name: Mapped[str] = mapped_column(String(64, collation="NOCASE"), unique=True)
    password_hash: Mapped[str] = mapped_column(String(255))
    role: Mapped[str] = mapped_column(String(16), default="member")
    disabled: Mapped[bool] = mapped_column(default=False)
    max_class: Mapped[str] = mapped_column(String(16), default=Klass.INTERACTIVE.label)
    weight: Mapped[float] = mapped_column(Float, default=1.0)
    created_at: Mapped[float] = mapped_column(Float, default=time.time)

    def __repr__(self) -> str:
        return f"User(id={self.id}, role={self.role!r}, disabled={self.disabled})"


class ApiKey(Base):
    __tablename__ = "api_keys"
    __table_args__ = (CheckConstraint(_in("max_class", CLASS_LABELS), name="max_class"),
                      CheckConstraint(_in("default_class", CLASS_LABELS), name="default_class"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(128))
    # Public identifier embedded in the key (`apl_<prefix>_<secret>`); shown in listings.
    prefix: Mapped[str] = mapped_column(String(16), unique=True)
    # sha256 hex of the whole plaintext key; the plaintext is never stored.
    key_hash: Mapped[str] = mapped_column(String(64))
    max_class: Mapped[str] = mapped_column(String(16), default=Klass.INTERACTIVE.label)
    created_at: Mapped[float] = mapped_column(Float, default=time.time)
    last_used_at: Mapped[float | None] = mapped_column(Float)
    revoked_at: Mapped[float | None] = mapped_column(Float)
    # The class a request runs in when it does not ask for one (None: the maximum). Home
    # Assistant cannot send headers, so its key is made ``voice`` this way.
    default_class: Mapped[str | None] = mapped_column(String(16))

    user: Mapped[User] = relationship(lazy="joined")

    def __repr__(self) -> str:
        return f"ApiKey(id={self.id}, prefix={self.prefix!r}, user_id={self.user_id})"


class Quota(Base):
    """Per-user limits; a NULL limit (or no row at all) means unlimited."""

    __tablename__ = "quotas"

    user_id: Mapped[int] = mapped_column(
        ForeignKey("users.id", ondelete="CASCADE"), primary_key=True
    )
    tokens_per_day: Mapped[int | None] = mapped_column(Integer)
    max_concurrent: Mapped[int | None] = mapped_column(Integer)
    max_prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    max_output_tokens: Mapped[int | None] = mapped_column(Integer)


class UsageCounter(Base):
    """The fairness scheduler's virtual token counter for one user, persisted."""

    __tablename__ = "usage_counters"

    user_id: Mapped[int] = mapped_column(
        ForeignKey("users.id", ondelete="CASCADE"), primary_key=True
    )
    vtc: Mapped[float] = mapped_column(Float, default=0.0)
    updated_at: Mapped[float] = mapped_column(Float, default=time.time)


class LedgerEntry(Base):
    """One row per finished request.

    ``prompt_tokens`` counts the whole prompt; ``cached_tokens`` is the part of it served
    from the prompt cache (a subset, as in OpenAI's usage object). Timestamps are unix
    seconds; ``admitted_at``/``first_token_at`` stay NULL when the request never got there.
    """

    __tablename__ = "ledger"
    __table_args__ = (Index("ix_ledger_user_id_finished_at", "user_id", "finished_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    request_id: Mapped[str] = mapped_column(String(64), unique=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    api_key_id: Mapped[int | None] = mapped_column(
        ForeignKey("api_keys.id", ondelete="SET NULL")
    )
    klass: Mapped[str] = mapped_column(String(16))
    endpoint: Mapped[str] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(255))
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0)
    output_tokens: Mapped[int] = mapped_column(Integer, default=0)
    queued_at: Mapped[float] = mapped_column(Float)
    admitted_at: Mapped[float | None] = mapped_column(Float)
    first_token_at: Mapped[float | None] = mapped_column(Float)
    finished_at: Mapped[float] = mapped_column(Float)
    finish_reason: Mapped[str] = mapped_column(String(16))
    preemptions: Mapped[int] = mapped_column(Integer, default=0)
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    itl_mean_ms: Mapped[float | None] = mapped_column(Float)
    itl_p95_ms: Mapped[float | None] = mapped_column(Float)


class Conversation(Base):
    __tablename__ = "conversations"
    __table_args__ = (Index("ix_conversations_user_id_updated_at", "user_id", "updated_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    title: Mapped[str] = mapped_column(String(200), default="")
    created_at: Mapped[float] = mapped_column(Float, default=time.time)
    updated_at: Mapped[float] = mapped_column(Float, default=time.time)
    title_auto: Mapped[bool] = mapped_column(default=False)
    """The title follows the shown branch (its generated title, else its first question cut
    short); False once a person named the conversation."""

    messages: Mapped[list[Message]] = relationship(
        back_populates="conversation",
        cascade="all, delete-orphan",
        passive_deletes=True,
        order_by="Message.id",
    )


class Message(Base):
    __tablename__ = "messages"
    __table_args__ = (CheckConstraint(_in("role", MESSAGE_ROLES), name="role"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    conversation_id: Mapped[int] = mapped_column(
        ForeignKey("conversations.id", ondelete="CASCADE"), index=True
    )
    role: Mapped[str] = mapped_column(String(16))
    content: Mapped[str] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Float, default=time.time)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    output_tokens: Mapped[int | None] = mapped_column(Integer)
    finish_reason: Mapped[str | None] = mapped_column(String(16))
    """Why an answer ended when it was not a plain stop (cancelled, length, quota), so its
    note survives a reload; None for questions and complete answers."""
    parent_id: Mapped[int | None] = mapped_column(
        ForeignKey("messages.id", ondelete="CASCADE"), index=True)
    """The turn this one follows (None: the conversation's first). Editing a question adds
    a sibling, so a conversation is a tree and each branch keeps its later turns."""
    shown: Mapped[bool] = mapped_column(default=True)
    """Among its siblings, the one on the branch shown (and sent to the model)."""
    seconds: Mapped[float | None] = mapped_column(Float)
    """An answer: how long it took to write, first word to last (its speed on hover)."""
    title: Mapped[str | None] = mapped_column(String(200))
    """On a first question: the title generated for the branch that starts with it."""

    conversation: Mapped[Conversation] = relationship(back_populates="messages")

    def __repr__(self) -> str:
        # Never the content: logs and tracebacks must not carry what people wrote.
        return f"Message(id={self.id}, conversation_id={self.conversation_id}, role={self.role!r})"


class AnswerVersion(Base):
    """An answer's other versions (Regenerate keeps the earlier ones): the shown version is
    the ``messages`` row itself; choosing another swaps its text into that row."""

    __tablename__ = "answer_versions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    message_id: Mapped[int] = mapped_column(ForeignKey("messages.id", ondelete="CASCADE"),
                                            index=True)
    content: Mapped[str] = mapped_column(Text)
    finish_reason: Mapped[str | None] = mapped_column(String(16))
    created_at: Mapped[float] = mapped_column(Float, default=time.time)

    def __repr__(self) -> str:
        return f"AnswerVersion(id={self.id}, message_id={self.message_id})"


class WebSession(Base):
    """A browser login. Only the SHA-256 of the cookie token is stored; a new token is made
    at every login (the id rotates) and logout deletes the row."""

    __tablename__ = "web_sessions"

    token_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[float] = mapped_column(Float, default=time.time)
    expires_at: Mapped[float] = mapped_column(Float)


class UserPreferences(Base):
    """What a person sets for themselves on the settings page."""

    __tablename__ = "user_preferences"
    __table_args__ = (CheckConstraint(_in("theme", THEMES), name="theme"),)

    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"),
                                         primary_key=True)
    system_prompt: Mapped[str] = mapped_column(Text, default="")
    """Their default system prompt (persona); empty: the household's."""
    theme: Mapped[str] = mapped_column(String(8), default="system")


class HouseholdSetting(Base):
    """Household-wide settings that admins set (``system_prompt``: the default persona)."""

    __tablename__ = "household_settings"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text, default="")


# Background jobs (appliance/jobs/). Definitions and runs live here, not in APScheduler's own
# (pickling) job store: the daemon re-adds every active job to its scheduler at start-up.
SOURCE_KINDS: tuple[str, ...] = ("text", "url", "conversations")
SCHEDULE_KINDS: tuple[str, ...] = ("none", "cron", "interval")
RUN_STATUSES: tuple[str, ...] = (
    "pending", "running", "done", "error", "quota", "cancelled", "interrupted")
RUN_TRIGGERS: tuple[str, ...] = ("schedule", "manual", "catch-up")


class Job(Base):
    """What a job produces (``instructions``) from which ``source``, when (``schedule_*``)
    and where the result goes (stored always; ``webhook_url`` optionally). ``cursor`` is the
    source's JSON memory between runs (feed items already summarised)."""

    __tablename__ = "jobs"
    __table_args__ = (
        CheckConstraint(_in("source_kind", SOURCE_KINDS), name="source_kind"),
        CheckConstraint(_in("schedule_kind", SCHEDULE_KINDS), name="schedule_kind"),
        UniqueConstraint("user_id", "name", name="uq_jobs_user_id_name"),
        # ids are never reused (a webhook receiver tells jobs apart by them): migration 0007
        {"sqlite_autoincrement": True},
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(100))
    instructions: Mapped[str] = mapped_column(Text)
    source_kind: Mapped[str] = mapped_column(String(16))
    source_text: Mapped[str | None] = mapped_column(Text)
    url: Mapped[str | None] = mapped_column(String(2000))
    headers: Mapped[str | None] = mapped_column(Text)  # JSON object; values never shown back
    schedule_kind: Mapped[str] = mapped_column(String(16), default="none")
    cron: Mapped[str | None] = mapped_column(String(120))
    interval_s: Mapped[int | None] = mapped_column(Integer)
    max_output_tokens: Mapped[int] = mapped_column(Integer, default=400)
    webhook_url: Mapped[str | None] = mapped_column(String(2000))
    paused: Mapped[bool] = mapped_column(default=False)
    cursor: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Float, default=time.time)
    updated_at: Mapped[float] = mapped_column(Float, default=time.time)

    def __repr__(self) -> str:
        return f"Job(id={self.id}, user_id={self.user_id}, source={self.source_kind!r})"


class JobRun(Base):
    """One run of a job: unique per (job, scheduled time), so a slot never runs twice.

    A run interrupted by a crash keeps its row: it is marked ``interrupted`` at the next
    start-up and retried once in the same row (``attempts`` 2, ``interrupted_at`` kept).
    ``request_ids`` are the ledger request ids of its model requests (space separated):
    the run's token counts are the ledger's sums over them."""

    __tablename__ = "job_runs"
    __table_args__ = (
        CheckConstraint(_in("status", RUN_STATUSES), name="status"),
        CheckConstraint(_in("trigger", RUN_TRIGGERS), name="trigger"),
        UniqueConstraint("job_id", "scheduled_for", name="uq_job_runs_job_id_scheduled_for"),
        Index("ix_job_runs_status", "status"),
        {"sqlite_autoincrement": True},  # run ids are never reused either
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    scheduled_for: Mapped[float] = mapped_column(Float)
    trigger: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[float] = mapped_column(Float, default=time.time)
    started_at: Mapped[float | None] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float)
    interrupted_at: Mapped[float | None] = mapped_column(Float)
    chunks_total: Mapped[int] = mapped_column(Integer, default=0)
    chunks_done: Mapped[int] = mapped_column(Integer, default=0)
    requests: Mapped[int] = mapped_column(Integer, default=0)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    output_tokens: Mapped[int] = mapped_column(Integer, default=0)
    request_ids: Mapped[str] = mapped_column(Text, default="")
    source_bytes: Mapped[int] = mapped_column(Integer, default=0)
    output: Mapped[str | None] = mapped_column(Text)
    error: Mapped[str | None] = mapped_column(Text)
    delivery: Mapped[str | None] = mapped_column(String(16))
    delivery_detail: Mapped[str | None] = mapped_column(Text)


class JobStep(Base):
    """One finished stage of a run (a map step, a reduce group), kept while the run can
    still be retried so an interrupted run resumes instead of paying for it again.

    ``key`` is a digest of what the stage asked (model, output limit, prompt), so a retry
    reuses a stage only when it would ask exactly the same; the rows go when the run
    finishes (they stay only for ``interrupted`` runs)."""

    __tablename__ = "job_steps"
    __table_args__ = (UniqueConstraint("run_id", "key", name="uq_job_steps_run_id_key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("job_runs.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(String(64))
    output: Mapped[str] = mapped_column(Text)
    request_id: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[float] = mapped_column(Float, default=time.time)
