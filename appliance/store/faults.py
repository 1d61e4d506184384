"""Storage faults as a first-class state: which SQLite errors mean "the disk will not take
writes" (full, read-only, I/O error, damaged file), the store's health, and what the
connection pool does about them.

A storage fault is not a bad request and not a bug: the daemon keeps answering, the store
writer keeps unwritten ledger rows and retries, handlers answer 503 ``storage_unavailable``
and ``/health`` says why. After such an error the whole pool is recycled, and a connection
opened while the store was failing is used once and then replaced: SQLite opens a file it
cannot write read-only and keeps it so, so a pooled connection from the bad spell would
fail again after the disk is back.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, event
from sqlalchemy.engine import ExceptionContext
from sqlalchemy.exc import DisconnectionError

log = logging.getLogger(__name__)

# Primary result codes (https://sqlite.org/rescode.html); extended codes keep them in the
# low byte (SQLITE_IOERR_WRITE is 778 = 3 << 8 | 10).
_FAULTS = {3: "SQLITE_PERM", 8: "SQLITE_READONLY", 10: "SQLITE_IOERR", 11: "SQLITE_CORRUPT",
           13: "SQLITE_FULL", 14: "SQLITE_CANTOPEN", 26: "SQLITE_NOTADB"}
_BUSY = {5: "SQLITE_BUSY", 6: "SQLITE_LOCKED"}
_DAMAGED = {"SQLITE_CORRUPT", "SQLITE_NOTADB"}
LOST = "DATABASE_FILE_LOST"
"""``StoreHealth.fault`` once the database file was deleted or replaced while running."""

DATABASE_DAMAGED_EXIT = 65
"""``appliance serve`` exit status when the database file is damaged (sysexits'
EX_DATAERR): listed in the unit's ``RestartPreventExitStatus=`` because restarting cannot
mend a file; a person must restore or recover it."""


def _code(exc: BaseException) -> int | None:
    orig = getattr(exc, "orig", None) or exc
    code = getattr(orig, "sqlite_errorcode", None)
    return None if code is None else int(code) & 0xFF


def storage_fault(exc: BaseException) -> str | None:
    """The SQLite error name when ``exc`` means the database cannot take writes (or cannot
    be read) whatever the statement: full, read-only, I/O error, damaged. None otherwise
    (a constraint, a lock, a bug)."""
    code = _code(exc)
    return _FAULTS.get(code) if code is not None else None


def is_busy(exc: BaseException) -> bool:
    """Locked by another connection past the busy timeout: wait and retry."""
    code = _code(exc)
    if code is not None:
        return code in _BUSY
    return "locked" in str(exc) or "busy" in str(exc)


def is_damaged(exc: BaseException) -> bool:
    return storage_fault(exc) in _DAMAGED


def driver_message(exc: BaseException) -> str:
    """SQLite's own words (``database or disk is full``), never SQL or parameters."""
    orig = getattr(exc, "orig", None) or exc
    return str(orig) if isinstance(orig, sqlite3.Error) else type(exc).__name__


def damaged_message(path: Path, reason: str) -> str:
    """The one line ``appliance serve`` prints before it exits with a damaged database."""
    return (f"appliance: the database {path} is damaged ({reason}); not "
            f"starting. Stop here and restore a backup of it, or recover what it holds with "
            f"`sqlite3 {path} .recover | sqlite3 {path}.recovered` and move "
            f"{path}.recovered to {path} (keep the damaged file); then start again.")


@dataclass
class StoreHealth:
    """Whether the database takes writes: set by any connection that hits a storage fault,
    cleared by the store writer's next successful commit (it retries and probes)."""

    fault: str | None = None
    """SQLite error name of the fault now, e.g. ``SQLITE_FULL``; None: writable."""
    detail: str = ""
    since: float | None = None
    faults_total: int = 0
    lost: str | None = None
    """Why the database file is no longer the one opened (deleted or replaced while
    running): every write refused until a restart; see :mod:`appliance.store.datadir`."""
    on_fault: list[Callable[[], None]] = field(default_factory=list, repr=False)
    """Called (from the failing thread) when a spell of faults begins."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def faulted(self) -> bool:
        return self.fault is not None

    def note_fault(self, name: str, detail: str) -> None:
        with self._lock:
            self.faults_total += 1
            begins = self.fault is None
            if begins:
                self.since = time.time()
                log.error("store: the database takes no writes (%s: %s); keeping ledger rows "
                          "in memory and retrying", name, detail)
            self.fault, self.detail = name, detail
        if begins:
            for hook in list(self.on_fault):
                hook()

    def note_lost(self, reason: str) -> None:
        """The file is gone or replaced: refuse every connection from now on (a new one
        would open, or create, another file) and say so loudly, once."""
        with self._lock:
            if self.lost is not None:
                return
            self.lost = reason
        log.critical("store: %s; refusing every write until the daemon is restarted "
                     "(it will refuse to start on an empty database while a backup exists)",
                     reason)
        self.note_fault(LOST, reason)

    def note_ok(self) -> None:
        with self._lock:
            if self.fault is None or self.lost is not None:
                return
            log.warning("store: the database takes writes again after %.1f s (%s)",
                        time.time() - (self.since or time.time()), self.fault)
            self.fault, self.detail, self.since = None, "", None


def lost_error(reason: str) -> sqlite3.OperationalError:
    """SQLite's "unable to open database file" (SQLITE_CANTOPEN), as a lost file gives."""
    exc = sqlite3.OperationalError(f"unable to open database file: {reason}")
    exc.sqlite_errorcode = 14
    exc.sqlite_errorname = "SQLITE_CANTOPEN"
    return exc


def _release(connection: Any) -> None:
    """Roll back the failed transaction before the connection is invalidated. Closing alone
    does not end it while the failed statement's cursor lives on (in the exception's
    traceback, until the garbage collector breaks the cycle): SQLite keeps such a
    connection open as a zombie, holding the write lock, and every other writer waits it
    out as "database is locked" long after the disk has room again."""
    try:
        raw = connection.connection.dbapi_connection
        if raw is not None and raw.in_transaction:
            raw.rollback()
    except Exception as exc:  # the connection is discarded whatever happens here
        log.debug("store: rollback after a storage fault failed (%s)", type(exc).__name__)


def install(engine: Engine, health: StoreHealth) -> None:
    """Note storage faults in ``health`` and recycle connections after them (see above)."""

    @event.listens_for(engine, "handle_error")
    def _on_error(ctx: ExceptionContext) -> None:
        name = storage_fault(ctx.original_exception)
        if name is None:
            return
        health.note_fault(name, driver_message(ctx.original_exception))
        if ctx.connection is not None and not ctx.is_pre_ping:
            _release(ctx.connection)
            ctx.is_disconnect = True  # invalidates this connection and the whole pool

    @event.listens_for(engine, "do_connect")
    def _do_connect(_dialect: Any, _record: Any, _cargs: Any, _cparams: Any) -> None:
        if health.lost is not None:  # SQLite would open (or create) another file there
            raise lost_error(health.lost)

    @event.listens_for(engine, "checkout")
    def _refuse_when_lost(_dbapi: Any, _record: Any, _proxy: Any) -> None:
        if health.lost is not None:  # pooled: still the unlinked file, whose writes vanish
            raise DisconnectionError(health.lost)

    @event.listens_for(engine, "connect")
    def _on_connect(_dbapi: Any, record: Any) -> None:
        record.info["fresh"] = True
        record.info["opened_in_fault"] = health.faulted

    @event.listens_for(engine, "checkout")
    def _on_checkout(_dbapi: Any, record: Any, _proxy: Any) -> None:
        if record.info.pop("fresh", False):
            return
        if record.info.get("opened_in_fault"):
            raise DisconnectionError("opened while the database took no writes")


# -- test hook --------------------------------------------------------------------------

TEST_ENV = "APPLIANCE_TEST_STORE_FAULT"
"""Path of a control file for tests of the real daemon; never set it in production. The
file says ``full``, ``readonly`` or nothing (or is missing)."""


def install_test_fault(engine: Engine, control: Path, db_path: Path) -> None:
    """Make SQLite itself fail the way a full disk or a read-only file does, by what the
    control file says when a connection is checked out:

    - ``full``: ``PRAGMA max_page_count`` is set to the file's current size, so any write
      that needs a new page fails with SQLITE_FULL ("database or disk is full"), the very
      error of a full disk, from the same place in SQLite's pager; cleared again (the
      connection's own default) when the file no longer says so, as freed space would.
    - ``readonly``: connections are (re)opened with ``mode=ro``, which is what SQLite does
      by itself with a file it may not write (chmod does not stop root, who runs the
      tests): writes fail with SQLITE_READONLY. Such a connection stays read-only after the
      file is cleared, like the real one; replacing it is the store's job.
    """

    def mode() -> str:
        try:
            return control.read_text().strip()
        except FileNotFoundError:
            return ""

    @event.listens_for(engine, "do_connect")
    def _do_connect(_dialect: Any, record: Any, cargs: list[Any], cparams: dict[str, Any]
                    ) -> None:
        if mode() == "readonly":
            cargs[:] = [f"file:{db_path}?mode=ro"]
            cparams["uri"] = True

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi: Any, record: Any) -> None:
        record.info["test_readonly"] = mode() == "readonly"
        record.info["test_max_pages"] = dbapi.execute("PRAGMA max_page_count").fetchone()[0]

    @event.listens_for(engine, "checkout")
    def _on_checkout(dbapi: Any, record: Any, _proxy: Any) -> None:
        now = mode()
        if now == "readonly" and not record.info.get("test_readonly"):
            raise DisconnectionError("test fault: reopen read-only")
        if now == "full":
            pages = dbapi.execute("PRAGMA page_count").fetchone()[0]
        else:
            pages = record.info["test_max_pages"]
        dbapi.execute(f"PRAGMA max_page_count = {int(pages)}")
