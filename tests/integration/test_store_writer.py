"""The single SQLite writer: batching, flush, close, and living beside other connections."""

from __future__ import annotations

import gc
import logging
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.exc import OperationalError

from appliance.store import conversations as convs
from appliance.store import limits
from appliance.store.db import Store
from appliance.store.ledger import LedgerRecord, insert_records
from appliance.store.models import LedgerEntry
from appliance.store.writer import StoreWriter
from tests.helpers import FAST_HASHER


def record(request_id: str, user_id: int, output: int = 10) -> LedgerRecord:
    now = time.time()
    return LedgerRecord(
        request_id=request_id, user_id=user_id, api_key_id=None, klass="interactive",
        endpoint="/api/chat", model="demo", prompt_tokens=20, cached_tokens=0,
        output_tokens=output, queued_at=now - 1, admitted_at=now - 0.9,
        first_token_at=now - 0.5, finished_at=now, finish_reason="stop",
    )


def ledger_rows(store: Store) -> int:
    with store.read_sessions() as s:
        return int(s.scalar(select(func.count()).select_from(LedgerEntry)) or 0)


def wait_until(predicate: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


class ThreadRecordingFactory:
    """Wraps a sessionmaker and notes which threads opened transactions."""

    def __init__(self, store: Store) -> None:
        self.inner = store.sessions
        self.threads: set[str] = set()

    def begin(self) -> Any:
        self.threads.add(threading.current_thread().name)
        return self.inner.begin()


def test_it_batches_many_rows_into_few_transactions(store: Store, ids: dict[str, int]) -> None:
    with StoreWriter(store.sessions, flush_interval=5.0) as writer:
        for i in range(200):
            writer.submit_ledger(record(f"req-{i}", ids["bob"]))
        writer.submit_counters({ids["bob"]: 1.0})
        writer.submit_counters({ids["bob"]: 2.0, ids["alice"]: 0.5})
        assert writer.flush(timeout=10)
        assert ledger_rows(store) == 200
        # The first row after idle may commit alone; everything else waits for one batch.
        assert writer.stats.commits <= 2
        assert writer.stats.ledger_rows == 200
    with store.read_sessions() as s:
        assert limits.load_counters(s) == {ids["bob"]: 2.0, ids["alice"]: 0.5}


def test_it_waits_flush_interval_between_commits(store: Store, ids: dict[str, int]) -> None:
    with StoreWriter(store.sessions, flush_interval=1.0) as writer:
        writer.submit_ledger(record("first", ids["alice"]))
        assert wait_until(lambda: writer.stats.commits == 1)  # after idle: at once
        submitted = time.monotonic()
        writer.submit_ledger(record("second", ids["alice"]))
        # No sleep to show it is not written early: the time it took to appear says so.
        assert wait_until(lambda: ledger_rows(store) == 2, timeout=5.0)
        assert time.monotonic() - submitted >= 0.7


def test_flush_makes_submitted_rows_visible_to_readers(store: Store, ids: dict[str, int]) -> None:
    with StoreWriter(store.sessions, flush_interval=60.0) as writer:
        writer.submit_ledger(record("warmup", ids["bob"]))
        assert writer.flush(timeout=5)
        writer.submit_ledger(record("r1", ids["bob"]))  # would wait a minute without flush
        assert writer.flush(timeout=5)  # True: done within the timeout, not a minute later
        assert ledger_rows(store) == 2


def test_close_flushes_everything_and_stops(store: Store, ids: dict[str, int]) -> None:
    writer = StoreWriter(store.sessions, flush_interval=60.0)
    writer.submit_ledger(record("warmup", ids["carol"]))
    writer.flush()
    for i in range(10):
        writer.submit_ledger(record(f"late-{i}", ids["carol"]))
    writer.submit_counters({ids["carol"]: 9.0})
    writer.close(timeout=5)
    assert ledger_rows(store) == 11
    with store.read_sessions() as s:
        assert limits.load_counters(s) == {ids["carol"]: 9.0}
    writer.close()  # idempotent
    assert writer.flush() is True
    with pytest.raises(RuntimeError, match="closed"):
        writer.submit_ledger(record("too-late", ids["carol"]))


def test_submit_never_blocks_the_engine_thread_while_the_database_is_locked(
    store: Store, ids: dict[str, int], db_path: Path
) -> None:
    blocker = sqlite3.connect(db_path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # someone else holds the write lock
    try:
        with StoreWriter(store.sessions, flush_interval=0.0) as writer:
            submitted: list[int] = []

            def submit_all() -> None:
                for i in range(100):
                    writer.submit_ledger(record(f"r{i}", ids["bob"]))
                    writer.submit_counters({ids["bob"]: float(i)})
                    submitted.append(i)
            engine = threading.Thread(target=submit_all)
            engine.start()
            engine.join(60)  # the lock is still held: a blocking submit could not return
            assert len(submitted) == 100, "submit waited for the database lock"
            assert writer.stats.commits == 0  # the writer tried meanwhile and got nothing in
            blocker.execute("COMMIT")
            assert writer.flush(timeout=10)
            assert ledger_rows(store) == 100
    finally:
        blocker.close()


def test_database_work_happens_only_on_the_writer_thread(
    store: Store, ids: dict[str, int]
) -> None:
    factory = ThreadRecordingFactory(store)
    writer = StoreWriter(factory, flush_interval=0.05, name="writer-under-test")  # type: ignore[arg-type]

    def engine_loop() -> None:
        for i in range(20):
            writer.submit_ledger(record(f"e{i}", ids["alice"]))

    engine_thread = threading.Thread(target=engine_loop, name="fake-engine")
    engine_thread.start()
    engine_thread.join()
    writer.close()
    assert factory.threads == {"writer-under-test"}
    assert ledger_rows(store) == 20


def test_a_bad_row_is_dropped_alone_and_logged_without_content(
    store: Store, ids: dict[str, int], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="appliance.store.writer")
    with StoreWriter(store.sessions, flush_interval=5.0) as writer:
        writer.submit_ledger(record("good-1", ids["bob"]))
        writer.submit_ledger(record("ghost", 9999))  # no such user: foreign key fails
        writer.submit_ledger(record("good-2", ids["bob"]))
        writer.submit_counters({9999: 1.0, ids["bob"]: 4.0})
        writer.flush()
        assert ledger_rows(store) == 2
        assert writer.stats.dropped == 2
    with store.read_sessions() as s:
        assert limits.load_counters(s) == {ids["bob"]: 4.0}
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert any("request_id=ghost user_id=9999" in m for m in dropped)
    assert all("INSERT" not in r.getMessage() for r in caplog.records)


def test_writer_reader_and_another_writer_never_see_database_is_locked(
    store: Store, ids: dict[str, int]
) -> None:
    """The store writer, a web handler writing chat history and a dashboard reading,
    all at once on one file: BEGIN IMMEDIATE + busy_timeout make writers queue up."""
    errors: list[BaseException] = []
    stop = threading.Event()
    alice, bob = ids["alice"], ids["bob"]
    done = {"chat": 0, "dashboard": 0}  # transactions each side finished

    def guarded(fn: Any) -> Any:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # collected and asserted on below
                errors.append(exc)
        return run

    def chat_writer() -> None:
        with store.sessions.begin() as s:
            conv_id = convs.create_conversation(s, alice, "busy").id
        n = 0
        while not stop.is_set():
            with store.sessions.begin() as s:  # read-then-write in one transaction
                convs.list_messages(s, alice, conv_id)
                convs.add_message(s, alice, conv_id, "user", f"message {n}")
            n += 1
            done["chat"] += 1
            # A handler writes per request, not in a tight loop: without this pause the
            # loop can take the lock back before the writer thread's busy wait notices it
            # is free, and on a loaded machine starve it past the flush timeout.
            time.sleep(0.002)

    def dashboard_reader() -> None:
        while not stop.is_set():
            with store.read_sessions() as s:
                s.scalar(select(func.count()).select_from(LedgerEntry))
                limits.load_counters(s)
            done["dashboard"] += 1

    with StoreWriter(store.sessions, flush_interval=0.0) as writer:
        threads = [threading.Thread(target=guarded(f)) for f in (chat_writer, dashboard_reader)]
        for t in threads:
            t.start()
        for i in range(300):
            writer.submit_ledger(record(f"c{i}", bob))
            writer.submit_counters({bob: float(i)})
            if i % 50 == 0:
                time.sleep(0.01)
        assert writer.flush(timeout=30)
        # Both sides got on with their work after the writer's last commit (each finished
        # another transaction), instead of a fixed pause.
        at_flush = dict(done)
        assert wait_until(lambda: all(done[k] > at_flush[k] for k in done) or bool(errors),
                          timeout=30)
        stop.set()
        for t in threads:
            t.join(timeout=30)
        assert writer.stats.dropped == 0
    assert errors == []
    assert ledger_rows(store) == 300


# -- storage faults: a full disk, a read-only file ---------------------------------------
# The faults are SQLite's own: `PRAGMA max_page_count` set to the file's size makes the
# pager answer SQLITE_FULL exactly where a full disk does, and a connection opened with
# `mode=ro` is what SQLite makes of a file it may not write (chmod would not stop root, who
# runs the tests). `appliance.store.faults.install_test_fault` applies them from a control
# file, so the same hook drives a real `appliance serve` (tests/integration/test_storage_faults.py).


@pytest.fixture
def control(tmp_path: Path) -> Path:
    return tmp_path / "store-fault"


@pytest.fixture
def faulty(db_path: Path, control: Path, store: Store) -> Any:
    """The household's database, opened again with the test fault hook."""
    from appliance.store.db import open_store

    opened = open_store(db_path, test_fault=control)
    yield opened
    opened.close()


def test_rows_that_meet_a_full_disk_are_kept_and_written_once_it_frees(
        faulty: Store, control: Path, ids: dict[str, int],
        caplog: pytest.LogCaptureFixture) -> None:
    control.write_text("full")
    with StoreWriter(faulty.sessions, flush_interval=0.0, health=faulty.health,
                     backlog_limit=50) as writer:
        for i in range(200):  # more than the pages the file has room for
            writer.submit_ledger(record(f"full-{i}", ids["bob"]))
        writer.submit_counters({ids["bob"]: 7.0})
        assert writer.flush(timeout=10) is False  # tried, kept
        assert writer.stats.backlog == 200 and writer.stats.dropped == 0
        assert faulty.health.fault == "SQLITE_FULL"
        refusal = writer.refusal()
        assert refusal is not None and "SQLITE_FULL" in refusal
        assert ledger_rows(faulty) == 0
        control.write_text("")  # space freed
        assert wait_until(lambda: writer.stats.backlog == 0, timeout=15)
        assert writer.refusal() is None and not faulty.health.faulted
    assert ledger_rows(faulty) == 200
    with faulty.read_sessions() as s:
        assert limits.load_counters(s)[ids["bob"]] == 7.0
    assert not [r for r in caplog.records if "dropped" in r.getMessage()]


def test_a_read_only_database_keeps_rows_and_no_read_only_connection_outlives_it(
        faulty: Store, control: Path, ids: dict[str, int]) -> None:
    from appliance.store import users

    with StoreWriter(faulty.sessions, flush_interval=0.0, health=faulty.health) as writer:
        writer.submit_ledger(record("before", ids["bob"]))
        assert writer.flush(timeout=10)
        control.write_text("readonly")
        for i in range(3):
            writer.submit_ledger(record(f"ro-{i}", ids["bob"]))
        assert writer.flush(timeout=10) is False
        assert writer.stats.backlog == 3 and faulty.health.fault == "SQLITE_READONLY"
        for name in ("dave", "erin"):  # a handler's write meets the fault too, then reads
            with pytest.raises(OperationalError), faulty.sessions.begin() as s:
                users.create_user(s, name, "correct horse 12", hasher=FAST_HASHER)
            with faulty.sessions() as s:
                assert users.list_users(s)
        control.write_text("")
        # The first write after the file is writable again succeeds: the connections
        # opened read-only meanwhile are not handed out again.
        with faulty.sessions.begin() as s:
            users.create_user(s, "fay", "correct horse 12", hasher=FAST_HASHER)
        assert wait_until(lambda: writer.stats.backlog == 0, timeout=15)
        assert wait_until(lambda: not faulty.health.faulted, timeout=15)
    assert ledger_rows(faulty) == 4


def test_a_fault_seen_only_by_a_handler_clears_when_a_probe_write_succeeds(
        faulty: Store, control: Path) -> None:
    from appliance.store import users

    with StoreWriter(faulty.sessions, flush_interval=0.0, health=faulty.health):
        control.write_text("readonly")
        with pytest.raises(OperationalError), faulty.sessions.begin() as s:
            users.create_user(s, "gus", "correct horse 12", hasher=FAST_HASHER)
        assert faulty.health.fault == "SQLITE_READONLY"
        control.write_text("")
        assert wait_until(lambda: not faulty.health.faulted, timeout=15)


def test_a_write_that_met_a_full_disk_holds_no_lock_while_its_error_lives(
        faulty: Store, control: Path, db_path: Path, ids: dict[str, int]) -> None:
    # The failed statement's cursor lives in the error's traceback until the garbage
    # collector breaks the cycle; closing its connection then leaves SQLite a zombie that
    # kept the write lock, and the daemon's writer saw "database is locked" for as long
    # (the intermittent full-disk failure of the daemon test).
    from appliance.store.db import open_store

    control.write_text("full")
    kept: list[OperationalError] = []
    gc.disable()
    try:
        try:
            with faulty.sessions.begin() as s:
                insert_records(s, [record(f"z-{i}", ids["bob"]) for i in range(300)])
        except OperationalError as exc:
            kept.append(exc)
        assert kept and faulty.health.fault == "SQLITE_FULL"
        control.write_text("")
        other = open_store(db_path, busy_timeout_ms=500)
        try:
            with other.sessions.begin() as s:
                insert_records(s, [record("after", ids["bob"])])
        finally:
            other.close()
    finally:
        gc.enable()
    assert ledger_rows(faulty) == 1


def test_closing_while_the_disk_is_full_names_every_row_it_could_not_write(
        faulty: Store, control: Path, ids: dict[str, int],
        caplog: pytest.LogCaptureFixture) -> None:
    control.write_text("full")
    writer = StoreWriter(faulty.sessions, flush_interval=0.0, health=faulty.health)
    for i in range(200):
        writer.submit_ledger(record(f"lost-{i}", ids["carol"]))
    with caplog.at_level("ERROR", logger="appliance.store.writer"):
        writer.close(timeout=30)
    assert writer.stats.lost_at_close == 200
    lines = [r.getMessage() for r in caplog.records if "NOT written" in r.getMessage()]
    assert len(lines) == 1 and "200 ledger rows" in lines[0] and "lost-0" in lines[0]
    assert ledger_rows(faulty) == 0


def test_a_new_reason_for_refused_writes_is_logged_again(
        store: Store, control: Path, db_path: Path, ids: dict[str, int],
        caplog: pytest.LogCaptureFixture) -> None:
    """A spell of refused writes is logged once, and again when its reason changes: a file
    that turns writable while another connection holds the write lock says so, where
    only the first reason was logged and the lockout went unsaid."""
    from appliance.store.db import open_store

    caplog.set_level(logging.WARNING, logger="appliance.store.writer")
    faulty = open_store(db_path, busy_timeout_ms=200, test_fault=control)
    control.write_text("readonly")
    blocker = sqlite3.connect(db_path, isolation_level=None)
    try:
        with StoreWriter(faulty.sessions, flush_interval=0.0, health=faulty.health) as writer:
            writer.submit_ledger(record("spell-0", ids["bob"]))
            assert writer.flush(timeout=10) is False
            blocker.execute("BEGIN IMMEDIATE")
            control.write_text("")
            assert wait_until(lambda: any("still no writes" in r.getMessage()
                                          for r in caplog.records), timeout=30)
            blocker.execute("COMMIT")
            assert wait_until(lambda: writer.stats.backlog == 0, timeout=30)
    finally:
        blocker.close()
        faulty.close()
    said = [r.getMessage() for r in caplog.records if r.name == "appliance.store.writer"]
    assert sum("SQLITE_READONLY" in m for m in said) == 1, said
    assert any("still no writes" in m and "locked" in m for m in said), said
    assert any("takes writes again" in m for m in said)
