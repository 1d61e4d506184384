"""How long a tick may last and what its prefill may spend: the latency objectives
(:class:`TickObjectives`), the tick budget derived from them and the cost model
(:func:`tick_budget`, appliance/sched/cost.py), and the prefill share of one tick as the
scheduler hands it out chunk by chunk (:class:`PrefillAllowance`). Pure arithmetic, like
the cost model: nothing here reads a clock."""

from __future__ import annotations

from dataclasses import dataclass

from appliance.sched.cost import CostModel

BURST_STEPS = 2.5
"""Decode steps an overdue burst's tick may last while its prompts ride in the decode step:
the ITL max goal (3 times the p50, about one step) less the cost model's error
(docs/decisions/riding-tick-bounds.md)."""

PRESENT_TICK = 0.5
"""While someone is present, a tick spent on work that can wait is planned to last this share
of reading one arrival alone: the arrival then waits for the tick in flight and its own
reading, 1.5 times its solo TTFT as planned, which leaves room for the cost model's error
within the 2x goal (docs/decisions/present-tick.md)."""

WHOLE_RIDING = 1.2
"""A fresh prompt riding in the decode step is read whole, not split, when it costs at most
this many times what the tick has left: split, its first token waits a tick for the stub;
more than this, the overrun breaks the ITL max goal (docs/decisions/riding-tick-bounds.md)."""


def even_chunk(remaining: int, n: int) -> int:
    """The chunk that reads ``remaining`` tokens in as many equal pieces as chunks of at
    most ``n`` take: as many ticks as a greedy split, the first token no later, and no stub
    (see the glossary in appliance/sched/__init__.py, and docs/decisions/riding-tick-bounds.md)."""
    pieces = -(-remaining // n)
    return -(-remaining // pieces)


@dataclass(frozen=True, slots=True)
class TickObjectives:
    """The latency objectives a tick's length is derived from.

    * ``itl_target_s``: the longest a decoding stream should wait between tokens, i.e. the
      longest tick while anything decodes; 0: ``itl_factor`` times the predicted decode
      step of the current batch.
    * ``ttft_target_s``: an arrival should see its first token within this; it waits for
      at most the tick in flight and then its own, so no tick is planned longer than half
      of it, decoding or not, unless a burst is already overdue (see :func:`tick_budget`).
    * ``min_chunk``: a prefill still advances by at least this many tokens per tick when
      the objectives leave no room, so a long prompt always finishes; while someone is
      present, work that can wait gets at least this chunk's time (riding in the decode
      step, and at least ``prefill_floor`` times the chunk's own fixed cost), and no more
      when the decode step already takes an arrival's reading time. 8: riding beside a
      decode step of 8 rows, the forward stays within the narrowest step a profile has
      today (16 rows, appliance/backend/profile.py).
    * ``prefill_floor``: the objectives are feasible when they leave prefill at least this
      many times a prefill forward's fixed cost (then at least half of the prefill time
      reads tokens). When they do not, a slow or busy machine overruns them: by that floor
      while someone waits on an answer, and by the most efficient chunk otherwise (see
      :func:`tick_budget`), instead of crawling through prompts a few tokens at a time.
    * ``presence_s``: how long after someone's last voice or interactive request was
      seen they count as present (they may send a chat turn or a voice command any moment,
      so other people's work that can wait is read in pieces that keep their next
      arrival's wait short).
    * ``arrival_tokens``: the prompt of such an arrival (a chat turn or a voice command,
      past what the prompt cache holds). While someone is present, a tick spent on work
      that can wait lasts about what reading this alone takes, so an arrival waits for the
      tick in flight no longer than for its own reading: its TTFT stays within twice solo.
    """

    itl_target_s: float = 0.0
    itl_factor: float = 2.0
    ttft_target_s: float = 1.0
    min_chunk: int = 8
    prefill_floor: float = 2.0
    presence_s: float = 60.0
    arrival_tokens: int = 64

    def __post_init__(self) -> None:
        if self.itl_target_s < 0 or self.itl_factor < 1 or self.ttft_target_s <= 0:
            raise ValueError("itl_target_s >= 0, itl_factor >= 1 and ttft_target_s > 0")
        if self.min_chunk < 1 or self.prefill_floor < 0 or self.presence_s < 0:
            raise ValueError("min_chunk >= 1, prefill_floor >= 0 and presence_s >= 0")
        if self.arrival_tokens < 1:
            raise ValueError("arrival_tokens must be >= 1")


@dataclass(frozen=True, slots=True)
class TickBudget:
    """What one tick may spend: ``target_s`` in all, ``decode_s`` of it predicted for the
    decode step, the rest (``prefill_s``) for prefill chunks, of which at most
    ``patient_s`` on work that can wait (None: all of it): chunks that leave their prompt
    unfinished, and background prompts. ``riding``: the tick's chunks are read in the
    decode step's forward (see :class:`CostModel`)."""

    target_s: float
    decode_s: float
    patient_s: float | None = None
    riding: bool = False
    rows: int = 0
    """The decode step's rows (chunks riding in it come after them)."""

    @property
    def prefill_s(self) -> float:
        return max(self.target_s - self.decode_s, 0.0)


def tick_budget(costs: CostModel, objectives: TickObjectives, decode_rows: int,
                kv_len: int, *, present: bool = True, overdue: bool = False,
                ride: bool = True, alone: bool = False) -> TickBudget:
    """The budget of a tick that prefills.

    * Target: the ITL objective while a batch decodes, never more than half the TTFT
      objective. ``overdue`` (a burst waits unread, see ``Scheduler._allowance``): the
      whole TTFT objective, so the burst shares one forward; riding, at most
      :data:`BURST_STEPS` decode steps (and at least the ITL objective).
    * Floor: when that leaves prefill less than ``prefill_floor`` forward fixed costs the
      objectives cannot be met here, and the tick gets the most efficient chunk on top of
      the decode step, so a slow machine reads prompts at its best pace; while streams
      decode, that chunk's time stops at the TTFT objective (or the decode step, if
      longer): where attention is nearly free the most efficient chunk is thousands of
      tokens. Riding, the floor is ``prefill_floor`` times a ``min_chunk`` chunk's riding
      time.
    * Patient share: while someone is ``present``, work that can wait gets no more than
      keeps the tick within reading one arrival (``arrival_tokens``) alone, and at least a
      ``min_chunk`` chunk (riding, also at least ``prefill_floor`` times a riding chunk's
      own fixed cost, so half its time reads tokens). Prompts read to their end may use the
      whole share (docs/decisions/riding-tick-bounds.md). ``alone``: the tick's one prompt is
      all the work (nothing decodes, nothing else waits): it may use the tick's whole
      target, half the TTFT objective, so a lone reading goes at the machine's pace and
      an arrival waits at most that (docs/decisions/lone-reading.md)."""
    riding = costs.rides and decode_rows > 0 and ride
    decode_s = costs.decode(decode_rows, kv_len + 1)
    bound = objectives.ttft_target_s / 2
    if decode_rows:
        itl = objectives.itl_target_s or objectives.itl_factor * decode_s
        target = min(itl, bound)
    else:
        target = bound
    if overdue:
        target = (max(target, min(BURST_STEPS * decode_s, objectives.ttft_target_s))
                  if riding else objectives.ttft_target_s)
    share = target - decode_s
    smallest = (costs.ride(objectives.min_chunk, 0, decode_rows) if riding
                else costs.prefill(objectives.min_chunk))
    floor = objectives.prefill_floor * (smallest if riding else costs.chunk_fixed())
    patient = None
    if present:
        arrival = PRESENT_TICK * costs.prefill(objectives.arrival_tokens)
        least = (max(smallest, objectives.prefill_floor * costs.chunk_fixed(riding=True))
                 if riding else smallest)
        patient = max(least, min(share, arrival - decode_s))
        if alone and not decode_rows:
            patient = max(patient, share)
    if floor > 0 and share < floor and not riding:
        best = costs.efficient_chunk()
        if best is not None:
            efficient = costs.prefill(best, 0)
            if decode_rows:  # streams wait out the tick: no longer than a TTFT objective more
                efficient = min(efficient, max(objectives.ttft_target_s, decode_s))
            floor = max(floor, efficient)
    return TickBudget(target_s=max(target, decode_s + floor), decode_s=decode_s,
                      patient_s=patient, riding=riding, rows=decode_rows)


class PrefillAllowance:
    """What is left of one tick's prefill share, in tokens (fixed chunks) or in seconds
    (time-budgeted); :meth:`size` proposes a chunk, :meth:`spend` books it."""

    def __init__(self, tokens: int | None = None, *, costs: CostModel | None = None,
                 budget: TickBudget | None = None, min_chunk: int = 1) -> None:
        self.tokens = tokens
        self.full_tokens = tokens
        self.costs = costs
        self.seconds = budget.prefill_s if budget is not None else None
        self.full = self.seconds
        self.slack = 0.0  # the share of the prefill time that work which can wait may not use
        if budget is not None and budget.patient_s is not None:
            self.slack = max(budget.prefill_s - budget.patient_s, 0.0)
        self.min_chunk = min_chunk
        self.riding = budget is not None and budget.riding
        self.rows = budget.rows if budget is not None else 0
        """Rows of the decode step's forward so far (riding: its rows and the chunks')."""
        self._fresh_forward = False  # a batched forward of whole fresh prompts is planned
        self.spent_any = False

    @property
    def timed(self) -> bool:
        return self.costs is not None and self.seconds is not None

    def exhausted(self) -> bool:
        if self.timed:
            return self.spent_any and self.seconds is not None and self.seconds <= 0
        return self.tokens is not None and self.tokens <= 0

    def _rides(self, remaining: int, computed: int, n: int) -> bool:
        """A whole fresh prompt joins the batched forward of the fresh prompts before it
        (the engine reads those together), so it pays no fixed cost of its own. (Riding in
        the decode step, every chunk pays its own small one, ``d5`` of the cost model.)"""
        return self._fresh_forward and computed == 0 and n >= remaining and not self.riding

    def size(self, remaining: int, computed: int, *, grant: bool = False,
             patient: bool = False, urgent: bool = False, turn: bool = False) -> int:
        """Tokens a prompt with ``remaining`` tokens left after ``computed`` may read now.
        ``grant``: a due grant, sized against the whole share whatever is spent.
        ``patient``: work that can wait (a background prompt). ``urgent``: a voice command.
        ``turn``: a chat turn or voice command (not background work, short: see
        :meth:`_whole`).

        Work that can wait, and any chunk that leaves its prompt unfinished, gets only the
        budget's patient share, and no more than the most efficient chunk (but riding in
        the decode step, where there is no forward's fixed cost to spread: an even share
        of what is left, :func:`even_chunk`); the first chunk of a tick (or a grant) reads
        at least ``min_chunk`` tokens, and a fresh prompt that does not fit whole when it is
        short (:meth:`_whole`). A later chunk of fewer than ``min_chunk`` tokens that
        leaves its prompt unfinished (a *crumb*) is not read (0): it would make the prompt
        one read in pieces, in a forward of its own next tick, which the streams of the
        prompts read whole beside it would wait out between their first and second tokens
        (docs/decisions/riding-tick-bounds.md)."""
        if not self.timed:
            cap = self.full_tokens if grant else self.tokens
            return remaining if cap is None else min(remaining, cap)
        costs = self.costs
        assert costs is not None and self.seconds is not None and self.full is not None
        seconds = self.full if grant else self.seconds
        limit = seconds - self.slack if patient else seconds
        if self._rides(remaining, computed,
                       costs.tokens_within(limit, computed, overhead=False)):
            return remaining
        riding = self.riding
        n = self._within(limit, computed)
        first = not self.spent_any or grant
        if n < remaining:
            if first and computed == 0 and self._whole(remaining, limit, urgent, turn):
                return remaining
            n = min(n, self._within(seconds - self.slack, computed))
            if riding:
                n = even_chunk(remaining, n) if n > 0 else 0
            else:
                best = costs.efficient_chunk(computed)
                if best is not None:
                    n = min(n, best)
        if first:
            n = max(n, self.min_chunk)
        elif n < min(remaining, self.min_chunk):
            return 0  # no crumbs (see above)
        return max(0, min(n, remaining))

    def _within(self, seconds: float, computed: int) -> int:
        assert self.costs is not None
        if self.riding:
            return self.costs.ride_tokens_within(seconds, computed, self.rows)
        return self.costs.tokens_within(seconds, computed)

    def _cost(self, tokens: int, computed: int, overhead: bool = True) -> float:
        assert self.costs is not None
        if self.riding:
            return self.costs.ride(tokens, computed, self.rows)
        return self.costs.prefill(tokens, computed, overhead=overhead)

    def _whole(self, remaining: int, limit: float, urgent: bool, turn: bool) -> bool:
        """Whether a fresh prompt that does not fit ``limit`` is read whole anyway. Read in
        forwards of its own: a chat turn or voice command (``turn``), whose first token its
        person waits for with nothing streaming (split, it would wait a tick, a decode step
        of other people's streams, for each piece: docs/decisions/turn-read-whole.md), and anything that
        costs at most two ``min_chunk`` forwards (split, it would pay a second fixed cost).
        Riding in the decode step, where a split costs no forward's fixed cost: when it costs
        at most :data:`WHOLE_RIDING` times the time left (a split would leave a stub), and a
        voice command (``urgent``) as when read apart: its wait is the one the household
        hears, a stream's longer gap is not."""
        costs = self.costs
        assert costs is not None
        cost = self._cost(remaining, 0)
        if self.riding and cost <= WHOLE_RIDING * limit:
            return True
        if not self.riding and turn:
            return True
        return (urgent or not self.riding) and cost <= 2 * costs.prefill(self.min_chunk)

    def spend(self, remaining: int, computed: int, n: int) -> None:
        if self.timed:
            assert self.costs is not None and self.seconds is not None
            self.seconds -= self._cost(n, computed,
                                       overhead=not self._rides(remaining, computed, n))
            if self.riding:
                self.rows += n
            if computed == 0 and n == remaining:
                self._fresh_forward = True
        elif self.tokens is not None:
            self.tokens = max(self.tokens - n, 0)
        self.spent_any = True
