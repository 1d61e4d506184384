"""The single SQLite writer thread: ledger rows and counters, off the hot path.

Rule: ``submit_*`` only put a message on an unbounded queue, so they are safe to call from
any thread (the MLX engine thread included) and never wait for the database. The writer
thread takes everything queued, and commits it in one transaction; after a commit it
waits until ``flush_interval`` seconds have passed before the next one, batching whatever
arrives meanwhile. A ``flush()`` (or ``close()``) cuts the wait short. The first write
after an idle spell is committed at once.

Nothing answered is dropped because the disk misbehaves. Rows that fail because the
database takes no writes (full, read-only, I/O error: see :mod:`appliance.store.faults`)
or stays locked past a few retries are kept in a backlog, in memory, and retried with a
backoff (0.5 s growing to 5 s) together with whatever arrives meanwhile; while the backlog
holds ``backlog_limit`` ledger rows, :meth:`StoreWriter.refusal` says why new model
requests must wait (the service answers them 503, so the backlog stays bounded). Only a
row that fails on its own (a constraint) is dropped and logged (ids and counts only), so
one bad row cannot block the ledger.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import cast

from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from appliance.store.faults import StoreHealth, driver_message, is_busy, storage_fault
from appliance.store.keys import touch_keys
from appliance.store.ledger import LedgerRecord, insert_records
from appliance.store.limits import save_counters

__all__ = ["LedgerRecord", "StoreWriter", "WriterStats"]

log = logging.getLogger(__name__)

DEFAULT_FLUSH_INTERVAL_S = 0.5
DEFAULT_BACKLOG_LIMIT = 1000
"""Ledger rows kept in memory while the database takes no writes before model requests are
refused: a few hundred bytes each, and about an hour of a busy household's requests."""
_RETRY_DELAYS_S = (0.05, 0.2, 0.5)
_STILL_EVERY_S = 60.0
"""While the database takes no writes, the writer says so again this often."""
_BACKOFF_S = (0.5, 1.0, 2.0, 5.0)
"""Waits between attempts while the database takes no writes: a disk that frees up is
noticed within seconds, a lasting fault costs one attempt per 5 s."""


@dataclass(slots=True)
class WriterStats:
    """Running totals, written by the writer thread only (reads from elsewhere are fine)."""

    commits: int = 0
    ledger_rows: int = 0
    counter_rows: int = 0
    dropped: int = 0
    conflicts: int = 0
    """Ledger rows not written because their request id was already there (logged)."""
    backlog: int = 0
    """Ledger rows kept for a retry because the database took no writes (now)."""
    lost_at_close: int = 0
    """Ledger rows still unwritten when the writer was closed (logged with their ids)."""


@dataclass(slots=True)
class _FlushRequest:
    done: threading.Event = field(default_factory=threading.Event)


class _Stop:
    pass


@dataclass(frozen=True, slots=True)
class _KeyUsed:
    """An API key was used at ``when`` (its ``last_used_at``; authentication only reads)."""

    key_id: int
    when: float


_Item = LedgerRecord | dict[int, float] | _FlushRequest | _Stop | _KeyUsed


@dataclass(slots=True)
class _Batch:
    ledger: list[LedgerRecord] = field(default_factory=list)
    counters: dict[int, float] = field(default_factory=dict)
    keys_used: dict[int, float] = field(default_factory=dict)
    waiters: list[threading.Event] = field(default_factory=list)
    stop: bool = False

    def add(self, item: _Item) -> None:
        if isinstance(item, LedgerRecord):
            self.ledger.append(item)
        elif isinstance(item, dict):
            self.counters.update(item)  # later values win: a counter only moves forward
        elif isinstance(item, _FlushRequest):
            self.waiters.append(item.done)
        elif isinstance(item, _KeyUsed):
            self.keys_used[item.key_id] = max(item.when, self.keys_used.get(item.key_id, 0.0))
        else:
            self.stop = True

    def absorb(self, other: _Batch) -> None:
        self.ledger.extend(other.ledger)
        self.counters.update(other.counters)
        for key_id, when in other.keys_used.items():
            self.keys_used[key_id] = max(when, self.keys_used.get(key_id, 0.0))
        self.waiters.extend(other.waiters)
        self.stop = self.stop or other.stop

    @property
    def urgent(self) -> bool:
        return self.stop or bool(self.waiters)

    @property
    def has_rows(self) -> bool:
        return bool(self.ledger or self.counters or self.keys_used)


class StoreWriter:
    """Owns all background writes to the database. Starts its thread on construction."""

    def __init__(
        self,
        session_factory: sessionmaker[Session],
        flush_interval: float = DEFAULT_FLUSH_INTERVAL_S,
        *,
        name: str = "appliance-store-writer",
        health: StoreHealth | None = None,
        backlog_limit: int = DEFAULT_BACKLOG_LIMIT,
    ) -> None:
        if flush_interval < 0:
            raise ValueError("flush_interval must be >= 0")
        if backlog_limit < 1:
            raise ValueError("backlog_limit must be >= 1")
        self._factory = session_factory
        self._interval = flush_interval
        self._queue: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders submit against close; never held for I/O
        self._closed = False
        self._last_commit = float("-inf")
        self.health = health if health is not None else StoreHealth()
        self.backlog_limit = backlog_limit
        self._backlog = _Batch()  # unwritten rows and who waits for them (writer thread)
        self._failures = 0  # attempts failed in a row: the backoff step
        self._said = ("", 0.0)  # the failure last logged, and when
        self._retry_at: float | None = None
        self.stats = WriterStats()
        self.health.on_fault.append(self._nudge)  # a handler's fault: probe, then clear
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- any thread ---------------------------------------------------------------------

    def submit_ledger(self, record: LedgerRecord) -> None:
        """Queue one finished request's ledger row. Never blocks, never touches the DB."""
        self._put(record)

    def submit_counters(self, values: Mapping[int, float]) -> None:
        """Queue virtual token counters (user id -> value). Never blocks."""
        self._put(dict(values))

    def submit_key_used(self, key_id: int, when: float) -> None:
        """Queue an API key's ``last_used_at``. Never blocks; a write that fails on its own
        drops only it (a timestamp for the keys page, nothing anybody is billed by)."""
        self._put(_KeyUsed(key_id, when))

    def refusal(self) -> str | None:
        """Why new model requests must wait: the backlog holds ``backlog_limit`` ledger
        rows the database would not take. None while it is below that."""
        if self.health.lost is not None:  # nothing will be written before a restart
            return self.health.lost
        kept = self.stats.backlog
        if kept < self.backlog_limit:
            return None
        why = self.health.fault or "database locked"
        return (f"{kept} ledger rows wait to be written and the database takes no writes "
                f"({why})")

    def flush(self, timeout: float | None = None) -> bool:
        """Block until everything submitted before this call has been tried. True when it
        is all committed (or dropped as bad rows); False on timeout, or when rows wait in
        the backlog because the database takes no writes. Not for the engine thread."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("flush() called from the writer thread")
        request = _FlushRequest()
        with self._lock:
            if self._closed:
                return self.stats.backlog == 0
            self._queue.put(request)
        return request.done.wait(timeout) and self.stats.backlog == 0

    def close(self, timeout: float | None = None) -> None:
        """Commit everything queued, then stop the thread. Idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._queue.put(_Stop())
        self._thread.join(timeout)

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _put(self, item: _Item) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("StoreWriter is closed")
            self._queue.put(item)

    def _nudge(self) -> None:
        with self._lock:
            if not self._closed:
                self._queue.put(_FlushRequest())

    # -- writer thread ------------------------------------------------------------------

    def _run(self) -> None:
        while self._step():
            pass

    def _step(self) -> bool:
        """Collect one batch, commit it with the backlog, wake flush() callers. False once
        stopped."""
        work = self._backlog
        work.absorb(self._collect())
        try:
            if work.has_rows:
                self._commit(work)
                if work.stop and work.has_rows:
                    self._last_tries(work)
            elif self.health.faulted:
                self._probe()
        except Exception:  # keep the thread alive whatever happens; waiters must wake
            log.exception("store writer: batch failed")
            self._backoff()
        finally:
            self.stats.backlog = len(work.ledger)
            for done in work.waiters:
                done.set()
            work.waiters.clear()
        return not work.stop

    def _collect(self) -> _Batch:
        batch = _Batch()
        waiting = self._backlog.has_rows or self.health.faulted
        if not waiting:
            batch.add(self._queue.get())  # sleep until there is something to do
        else:  # until the next retry, unless something arrives
            try:
                batch.add(self._queue.get(timeout=max(0.0, (self._retry_at or 0.0)
                                                      - time.monotonic())))
            except queue.Empty:
                return batch
        deadline = max(self._last_commit + self._interval, self._retry_at or float("-inf"))
        while not batch.urgent:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                batch.add(self._queue.get(timeout=remaining))
            except queue.Empty:
                break
        while True:  # take whatever else is already waiting
            try:
                batch.add(self._queue.get_nowait())
            except queue.Empty:
                return batch

    def _commit(self, work: _Batch) -> None:
        """Write ``work``'s rows; what is written or dropped leaves it, the rest stays."""
        started = time.monotonic()
        n_ledger, n_counters = len(work.ledger), len(work.counters)
        if work.ledger or work.counters:
            for delay in (*_RETRY_DELAYS_S, None):
                try:
                    self._write(work.ledger, work.counters)
                except SQLAlchemyError as exc:
                    if storage_fault(exc) is not None or (is_busy(exc) and delay is None):
                        self._failed(exc)
                        return
                    if is_busy(exc):  # locked past busy_timeout: try again soon
                        time.sleep(cast(float, delay))
                        continue
                    log.warning("store writer: batch failed (%s), writing rows singly",
                                type(exc).__name__)
                    if not self._commit_singly(work):
                        return
                    break
                else:
                    self._count(n_ledger, n_counters)
                    work.ledger, work.counters = [], {}
                    log.debug("store writer: committed ledger=%d counters=%d in %.1f ms",
                              n_ledger, n_counters, (time.monotonic() - started) * 1e3)
                    break
        if work.keys_used and not self._touch_keys(work.keys_used):
            return
        work.keys_used = {}
        self._recovered(n_ledger)
        self._last_commit = time.monotonic()

    def _write(self, ledger: list[LedgerRecord], counters: Mapping[int, float]) -> None:
        with self._factory.begin() as session:
            skipped = insert_records(session, ledger)
            save_counters(session, counters)
        if skipped:
            self.stats.conflicts += len(skipped)
            log.error("store writer: %d ledger rows NOT written: their request id is already "
                      "in the ledger (ids %s)", len(skipped), ", ".join(skipped[:10]))

    def _touch_keys(self, used: Mapping[int, float]) -> bool:
        """False when the database takes no writes (the times stay for the next try)."""
        try:
            with self._factory.begin() as session:
                touch_keys(session, used)
        except SQLAlchemyError as exc:
            if storage_fault(exc) is not None or is_busy(exc):
                self._failed(exc)
                return False
            log.warning("store writer: last-used times of %d keys not saved (%s)", len(used),
                        _reason(exc))
        return True

    def _probe(self) -> None:
        """Someone hit a storage fault and nothing waits to be written: try a real write
        (the header's user version, rewritten as it is) to learn when the disk is back."""
        try:
            with self._factory.begin() as session:
                version = int(session.execute(text("PRAGMA user_version")).scalar() or 0)
                session.execute(text(f"PRAGMA user_version = {version}"))
        except SQLAlchemyError as exc:
            self._failed(exc)
        else:
            self._recovered(0)

    def _failed(self, exc: SQLAlchemyError) -> None:
        """The database took no writes: keep everything and try again after a backoff.
        Logged at a spell's first failure, when the reason changes (a disk freed, then
        another connection holding the lock) and every :data:`_STILL_EVERY_S` besides."""
        self._backoff()
        reason = f"{storage_fault(exc) or type(exc).__name__}: {driver_message(exc)}"
        now = time.monotonic()
        if self._failures == 1:
            log.warning("store writer: %d ledger rows and %d counters kept, retrying every "
                        "%.1f-%.0f s (%s)", len(self._backlog.ledger),
                        len(self._backlog.counters), _BACKOFF_S[0], _BACKOFF_S[-1], reason)
        elif reason != self._said[0] or now - self._said[1] >= _STILL_EVERY_S:
            log.warning("store writer: still no writes after %d attempts; %d ledger rows and "
                        "%d counters kept (%s)", self._failures, len(self._backlog.ledger),
                        len(self._backlog.counters), reason)
        else:
            return
        self._said = (reason, now)

    def _backoff(self) -> None:
        self._failures += 1
        delay = _BACKOFF_S[min(self._failures, len(_BACKOFF_S)) - 1]
        self._retry_at = time.monotonic() + delay

    def _recovered(self, written: int) -> None:
        if self._failures:
            log.warning("store writer: the database takes writes again after %d failed "
                        "attempts; %d ledger rows written", self._failures, written)
        self._failures, self._retry_at = 0, None
        self.health.note_ok()

    def _last_tries(self, work: _Batch) -> None:
        """Closing with rows the database would not take: a few more tries, then say which
        rows are lost (ids only)."""
        for delay in _BACKOFF_S[:3]:
            time.sleep(delay)
            self._commit(work)
            if not work.has_rows:
                return
        self.stats.lost_at_close += len(work.ledger)
        ids = ", ".join(r.request_id for r in work.ledger[:20])
        log.error("store writer: closing with %d ledger rows and %d counters NOT written: "
                  "the database takes no writes (%s); request ids %s%s", len(work.ledger),
                  len(work.counters), self.health.fault or "locked", ids,
                  " ..." if len(work.ledger) > 20 else "")
        work.ledger, work.counters, work.keys_used = [], {}, {}

    def _count(self, ledger_rows: int, counter_rows: int) -> None:
        self.stats.commits += 1
        self.stats.ledger_rows += ledger_rows
        self.stats.counter_rows += counter_rows

    def _commit_singly(self, work: _Batch) -> bool:
        """Write rows one by one, dropping (and logging) those that fail on their own.
        False when the database stopped taking writes meanwhile: the rest stays."""
        while work.ledger:
            record = work.ledger[0]
            try:
                self._write([record], {})
                self._count(1, 0)
            except SQLAlchemyError as exc:
                if storage_fault(exc) is not None or is_busy(exc):
                    self._failed(exc)
                    return False
                self.stats.dropped += 1
                log.error("store writer: dropped ledger row request_id=%s user_id=%d (%s)",
                          record.request_id, record.user_id, _reason(exc))
            work.ledger.pop(0)
        while work.counters:
            user_id, value = next(iter(work.counters.items()))
            try:
                self._write([], {user_id: value})
                self._count(0, 1)
            except SQLAlchemyError as exc:
                if storage_fault(exc) is not None or is_busy(exc):
                    self._failed(exc)
                    return False
                self.stats.dropped += 1
                log.error("store writer: dropped counter user_id=%d (%s)", user_id, _reason(exc))
            del work.counters[user_id]
        return True


def _reason(exc: SQLAlchemyError) -> str:
    """The driver's message without SQL or parameters (e.g. 'FOREIGN KEY constraint failed')."""
    orig = getattr(exc, "orig", None)
    return str(orig) if orig is not None else type(exc).__name__
