"""The data folder is owned: one daemon per folder (a lock held for the process's life), a
last-known-good copy of the database beside it, and a watch on the database file.

- ``hold_lock``: ``flock`` on ``serve.lock`` in the folder, held until the process ends (the
  kernel drops it even after kill -9); a second ``appliance serve`` on the same folder is
  told the first one's PID and exits, so jobs never run twice.
- ``take_backup``: SQLite's online backup API into ``appliance.db.backup`` (written beside,
  then renamed over the old copy, 0600), at start once the file passed its checks and then
  every ``--backup-interval`` minutes while the file is still the one opened.
- ``check_not_lost``: at start, a database that is missing (or empty) while a backup exists
  is refused with the restore command; a fresh empty database would silently drop every
  user and key (docs/decisions/data-folder.md).
- ``DatabaseWatch``: notices the file deleted or replaced under the running daemon and
  marks the store lost (``StoreHealth.note_lost``): ``/health`` 503, writes refused.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from appliance.store.faults import StoreHealth

log = logging.getLogger(__name__)

LOCK_FILE = "serve.lock"
DATA_DIR_BUSY_EXIT = 73
"""``appliance serve`` exit status when another daemon holds the data folder (sysexits'
EX_CANTCREAT)."""
DATABASE_LOST_EXIT = 66
"""``appliance serve`` exit status when the database is missing but a backup exists
(sysexits' EX_NOINPUT): a person must restore it, so the unit does not retry."""
BACKUP_SUFFIX = ".backup"


class DataDirBusy(Exception):
    """Another process holds the data folder's lock; the message names it."""


class DatabaseLost(Exception):
    """The database is missing (or empty) and a backup exists; the message says how to
    restore it."""


def backup_file(db: Path) -> Path:
    return db.with_name(db.name + BACKUP_SUFFIX)


def hold_lock(data_dir: Path) -> int:
    """Take the folder's lock (non-blocking) and write our PID into it; returns the open
    descriptor, which must stay open for the process's life. Raises ``DataDirBusy``."""
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            os.close(fd)
            raise
        owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise DataDirBusy(
            f"appliance: another daemon (PID {owner}) already serves the data folder "
            f"{data_dir}; not starting a second one (its jobs would run twice). Stop it "
            f"first, or give this one its own --data-dir.") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def check_not_lost(db: Path) -> None:
    """Raise ``DatabaseLost`` when ``db`` is missing or empty while its backup exists."""
    backup = backup_file(db)
    if not backup.exists():
        return
    try:
        if db.stat().st_size > 0:
            return
        what = "is empty"
    except FileNotFoundError:
        what = "is missing"
    raise DatabaseLost(
        f"appliance: the database {db} {what} but its last backup {backup} exists "
        f"(taken {time.strftime('%Y-%m-%d %H:%M', time.localtime(backup.stat().st_mtime))}); "
        f"not creating an empty one, which would lose every user and key. Restore it with "
        f"`rm -f {db}-wal {db}-shm && cp -p {backup} {db}`, then start again; to start "
        f"afresh on purpose, move {backup} away first.")


def take_backup(db: Path) -> Path:
    """Copy ``db`` with SQLite's online backup API (a consistent snapshot, WAL included,
    even while the writer commits) to ``appliance.db.backup``, atomically; returns the
    backup's path."""
    backup = backup_file(db)
    tmp = backup.with_name(backup.name + ".tmp")
    tmp.unlink(missing_ok=True)
    os.close(os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    src = sqlite3.connect(f"file:{db}?mode=rw", uri=True)  # never creates it
    try:
        dst = sqlite3.connect(tmp)
        try:
            src.backup(dst)
            dst.execute("PRAGMA journal_mode = DELETE")  # one self-contained file
        finally:
            dst.close()
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, backup)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        src.close()
    return backup


def file_id(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


@dataclass
class DatabaseWatch:
    """A thread that stats the database file every ``interval_s`` and takes a backup every
    ``backup_interval_s`` (0: only the one at start) while it is still the file opened.

    What was written after the last backup cannot be saved once the file is gone: SQLite
    refuses to read a deleted file even through a connection opened before
    (SQLITE_IOERR_FSTAT), so the backup's interval bounds what a deletion loses."""

    db: Path
    health: StoreHealth
    interval_s: float = 1.0
    backup_interval_s: float = 3600.0
    _opened: tuple[int, int] | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> DatabaseWatch:
        self._opened = file_id(self.db)
        self._thread = threading.Thread(target=self._run, name="appliance-db-watch",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def check(self) -> str | None:
        """Why the file is no longer the one opened (the store then marked lost), or
        None."""
        if self.health.lost is not None:
            return self.health.lost
        now = file_id(self.db)
        if now == self._opened:
            return None
        what = "deleted" if now is None else "replaced by another file"
        backup = backup_file(self.db)
        self.health.note_lost(f"the database file {self.db} was {what} while running; "
                              f"its last backup is {backup}")
        return self.health.lost

    def _run(self) -> None:
        next_backup = time.monotonic() + self.backup_interval_s
        while not self._stop.wait(self.interval_s):
            if self.check() is not None:
                return  # lost for good: a restart decides (and refuses without the file)
            if self.backup_interval_s > 0 and time.monotonic() >= next_backup:
                next_backup = time.monotonic() + self.backup_interval_s
                self._backup()

    def _backup(self) -> None:
        try:
            started = time.monotonic()
            path = take_backup(self.db)
            log.info("store: database backed up to %s in %.2f s", path,
                     time.monotonic() - started)
        except (OSError, sqlite3.Error) as exc:
            log.warning("store: the periodic backup failed (%s); the previous one is kept", exc)
