"""`appliance bench fairness`: our server under `--policy fcfs` and `--policy fair`, same run.

For each policy a fresh server (the real MLX engine, on 127.0.0.1, with its own copy of a
throwaway data dir holding the personas' users and keys) runs these phases one after another:

1. ``solo-light``: bob alone, short chats one at a time with think-time gaps (baseline).
2. ``solo-voice``: dave alone, short voice-class requests one at a time (baseline).
3. ``heavy-light``: alice keeps K long streaming requests in flight (long prompts, long
   outputs) while bob chats as in 1. → bob's TTFT relative to his solo TTFT.
4. ``backlogged``: alice keeps twice the batch size of long requests in flight and bob M
   short ones, so that both always have a request waiting even when one of them fills the
   whole batch → service difference per window between the two backlogged users, as in
   the VTC paper (Sheng et al., OSDI 2024).
5. ``voice-background``: carol keeps more background-class requests in flight than the
   batch holds while dave sends voice requests as in 2. → voice TTFT relative to solo.

Output tokens/s over the loaded phases (3-5) compares the throughput of the two policies.
Prompt and output lengths are drawn per request from seeded generators (the same sequence
under both policies), and end-of-sequence tokens get a logit bias of -100 so that every
request writes exactly its ``max_tokens``: both policies get the same work. Service is attributed in time from what the client sees:
prompt tokens computed (``prompt_tokens - cached_tokens`` of the usage chunk) at the first
text chunk, output tokens spread over the text chunks; a user is backlogged at a moment when
one of their requests was sent and has not produced its first text chunk yet.

Run: ``appliance bench fairness [--model DIR|demo|smollm-135m] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import datetime as dt
import itertools
import json
import math
import os
import platform
import random
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from appliance.bench.common import (
    OPENBLAS_PATH,
    RequestTiming,
    ServerProcess,
    ServerStartError,
    default_blas,
    describe_model,
    free_port,
    git_commit,
    model_facts,
    percentile,
    run_guarded,
    running,
    safe_ratio,
    server_env,
    stream_chat,
    wait_ready,
    write_report,
)
from appliance.bench.serve import (
    DATA_DIR_ENV,
    QUESTIONS,
    Target,
    Workload,
    blas_loaded,
    blas_report,
    chat_payload,
    discover_model,
    fmt_ms,
    fmt_rate,
    last_line,
    package_versions,
    resolve_model,
    warm_up,
)
from appliance.sched.fair import DEFAULT_W_IN, DEFAULT_W_OUT
from appliance.sched.simulator import SimResult

HOST = "127.0.0.1"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO_MODEL_DIR = REPO_ROOT / "appliance" / "demo_model"
DEFAULT_OUTPUT_ROOT = Path(".bench/fairness")
POLICIES = ("fcfs", "fair")
CLASS_HEADER = "x-appliance-class"

START_SPREAD_S = 2.0
"""The slots of a multi-request lane start at random within this many seconds."""

HEAVY = "alice"
LIGHT = "bob"
BACKGROUND = "carol"
VOICE = "dave"

SOLO_LIGHT = "solo-light"
SOLO_VOICE = "solo-voice"
HEAVY_LIGHT = "heavy-light"
BACKLOGGED = "backlogged"
VOICE_BACKGROUND = "voice-background"
LOADED_PHASES = (HEAVY_LIGHT, BACKLOGGED, VOICE_BACKGROUND)
SAME_MIX_PHASES = (HEAVY_LIGHT, VOICE_BACKGROUND)
"""Loaded phases in which both policies serve every request of the same mix (in the
backlogged phase fair serves more of bob's short requests, which changes output tok/s)."""
PHASES = (SOLO_LIGHT, SOLO_VOICE, *LOADED_PHASES)

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


@dataclass(frozen=True)
class Persona:
    name: str
    role: str = "member"
    max_class: str = "interactive"


PERSONAS = (
    Persona(HEAVY),
    Persona(LIGHT),
    Persona(BACKGROUND),
    Persona(VOICE, role="admin", max_class="voice"),
)

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
        p50_s=percentile(ok, 50),
        p95_s=percentile(ok, 95),
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
    request_errors: int = 0


def summarize_policy(policy: str, phases: Mapping[str, Sequence[Record]],
                     spans: Mapping[str, PhaseWindow], window_s: float, windows: int,
                     w_in: float, w_out: float, error: str | None = None,
                     solo: Mapping[str, Sequence[Record]] | None = None) -> PolicySummary:
    """Everything the table shows for one policy, from the phases' raw records. ``solo``:
    the solo phases' records to divide by (default: this server's own)."""
    def stats(phase: str, user: str, source: Mapping[str, Sequence[Record]] = phases
              ) -> TtftStats | None:
        if phase not in source:
            return None
        span = spans.get(phase, PhaseWindow(0.0, math.inf))
        return ttft_stats(source[phase], user, span.start_s, span.end_s)

    baseline = phases if solo is None else solo
    s = PolicySummary(policy=policy, error=error)
    s.light_solo, s.light_loaded = stats(SOLO_LIGHT, LIGHT, baseline), stats(HEAVY_LIGHT, LIGHT)
    s.voice_solo = stats(SOLO_VOICE, VOICE, baseline)
    s.voice_loaded = stats(VOICE_BACKGROUND, VOICE)
    s.light_solo_own, s.voice_solo_own = stats(SOLO_LIGHT, LIGHT), stats(SOLO_VOICE, VOICE)
    if s.light_solo and s.light_loaded:
        s.light_ratio = ratio_of_p95(s.light_loaded, s.light_solo)
    if s.voice_solo and s.voice_loaded:
        s.voice_ratio = ratio_of_p95(s.voice_loaded, s.voice_solo)
    if BACKLOGGED in phases:
        recs, start = phases[BACKLOGGED], spans[BACKLOGGED].start_s
        s.service = service_difference(recs, (HEAVY, LIGHT), start, window_s, windows,
                                       w_in, w_out)
        end = start + window_s * windows
        s.service_totals = {u: service_between(recs, u, start, end, w_in, w_out)
                            for u in (HEAVY, LIGHT)}
    s.phase_tokens_per_s = {name: combined_rate(phases, spans, (name,))
                            for name in LOADED_PHASES if name in phases}
    s.tokens_per_s = combined_rate(phases, spans, LOADED_PHASES)
    s.same_mix_tokens_per_s = combined_rate(phases, spans, SAME_MIX_PHASES)
    s.request_errors = sum(1 for recs in phases.values() for r in recs if not r.timing.ok)
    return s


def pool_solo(runs: Sequence[Mapping[str, Sequence[Record]]]) -> dict[str, list[Record]]:
    """The solo phases of every server together: with one request at a time the policy
    cannot matter, and twice the samples make a steadier p95 to divide by."""
    return {name: [r for phases in runs for r in phases.get(name, ())]
            for name in (SOLO_LIGHT, SOLO_VOICE) if any(name in phases for phases in runs)}


def combined_rate(phases: Mapping[str, Sequence[Record]], spans: Mapping[str, PhaseWindow],
                  names: Sequence[str]) -> float | None:
    """Output tokens/s over the measured spans of the named phases together; None unless
    every one of them ran."""
    if not names or any(name not in phases for name in names):
        return None
    tokens = sum(output_tokens_between(phases[n], spans[n].start_s, spans[n].end_s)
                 for n in names)
    return safe_ratio(tokens, sum(spans[n].length_s for n in names))


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
    return [
        Goal(GOAL_LIGHT, light, "<=", LIGHT_TTFT_GOAL),
        Goal(GOAL_VOICE, voice, "<=", VOICE_TTFT_GOAL),
        Goal(GOAL_SD_AVG, avg, "<=", SERVICE_DIFF_GOAL),
        Goal(GOAL_SD_MAX, worst, "<=", SERVICE_DIFF_GOAL),
        Goal(GOAL_THROUGHPUT, tput, ">=", THROUGHPUT_GOAL),
        Goal(GOAL_THROUGHPUT_SAME_MIX, same, ">=", THROUGHPUT_GOAL),
    ]


# --------------------------------------------------------------------------------------
# rendering (pure)
# --------------------------------------------------------------------------------------


def fmt_x(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def fmt_tokens(value: float | None) -> str:
    return "–" if value is None else f"{value:,.0f}"


def fmt_pair(stats: TtftStats | None) -> str:
    """`p50 / p95 (n)` in ms."""
    if stats is None:
        return "–"
    ok = stats.requests - stats.errors
    errors = f", {stats.errors} failed" if stats.errors else ""
    return f"{fmt_ms(stats.p50_s)} / {fmt_ms(stats.p95_s)} (n={ok}{errors})"


def fmt_service(sd: ServiceDifference | None, pick: Callable[[ServiceDifference], float | None]
                ) -> str:
    if sd is None:
        return "–"
    return f"{fmt_tokens(pick(sd))} ({sd.windows}/{sd.windows_total} windows)"


def fmt_goal(goal: Goal) -> str:
    met = {True: "**yes**", False: "**no**", None: "–"}[goal.met]
    return f"{met} ({fmt_x(goal.value)})" if goal.value is not None else met


def fmt_share(totals: Mapping[str, float]) -> str:
    if not totals:
        return "–"
    return " : ".join(f"{u} {fmt_tokens(v)}" for u, v in totals.items())


def phase_rate(phase: str) -> Callable[[PolicySummary], str]:
    return lambda s: fmt_rate(s.phase_tokens_per_s.get(phase))


def render_table(summaries: Mapping[str, PolicySummary], goals: Sequence[Goal],
                 window_s: float) -> str:
    """Markdown: one row per figure, one column per policy, then the goal and whether fair
    met it."""
    names = list(summaries)
    by_goal = {g.name: g for g in goals}
    win = f"{window_s:g} s"

    def row(label: str, cell: Callable[[PolicySummary], str], goal: str = "",
            goal_key: str | None = None) -> str:
        cells = [cell(summaries[n]) for n in names]
        met = fmt_goal(by_goal[goal_key]) if goal_key else ""
        return "| " + " | ".join([label, *cells, goal, met]) + " |"

    lines = [
        "| figure | " + " | ".join(names) + " | goal | met |",
        "|---|" + "---:|" * len(names) + "---|---|",
        row("light user (bob) TTFT p50 / p95 ms, solo on this server",
            lambda s: fmt_pair(s.light_solo_own)),
        row("light user TTFT p50 / p95 ms, solo, all servers pooled (baseline)",
            lambda s: fmt_pair(s.light_solo)),
        row("light user TTFT p50 / p95 ms, heavy user backlogged",
            lambda s: fmt_pair(s.light_loaded)),
        row("light-user TTFT p95 relative to solo", lambda s: fmt_x(s.light_ratio),
            f"fair ≤ {LIGHT_TTFT_GOAL:g}×", GOAL_LIGHT),
        row("voice (dave) TTFT p50 / p95 ms, solo on this server",
            lambda s: fmt_pair(s.voice_solo_own)),
        row("voice TTFT p50 / p95 ms, solo, all servers pooled (baseline)",
            lambda s: fmt_pair(s.voice_solo)),
        row("voice TTFT p50 / p95 ms, background backlog", lambda s: fmt_pair(s.voice_loaded)),
        row("voice TTFT p95 relative to solo", lambda s: fmt_x(s.voice_ratio),
            f"fair ≤ {VOICE_TTFT_GOAL:g}×", GOAL_VOICE),
        row(f"service difference heavy vs light per {win} window, avg",
            lambda s: fmt_service(s.service, lambda d: d.avg),
            f"fair ≤ {SERVICE_DIFF_GOAL:g}× fcfs", GOAL_SD_AVG),
        row(f"service difference per {win} window, max",
            lambda s: fmt_service(s.service, lambda d: d.max),
            f"fair ≤ {SERVICE_DIFF_GOAL:g}× fcfs", GOAL_SD_MAX),
        row("weighted service in those windows", lambda s: fmt_share(s.service_totals)),
        *(row(f"output tok/s, {p}", phase_rate(p)) for p in LOADED_PHASES),
        row("output tok/s, loaded phases together", lambda s: fmt_rate(s.tokens_per_s),
            f"fair ≥ {THROUGHPUT_GOAL:g}× fcfs", GOAL_THROUGHPUT),
        row(f"output tok/s, {' + '.join(SAME_MIX_PHASES)} (same mix under both)",
            lambda s: fmt_rate(s.same_mix_tokens_per_s),
            f"fair ≥ {THROUGHPUT_GOAL:g}× fcfs", GOAL_THROUGHPUT_SAME_MIX),
    ]
    return "\n".join(lines)


def render_report(meta: Mapping[str, Any], summaries: Mapping[str, PolicySummary],
                  goals: Sequence[Goal], servers: Mapping[str, Mapping[str, Any]]) -> str:
    """The whole Markdown report: facts about the run, the table, notes."""
    wl = meta["workload"]
    lines = [
        f"### Fairness benchmark: {', '.join(summaries)} ({meta['date']})",
        "",
        f"- command: `{meta['command']}`",
        f"- model: `{meta['model']['path']}` ({describe_model(meta['model'])})",
        f"- BLAS: {meta['blas_report']}",
        f"- git commit: `{meta['git_commit']}`; mlx {meta['versions'].get('mlx', '?')}, "
        f"mlx-lm {meta['versions'].get('mlx_lm', '?')}, python {meta['versions']['python']}",
        f"- machine: {meta['machine']}; max batch {meta['max_batch_size']}; "
        f"w_in {meta['w_in']:g}, w_out {meta['w_out']:g}; run took {meta['duration_s']:.0f} s",
        f"- workload: {wl}",
    ]
    for name, server in servers.items():
        lines.append(f"- {name}: `{server['command']}` (log `{server['log']}`)")
    lines += ["", render_table(summaries, goals, meta["window_s"]), ""]
    lines += [
        "TTFT: request sent → first text chunk, from the client. Each server ran the solo "
        "baselines just before its loaded phases; the ratios divide by the p95 of all servers' "
        "solo requests pooled (one request at a time, so the policy cannot matter). Service: w_in × prompt tokens computed + w_out × output tokens, per user "
        f"per {meta['window_s']:g} s window (60 s in the VTC paper; shorter here to get several "
        "windows from a short run), counted only in windows where both users had a request "
        "waiting throughout. Goals apply to fair; fcfs is the reference.",
    ]
    for name, s in summaries.items():
        if s.error:
            lines.append(f"- {name} FAILED: {s.error}")
        elif s.request_errors:
            lines.append(f"- {name}: {s.request_errors} requests failed (see the JSON).")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# workload
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    prompt_tokens: tuple[int, int]
    max_tokens: tuple[int, int]


@dataclass(frozen=True)
class Lane:
    """A closed-loop client: `concurrency` requests in flight, each followed by a think
    time, until the phase's deadline or `requests` requests per slot."""

    user: str
    klass: str | None
    concurrency: int
    shape: Shape
    think_s: tuple[float, float] = (0.0, 0.0)
    requests: int | None = None


@dataclass(frozen=True)
class PhaseSpec:
    name: str
    lanes: tuple[Lane, ...]
    duration_s: float | None
    """None: until every lane has sent its `requests`."""
    ramp_s: float = 0.0
    """Not measured: the start of a loaded phase, while the backlog builds up."""

    def window(self) -> PhaseWindow:
        if self.duration_s is None:
            return PhaseWindow(0.0, math.inf)
        return PhaseWindow(self.ramp_s, self.duration_s)


class PromptMaker:
    """Distinct prompts of about a given number of tokens: a serial number, then household
    questions, word by word, until the target is reached (token counts from the model's own
    tokenizer, summed per word; the chat template adds its own few tokens on top)."""

    def __init__(self, count_tokens: Callable[[str], int],
                 sentences: Sequence[str] = QUESTIONS) -> None:
        self._count = count_tokens
        self._sentences = [s.split() for s in sentences]
        self._sizes: dict[str, int] = {}
        self._serials = itertools.count(1)

    def _size(self, word: str) -> int:
        if word not in self._sizes:
            self._sizes[word] = max(1, self._count(" " + word))
        return self._sizes[word]

    def make(self, tokens: tuple[int, int], rng: random.Random) -> str:
        target = rng.randint(*tokens)
        head = f"Request {next(self._serials)}:"
        words, total = [head], self._count(head)
        order = self._sentences[:]
        rng.shuffle(order)
        for word in itertools.chain.from_iterable(itertools.cycle(order)):
            if total >= target:
                break
            words.append(word)
            total += self._size(word)
        return " ".join(words)


def token_counter(model_dir: Path) -> Callable[[str], int]:
    """Count tokens with the model's tokenizer.json (about 4 characters a token without)."""
    path = model_dir / "tokenizer.json"
    if not path.exists():
        return lambda text: max(1, len(text) // 4)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


def eos_token_ids(model_dir: Path) -> list[int]:
    """End-of-sequence ids from config.json, generation_config.json and the tokenizer."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        if path.exists():
            value = json.loads(path.read_text()).get("eos_token_id")
            ids.update(value if isinstance(value, list) else [] if value is None else [value])
    tok_cfg, tok_json = model_dir / "tokenizer_config.json", model_dir / "tokenizer.json"
    if tok_cfg.exists() and tok_json.exists():
        eos = json.loads(tok_cfg.read_text()).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        added = json.loads(tok_json.read_text()).get("added_tokens") or []
        ids.update(t["id"] for t in added if eos is not None and t.get("content") == eos)
    return sorted(i for i in ids if isinstance(i, int))


@dataclass
class Config:
    model_dir: Path
    policies: list[str]
    blas: str
    our_cmd: list[str]
    server_args: list[str]
    max_batch_size: int
    heavy_concurrency: int
    heavy_backlog: int
    light_backlog: int
    background_concurrency: int
    solo_requests: int
    heavy_light_s: float
    voice_background_s: float
    window_s: float
    windows: int
    ramp_s: float
    w_in: float
    w_out: float
    fair_flags: list[str]
    seed: int
    eos_bias: bool
    phases: list[str]
    output_dir: Path
    ready_timeout_s: float
    request_timeout_s: float
    drain_timeout_s: float
    command: str
    heavy: Shape = Shape((600, 1000), (192, 320))
    light: Shape = Shape((30, 30), (32, 32))
    voice: Shape = Shape((30, 30), (24, 24))
    background: Shape = Shape((300, 600), (96, 160))
    light_think_s: tuple[float, float] = (0.3, 1.0)
    voice_think_s: tuple[float, float] = (0.5, 1.5)


def phase_specs(cfg: Config) -> list[PhaseSpec]:
    """The five phases, in the order each server runs them."""
    n = cfg.solo_requests
    bob = Lane(LIGHT, None, 1, cfg.light, cfg.light_think_s)
    dave = Lane(VOICE, "voice", 1, cfg.voice, cfg.voice_think_s)
    alice = Lane(HEAVY, None, cfg.heavy_concurrency, cfg.heavy)
    return [
        PhaseSpec(SOLO_LIGHT, (Lane(LIGHT, None, 1, cfg.light, cfg.light_think_s, n),), None),
        PhaseSpec(SOLO_VOICE, (Lane(VOICE, "voice", 1, cfg.voice, cfg.voice_think_s, n),), None),
        PhaseSpec(HEAVY_LIGHT, (alice, bob), cfg.ramp_s + cfg.heavy_light_s, cfg.ramp_s),
        PhaseSpec(BACKLOGGED, (Lane(HEAVY, None, cfg.heavy_backlog, cfg.heavy),
                               Lane(LIGHT, None, cfg.light_backlog, cfg.light)),
                  cfg.ramp_s + cfg.window_s * cfg.windows, cfg.ramp_s),
        PhaseSpec(VOICE_BACKGROUND,
                  (Lane(BACKGROUND, "background", cfg.background_concurrency, cfg.background),
                   dave),
                  cfg.ramp_s + cfg.voice_background_s, cfg.ramp_s),
    ]


def describe_workload(cfg: Config) -> str:
    def span(lo: int, hi: int) -> str:
        return f"{lo}" if lo == hi else f"{lo}-{hi}"

    def shape(s: Shape) -> str:
        return (f"{span(*s.prompt_tokens)}-token prompts, {span(*s.max_tokens)} output "
                "tokens")

    return (
        f"{HEAVY} (heavy) {cfg.heavy_concurrency} in flight, {shape(cfg.heavy)}; "
        f"{LIGHT} (light) one at a time, {shape(cfg.light)}, think "
        f"{cfg.light_think_s[0]:g}-{cfg.light_think_s[1]:g} s; in the backlogged phase "
        f"{HEAVY} {cfg.heavy_backlog} and {LIGHT} {cfg.light_backlog} in flight; {BACKGROUND} (background class) "
        f"{cfg.background_concurrency} in flight, {shape(cfg.background)}; {VOICE} (voice "
        f"class) one at a time, {shape(cfg.voice)}, think {cfg.voice_think_s[0]:g}-"
        f"{cfg.voice_think_s[1]:g} s. Solo baselines {cfg.solo_requests} requests each; "
        f"{HEAVY_LIGHT} {cfg.heavy_light_s:g} s, {BACKLOGGED} {cfg.windows} × "
        f"{cfg.window_s:g} s windows, {VOICE_BACKGROUND} {cfg.voice_background_s:g} s, each "
        f"after {cfg.ramp_s:g} s unmeasured ramp-up; temperature 0, EOS "
        f"{'suppressed (fixed output lengths)' if cfg.eos_bias else 'allowed'}, distinct "
        "prompts"
    )


# --------------------------------------------------------------------------------------
# driving one server
# --------------------------------------------------------------------------------------


@dataclass
class PhaseRun:
    spec: PhaseSpec
    targets: Mapping[str, Target]
    prompts: PromptMaker
    logit_bias: Mapping[str, float]
    seed: int
    t0: float = 0.0
    deadline: float | None = None
    records: list[Record] = field(default_factory=list)


async def lane_slot(run: PhaseRun, client: httpx.AsyncClient, lane: Lane, slot: int) -> None:
    """One request of a lane in flight at a time, back to back (after the think time)."""
    target = run.targets[lane.user]
    url = f"{target.base_url}/v1/chat/completions"
    rng = random.Random(f"{run.seed}:{run.spec.name}:{lane.user}:{slot}")
    if lane.concurrency > 1:  # a user's parallel requests do not all start (and end) together
        await asyncio.sleep(rng.uniform(0.0, START_SPREAD_S))
    for index in itertools.count():
        if lane.requests is not None and index >= lane.requests:
            return
        if run.deadline is not None and time.perf_counter() >= run.deadline:
            return
        payload = chat_payload(target, run.prompts.make(lane.shape.prompt_tokens, rng),
                               rng.randint(*lane.shape.max_tokens), include_usage=True)
        if run.logit_bias:
            payload["logit_bias"] = dict(run.logit_bias)
        sent = time.perf_counter() - run.t0
        timing = await stream_chat(client, url, payload, target.headers, client_id=slot,
                                   index=index)
        run.records.append(Record(lane.user, slot, sent, timing))
        pause = rng.uniform(*lane.think_s)
        await asyncio.sleep(pause if timing.ok else max(pause, 1.0))


async def run_phase(run: PhaseRun, request_timeout_s: float, drain_timeout_s: float) -> int:
    """Run every lane of the phase; returns how many requests were cut off at the drain
    timeout (their records are lost)."""
    slots = [(lane, i) for lane in run.spec.lanes for i in range(lane.concurrency)]
    limits = httpx.Limits(max_connections=len(slots) + 4, max_keepalive_connections=len(slots))
    timeout = httpx.Timeout(request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        run.t0 = time.perf_counter()
        if run.spec.duration_s is not None:
            run.deadline = run.t0 + run.spec.duration_s
        tasks = [asyncio.create_task(lane_slot(run, client, lane, i)) for lane, i in slots]
        wait = None if run.spec.duration_s is None else run.spec.duration_s + drain_timeout_s
        _, pending = await asyncio.wait(tasks, timeout=wait)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return len(pending)


def server_argv(cfg: Config, policy: str, port: int) -> list[str]:
    argv = [*cfg.our_cmd, "--model", str(cfg.model_dir), "--host", HOST, "--port", str(port),
            "--max-batch-size", str(cfg.max_batch_size), "--policy", policy]
    if policy == "fair":
        argv += cfg.fair_flags
    return [*argv, *cfg.server_args]


def make_server(cfg: Config, policy: str, port: int, data_dir: Path) -> ServerProcess:
    env = server_env(cfg.blas)
    env["APPLIANCE_BLAS"] = cfg.blas  # our CLI would preload OpenBLAS on its own otherwise
    env[DATA_DIR_ENV] = str(data_dir)
    return ServerProcess(name=f"ours --policy {policy}", argv=server_argv(cfg, policy, port),
                         env=env, log_path=cfg.output_dir / f"{policy}.log")


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


async def bench_policy(cfg: Config, policy: str, keys: Mapping[str, str], template: Path,
                       prompts: PromptMaker, bias: Mapping[str, float]) -> dict[str, Any]:
    """Start a server with this policy on a fresh copy of the data dir, run every phase,
    stop it. The raw records of each phase go into the returned JSON-able dict."""
    data_dir = cfg.output_dir / f"data-{policy}"
    shutil.rmtree(data_dir, ignore_errors=True)
    shutil.copytree(template, data_dir)
    port = free_port(HOST)
    server = make_server(cfg, policy, port, data_dir)
    info: dict[str, Any] = {"command": shlex.join(server.argv), "log": str(server.log_path),
                            "error": None, "phases": {}, "cut_off": {}}
    log(f"starting {policy}: {info['command']}")
    try:
        with running(server):
            await drive(cfg, policy, server, port, keys, prompts, bias, info)
    except (ServerStartError, RuntimeError, httpx.HTTPError, OSError) as exc:
        log(f"{policy} failed: {exc}")
        info["error"] = str(exc)
    info["exit_code"] = server.proc.returncode if server.proc else None
    return info


async def drive(cfg: Config, policy: str, server: ServerProcess, port: int,
                keys: Mapping[str, str], prompts: PromptMaker, bias: Mapping[str, float],
                info: dict[str, Any]) -> None:
    base_url = f"http://{HOST}:{port}"
    auth = {"Authorization": f"Bearer {keys[HEAVY]}"}
    info["health"] = await wait_ready(server, base_url, auth, cfg.ready_timeout_s)
    info["openblas_loaded"] = blas_loaded(server)
    model = await discover_model(Target(HEAVY, base_url, auth, None))
    targets = user_targets(base_url, keys, model)
    await warm_up(targets[HEAVY], Workload([cfg.max_batch_size], 1, 8, True, True,
                                           cfg.request_timeout_s))
    for spec in phase_specs(cfg):
        if spec.name not in cfg.phases:
            continue
        if server.exited() is not None:
            raise RuntimeError(f"server exited with code {server.exited()}; log "
                               f"{server.log_path}:\n{server.log_tail()}")
        run = PhaseRun(spec, targets, prompts, bias, cfg.seed)
        cut = await run_phase(run, cfg.request_timeout_s, cfg.drain_timeout_s)
        info["phases"][spec.name] = run.records
        info["cut_off"][spec.name] = cut
        failed = sum(1 for r in run.records if not r.timing.ok)
        log(f"{policy} {spec.name}: {len(run.records)} requests, {failed} failed, "
            f"{cut} cut off")


def user_targets(base_url: str, keys: Mapping[str, str], model: str | None
                 ) -> dict[str, Target]:
    klass = {BACKGROUND: "background", VOICE: "voice"}
    targets = {}
    for user, key in keys.items():
        headers = {"Authorization": f"Bearer {key}"}
        if user in klass:
            headers[CLASS_HEADER] = klass[user]
        targets[user] = Target(user, base_url, headers, model)
    return targets


# --------------------------------------------------------------------------------------
# provisioning: a throwaway data dir with the personas
# --------------------------------------------------------------------------------------


def admin_steps(personas: Sequence[Persona]) -> list[tuple[list[str], str | None]]:
    """The `appliance` commands (and their stdin) that make the personas and their keys."""
    steps: list[tuple[list[str], str | None]] = [(["migrate"], None)]
    for p in personas:
        steps.append((["user", "add", p.name, "--role", p.role, "--max-class", p.max_class,
                       "--password-stdin"], secrets.token_urlsafe(18) + "\n"))
        steps.append((["key", "create", p.name, "--name", "bench-fairness"], None))
    return steps


def provision(cfg: Config, data_dir: Path) -> dict[str, str]:
    """Users and API keys of the personas in a fresh data dir; returns user → key."""
    shutil.rmtree(data_dir, ignore_errors=True)
    env = server_env(cfg.blas)
    env[DATA_DIR_ENV] = str(data_dir)
    keys: dict[str, str] = {}
    for argv, stdin in admin_steps(PERSONAS):
        proc = subprocess.run([sys.executable, "-m", "appliance", *argv], env=env, input=stdin,
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"`appliance {' '.join(argv)}` failed ({proc.returncode}): "
                               f"{(proc.stderr or proc.stdout).strip()[-500:]}")
        if argv[0] == "key":
            key = last_line(proc.stdout)
            if not key or " " in key:
                raise RuntimeError(f"no API key in the output of `appliance key create`: "
                                   f"{proc.stdout!r}")
            keys[argv[2]] = key
    return keys


# --------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------


def summarize_all(cfg: Config, servers: Mapping[str, Mapping[str, Any]]
                  ) -> dict[str, PolicySummary]:
    spans = {spec.name: spec.window() for spec in phase_specs(cfg)}
    solo = pool_solo([info["phases"] for info in servers.values()])
    return {
        policy: summarize_policy(policy, info["phases"], spans, cfg.window_s, cfg.windows,
                                 cfg.w_in, cfg.w_out, error=info["error"], solo=solo)
        for policy, info in servers.items()
    }


def build_meta(cfg: Config, servers: Mapping[str, Mapping[str, Any]], started: dt.datetime
               ) -> dict[str, Any]:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "date": started.isoformat(timespec="seconds"),
        "command": cfg.command,
        "model": model_facts(cfg.model_dir),
        "blas": cfg.blas,
        "blas_report": blas_report(cfg.blas, servers),
        "git_commit": git_commit(REPO_ROOT),
        "versions": package_versions(),
        "machine": f"{platform.system()} {platform.machine()}, {cpus} CPUs",
        "max_batch_size": cfg.max_batch_size,
        "w_in": cfg.w_in,
        "w_out": cfg.w_out,
        "window_s": cfg.window_s,
        "windows": cfg.windows,
        "workload": describe_workload(cfg),
        "output_dir": str(cfg.output_dir),
        "duration_s": round((dt.datetime.now(dt.UTC) - started).total_seconds(), 1),
    }


def report_json(meta: Mapping[str, Any], summaries: Mapping[str, PolicySummary],
                goals: Sequence[Goal], servers: Mapping[str, Mapping[str, Any]]
                ) -> dict[str, Any]:
    raw = {
        policy: {**{k: v for k, v in info.items() if k != "phases"},
                 "phases": {name: [r.to_json() for r in recs]
                            for name, recs in info["phases"].items()}}
        for policy, info in servers.items()
    }
    return {
        "meta": dict(meta),
        "summaries": {p: asdict(s) for p, s in summaries.items()},
        "goals": [dict(asdict(g), met=g.met) for g in goals],
        "servers": raw,
    }


# --------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------


def positive(kind: type[int] | type[float]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="appliance bench fairness",
        description="Our server under --policy fcfs and --policy fair on the same load: "
        "light-user and voice TTFT against solo, service difference, throughput.")
    p.add_argument("--model", default="demo",
                   help="model directory, or 'demo' (the bundled demo model, the default: a "
                   "run takes ~8 min on 2 cores) or 'smollm-135m' (the random SmolLM-135M "
                   "shape of `bench serve`, built once; much slower)")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="comma-separated policies, one server each, in this order "
                   "(default: fcfs,fair)")
    p.add_argument("--max-batch-size", type=positive(int), default=8)
    p.add_argument("--heavy-concurrency", type=positive(int), default=6,
                   help="alice's requests in flight (default: 6)")
    p.add_argument("--heavy-backlog", type=positive(int), default=None,
                   help="alice's requests in flight in the backlogged phase (default: twice the "
                   "max batch size, so that some wait even when hers fill the batch)")
    p.add_argument("--light-backlog", type=positive(int), default=12,
                   help="bob's requests in flight in the backlogged phase (default: 12)")
    p.add_argument("--background-concurrency", type=positive(int), default=12,
                   help="carol's background requests in flight (default: 12)")
    p.add_argument("--solo-requests", type=positive(int), default=20,
                   help="requests of each solo baseline (default: 20)")
    p.add_argument("--heavy-light-seconds", type=positive(float), default=40.0)
    p.add_argument("--voice-background-seconds", type=positive(float), default=40.0)
    p.add_argument("--window", type=positive(float), default=15.0,
                   help="service-difference window in seconds (default: 15; the VTC paper "
                   "uses 60, too long for a short run)")
    p.add_argument("--windows", type=positive(int), default=4,
                   help="windows in the backlogged phase (default: 4)")
    p.add_argument("--ramp-seconds", type=float, default=5.0,
                   help="unmeasured start of each loaded phase (default: 5)")
    p.add_argument("--aging-seconds", type=float, default=None,
                   help="passed to the fair server (default: the daemon's)")
    p.add_argument("--w-in", type=float, default=None,
                   help=f"passed to the fair server and used for the service figures "
                   f"(default: {DEFAULT_W_IN:g})")
    p.add_argument("--w-out", type=float, default=None,
                   help=f"as --w-in, for output tokens (default: {DEFAULT_W_OUT:g})")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for both servers (repeatable), e.g. "
                   "--server-arg=--enable-preemption")
    p.add_argument("--allow-eos", action="store_true",
                   help="let the model stop on its own (default: EOS gets a -100 logit bias, "
                   "so output lengths are fixed)")
    p.add_argument("--phases", default=",".join(PHASES),
                   help="comma-separated phases to run (default: all, in this order)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--blas", choices=("openblas", "bundled"), default=None,
                   help="default: openblas when installed")
    p.add_argument("--our-cmd", default=f"{shlex.quote(sys.executable)} -m appliance serve",
                   help="command prefix of our server")
    p.add_argument("--request-timeout", type=positive(float), default=600.0)
    p.add_argument("--ready-timeout", type=positive(float), default=300.0)
    p.add_argument("--drain-timeout", type=positive(float), default=120.0,
                   help="seconds a loaded phase waits, after its end, for requests in flight")
    p.add_argument("--output-dir", type=Path, default=None,
                   help=f"logs, data dirs, report (default: {DEFAULT_OUTPUT_ROOT}/<time>)")
    p.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    return p


def model_dir_from(arg: str) -> Path:
    if arg == "demo":
        return DEMO_MODEL_DIR
    if arg == "smollm-135m":
        return resolve_model(None)
    return resolve_model(Path(arg))


def config_from_args(args: argparse.Namespace, command: str, started: dt.datetime) -> Config:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies or any(p not in POLICIES for p in policies):
        raise SystemExit(f"--policies: choose from {', '.join(POLICIES)}")
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    if not phases or any(p not in PHASES for p in phases):
        raise SystemExit(f"--phases: choose from {', '.join(PHASES)}")
    blas = args.blas or default_blas()
    if blas == "openblas" and not OPENBLAS_PATH.exists():
        raise SystemExit(f"--blas openblas: {OPENBLAS_PATH} not found "
                         "(apt-get install libopenblas0-pthread)")
    fair_flags: list[str] = []
    for flag, value in (("--aging-seconds", args.aging_seconds), ("--w-in", args.w_in),
                        ("--w-out", args.w_out)):
        if value is not None:
            fair_flags += [flag, f"{value:g}"]
    stamp = started.strftime("%Y%m%dT%H%M%SZ")
    return Config(
        model_dir=model_dir_from(args.model),
        policies=policies,
        blas=blas,
        our_cmd=shlex.split(args.our_cmd),
        server_args=list(args.server_arg),
        max_batch_size=args.max_batch_size,
        heavy_concurrency=args.heavy_concurrency,
        heavy_backlog=args.heavy_backlog or 2 * args.max_batch_size,
        light_backlog=args.light_backlog,
        background_concurrency=args.background_concurrency,
        solo_requests=args.solo_requests,
        heavy_light_s=args.heavy_light_seconds,
        voice_background_s=args.voice_background_seconds,
        window_s=args.window,
        windows=args.windows,
        ramp_s=max(0.0, args.ramp_seconds),
        w_in=DEFAULT_W_IN if args.w_in is None else args.w_in,
        w_out=DEFAULT_W_OUT if args.w_out is None else args.w_out,
        fair_flags=fair_flags,
        seed=args.seed,
        eos_bias=not args.allow_eos,
        phases=phases,
        output_dir=(args.output_dir or DEFAULT_OUTPUT_ROOT / stamp).resolve(),
        ready_timeout_s=args.ready_timeout,
        request_timeout_s=args.request_timeout,
        drain_timeout_s=args.drain_timeout,
        command=command,
    )


async def bench_all(cfg: Config, keys: Mapping[str, str], template: Path
                    ) -> dict[str, dict[str, Any]]:
    prompts = PromptMaker(token_counter(cfg.model_dir))
    bias = {str(i): -100.0 for i in eos_token_ids(cfg.model_dir)} if cfg.eos_bias else {}
    return {policy: await bench_policy(cfg, policy, keys, template, prompts, bias)
            for policy in cfg.policies}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the Markdown report; 0 when every server ran cleanly."""
    prog = "python -m appliance.bench.fairness" if argv is None else "appliance bench fairness"
    args_list = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(args_list)
    started = dt.datetime.now(dt.UTC)
    cfg = config_from_args(args, shlex.join([*shlex.split(prog), *args_list]), started)
    cfg.output_dir.mkdir(parents=True, exist_ok=True)
    template = cfg.output_dir / "data-template"
    log(f"provisioning users {', '.join(p.name for p in PERSONAS)} in {template}")
    try:
        keys = provision(cfg, template)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        log(f"could not provision the users: {exc}")
        return 1
    servers = run_guarded(bench_all(cfg, keys, template), cfg.output_dir)
    if servers is None:
        return 130
    summaries = summarize_all(cfg, servers)
    goals = evaluate_goals(summaries)
    meta = build_meta(cfg, servers, started)
    write_report(cfg.output_dir, render_report(meta, summaries, goals, servers),
                 report_json(meta, summaries, goals, servers), args.json)
    failed = any(s.error or s.request_errors for s in summaries.values())
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
