"""What a tick costs: a model of prefill and decode time fitted online from the engine's own
measurements (per model, per machine), and the tick budget derived from it.

Pure arithmetic: the engine times its forward passes with its own clock and hands the
numbers to :meth:`CostModel.observe_decode` / :meth:`CostModel.observe_prefill`; the
scheduler asks for predictions. Nothing here reads a clock.

The model (seconds):

* decode step of ``B`` rows over ``L`` KV positions each (padded):
  ``d0 + d1 * B + d2 * B * L / 1e3``: a fixed cost per forward (on a CPU mostly reading the
  weights), per row, and attention over the KV; plus, for prompt chunks read in the same
  forward (appliance/engine/mixed.py), ``d3 * n / 1e3 + d4 * n * (k + n / 2) / 1e6`` per
  chunk of ``n`` tokens after ``k`` cached positions: they pay no fixed cost of their own;
* prefill forward of ``rows`` prompts, ``n`` new tokens each, after ``k`` cached positions:
  ``p0 + p1 * rows * n / 1e3 + p2 * rows * n * (k + n / 2) / 1e6``: a fixed cost per
  forward, the matmuls per token, and attention (every new token looks at every earlier
  position, so a chunk deep into a long prompt costs more per token).

Each is fitted by exponentially forgetting least squares on relative errors (recent ticks
weigh more, so a machine that gets busier is followed; a 5 ms tick counts as much as a 5 s
one, so the fit does not depend on how fast the machine is), ridge-pulled towards a prior
in relative terms so the first few observations cannot send a coefficient anywhere silly,
and kept non-negative. The priors
are those of a slow machine (a small model on two CPU cores), so before any data the
scheduler errs on the side of small chunks; the first ticks correct them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

BURST_STEPS = 2.5
"""Decode steps an overdue burst's tick may last while its prompts ride in the decode step
(issue 10's ITL max goal is 3 times the streams' ITL p50, which is about one step; the
half step left is the cost model's error). Read apart, the burst's prompts share a
forward's fixed cost, so such a tick may last the whole TTFT objective; riding, they have
none to share. Without it, prompts arriving while 7 rows decode were read 9 tokens a tick
(within :data:`WIDE_ROWS`), and at C = 8 a client's turn waited up to 3.2 s (serving run
s27); with 3 steps and no wide-rows term in the cost model, such ticks ran to 4-6 times
the ITL p50 (run s24)."""

WIDE_ROWS = 16
"""Rows of a forward's matrix products (decode rows plus the tokens riding with them) beyond
which they cost a step more. On Linux with OpenBLAS the appliance's own kernel
(appliance/native/skinny_matmul.c) takes products of up to 32 rows in groups of 8 over
blocks of the weights; a third group took 15-35 ms more on the SmolLM-135M shape (a decode
step of 4 rows with a 12-token chunk riding in it 72-74 ms, with a 16-token one 101-109;
``python -m appliance.bench.mixed --rows 4,7 --chunks 8,12,16,20,24,28``). When the kernel
took at most 16 rows and OpenBLAS's gemm, which first copies the weights, the rest, the
step was 52 ms (84 and 136 ms). The decode fit learns the step (``d5``); where products
have none, it fits about zero."""

DECODE_PRIOR = (0.05, 0.002, 0.01, 1.5, 8.0, 0.02)
"""d0 s/step, d1 s/row, d2 s per 1e3 row-positions (about a 135M fp32 model on 2 cores);
d3 s per 1e3 and d4 s per 1e6 token-positions of prompt chunks riding in the step (the
prefill prior's per-token terms); d5 s for a forward of more than :data:`WIDE_ROWS`
rows."""
PREFILL_PRIOR = (0.08, 1.5, 8.0)
"""p0 s/forward, p1 s per 1e3 tokens, p2 s per 1e6 token-positions (same machine)."""


class OnlineFit:
    """Least squares of relative errors, ``y ~ beta . x`` weighted 1/y^2, with forgetting, a
    relative ridge towards ``prior`` (``strength * sum((b - prior) / prior)^2``) and
    beta >= 0. ``prior`` must be positive."""

    def __init__(self, prior: Sequence[float], strength: float = 1e-2,
                 forget: float = 0.98) -> None:
        if not 0 < forget <= 1:
            raise ValueError("forget must be in (0, 1]")
        self.prior = tuple(float(p) for p in prior)
        if any(p <= 0 for p in self.prior):
            raise ValueError("prior coefficients must be positive")
        self.strength = strength
        self.forget = forget
        m = len(self.prior)
        self._xx = [[0.0] * m for _ in range(m)]
        self._xy = [0.0] * m
        self.observations = 0
        self._beta: tuple[float, ...] = self.prior
        self._fitted_at = 0

    REFIT_EVERY = 4
    """Observations between refits once warmed up (a refit is a few small linear solves;
    the engine observes twice a tick, and ticks of a tiny model take a millisecond)."""

    @property
    def beta(self) -> tuple[float, ...]:
        """The fitted coefficients, refitted lazily."""
        stale = self.observations - self._fitted_at
        if stale and (self.observations <= 16 or stale >= self.REFIT_EVERY):
            self._beta = self._solve()
            self._fitted_at = self.observations
        return self._beta

    def predict(self, x: Sequence[float]) -> float:
        return sum(b * v for b, v in zip(self.beta, x, strict=True))

    def observe(self, x: Sequence[float], y: float) -> None:
        if not (math.isfinite(y) and y >= 0):
            return
        f = self.forget
        w = 1.0 / max(y, 1e-6) ** 2
        m = len(self.prior)
        for i in range(m):
            self._xy[i] = f * self._xy[i] + w * x[i] * y
            row = self._xx[i]
            for j in range(m):
                row[j] = f * row[j] + w * x[i] * x[j]
        self.observations += 1

    def _solve(self) -> tuple[float, ...]:
        """Minimise sum w (y - b.x)^2 + strength sum((b - prior) / prior)^2 with b >= 0,
        by dropping the most negative coefficient (held at zero) until the rest are
        non-negative: at most one small solve per coefficient."""
        m = len(self.prior)
        ridge = [self.strength / p ** 2 for p in self.prior]
        a = [[self._xx[i][j] + (ridge[i] if i == j else 0.0) for j in range(m)]
             for i in range(m)]
        rhs = [self._xy[i] + ridge[i] * self.prior[i] for i in range(m)]
        free = list(range(m))
        while free:
            sol = _solve_linear([[a[i][j] for j in free] for i in free], [rhs[i] for i in free])
            if sol is None:
                return self._beta
            worst = min(range(len(free)), key=lambda k: sol[k])
            if sol[worst] >= 0:
                beta = [0.0] * m
                for i, v in zip(free, sol, strict=True):
                    beta[i] = v
                return tuple(beta)
            del free[worst]
        return tuple(0.0 for _ in range(m))


def _solve_linear(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    if n == 0:
        return []
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-15:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


Riding = Sequence[tuple[int, int]]
"""Prompt chunks read in a decode step's forward: (tokens, cached positions before) each."""


def decode_features(rows: int, kv_len: int, riding: Riding = ()) -> tuple[float, ...]:
    tokens = sum(n for n, _ in riding)
    positions = sum(n * (k + n / 2) for n, k in riding)
    return (1.0, float(rows), rows * kv_len / 1e3, tokens / 1e3, positions / 1e6,
            1.0 if rows + tokens > WIDE_ROWS else 0.0)


def prefill_features(rows: int, tokens: int, offset: int) -> tuple[float, float, float]:
    return (1.0, rows * tokens / 1e3, rows * tokens * (offset + tokens / 2) / 1e6)


@dataclass(slots=True)
class CostModel:
    """Predicted seconds of a decode step (with the prompt chunks riding in it) and of a
    prefill forward, fitted online. ``rides``: the engine reads prompt chunks in the decode
    step's forward whenever a batch decodes (then a chunk costs :meth:`prefill` with
    ``riding``)."""

    decode_fit: OnlineFit = field(default_factory=lambda: OnlineFit(DECODE_PRIOR))
    prefill_fit: OnlineFit = field(default_factory=lambda: OnlineFit(PREFILL_PRIOR))
    rides: bool = False

    def observe_decode(self, rows: int, kv_len: int, seconds: float,
                       riding: Riding = ()) -> None:
        if rows > 0:
            self.decode_fit.observe(decode_features(rows, kv_len, riding), seconds)

    def observe_prefill(self, rows: int, tokens: int, offset: int, seconds: float) -> None:
        if rows > 0 and tokens > 0:
            self.prefill_fit.observe(prefill_features(rows, tokens, offset), seconds)

    def decode(self, rows: int, kv_len: int, riding: Riding = ()) -> float:
        """A decode step of ``rows`` rows, with the prompt chunks ``riding`` in it."""
        return self.decode_fit.predict(decode_features(rows, kv_len, riding)) if rows > 0 \
            else 0.0

    def ride(self, tokens: int, offset: int, rows: int) -> float:
        """A chunk riding in a decode step whose forward has ``rows`` rows before it (the
        decode rows and the chunks already riding): its tokens, and the step to products
        of more than :data:`WIDE_ROWS` rows if it crosses there."""
        if tokens <= 0:
            return 0.0
        wide = self.decode_fit.beta[5] if rows <= WIDE_ROWS < rows + tokens else 0.0
        return self.prefill(tokens, offset, riding=True) + wide

    def ride_tokens_within(self, seconds: float, offset: int, rows: int) -> int:
        """The most tokens of a chunk riding after ``rows`` rows (as :meth:`ride`) within
        ``seconds``: up to :data:`WIDE_ROWS` rows in all, or more only when the time left
        after the step to wider products reads more than that."""
        n = self.tokens_within(seconds, offset, riding=True)
        narrow = max(WIDE_ROWS - rows, 0)
        if n <= narrow or rows > WIDE_ROWS:
            return n
        wide = self.tokens_within(seconds - self.decode_fit.beta[5], offset, riding=True)
        return wide if wide > narrow else narrow

    def prefill(self, tokens: int, offset: int = 0, *, overhead: bool = True,
                riding: bool = False) -> float:
        """One prompt's chunk of ``tokens`` after ``offset`` cached positions; without the
        forward's fixed cost when it rides in a prefill forward already paid for, and at
        the decode step's per-token rates when it is ``riding`` in that step."""
        if tokens <= 0:
            return 0.0
        p0, p1, p2 = self._chunk_rates(overhead, riding)
        x = prefill_features(1, tokens, offset)
        return p0 + p1 * x[1] + p2 * x[2]

    def _chunk_rates(self, overhead: bool, riding: bool) -> tuple[float, float, float]:
        """(fixed, per 1e3 tokens, per 1e6 token-positions) of one chunk."""
        if riding:
            _, _, _, d3, d4, _ = self.decode_fit.beta
            return (0.0, d3, d4)
        p0, p1, p2 = self.prefill_fit.beta
        return (p0 if overhead else 0.0, p1, p2)

    def prefill_rows(self, rows: int, tokens: int, offset: int) -> float:
        """One forward of ``rows`` prompts of ``tokens`` new tokens each."""
        if rows <= 0 or tokens <= 0:
            return 0.0
        return self.prefill_fit.predict(prefill_features(rows, tokens, offset))

    def efficient_chunk(self, offset: int = 0) -> int | None:
        """The chunk size with the lowest predicted time per token (fixed cost spread over
        the chunk against attention growing within it): sqrt(2 p0 / p2) tokens, or None
        when attention is free (bigger is always better)."""
        p0, _, p2 = self.prefill_fit.beta
        if p2 <= 0:
            return None
        return max(1, int(math.sqrt(2 * p0 / (p2 / 1e6))))

    def tokens_within(self, seconds: float, offset: int = 0, *, overhead: bool = True,
                      riding: bool = False) -> int:
        """The most tokens of one prompt, after ``offset`` cached positions, whose chunk is
        predicted to take at most ``seconds`` (``overhead``, ``riding``: as :meth:`prefill`)."""
        p0, p1, p2 = self._chunk_rates(overhead, riding)
        left = seconds - p0
        if left <= 0:
            return 0
        # p2/1e6 * (n*offset + n^2/2) + p1/1e3 * n <= left
        qa = p2 / 2e6
        qb = p1 / 1e3 + p2 * offset / 1e6
        if qa <= 0:
            return int(left / qb) if qb > 0 else 1 << 30
        n = (-qb + math.sqrt(qb * qb + 4 * qa * left)) / (2 * qa)
        return max(0, int(n))


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
      present, work that can wait gets at least this chunk's time, and no more when the
      decode step already takes an arrival's reading time. 8: riding in a decode step of
      8 rows on a CPU, the product stays within two groups of the appliance's own kernel
      (16 rows; appliance/native/skinny_matmul.c).
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
                ride: bool = True) -> TickBudget:
    """The tick target of a tick that prefills: the ITL objective while a batch decodes,
    capped by the TTFT bound (half the TTFT objective) either way. ``overdue``: a prompt
    someone waits on has already waited that bound unread (a burst of arrivals, read one a
    tick, would leave the last waiting several ticks past its objective), or nothing
    decodes and several such prompts wait (see ``Scheduler._allowance``), so the tick may
    last the whole TTFT objective: the burst's prompts share one forward (one fixed cost)
    and the running streams see one gap of at most that length. Riding in the decode step,
    the chunks have no fixed cost to share, so such a tick lasts at most
    :data:`BURST_STEPS` decode steps (and at least the ITL objective): enough to pay the
    step to products of more than :data:`WIDE_ROWS` rows and read the burst in big chunks.

    When that leaves prefill less than its floor (``prefill_floor`` forward fixed costs),
    the objectives cannot be met on this machine at all, and the tick gets the time of the
    most efficient chunk on top of the decode step, so a slow or busy machine at least
    reads prompts at its best pace, several fresh ones per forward.

    While the household is ``present`` (voice or interactive work about), work that can
    wait (a chunk of a long document, a background prompt) gets no more than keeps the
    tick within the time of reading one arrival (``arrival_tokens``) alone, and never less
    than a ``min_chunk`` chunk: the next chat turn or voice command waits one short tick,
    not a big chunk of someone's document (on a CPU with long contexts, seconds). Prompts read to
    their end (chat turns arriving together) may use the whole share.

    When the engine reads chunks in the decode step's forward (``costs.rides``), a batch
    decodes and the tick may ``ride``, chunks have no fixed cost: the floor is then
    ``prefill_floor`` times a ``min_chunk`` chunk's riding time, and work that can wait gets
    at least that chunk."""
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
    floor = objectives.prefill_floor * (smallest if riding else costs.prefill_fit.beta[0])
    patient = None
    if present:
        arrival = costs.prefill(objectives.arrival_tokens)
        patient = max(smallest, min(share, arrival - decode_s))
    if floor > 0 and share < floor and not riding:
        best = costs.efficient_chunk()
        if best is not None:
            floor = max(floor, costs.prefill(best, 0))
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
        the decode step, no chunk does.)"""
        return self._fresh_forward and computed == 0 and n >= remaining and not self.riding

    def size(self, remaining: int, computed: int, *, grant: bool = False,
             patient: bool = False, urgent: bool = False) -> int:
        """Tokens a prompt with ``remaining`` tokens left after ``computed`` may read now.
        ``grant``: a due grant, sized against the whole share whatever is spent.
        ``patient``: work that can wait (a background prompt). ``urgent``: a voice command.

        Work that can wait, and any chunk that leaves its prompt unfinished, gets only the
        budget's patient share, and no more than the most efficient chunk (but riding in
        the decode step, where there is no fixed cost to spread); the first chunk
        of a tick (or a grant) reads at least ``min_chunk`` tokens, and a fresh prompt that
        does not fit whole when it is short (:meth:`_whole`)."""
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
            if first and computed == 0 and self._whole(remaining, limit, urgent):
                return remaining
            n = min(n, self._within(seconds - self.slack, computed))
            best = None if riding else costs.efficient_chunk(computed)
            if best is not None:
                n = min(n, best)
        if first:
            n = max(n, self.min_chunk)
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

    def _whole(self, remaining: int, limit: float, urgent: bool) -> bool:
        """Whether a fresh prompt that does not fit ``limit`` is read whole anyway. Read in
        forwards of its own: when it costs at most two ``min_chunk`` forwards (split, a
        short chat turn would wait a tick for its first token and pay a second fixed
        cost). Riding in the decode step, where a split costs no fixed cost: when it costs
        at most half again the time left (a split would leave a stub for the next tick),
        and a voice command (``urgent``) as when read apart: its wait is the one the
        household hears, a stream's longer gap is not."""
        costs = self.costs
        assert costs is not None
        cost = self._cost(remaining, 0)
        if self.riding and cost <= 1.5 * limit:
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
