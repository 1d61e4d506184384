"""The single SQLite writer thread: ledger rows and counters, off the hot path.

Rule: ``submit_*`` only put a message on an unbounded queue, so they are safe to call from
any thread (the MLX engine thread included) and never wait for the database. The writer
thread takes everything queued, and commits it in one transaction; after a commit it
waits until ``flush_interval`` seconds have passed before the next one, batching whatever
arrives meanwhile. A ``flush()`` (or ``close()``) cuts the wait short. The first write
after an idle spell is committed at once.

If a batch fails, transient errors (a locked database) are retried a few times; then the
rows are written one by one and the ones that still fail are dropped and logged (ids and
counts only), so one bad row cannot block the ledger.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from sqlalchemy.exc import OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from appliance.store.keys import touch_keys
from appliance.store.ledger import LedgerRecord, insert_records
from appliance.store.limits import save_counters

__all__ = ["LedgerRecord", "StoreWriter", "WriterStats"]

log = logging.getLogger(__name__)

DEFAULT_FLUSH_INTERVAL_S = 0.5
_RETRY_DELAYS_S = (0.05, 0.2, 0.5)


@dataclass(slots=True)
class WriterStats:
    """Running totals, written by the writer thread only (reads from elsewhere are fine)."""

    commits: int = 0
    ledger_rows: int = 0
    counter_rows: int = 0
    dropped: int = 0
    conflicts: int = 0
    """Ledger rows not written because their request id was already there (logged)."""


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
    ) -> None:
        if flush_interval < 0:
            raise ValueError("flush_interval must be >= 0")
        self._factory = session_factory
        self._interval = flush_interval
        self._queue: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders submit against close; never held for I/O
        self._closed = False
        self._last_commit = float("-inf")
        self.stats = WriterStats()
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
        """Queue an API key's ``last_used_at``. Never blocks; a failed write drops only it
        (a timestamp for the keys page, nothing anybody is billed by)."""
        self._put(_KeyUsed(key_id, when))

    def flush(self, timeout: float | None = None) -> bool:
        """Block until everything submitted before this call is committed (or dropped after
        failing). Returns False on timeout. Not for the engine thread: it waits on the DB."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("flush() called from the writer thread")
        request = _FlushRequest()
        with self._lock:
            if self._closed:
                return True
            self._queue.put(request)
        return request.done.wait(timeout)

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

    # -- writer thread ------------------------------------------------------------------

    def _run(self) -> None:
        while self._step():
            pass

    def _step(self) -> bool:
        """Collect one batch, commit it, wake flush() callers. False once stopped."""
        batch = self._collect()
        try:
            if batch.has_rows:
                if batch.ledger or batch.counters:
                    self._commit(batch)
                self._touch_keys(batch.keys_used)
                self._last_commit = time.monotonic()
        except Exception:  # keep the thread alive whatever happens; waiters must wake
            log.exception("store writer: batch failed")
        finally:
            for done in batch.waiters:
                done.set()
        return not batch.stop

    def _collect(self) -> _Batch:
        batch = _Batch()
        batch.add(self._queue.get())  # sleep until there is something to do
        deadline = self._last_commit + self._interval
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

    def _commit(self, batch: _Batch) -> None:
        started = time.monotonic()
        for delay in (*_RETRY_DELAYS_S, None):
            try:
                self._write(batch.ledger, batch.counters)
            except OperationalError as exc:  # e.g. locked past busy_timeout: try again
                if delay is None:
                    log.warning("store writer: batch failed (%s), writing rows singly",
                                type(exc.orig).__name__)
                    self._commit_singly(batch)
                    return
                time.sleep(delay)
            except SQLAlchemyError as exc:  # a bad row (constraint): isolate it
                log.warning("store writer: batch failed (%s), writing rows singly",
                            type(exc).__name__)
                self._commit_singly(batch)
                return
            else:
                self._count(len(batch.ledger), len(batch.counters))
                log.debug(
                    "store writer: committed ledger=%d counters=%d in %.1f ms",
                    len(batch.ledger), len(batch.counters), (time.monotonic() - started) * 1e3,
                )
                return

    def _write(self, ledger: list[LedgerRecord], counters: Mapping[int, float]) -> None:
        with self._factory.begin() as session:
            skipped = insert_records(session, ledger)
            save_counters(session, counters)
        if skipped:
            self.stats.conflicts += len(skipped)
            log.error("store writer: %d ledger rows NOT written: their request id is already "
                      "in the ledger (ids %s)", len(skipped), ", ".join(skipped[:10]))

    def _touch_keys(self, used: Mapping[int, float]) -> None:
        if not used:
            return
        try:
            with self._factory.begin() as session:
                touch_keys(session, used)
        except SQLAlchemyError as exc:
            log.warning("store writer: last-used times of %d keys not saved (%s)", len(used),
                        _reason(exc))

    def _count(self, ledger_rows: int, counter_rows: int) -> None:
        self.stats.commits += 1
        self.stats.ledger_rows += ledger_rows
        self.stats.counter_rows += counter_rows

    def _commit_singly(self, batch: _Batch) -> None:
        for record in batch.ledger:
            try:
                self._write([record], {})
                self._count(1, 0)
            except SQLAlchemyError as exc:
                self.stats.dropped += 1
                log.error("store writer: dropped ledger row request_id=%s user_id=%d (%s)",
                          record.request_id, record.user_id, _reason(exc))
        for user_id, value in batch.counters.items():
            try:
                self._write([], {user_id: value})
                self._count(0, 1)
            except SQLAlchemyError as exc:
                self.stats.dropped += 1
                log.error("store writer: dropped counter user_id=%d (%s)", user_id, _reason(exc))


def _reason(exc: SQLAlchemyError) -> str:
    """The driver's message without SQL or parameters (e.g. 'FOREIGN KEY constraint failed')."""
    orig = getattr(exc, "orig", None)
    return str(orig) if orig is not None else type(exc).__name__
