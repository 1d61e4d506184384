"""Repeated log records are counted, not written: a flood cannot fill the disk."""

from __future__ import annotations

import logging

from appliance.logfilter import RepeatFilter


def record(msg: str = "accept failed on fd %d", name: str = "asyncio",
           level: int = logging.ERROR) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, (3,), None)


def test_a_repeated_record_passes_a_burst_then_is_counted_and_reported() -> None:
    now = [0.0]
    f = RepeatFilter(burst=10, period=60.0, clock=lambda: now[0])
    passed = sum(f.filter(record()) for _ in range(264_419))
    assert passed == 10
    assert f.filter(record("another message"))  # other kinds are not held back
    now[0] = 61.0
    late = record()
    assert f.filter(late)
    assert "[264409 similar messages suppressed]" in str(late.msg)


def test_memory_stays_bounded_with_many_kinds() -> None:
    f = RepeatFilter(max_kinds=100)
    for i in range(10_000):
        f.filter(record(f"message {i}"))
    assert len(f._windows) <= 100


def test_debug_records_pass_whole() -> None:
    # the tick log at debug: one line a tick under one template, every one wanted
    f = RepeatFilter(burst=10, period=60.0, clock=lambda: 0.0)
    ticks = record("%s", "appliance.engine.runner", logging.DEBUG)
    assert all(f.filter(ticks) for _ in range(1000))
    info = record("%s", "appliance.engine.runner", logging.INFO)
    assert sum(f.filter(info) for _ in range(1000)) == 10
