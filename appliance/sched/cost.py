"""What a tick costs: a model of prefill and decode time fitted online from the engine's own
measurements (per model, per machine). The tick budget derived from it is in
appliance/sched/budget.py.

Pure arithmetic: the engine times its forward passes with its own clock and hands the
numbers to :meth:`CostModel.observe_decode` / :meth:`CostModel.observe_prefill`; the
scheduler asks for predictions. Nothing here reads a clock.

The model (seconds):

* decode step of ``B`` rows over ``L`` KV positions each (padded):
  ``d0 + d1 * B + d2 * B * L / 1e3``: a fixed cost per forward (on a CPU mostly reading the
  weights), per row, and attention over the KV; plus, for prompt chunks read in the same
  forward (appliance/engine/mixed.py), ``d5 + d3 * n / 1e3 + d4 * n * (k + n / 2) / 1e6``
  per chunk of ``n`` tokens after ``k`` cached positions: no forward's fixed cost, but a
  small one of the chunk's own (its attention, mask and positions are its own; without it
  the fit put that cost on each token and never tried bigger chunks: docs/decisions/cost-model-steps.md);
  ``d3`` and ``d4`` are pulled towards the prefill fit's ``p1`` and ``p2``, which a prompt's
  own forward teaches before any chunk rides;
* prefill forward of ``rows`` prompts, ``n`` new tokens each, after ``k`` cached positions:
  ``p0 + p1 * rows * n / 1e3 + p2 * rows * n * (k + n / 2) / 1e6``: a fixed cost per
  forward, the matmuls per token, and attention (every new token looks at every earlier
  position, so a chunk deep into a long prompt costs more per token).

  Steps on top (``s0``, ``s1``, ...): where the device's matrix products change kernels at
  some row count (the backend's :class:`CostProfile`), a forward of more rows costs a step
  more for each one it passes.

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

STEP_SHARE = 0.5
"""A step to wider products the fit has not seen yet is pulled towards this share of the
fitted fixed cost of a decode step (``d0``): a fixed prior of one machine's step kept every
chunk of a faster model below the step, so the fit never learnt it had none."""

BASE_DECODE_PRIOR = (0.05, 0.002, 0.01, 1.5, 8.0, 0.002)
"""d0 s/step, d1 s/row, d2 s per 1e3 row-positions (about a 135M fp32 model on 2 cores);
d3 s per 1e3 and d4 s per 1e6 token-positions of prompt chunks riding in the step (the
prefill prior's per-token terms); d5 s per chunk riding in the step."""
PREFILL_PRIOR = (0.08, 1.5, 8.0)
"""p0 s/forward, p1 s per 1e3 tokens, p2 s per 1e6 token-positions (same machine)."""
PULL_TOLERANCE = 0.05
"""A pulled prior that moves less than this share is left as it was (no refit for it)."""

STEP_AT = len(BASE_DECODE_PRIOR)
"""Index in the decode fit of the first step's coefficient (the others follow)."""


@dataclass(frozen=True, slots=True)
class CostProfile:
    """What a backend tells the cost model about its device, and nothing about how: the row
    counts past which a forward's matrix products cost a step more (another kernel takes
    them), narrowest first. No steps: the fit has no step terms at all."""

    name: str = "plain"
    step_rows: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if list(self.step_rows) != sorted(set(self.step_rows)) or any(
                r < 1 for r in self.step_rows):
            raise ValueError("step_rows must be increasing positive row counts")

    def decode_prior(self) -> tuple[float, ...]:
        return BASE_DECODE_PRIOR + (STEP_SHARE * BASE_DECODE_PRIOR[0],) * len(self.step_rows)


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
        self._pulled = False

    REFIT_EVERY = 4
    """Observations between refits once warmed up (a refit is a few small linear solves;
    the engine observes twice a tick, and ticks of a tiny model take a millisecond)."""

    @property
    def beta(self) -> tuple[float, ...]:
        """The fitted coefficients, refitted lazily."""
        stale = self.observations - self._fitted_at
        if self._pulled or (stale and (self.observations <= 16 or stale >= self.REFIT_EVERY)):
            self._beta = self._solve()
            self._fitted_at = self.observations
            self._pulled = False
        return self._beta

    def pull(self, i: int, value: float, *, refit: bool = False) -> None:
        """Pull coefficient ``i`` towards ``value`` (> 0) instead of its prior, from the
        next refit on (``refit``: at the next look, when it moved by more than
        :data:`PULL_TOLERANCE`): a coefficient the data seldom informs, whose plausible
        size follows another's."""
        if not value > 0:
            raise ValueError("a prior must be positive")
        if refit and not math.isclose(value, self.prior[i], rel_tol=PULL_TOLERANCE):
            self._pulled = True
        self.prior = (*self.prior[:i], float(value), *self.prior[i + 1:])

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


def decode_features(rows: int, kv_len: int, riding: Riding = (),
                    step_rows: Sequence[int] = ()) -> tuple[float, ...]:
    tokens = sum(n for n, _ in riding)
    positions = sum(n * (k + n / 2) for n, k in riding)
    return (1.0, float(rows), rows * kv_len / 1e3, tokens / 1e3, positions / 1e6,
            float(sum(n > 0 for n, _ in riding)),
            *(1.0 if rows + tokens > limit else 0.0 for limit in step_rows))


def prefill_features(rows: int, tokens: int, offset: int) -> tuple[float, float, float]:
    return (1.0, rows * tokens / 1e3, rows * tokens * (offset + tokens / 2) / 1e6)


@dataclass(slots=True)
class CostModel:
    """Predicted seconds of a decode step (with the prompt chunks riding in it) and of a
    prefill forward, fitted online. ``rides``: the engine reads prompt chunks in the decode
    step's forward whenever a batch decodes (then a chunk costs :meth:`prefill` with
    ``riding``). ``profile``: the device's steps (:class:`CostProfile`)."""

    profile: CostProfile = field(default_factory=CostProfile)
    rides: bool = False
    decode_fit: OnlineFit = field(init=False)
    prefill_fit: OnlineFit = field(init=False)

    def __post_init__(self) -> None:
        self.decode_fit = OnlineFit(self.profile.decode_prior())
        self.prefill_fit = OnlineFit(PREFILL_PRIOR)

    @property
    def _steps(self) -> list[tuple[int, int]]:
        """(rows, coefficient index) of each step, narrowest first."""
        return [(limit, STEP_AT + i) for i, limit in enumerate(self.profile.step_rows)]

    def step_cost(self, limit: int) -> float:
        """The fitted step past ``limit`` rows (a row count of the profile)."""
        return self.decode_fit.beta[STEP_AT + self.profile.step_rows.index(limit)]

    def observe_decode(self, rows: int, kv_len: int, seconds: float,
                       riding: Riding = ()) -> None:
        if rows > 0:
            fit = self.decode_fit
            fit.observe(decode_features(rows, kv_len, riding, self.profile.step_rows), seconds)
            if fit.beta[0] > 0:
                for _, i in self._steps:
                    fit.pull(i, STEP_SHARE * fit.beta[0])

    def observe_prefill(self, rows: int, tokens: int, offset: int, seconds: float) -> None:
        if rows > 0 and tokens > 0:
            self.prefill_fit.observe(prefill_features(rows, tokens, offset), seconds)
            # A chunk riding in the decode step goes through the same products and
            # attention as a prompt's own forward: until riding is seen, its per-token
            # costs are the prefill's, not a small model's prior (a 1B file's first
            # riding chunk ran 2.3x its prediction, its streams' longest gap).
            _, p1, p2 = self.prefill_fit.beta
            if p1 > 0:
                self.decode_fit.pull(3, p1, refit=True)
            if p2 > 0:
                self.decode_fit.pull(4, p2, refit=True)

    def decode(self, rows: int, kv_len: int, riding: Riding = ()) -> float:
        """A decode step of ``rows`` rows, with the prompt chunks ``riding`` in it."""
        if rows <= 0:
            return 0.0
        return self.decode_fit.predict(
            decode_features(rows, kv_len, riding, self.profile.step_rows))

    def ride(self, tokens: int, offset: int, rows: int) -> float:
        """A chunk riding in a decode step whose forward has ``rows`` rows before it (the
        decode rows and the chunks already riding): its tokens, and the profile's steps to
        wider products it crosses."""
        if tokens <= 0:
            return 0.0
        beta = self.decode_fit.beta
        steps = sum(beta[i] for limit, i in self._steps if rows <= limit < rows + tokens)
        return self.prefill(tokens, offset, riding=True) + steps

    def ride_tokens_within(self, seconds: float, offset: int, rows: int) -> int:
        """The most tokens of a chunk riding after ``rows`` rows (as :meth:`ride`) within
        ``seconds``: up to the next step's rows in all, or past it only when the time left
        after paying the step reads more than that, and so on."""
        n = self.tokens_within(seconds, offset, riding=True)
        paid = 0.0
        beta = self.decode_fit.beta
        for limit, i in self._steps:
            room = limit - rows
            if room < 0 or n <= room:  # crossed already, or not reached
                continue
            paid += beta[i]
            n = self.tokens_within(seconds - paid, offset, riding=True)
            if n <= room:
                return room
        return n

    def prefill(self, tokens: int, offset: int = 0, *, overhead: bool = True,
                riding: bool = False) -> float:
        """One prompt's chunk of ``tokens`` after ``offset`` cached positions; without the
        forward's fixed cost when it rides in a prefill forward already paid for, and at
        the decode step's rates (a chunk's own small fixed cost, then per token) when it
        is ``riding`` in that step."""
        if tokens <= 0:
            return 0.0
        p0, p1, p2 = self._chunk_rates(overhead, riding)
        x = prefill_features(1, tokens, offset)
        return p0 + p1 * x[1] + p2 * x[2]

    def _chunk_rates(self, overhead: bool, riding: bool) -> tuple[float, float, float]:
        """(fixed, per 1e3 tokens, per 1e6 token-positions) of one chunk."""
        if riding:
            d3, d4, d5 = self.decode_fit.beta[3:6]
            return (d5 if overhead else 0.0, d3, d4)
        p0, p1, p2 = self.prefill_fit.beta
        return (p0 if overhead else 0.0, p1, p2)

    def chunk_fixed(self, *, riding: bool = False) -> float:
        """The fixed cost of one prompt's chunk: a forward's, or riding in a decode step
        the chunk's own (``d5``)."""
        return self._chunk_rates(True, riding)[0]

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
