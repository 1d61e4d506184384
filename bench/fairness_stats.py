"""The pure half of `python -m bench.fairness`: what the client saw of each request, and
the figures and goals made from it (no servers, no I/O; unit-tested). The Markdown made
from them: fairness_report.py."""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from appliance.percentiles import percentile
from appliance.sched.simulator import SimResult
from bench.client import RequestTiming
from bench.report import safe_ratio

HEAVY = "alice"
LIGHT = "bob"
BACKGROUND = "carol"
VOICE = "dave"
WEIGHTED_USER = "erin"
"""Of weight ``WEIGHT``; busy only in the weighted phase, against alice (weight 1)."""
WEIGHT = 4.0

SOLO_LIGHT = "solo-light"
SOLO_VOICE = "solo-voice"
HEAVY_LIGHT = "heavy-light"
BACKLOGGED = "backlogged"
VOICE_BACKGROUND = "voice-background"
LOADED_PHASES = (HEAVY_LIGHT, BACKLOGGED, VOICE_BACKGROUND)
SAME_MIX_PHASES = (HEAVY_LIGHT, VOICE_BACKGROUND)
"""Loaded phases in which both policies serve every request of the same mix (in the
backlogged phase fair serves more of bob's short requests, which changes output tok/s)."""
WEIGHTED = "weighted"
"""alice (weight 1) and erin (weight 4) both keep more requests in flight than the batch
holds: service should follow the weights. Not among LOADED_PHASES, so the throughput
figures keep their old mix."""
PHASES = (SOLO_LIGHT, SOLO_VOICE, *LOADED_PHASES, WEIGHTED)

GOAL_LIGHT = "light-user TTFT p95 / solo (fair)"
GOAL_VOICE = "voice TTFT p95 / solo (fair)"
GOAL_SD_AVG = "service difference avg, fair / fcfs"
GOAL_SD_MAX = "service difference max, fair / fcfs"
GOAL_THROUGHPUT = "output tok/s, fair / fcfs"
GOAL_THROUGHPUT_SAME_MIX = "output tok/s of the same-mix phases, fair / fcfs"
LIGHT_TTFT_GOAL = 2.0
VOICE_TTFT_GOAL = 1.5
SERVICE_DIFF_GOAL = 0.5
THROUGHPUT_GOAL = 0.97
GOAL_WEIGHTED = "weighted phase: service ratio off the weight (fair)"
WEIGHTED_GOAL = 0.2


# --------------------------------------------------------------------------------------
# what the client saw (pure)
# --------------------------------------------------------------------------------------


@dataclass
class Record:
    """One request of one phase. Times are seconds since the phase started."""

    user: str
    lane: int
    sent_s: float
    timing: RequestTiming

    @property
    def first_token_s(self) -> float | None:
        ttft = self.timing.ttft_s
        return None if ttft is None else self.sent_s + ttft

    @property
    def end_s(self) -> float:
        return self.sent_s + self.timing.duration_s

    @property
    def computed_prompt_tokens(self) -> int | None:
        """Prompt tokens the server computed (the prompt cache's hits cost nothing)."""
        prompt = self.timing.prompt_tokens
        if prompt is None:
            return None
        return max(0, prompt - (self.timing.cached_tokens or 0))

    def waiting_at(self, t: float) -> bool:
        """Sent and without a first text chunk yet (queued or prefilling) at time t."""
        until = self.first_token_s
        return self.sent_s <= t < (self.end_s if until is None else until)

    def output_events(self) -> list[tuple[float, float]]:
        """(time, output tokens): the request's output tokens spread over its text chunks."""
        chunks = self.timing.chunk_times
        if not chunks:
            return []
        each = self.timing.output_tokens / len(chunks)
        return [(self.sent_s + c, each) for c in chunks]

    def service_events(self, w_in: float, w_out: float) -> list[tuple[float, float]]:
        """(time, weighted service): computed prompt at the first chunk, output per chunk."""
        events = [(t, w_out * n) for t, n in self.output_events()]
        first, computed = self.first_token_s, self.computed_prompt_tokens
        if first is not None and computed:
            events.append((first, w_in * computed))
        return sorted(events)

    def to_json(self) -> dict[str, Any]:
        return dict(self.timing.summary(), user=self.user, lane=self.lane,
                    sent_s=round(self.sent_s, 6))


# --------------------------------------------------------------------------------------
# statistics (pure)
# --------------------------------------------------------------------------------------


@dataclass
class TtftStats:
    """TTFT of one user's requests sent within a phase's measured span."""

    requests: int
    errors: int
    p50_s: float | None
    p95_s: float | None
    first_error: str | None = None


def ttft_stats(records: Iterable[Record], user: str, since_s: float = 0.0,
               until_s: float = math.inf) -> TtftStats:
    mine = [r for r in records if r.user == user and since_s <= r.sent_s < until_s]
    ok = [r.timing.ttft_s for r in mine if r.timing.ok and r.timing.ttft_s is not None]
    failed = [r for r in mine if not r.timing.ok]
    return TtftStats(
        requests=len(mine),
        errors=len(failed),
        p50_s=percentile(ok, 50, "linear"),
        p95_s=percentile(ok, 95, "linear"),
        first_error=failed[0].timing.error if failed else None,
    )


def output_tokens_between(records: Iterable[Record], start_s: float, end_s: float) -> float:
    """Output tokens whose text chunks arrived within [start_s, end_s)."""
    return sum(n for r in records for t, n in r.output_events() if start_s <= t < end_s)


def service_between(records: Iterable[Record], user: str, start_s: float, end_s: float,
                    w_in: float, w_out: float) -> float:
    """One user's weighted service (w_in * computed prompt + w_out * output) in a span."""
    return sum(s for r in records if r.user == user
               for t, s in r.service_events(w_in, w_out) if start_s <= t < end_s)


def waiting_share(records: Iterable[Record], user: str, start_s: float, end_s: float
                  ) -> float | None:
    """The share of [start_s, end_s) in which ``user`` had a request waiting (sent, no text
    yet): whether they were backlogged, as the server saw it give them nothing more."""
    if end_s <= start_s:
        return None
    spans = sorted((max(r.sent_s, start_s), min(r.end_s if r.first_token_s is None
                                                 else r.first_token_s, end_s))
                   for r in records if r.user == user)
    covered, reach = 0.0, start_s
    for lo, hi in spans:
        lo = max(lo, reach)
        if hi > lo:
            covered += hi - lo
            reach = hi
    return covered / (end_s - start_s)


def mean_of(values: Sequence[float | None]) -> float | None:
    """The mean, or None when any value is unknown (or there are none)."""
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known and len(known) == len(values) else None


class CumulativeService:
    """A user's weighted service received up to (and including) any moment."""

    def __init__(self, events: Iterable[tuple[float, float]]) -> None:
        ordered = sorted(events)
        self._times = [t for t, _ in ordered]
        self._totals = list(itertools.accumulate(s for _, s in ordered))

    def at(self, t: float) -> float:
        k = bisect.bisect_right(self._times, t)
        return self._totals[k - 1] if k else 0.0


@dataclass
class ServiceDifference:
    """Service gap between backlogged users per window (VTC's fairness measure)."""

    window_s: float
    windows: int
    """Windows in which every compared user was backlogged throughout (the only ones counted)."""
    windows_total: int
    avg: float | None
    max: float | None


def service_grid(records: Sequence[Record], users: Sequence[str], start_s: float,
                 window_s: float, windows: int, w_in: float, w_out: float,
                 samples_per_window: int = 200) -> SimResult:
    """The phase sampled on a grid in the simulator's own format: ``times`` (in sample
    units, so that window edges are exact), cumulative weighted ``served`` per user, and the
    users ``queued`` (backlogged) at each sample."""
    step = window_s / samples_per_window
    count = windows * samples_per_window
    cumulative = {
        u: CumulativeService(e for r in records if r.user == u
                             for e in r.service_events(w_in, w_out))
        for u in users
    }
    mine = {u: [r for r in records if r.user == u] for u in users}
    grid = [start_s + k * step for k in range(count + 1)]
    return SimResult(
        times=[float(k) for k in range(count + 1)],
        served=[{u: cumulative[u].at(t) for u in users} for t in grid],
        queued=[frozenset(u for u in users if any(r.waiting_at(t) for r in mine[u]))
                for t in grid[:-1]],
    )


def service_difference(records: Sequence[Record], users: Sequence[str], start_s: float,
                       window_s: float, windows: int, w_in: float, w_out: float,
                       samples_per_window: int = 200) -> ServiceDifference:
    """Average and maximum, over the windows in which all ``users`` were backlogged
    throughout, of (most - least) weighted service received in the window. The windows are
    consecutive, ``window_s`` long, from ``start_s``; the arithmetic is the simulator's
    (:meth:`SimResult.service_difference`)."""
    if windows < 1:
        return ServiceDifference(window_s, 0, 0, None, None)
    grid = service_grid(records, users, start_s, window_s, windows, w_in, w_out,
                        samples_per_window)
    avg, worst, counted = grid.service_difference(float(samples_per_window))
    if counted == 0:
        return ServiceDifference(window_s, 0, windows, None, None)
    return ServiceDifference(window_s, counted, windows, avg, worst)


def ratio_of_p95(loaded: TtftStats, solo: TtftStats) -> float | None:
    """TTFT p95 under load relative to the same user's solo TTFT p95."""
    return safe_ratio(loaded.p95_s, solo.p95_s)


# --------------------------------------------------------------------------------------
# one policy's figures, the goals (pure)
# --------------------------------------------------------------------------------------


@dataclass
class PhaseWindow:
    """The measured span of a phase: [start_s, end_s) since the phase started."""

    start_s: float
    end_s: float

    @property
    def length_s(self) -> float:
        return max(0.0, self.end_s - self.start_s)


@dataclass
class PolicySummary:
    policy: str
    error: str | None = None
    light_solo: TtftStats | None = None
    """The ratio's baseline: bob alone (on every server, pooled, when given)."""
    light_solo_own: TtftStats | None = None
    """bob alone on this server only."""
    light_loaded: TtftStats | None = None
    voice_solo: TtftStats | None = None
    voice_solo_own: TtftStats | None = None
    voice_loaded: TtftStats | None = None
    light_ratio: float | None = None
    voice_ratio: float | None = None
    service: ServiceDifference | None = None
    service_totals: dict[str, float] = field(default_factory=dict)
    """Weighted service of heavy and light over the backlogged phase's windows."""
    phase_tokens_per_s: dict[str, float | None] = field(default_factory=dict)
    tokens_per_s: float | None = None
    """Output tokens/s over the measured spans of all loaded phases together."""
    same_mix_tokens_per_s: float | None = None
    """Output tokens/s over the same-mix phases (heavy-light, voice-background) together."""
    weighted_totals: dict[str, float] = field(default_factory=dict)
    """Weighted service of alice and erin over the weighted phase's measured span."""
    weighted_ratio: float | None = None
    """erin's service over alice's in the weighted phase (WEIGHT when weights are kept)."""
    weighted_waiting: dict[str, float | None] = field(default_factory=dict)
    """Share of the weighted phase's measured span in which each of alice and erin had a
    request waiting: the weights are a promise to users backlogged throughout, and a user
    with nothing queued when a slot frees loses it (docs/decisions/weighted-shares.md)."""
    request_errors: int = 0


Phases = Mapping[str, Sequence[Record]]
"""One server's run: each phase's records."""


def summarize_policy(policy: str, runs: Sequence[Phases],
                     spans: Mapping[str, PhaseWindow], window_s: float, windows: int,
                     w_in: float, w_out: float, error: str | None = None,
                     solo: Phases | None = None) -> PolicySummary:
    """Everything the table shows for one policy, from the phases' raw records of its
    servers (one per round, ``--rounds``). Over rounds, TTFTs are pooled, the service
    difference is the counted windows' average and their maximum, and the rates are all
    rounds' tokens over all their spans. ``solo``: the solo phases' records to divide by
    (default: this policy's own)."""
    pooled = {name: [r for run in runs for r in run.get(name, ())]
              for name in {n for run in runs for n in run}}

    def stats(phase: str, user: str, source: Phases = pooled) -> TtftStats | None:
        if phase not in source:
            return None
        span = spans.get(phase, PhaseWindow(0.0, math.inf))
        return ttft_stats(source[phase], user, span.start_s, span.end_s)

    baseline = pooled if solo is None else solo
    s = PolicySummary(policy=policy, error=error)
    s.light_solo, s.light_loaded = stats(SOLO_LIGHT, LIGHT, baseline), stats(HEAVY_LIGHT, LIGHT)
    s.voice_solo = stats(SOLO_VOICE, VOICE, baseline)
    s.voice_loaded = stats(VOICE_BACKGROUND, VOICE)
    s.light_solo_own, s.voice_solo_own = stats(SOLO_LIGHT, LIGHT), stats(SOLO_VOICE, VOICE)
    if s.light_solo and s.light_loaded:
        s.light_ratio = ratio_of_p95(s.light_loaded, s.light_solo)
    if s.voice_solo and s.voice_loaded:
        s.voice_ratio = ratio_of_p95(s.voice_loaded, s.voice_solo)
    backlogged = [run[BACKLOGGED] for run in runs if BACKLOGGED in run]
    if backlogged:
        start = spans[BACKLOGGED].start_s
        s.service = pool_service([service_difference(recs, (HEAVY, LIGHT), start, window_s,
                                                     windows, w_in, w_out)
                                  for recs in backlogged])
        end = start + window_s * windows
        s.service_totals = {u: sum(service_between(recs, u, start, end, w_in, w_out)
                                   for recs in backlogged) for u in (HEAVY, LIGHT)}
    weighted = [run[WEIGHTED] for run in runs if WEIGHTED in run]
    if weighted:
        span = spans[WEIGHTED]
        s.weighted_totals = {u: sum(service_between(recs, u, span.start_s, span.end_s,
                                                    w_in, w_out) for recs in weighted)
                             for u in (HEAVY, WEIGHTED_USER)}
        s.weighted_ratio = safe_ratio(s.weighted_totals[WEIGHTED_USER],
                                      s.weighted_totals[HEAVY])
        s.weighted_waiting = {u: mean_of([waiting_share(recs, u, span.start_s, span.end_s)
                                          for recs in weighted])
                              for u in (HEAVY, WEIGHTED_USER)}
    s.phase_tokens_per_s = {name: combined_rate(runs, spans, (name,))
                            for name in LOADED_PHASES if name in pooled}
    s.tokens_per_s = combined_rate(runs, spans, LOADED_PHASES)
    s.same_mix_tokens_per_s = combined_rate(runs, spans, SAME_MIX_PHASES)
    s.request_errors = sum(1 for recs in pooled.values() for r in recs if not r.timing.ok)
    return s


def pool_service(rounds: Sequence[ServiceDifference]) -> ServiceDifference:
    """The service difference over several rounds' windows: the average over every counted
    window, the largest of any."""
    counted = [(d.windows, d.avg, d.max) for d in rounds
               if d.windows and d.avg is not None and d.max is not None]
    windows = sum(n for n, _, _ in counted)
    total = sum(d.windows_total for d in rounds)
    if not windows:
        return ServiceDifference(rounds[0].window_s, 0, total, None, None)
    return ServiceDifference(rounds[0].window_s, windows, total,
                             sum(n * avg for n, avg, _ in counted) / windows,
                             max(worst for _, _, worst in counted))


def pool_solo(runs: Sequence[Mapping[str, Sequence[Record]]]) -> dict[str, list[Record]]:
    """The solo phases of every server together: with one request at a time the policy
    cannot matter, and twice the samples make a steadier p95 to divide by."""
    return {name: [r for phases in runs for r in phases.get(name, ())]
            for name in (SOLO_LIGHT, SOLO_VOICE) if any(name in phases for phases in runs)}


def combined_rate(runs: Sequence[Phases], spans: Mapping[str, PhaseWindow],
                  names: Sequence[str]) -> float | None:
    """Output tokens/s over the measured spans of the named phases together, in every run;
    None unless every one of them ran in every run."""
    if not names or not runs or any(name not in run for run in runs for name in names):
        return None
    tokens = sum(output_tokens_between(run[n], spans[n].start_s, spans[n].end_s)
                 for run in runs for n in names)
    return safe_ratio(tokens, len(runs) * sum(spans[n].length_s for n in names))


@dataclass(frozen=True)
class Goal:
    name: str
    value: float | None
    op: str
    """``<=`` or ``>=``."""
    target: float

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        return self.value <= self.target if self.op == "<=" else self.value >= self.target


def evaluate_goals(summaries: Mapping[str, PolicySummary]) -> list[Goal]:
    """The goals: fair's own TTFT ratios, and fair against fcfs for the rest."""
    fair, fcfs = summaries.get("fair"), summaries.get("fcfs")
    light = fair.light_ratio if fair else None
    voice = fair.voice_ratio if fair else None
    fair_sd, fcfs_sd = (fair.service if fair else None), (fcfs.service if fcfs else None)
    avg = safe_ratio(fair_sd.avg if fair_sd else None, fcfs_sd.avg if fcfs_sd else None)
    worst = safe_ratio(fair_sd.max if fair_sd else None, fcfs_sd.max if fcfs_sd else None)
    tput = safe_ratio(fair.tokens_per_s if fair else None, fcfs.tokens_per_s if fcfs else None)
    same = safe_ratio(fair.same_mix_tokens_per_s if fair else None,
                      fcfs.same_mix_tokens_per_s if fcfs else None)
    ratio = fair.weighted_ratio if fair else None
    off = None if ratio is None else abs(ratio / WEIGHT - 1.0)
    return [
        Goal(GOAL_LIGHT, light, "<=", LIGHT_TTFT_GOAL),
        Goal(GOAL_VOICE, voice, "<=", VOICE_TTFT_GOAL),
        Goal(GOAL_SD_AVG, avg, "<=", SERVICE_DIFF_GOAL),
        Goal(GOAL_SD_MAX, worst, "<=", SERVICE_DIFF_GOAL),
        Goal(GOAL_THROUGHPUT, tput, ">=", THROUGHPUT_GOAL),
        Goal(GOAL_THROUGHPUT_SAME_MIX, same, ">=", THROUGHPUT_GOAL),
        Goal(GOAL_WEIGHTED, off, "<=", WEIGHTED_GOAL),
    ]
