"""The engine's supervisor: a dead or stalled engine thread never hides behind "ok".

Rule: every ``interval_s`` the supervisor asks the engine whether it serves
(:meth:`Engine.check`: the thread is alive, and it has gone round its loop within
``stall_timeout_s`` whenever requests wait). The first time it does not, the supervisor
fails the engine (every waiting and running request ends with HTTP 503, nothing new is
admitted, ``/health`` answers 503 with the reason) and calls ``on_down(reason)`` once.

What ``on_down`` does is the daemon's decision (``appliance serve``): it shuts down and
exits with :data:`ENGINE_DOWN_EXIT`, so systemd (``Restart=on-failure``) or launchd
(``KeepAlive`` unless the exit succeeded) starts a fresh daemon. Restarting the engine
inside the process is not attempted: a stalled thread cannot be stopped from Python and
still holds MLX and its memory, and a thread that died of an unknown error leaves state we
cannot trust. A fresh process reloads the model in seconds and loses nothing durable (the
ledger and counters are flushed on the way out).

No MLX here.
"""

from __future__ import annotations

import faulthandler
import logging
import sys
import threading
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)

ENGINE_DOWN_EXIT = 70
"""Exit status of a daemon whose engine stopped serving (EX_SOFTWARE): not 0, so the service
manager restarts it."""


class Supervised(Protocol):
    def check(self, now: float | None = None) -> str | None: ...

    def fail(self, reason: str) -> int: ...


class Supervisor:
    def __init__(self, engine: Supervised, on_down: Callable[[str], None] | None = None,
                 interval_s: float = 1.0) -> None:
        self._engine = engine
        self._on_down = on_down
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.reason: str | None = None
        """Why the engine was declared down (None while it serves)."""

    def start(self) -> Supervisor:
        self._thread = threading.Thread(target=self._run, name="engine-supervisor",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def step(self, now: float | None = None) -> bool:
        """Check once; returns True when this call declared the engine down."""
        if self.reason is not None:
            return False
        reason = self._engine.check(now)
        if reason is None:
            return False
        self.reason = reason
        ended = self._engine.fail(reason)
        log.critical("engine not serving: %s; ended %d requests with 503", reason, ended)
        _dump_stacks()
        if self._on_down is not None:
            try:
                self._on_down(reason)
            except Exception:
                log.exception("engine supervisor: on_down failed")
        return True

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                if self.step():
                    return
            except Exception:  # the watchdog itself must not die quietly
                log.exception("engine supervisor: check failed")


def _dump_stacks() -> None:
    """Every thread's Python stack to stderr (the daemon's log): where a stalled engine
    thread is stuck (code locations only, never a request's text)."""
    try:
        sys.stderr.write("engine supervisor: the threads' stacks, most recent call first\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    except (OSError, ValueError, AttributeError):  # no real stderr (a test's capture)
        log.warning("engine supervisor: could not dump the threads' stacks")
