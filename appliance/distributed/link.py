"""Rank 0's side of the pipeline (engine thread, MLX): what it tells the other machines
before each forward, and how it notices they are gone.

The engine's decode batch records each change it makes (:meth:`Link.record`); the
forwards say what the next pipelined forward reads (:meth:`Link.expect`); when the model's
first stage hands its hidden states on (appliance/distributed/stage.py) the link sends the
recorded changes and that forward as one plan (appliance/distributed/plan.py) and then
waits for the last stage's answer, timed by the watchdog.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from appliance.distributed import plan
from appliance.distributed.control import Channel, ChannelClosed
from appliance.engine.request import GroupLost

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RankInfo:
    """What the dashboard and ``/health`` show of one machine of the group."""

    rank: int
    host: str
    layers: tuple[int, int]
    weight_bytes: int = 0
    kv_bytes: int = 0
    steps: int = 0
    step_ms: float = 0.0
    link_ms: float | None = None
    rss_bytes: int = 0
    seen: float = field(default_factory=time.monotonic)
    computing: bool = False
    """Its last beat said it computes its layers (rather than waits for a plan or on the
    ring)."""
    waiting_since: float = field(default_factory=time.monotonic)
    """When it last began to wait (for a plan or on the ring), by its beats (monotonic)."""

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "layers": list(self.layers),
                "weight_bytes": self.weight_bytes, "kv_bytes": self.kv_bytes,
                "steps": self.steps, "step_ms": round(self.step_ms, 2),
                "link_ms": None if self.link_ms is None else round(self.link_ms, 3),
                "rss_bytes": self.rss_bytes,
                "seen_s": round(time.monotonic() - self.seen, 1) if self.rank else 0.0}


class Link:
    def __init__(self, group: Any, ranks: list[RankInfo], channels: list[Channel],
                 step_timeout: float) -> None:
        self.group = group
        self.ranks = ranks
        self.channels = channels
        self.step_timeout = step_timeout
        self.step = 0
        self._journal: list[list[Any]] = []
        self._next: list[Any] | None = None
        self.live: Callable[[], list[int]] = list
        """The sequences whose own caches rank 0 holds (the runner sets it)."""
        self.sent = False
        """The forward last expected went out (a failure after it parts the group)."""
        self.busy_since: float | None = None
        """When the forward now waiting on the other machines was sent (monotonic)."""
        self.lost: str | None = None
        self._lock = threading.Lock()
        self.on_lost: Callable[[str], None] | None = None
        self.remember: Callable[[str], None] | None = None
        """Keeps the reason past the restart the loss causes (the coordinator sets it)."""

    # ---- the engine thread ----
    def record(self, op: list[Any]) -> None:
        """A change of the decode batch (``join``, ``remove``, ``reset``)."""
        self._journal.append(op)

    def expect(self, rows: int, chunks: list[list[int]]) -> None:
        """The next pipelined forward reads ``rows`` decode rows and ``chunks``
        (``[rid, start, n]`` each)."""
        self._next = ["forward", rows, chunks]
        self.sent = False

    def ship(self, tokens: int) -> None:
        """Send the recorded changes and the expected forward of ``tokens`` tokens."""
        if self.lost is not None:
            raise GroupLost(self.lost)
        forward, self._next = self._next, None
        if forward is None:
            raise RuntimeError("a pipelined forward that was never described")
        if forward[1] + sum(n for _, _, n in forward[2]) != tokens:
            raise RuntimeError("a pipelined forward whose tokens do not match its plan")
        ops = [*self._journal, [*forward, self.live()]]
        self._journal = []
        self.busy_since = time.monotonic()
        message = plan.encode(ops, self.step)
        for rank, ch in enumerate(self.channels, 1):
            try:
                ch.send(message)
            except ChannelClosed as exc:
                raise self._fail(f"machine {rank} lost: {exc}") from exc
        self.step += 1
        self.sent = True

    def run(self, out: mx.array, start: float) -> None:
        """Evaluate the forward's part that crosses the machines (after :meth:`ship`);
        ``start``: when the forward's own computing began (perf_counter)."""
        try:
            mx.eval(out)
        except Exception as exc:
            raise self._fail(f"the pipelined forward failed: {exc}") from exc
        finally:
            self.busy_since = None
        me = self.ranks[0]
        me.steps += 1
        me.step_ms = (time.perf_counter() - start) * 1000
        if self.lost is not None:  # the watchdog gave up on this forward meanwhile
            raise GroupLost(self.lost)

    def stop(self) -> None:
        """Tell the other machines rank 0 is shutting down (best effort)."""
        if self.lost is None:
            for ch in self.channels:
                try:
                    ch.send(plan.encode([["stop"]], self.step))
                except ChannelClosed:
                    log.warning("could not tell the other machines to stop")

    # ---- any thread ----
    def lose(self, reason: str) -> bool:
        """Declare the group lost (the first reason wins); True when this call did."""
        with self._lock:
            if self.lost is not None:
                return False
            self.lost = reason
        log.critical("distributed group lost: %s", reason)
        if self.remember is not None:
            try:
                self.remember(reason)
            except Exception:
                log.exception("could not keep the reason the group was lost")
        if self.on_lost is not None:
            try:
                self.on_lost(reason)
            except Exception:
                log.exception("on_lost failed")
        return True

    def _fail(self, reason: str) -> GroupLost:
        self.lose(reason)
        return GroupLost(self.lost or reason)

    def overdue(self, now: float) -> float | None:
        """Seconds the forward in flight has waited past ``step_timeout`` (None: fine)."""
        since = self.busy_since
        if since is None or now - since <= self.step_timeout:
            return None
        return now - since
