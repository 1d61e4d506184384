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
LONGEST_EVERY_S = 60.0
"""While the engine works, the longest ticks in which streams decoded are logged for each
such spell with why they were long (a run's worst gaps are these ticks: docs/engine.md,
"The tick log"); the last spell's also when the engine stops."""
LONGEST_KEPT = 3
MISPREDICTED = 1.5
"""A tick whose forwards took more than this many times the cost model's prediction."""

Meter = Callable[[str, int, int, int, float], float]
"""Test hook: (``decode``|``prefill``|``verify``, rows, tokens per row, KV offset, measured seconds)
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
    tick: int = 0
    chunks: tuple[tuple[int, int, int], ...] = ()
    """The prompt chunks read: (request id, tokens, positions already read) each."""
    ride: bool = False
    """The chunks rode in the decode step's forward."""
    drafts: int = 0
    """Draft tokens the step's rows verified, all together (appliance/engine/lookup.py)."""
    kv_copies: int = 0
    """Layers of the decode batch's KV copied into new windows during the tick (growth, more
    slots, a row reaching before the window: appliance/engine/slots.py), in fresh memory:
    in a VM some 100 ms each for long windows, inside a forward or between them."""
    left: int = 0
    """Rows that left the decode batch during the tick (finished, failed or preempted):
    each one's KV copied into the prompt cache and its slot filled, with its stream's end
    handed to the event loop, the host work a finishing tick shows."""
    joined: int = 0
    """Rows that joined the decode batch during the tick."""

    @property
    def why(self) -> str:
        """Why the tick lasted what it did: ``host`` (work between the forwards that the
        cost model does not see), ``mispredicted`` (the forwards took well over the
        prediction), ``untimed`` (prefill sized in tokens) or ``planned`` (the plan's
        budget asked for this much: see ``target_ms``)."""
        if self.wall_s - self.measured_s > max(0.5 * self.measured_s, 0.01):
            return "host"
        if self.measured_s > MISPREDICTED * self.predicted_s:
            return "mispredicted"
        return "untimed" if self.target_s is None else "planned"

    def describe(self) -> str:
        chunks = ",".join(f"{rid}:{n}@{k}" for rid, n, k in self.chunks) or "-"
        return (f"tick={self.tick} wall_ms={self.wall_s * 1e3:.0f} "
                f"measured_ms={self.measured_s * 1e3:.0f} "
                f"predicted_ms={self.predicted_s * 1e3:.0f} "
                f"target_ms={(self.target_s or 0) * 1e3:.0f} decode_rows={self.decode_rows} "
                f"ride={self.ride} chunks={chunks} drafts={self.drafts} "
                f"kv_copies={self.kv_copies} left={self.left} joined={self.joined} "
                f"why={self.why}")


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
        self._drafts = 0
        self.longest: list[TickRecord] = []
        """The longest ticks of the spell since they were last logged, longest first."""
        self._longest_since: float | None = None

    def begin(self) -> None:
        self._measured = self._predicted = 0.0
        self._rows = 0
        self._waited = 0.0
        self._drafts = 0
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

    def verify(self, drafts: int, offset: int, start: float, predicted: float,
               rows: int = 1) -> float:
        """Book a verify of ``drafts`` drafts in all over ``rows`` rows that began at
        ``start`` (its ``predicted`` seconds are the drafting's; the cost model does not fit
        verifies: appliance/engine/lookup.py); returns its seconds."""
        seconds = self.timer() - start
        if self.meter is not None:
            seconds = self.meter("verify", rows, (drafts + rows) // rows, offset, seconds)
        self._measured += seconds
        self._predicted += predicted
        self._rows = rows
        self._drafts += drafts
        return seconds

    def end(self, tick: int, target_s: float | None,
            chunks: Sequence[tuple[int, int, int]] = (), ride: bool = False,
            kv_copies: int = 0, left: int = 0, joined: int = 0) -> TickRecord:
        """Record the tick; ``chunks``: the prompt chunks it read, (request id, tokens,
        positions already read) each; ``kv_copies``: KV layers copied into new windows;
        ``left``, ``joined``: rows that left and joined the decode batch."""
        record = TickRecord(target_s=target_s, predicted_s=self._predicted,
                            measured_s=self._measured, decode_rows=self._rows,
                            prefill_tokens=sum(n for _, n, _ in chunks),
                            wait_s=self._waited, wall_s=self.timer() - self._began,
                            tick=tick, chunks=tuple(chunks), ride=ride,
                            drafts=self._drafts, kv_copies=kv_copies, left=left,
                            joined=joined)
        self.log.append(record)
        log.debug("%s", record.describe())
        if target_s is not None and record.measured_s > OVER_TARGET * target_s:
            self.over_target += 1
            log.info("tick over target %s", record.describe())
        self._keep_longest(record)
        return record

    def _keep_longest(self, record: TickRecord) -> None:
        now = self.timer()
        if self._longest_since is None:
            self._longest_since = now
        if record.decode_rows:  # else no stream waited: a first token's wait, not a gap
            self.longest.append(record)
            self.longest.sort(key=lambda r: -r.wall_s)
            del self.longest[LONGEST_KEPT:]
        if now - self._longest_since >= LONGEST_EVERY_S:
            self.report_longest()

    def report_longest(self) -> None:
        """Log the spell's longest ticks and start a new spell (also when the engine goes
        idle, so a short burst of work is reported too)."""
        if self.longest:
            log.info("longest ticks of the last %.0f s: %s",
                     self.timer() - (self._longest_since or self.timer()),
                     " | ".join(r.describe() for r in self.longest))
        self.longest = []
        self._longest_since = None
