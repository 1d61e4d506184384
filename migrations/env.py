"""Alembic environment, driven from code (``appliance.store.migrate``); no alembic.ini.

The caller puts an open ``Connection`` in ``config.attributes["connection"]`` (inside a
transaction it will commit), or sets ``sqlalchemy.url`` for offline SQL generation.
Migrations run with SQLite foreign keys OFF (batch table rebuilds need that), so before
the caller commits we run ``PRAGMA foreign_key_check`` and refuse to finish when a
migration left dangling references.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import text
from sqlalchemy.engine import Connection

from appliance.store.models import Base

target_metadata = Base.metadata


def run_migrations_offline() -> None:
    context.configure(
        url=context.config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def _check_foreign_keys(connection: Connection) -> None:
    problems = connection.execute(text("PRAGMA foreign_key_check")).fetchall()
    if problems:
        tables = sorted({str(row[0]) for row in problems})
        raise RuntimeError(f"migration left broken foreign keys in: {', '.join(tables)}")


def run_migrations_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is None:
        raise RuntimeError("run migrations through appliance.store.migrate (no connection given)")
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=True,  # SQLite can only ALTER a little: rebuild tables instead
        transactional_ddl=True,  # our pysqlite setup makes SQLite DDL transactional
    )
    with context.begin_transaction():
        context.run_migrations()
    _check_foreign_keys(connection)


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
