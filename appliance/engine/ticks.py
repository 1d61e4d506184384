"""A tick's timing: the engine's forwards timed (or metered, in tests), the cost model fitted
to them, and the tick log with what each tick was planned to take and took."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from appliance.sched.cost import CostModel

log = logging.getLogger("appliance.engine.runner")  # the tick's lines stay with the runner's

TICK_LOG = 2048
"""Recent ticks kept for tests and the debug log (target, prediction, measurement)."""
OVER_TARGET = 2.0
"""A tick that takes more than this many times its target is logged and counted (the cost
model mispredicted, or the machine was busy): what stalls a stream shows in the log."""

Meter = Callable[[str, int, int, int, float], float]
"""Test hook: (``decode``|``prefill``, rows, tokens per row, KV offset, measured seconds)
-> the seconds the engine books for that forward (and fits its cost model to)."""


@dataclass(frozen=True, slots=True)
class TickRecord:
    """One tick as the engine timed it, in seconds of its own timer."""

    target_s: float | None
    """The tick's time budget (None: prefill sized in tokens)."""
    predicted_s: float
    """The cost model's prediction for the work the plan gave the tick."""
    measured_s: float
    decode_rows: int
    prefill_tokens: int
    wait_s: float = 0.0
    """A decode step's span on the device, from its launch (``mx.async_eval``) until its
    tokens were ready. The engine thread built the next step inside it, overlapping the
    device; ``wall_s - wait_s`` is the host work the device waited for (the plan, the
    step's graph when it was not built ahead, text and events)."""
    wall_s: float = 0.0
    """The whole tick by the engine's timer: its forwards and everything between them
    (rows joining and leaving the batch, prompt-cache copies, the plan). Where it is well
    above ``measured_s``, a stream's gap came from work the cost model does not see."""


class TickTiming:
    """Books each forward of a tick (:meth:`forward`), fits ``costs`` to it, and records the
    tick (:meth:`end`)."""

    def __init__(self, costs: CostModel, timer: Callable[[], float],
                 meter: Meter | None) -> None:
        self.costs = costs
        self.timer = timer
        self.meter = meter
        self.log: deque[TickRecord] = deque(maxlen=TICK_LOG)
        self.over_target = 0
        self._measured = 0.0
        self._predicted = 0.0
        self._rows = 0
        self._began = 0.0
        self._waited = 0.0

    def begin(self) -> None:
        self._measured = self._predicted = 0.0
        self._rows = 0
        self._waited = 0.0
        self._began = self.timer()

    def waited(self, since: float) -> None:
        """A decode step ran on the device from ``since`` until now."""
        self._waited += self.timer() - since

    def forward(self, kind: str, rows: int, tokens: int, offset: int, start: float,
                riding: Sequence[tuple[int, int]] = ()) -> None:
        """Book one forward that began at ``start`` (the meter may replace its time: a
        decode step's, then each riding chunk's as ``ride``) and fit the cost model.
        ``riding``: the prompt chunks read in a decode step's forward, (tokens, offset)
        each."""
        seconds = self.timer() - start
        if self.meter is not None:
            seconds = self.meter(kind, rows, tokens, offset, seconds) + sum(
                self.meter("ride", 1, n, k, 0.0) for n, k in riding)
        self._measured += seconds
        if kind == "decode":
            self._rows = rows
            self._predicted += self.costs.decode(rows, offset, riding)
            self.costs.observe_decode(rows, offset, seconds, riding)
        else:
            self._predicted += self.costs.prefill_rows(rows, tokens, offset)
            self.costs.observe_prefill(rows, tokens, offset, seconds)

    def end(self, tick: int, target_s: float | None, prefill_tokens: int,
            ride: bool) -> TickRecord:
        record = TickRecord(target_s=target_s, predicted_s=self._predicted,
                            measured_s=self._measured, decode_rows=self._rows,
                            prefill_tokens=prefill_tokens, wait_s=self._waited,
                            wall_s=self.timer() - self._began)
        self.log.append(record)
        log.debug("tick=%d target_ms=%.0f predicted_ms=%.0f measured_ms=%.0f wall_ms=%.0f "
                  "decode_rows=%d prefill_tokens=%d ride=%s", tick, (target_s or 0) * 1e3,
                  record.predicted_s * 1e3, record.measured_s * 1e3, record.wall_s * 1e3,
                  record.decode_rows, prefill_tokens, ride)
        if target_s is not None and record.measured_s > OVER_TARGET * target_s:
            self.over_target += 1
            log.info("tick over target tick=%d target_ms=%.0f predicted_ms=%.0f "
                     "measured_ms=%.0f wall_ms=%.0f decode_rows=%d prefill_tokens=%d", tick,
                     target_s * 1e3, record.predicted_s * 1e3, record.measured_s * 1e3,
                     record.wall_s * 1e3, record.decode_rows, prefill_tokens)
        return record
