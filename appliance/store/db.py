"""SQLite engine and sessions.

One database file, opened in WAL mode so readers never block the writer and the writer
never blocks readers. Every connection gets ``foreign_keys=ON`` and a ``busy_timeout``.

Transactions: pysqlite's own transaction handling is switched off (``isolation_level =
None``) and we emit ``BEGIN`` ourselves, following SQLAlchemy's "Serializable isolation /
Savepoints / Transactional DDL" recipe for pysqlite. Write sessions begin with ``BEGIN
IMMEDIATE``: the write lock is taken up front, where ``busy_timeout`` waits for it. With a
plain deferred ``BEGIN`` a transaction that reads and then writes can fail at once with
"database is locked" when another writer committed in between (SQLite cannot wait there
without breaking snapshot isolation). Read-only sessions (``write=False``) begin deferred
and never wait for the writer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session, sessionmaker

from appliance.store import faults
from appliance.store.faults import StoreHealth

DEFAULT_BUSY_TIMEOUT_MS = 5000
_BEGIN_OPTION = "appliance_sqlite_begin"


def sqlite_url(path: Path) -> str:
    return f"sqlite+pysqlite:///{Path(path).resolve()}"


def make_engine(
    path: Path,
    *,
    busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS,
    foreign_keys: bool = True,
    echo: bool = False,
) -> Engine:
    """Open (creating if needed) the SQLite file at ``path``.

    ``foreign_keys=False`` exists for migrations only: SQLite's batch "move and copy" table
    rebuilds must run with foreign keys off (``migrations/env.py`` re-checks them with
    ``PRAGMA foreign_key_check`` before committing).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    make_private(path)
    engine = create_engine(sqlite_url(path), echo=echo)
    _install_pragmas(engine, busy_timeout_ms=busy_timeout_ms, foreign_keys=foreign_keys)
    return engine


def make_private(path: Path) -> None:
    """Create the database file readable by its owner only (0600, like the secret), and
    tighten an existing one with its WAL and shared-memory files. SQLite creates ``-wal``
    and ``-shm`` with the database file's own mode, so they follow."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.close(fd)
    for f in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        try:
            if f.stat().st_mode & 0o077:
                f.chmod(0o600)
        except FileNotFoundError:
            pass


def _install_pragmas(engine: Engine, *, busy_timeout_ms: int, foreign_keys: bool) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Stop pysqlite from emitting BEGIN (and from committing before DDL) on its own.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
            cursor.execute("PRAGMA journal_mode = WAL")
            # NORMAL is durable across application crashes in WAL mode; only an OS crash or
            # power cut can lose the last commits, which is the right trade for a ledger.
            cursor.execute("PRAGMA synchronous = NORMAL")
            cursor.execute(f"PRAGMA foreign_keys = {'ON' if foreign_keys else 'OFF'}")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        mode = conn.get_execution_options().get(_BEGIN_OPTION, "IMMEDIATE")
        conn.exec_driver_sql(f"BEGIN {mode}")


def session_factory(engine: Engine, *, write: bool = True) -> sessionmaker[Session]:
    """Sessions bound to ``engine``.

    ``write=True`` (default): transactions start with ``BEGIN IMMEDIATE``.
    ``write=False``: ``BEGIN DEFERRED``, for pure reads (pages, dashboards); a write inside
    such a session may fail with "database is locked" instead of waiting.

    Objects stay usable after commit (``expire_on_commit=False``), so callers can return
    rows from a ``with factory.begin() as session:`` block.
    """
    bind = engine if write else engine.execution_options(**{_BEGIN_OPTION: "DEFERRED"})
    return sessionmaker(bind=bind, expire_on_commit=False)


@dataclass(frozen=True, slots=True)
class Store:
    """An open database: the engine and its two kinds of sessions."""

    engine: Engine
    sessions: sessionmaker[Session]  # BEGIN IMMEDIATE: anything that may write
    read_sessions: sessionmaker[Session]  # BEGIN DEFERRED: pure reads
    health: StoreHealth = field(default_factory=StoreHealth)
    """Whether the file takes writes (see :mod:`appliance.store.faults`)."""

    def close(self) -> None:
        self.engine.dispose()


DB_FILE = "appliance.db"


def db_file(data_dir: str | Path) -> Path:
    """The database in a data folder (``--data-dir``)."""
    return Path(data_dir).expanduser() / DB_FILE


def open_store(path: Path, *, busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS,
               test_fault: Path | None = None) -> Store:
    """Open the (already migrated) database at ``path``; see ``appliance.store.migrate``.
    Storage faults are noted in ``Store.health`` and recycle the pool; ``test_fault`` is the
    tests' control file (``faults.install_test_fault``)."""
    engine = make_engine(path, busy_timeout_ms=busy_timeout_ms)
    health = StoreHealth()
    faults.install(engine, health)
    if test_fault is not None:
        faults.install_test_fault(engine, test_fault, Path(path).resolve())
    return Store(engine, session_factory(engine), session_factory(engine, write=False), health)
