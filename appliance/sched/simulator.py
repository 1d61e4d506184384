"""A simulator: the real :class:`Scheduler` driven by synthetic workloads and a cost model.

Each tick does what the engine's tick does (plan, preempt, admit, one decode step for every
decoding request, the plan's prefill chunks, finishes, charging) on a simulated clock:
a tick lasts ``decode_base_s + decode_per_seq_s * batch`` when a batch decodes, plus
``prefill_per_token_s`` per prefilled token. Thousands of requests take seconds, so
policies can be compared on the same workload.

    python -m appliance.sched.workloads --policy fair --scenario heavy-light  (its CLI)
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from appliance.sched.quota import QuotaLimits, check_admission, exhausted
from appliance.sched.scheduler import Scheduler
from appliance.sched.states import RequestState, finish_state
from appliance.sched.types import Plan, SchedulerConfig, SeqView
from appliance.vocab import DAY_S, FinishReason, Klass

Observer = Callable[[float, Sequence[SeqView], Plan], None]


@dataclass(frozen=True, slots=True)
class Arrival:
    t: float
    user: str
    klass: Klass
    prompt: int
    output: int
    """Tokens the model would write before it stops on its own."""
    max_tokens: int | None = None
    """The request's cap (None: ``output``); it finishes at the smaller of the two."""


@dataclass(frozen=True, slots=True)
class Loop:
    """A closed-loop client (a script, a chat): ``concurrency`` requests in flight, each
    finish (or refusal) followed by the next after ``think_s``, until ``stop``."""

    user: str
    klass: Klass
    concurrency: int
    prompt: tuple[int, int]
    output: tuple[int, int]
    think_s: float = 0.0
    start: float = 0.0
    stop: float = math.inf
    seed: int = 0
    late: tuple[tuple[float, float], ...] = ()
    """Delivery stalls, ``(start, end)``: a request that finishes within one reaches the
    client only at its end (a busy event loop or client), so the next is sent late."""

    def delivered(self, t: float) -> float:
        """When a finish at ``t`` reaches the client."""
        return next((end for start, end in self.late if start <= t < end), t)


@dataclass(frozen=True, slots=True)
class CostModel:
    decode_base_s: float = 0.012
    decode_per_seq_s: float = 0.0015
    prefill_per_token_s: float = 0.00025

    def tick_seconds(self, decoding: int, prefill_tokens: int) -> float:
        decode = self.decode_base_s + self.decode_per_seq_s * decoding if decoding else 0.0
        return decode + self.prefill_per_token_s * prefill_tokens


@dataclass(frozen=True, slots=True)
class RequestResult:
    rid: int
    user: str
    klass: Klass
    arrival: float
    started: float | None
    """First admission."""
    first_token: float | None
    finished: float | None
    reason: FinishReason
    preemptions: int
    generated: int

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival


@dataclass(slots=True, eq=False)
class _Req:
    rid: int
    a: Arrival
    loop: int | None
    state: RequestState = RequestState.QUEUED
    computed: int = 0
    generated: int = 0
    started: float | None = None
    first_token: float | None = None
    finished: float | None = None
    preemptions: int = 0
    reason: FinishReason | None = None
    kept: int = 0
    """KV tokens parked in the prompt cache while queued after yielding a slot."""

    @property
    def tokens(self) -> int:
        return self.a.prompt + self.generated

    @property
    def cap(self) -> int:
        return self.a.output if self.a.max_tokens is None else self.a.max_tokens

    @property
    def kv(self) -> int:
        if self.state is RequestState.DECODING:
            return self.tokens
        return self.computed if self.state is RequestState.PREFILLING else 0

    def view(self) -> SeqView:
        return SeqView(rid=self.rid, user=self.a.user, klass=self.a.klass, arrival=self.a.t,
                       state=self.state, prefill_len=self.tokens, computed=self.computed,
                       kv_tokens=self.kv, max_tokens=self.cap, generated=self.generated)

    def result(self) -> RequestResult:
        assert self.reason is not None, "only a finished request has a result"
        return RequestResult(self.rid, self.a.user, self.a.klass, self.a.t, self.started,
                             self.first_token, self.finished, self.reason, self.preemptions,
                             self.generated)


@dataclass(slots=True)
class SimResult:
    requests: list[RequestResult] = field(default_factory=list)
    refused: list[tuple[Arrival, str]] = field(default_factory=list)
    """(arrival, limit): a quota verdict's limit (HTTP 429) or ``queue_full`` (HTTP 503)."""
    times: list[float] = field(default_factory=list)
    """Start of each tick, then the end of the last one."""
    served: list[dict[str, float]] = field(default_factory=list)
    """Cumulative weighted tokens ``w_in * prefill + w_out * output`` per user at ``times``."""
    queued: list[frozenset[str]] = field(default_factory=list)
    """Users with a request still waiting after each tick's admissions: backlogged users
    (whose wait the policy chose)."""
    present: list[frozenset[str]] = field(default_factory=list)
    """Users with a request queued or running at the end of each tick (one who is absent
    there left the backlog, and is lifted when they come back)."""
    usage: dict[str, int] = field(default_factory=dict)
    """Raw tokens (prefill computed + output) per user, as the daily quota counts them."""
    peak_kv: int = 0
    max_running: int = 0
    ticks: int = 0
    unfinished: int = 0

    @property
    def preemptions(self) -> int:
        return sum(r.preemptions for r in self.requests)

    def service_difference(self, window: float = 60.0) -> tuple[float, float, int]:
        """(average, maximum, windows) of the service gap between users backlogged (with a
        queued request) through a whole window, as in Sheng et al. 2024; windows with fewer
        than two such users are skipped."""
        gaps = [g for g in _window_gaps(self, window) if g is not None]
        if not gaps:
            return 0.0, 0.0, 0
        return sum(gaps) / len(gaps), max(gaps), len(gaps)


def _window_gaps(res: SimResult, window: float) -> Iterable[float | None]:
    if len(res.times) < 2:
        return
    i, n = 0, len(res.queued)
    while i < n:
        end = res.times[i] + window
        j = i
        both = set(res.queued[i])
        while j < n and res.times[j] < end:
            both &= res.queued[j]
            j += 1
        if len(both) >= 2:
            got = [res.served[j].get(u, 0.0) - res.served[i].get(u, 0.0) for u in both]
            yield max(got) - min(got)
        else:
            yield None
        i = j


@dataclass(slots=True)
class Simulator:
    config: SchedulerConfig
    cost: CostModel = field(default_factory=CostModel)
    quotas: Mapping[str, QuotaLimits] = field(default_factory=dict)
    weights: Mapping[str, float] = field(default_factory=dict)
    max_queue_depth: int = 256
    observer: Observer | None = None
    max_ticks: int = 2_000_000
    scheduler: Scheduler = field(init=False)
    _live: dict[int, _Req] = field(default_factory=dict)
    _arrivals: list[tuple[float, int, Arrival, int | None]] = field(default_factory=list)
    _loops: list[tuple[Loop, random.Random]] = field(default_factory=list)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _res: SimResult = field(default_factory=SimResult)
    _weighted: dict[str, float] = field(default_factory=dict)
    _now: float = 0.0

    def __post_init__(self) -> None:
        self.scheduler = Scheduler(self.config)
        for user, w in self.weights.items():
            self.scheduler.counters.set_weight(user, w)

    def run(self, arrivals: Iterable[Arrival] = (), loops: Sequence[Loop] = ()) -> SimResult:
        for a in arrivals:
            self._push(a, None)
        for k, loop in enumerate(loops):
            self._loops.append((loop, random.Random(loop.seed * 7919 + k)))
            for _ in range(loop.concurrency):
                self._next_of(k, loop.start)
        while self._res.ticks < self.max_ticks and (self._live or self._arrivals):
            self._intake()
            if self._live and self._tick():
                continue
            if not self._arrivals:
                break  # idle for good, or stuck: nothing can run and nothing will arrive
            self._now = max(self._now, self._arrivals[0][0])
        self._res.times.append(self._now)
        self._res.served.append(dict(self._weighted))
        self._res.unfinished = len(self._live)
        self._res.requests.sort(key=lambda r: r.rid)
        return self._res

    # ---- arrivals ----
    def _push(self, a: Arrival, loop: int | None) -> None:
        heapq.heappush(self._arrivals, (a.t, next(self._ids), a, loop))

    def _next_of(self, k: int, after: float) -> None:
        loop, rng = self._loops[k]
        t = loop.delivered(after) + loop.think_s
        if t < loop.stop:
            self._push(Arrival(t, loop.user, loop.klass, rng.randint(*loop.prompt),
                               rng.randint(*loop.output)), k)

    def _intake(self) -> None:
        while self._arrivals and self._arrivals[0][0] <= self._now:
            _, rid, a, loop = heapq.heappop(self._arrivals)
            refusal = self._refusal(a)
            if refusal is None:
                self._live[rid] = _Req(rid, a, loop)
                continue
            self._res.refused.append((a, refusal))
            if loop is not None:
                self._next_of(loop, self._now + 1.0)

    def _refusal(self, a: Arrival) -> str | None:
        if sum(r.state is RequestState.QUEUED for r in self._live.values()) >= \
                self.max_queue_depth:
            return "queue_full"
        limits = self.quotas.get(a.user)
        if limits is None:
            return None
        mine = sum(r.a.user == a.user for r in self._live.values())
        verdict = check_admission(limits, self._res.usage.get(a.user, 0), mine, a.prompt,
                                  a.max_tokens or a.output, a.klass, Klass.VOICE, self._now,
                                  self._now - DAY_S)
        return None if verdict is None else verdict.limit

    # ---- one tick ----
    def _tick(self) -> bool:
        """Run one tick; False when nothing could run (waiting for an arrival)."""
        views = [r.view() for r in self._live.values()]
        plan = self.scheduler.step(self._now, views)
        if self.observer is not None:
            self.observer(self._now, views, plan)
        self._res.ticks += 1
        self._res.times.append(self._now)
        self._res.served.append(dict(self._weighted))
        self._res.queued.append(frozenset(
            v.user for v in views if v.state is RequestState.QUEUED
            and v.rid not in plan.admit and v.rid not in plan.reject))
        self._apply(plan)
        running = sum(r.state.running for r in self._live.values())
        self._res.max_running = max(self._res.max_running, running)
        work = _Work()
        decoding = [r for r in self._live.values() if r.state is RequestState.DECODING]
        for r in decoding:
            self._token(r, work)
        for rid, n in plan.prefill:
            self._prefill(self._live[rid], n, work)
        self._res.peak_kv = max(self._res.peak_kv, sum(r.kv for r in self._live.values()))
        dt = self.cost.tick_seconds(len(decoding), work.prefilled)
        self._now += dt
        self._settle(work)
        self._res.present.append(frozenset(r.a.user for r in self._live.values()))
        self.scheduler.update(plan, [r.view() for r in self._live.values()],
                              decoded=bool(decoding),
                              served={u: (p, o) for u, (p, o) in work.served.items()})
        return dt > 0 or not plan.empty

    def _apply(self, plan: Plan) -> None:
        for rid in plan.reject:
            r = self._live[rid]
            self._finish(r, FinishReason.LENGTH if r.generated else FinishReason.ERROR)
        for rid in plan.preempt:
            r = self._live[rid]
            # a yielded slot parks its KV in the prompt cache, so readmission (as the
            # engine's) computes just the last token; memory preemption recomputes it all
            r.kept = r.tokens - 1 if rid in plan.keep_kv else 0
            r.state, r.computed = RequestState.QUEUED, 0
            r.preemptions += 1
        for rid in plan.admit:
            r = self._live[rid]
            r.state, r.computed, r.kept = RequestState.PREFILLING, r.kept, 0
            if r.started is None:
                r.started = self._now

    def _token(self, r: _Req, work: _Work) -> None:
        r.generated += 1
        work.served.setdefault(r.a.user, [0, 0])[1] += 1
        if r.generated >= r.cap:
            capped = r.a.max_tokens is not None and r.generated >= r.a.max_tokens
            work.done.append((r, FinishReason.LENGTH if capped else FinishReason.STOP))

    def _prefill(self, r: _Req, n: int, work: _Work) -> None:
        n = min(n, r.tokens - r.computed)  # a kept prefix leaves less than planned
        r.computed += n
        work.prefilled += n
        work.served.setdefault(r.a.user, [0, 0])[0] += n
        if r.computed < r.tokens:
            return
        r.state = RequestState.DECODING
        if r.first_token is None:
            work.first.append(r)
        self._token(r, work)

    def _settle(self, work: _Work) -> None:
        w_in, w_out = self.config.w_in, self.config.w_out
        for user, (p, o) in work.served.items():
            self._weighted[user] = self._weighted.get(user, 0.0) + w_in * p + w_out * o
            self._res.usage[user] = self._res.usage.get(user, 0) + p + o
        for r in work.first:
            r.first_token = self._now
        for r, reason in work.done:
            self._finish(r, reason)
        for user, limits in self.quotas.items():
            if exhausted(limits, self._res.usage.get(user, 0)):
                for r in [r for r in self._live.values() if r.a.user == user]:
                    self._finish(r, FinishReason.QUOTA)

    def _finish(self, r: _Req, reason: FinishReason) -> None:
        del self._live[r.rid]
        r.finished, r.reason, r.state = self._now, reason, finish_state(reason)
        self._res.requests.append(r.result())
        if r.loop is not None:
            self._next_of(r.loop, self._now)


@dataclass(slots=True)
class _Work:
    """What one tick did: tokens per user (prefill, output), first tokens, finishes."""

    served: dict[str, list[int]] = field(default_factory=dict)
    prefilled: int = 0
    first: list[_Req] = field(default_factory=list)
    done: list[tuple[_Req, FinishReason]] = field(default_factory=list)
