"""Rate-limited logging: the same message repeated thousands of times a second (a connection
flood, a failing accept loop) must not write hundreds of megabytes of tracebacks.

``RepeatFilter`` lets through at most ``burst`` records of one kind (logger, level, message
template and exception type) per ``period`` seconds; the rest are counted, and the first
record let through after a quiet spell says how many were suppressed. Records carry ids and
numbers only (see STYLE.md), so grouping by template loses nothing a reader needs.

Debug records pass whole: an admin turns debug on to read every line (the tick log writes
one a tick under one template, which the limit cut to ten a minute), and a flood's records
are warnings and errors.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

Key = tuple[str, int, str, str]


class RepeatFilter(logging.Filter):
    def __init__(self, burst: int = 10, period: float = 60.0, max_kinds: int = 1000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.burst = burst
        self.period = period
        self.max_kinds = max_kinds
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: dict[Key, list[float | int]] = {}  # key -> [window start, passed, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.INFO:
            return True
        exc = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else ""
        key: Key = (record.name, record.levelno, str(record.msg), exc)
        now = self._clock()
        with self._lock:
            window = self._windows.get(key)
            if window is None or now - window[0] >= self.period:
                dropped = int(window[2]) if window is not None else 0
                if window is None and len(self._windows) >= self.max_kinds:
                    self._windows.clear()  # many kinds at once: start afresh (bounded memory)
                self._windows[key] = [now, 1, 0]
                if dropped:
                    record.msg = f"{record.msg} [{dropped} similar messages suppressed]"
                return True
            if window[1] < self.burst:
                window[1] = int(window[1]) + 1
                return True
            window[2] = int(window[2]) + 1
            return False


def install(logger: logging.Logger | None = None, burst: int = 10,
            period: float = 60.0) -> RepeatFilter:
    """Attach one ``RepeatFilter`` to every handler of ``logger`` (the root by default)."""
    target = logger or logging.getLogger()
    rate = RepeatFilter(burst=burst, period=period)
    for handler in target.handlers:
        handler.addFilter(rate)
    return rate
