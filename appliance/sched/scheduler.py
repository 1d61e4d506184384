"""Who goes next: the scheduler as a step function over explicit inputs.

``plan = scheduler.step(now, view, cache_tokens=...)``; the engine runs the plan; then
``scheduler.update(plan, view, decoded=..., served=...)``. No clock reads, no database, no
MLX in here: tests build the inputs by hand. Fairness lives in fair.py, KV accounting in
memory.py, quota checks in quota.py, and simulator.py runs this scheduler on synthetic
workloads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from appliance.sched.budget import PrefillAllowance, TickBudget, tick_budget
from appliance.sched.cost import CostModel
from appliance.sched.fair import VirtualCounters, share_victim
from appliance.sched.invariants import check_plan
from appliance.sched.memory import chunk_growth, held, reservation, victim_order
from appliance.sched.policy import QueuePolicy, make_policy
from appliance.sched.states import RequestState
from appliance.sched.types import (
    Chunks,
    Plan,
    SchedulerConfig,
    SeqView,
)
from appliance.vocab import Klass


def _backlogged(seqs: Iterable[SeqView]) -> set[str]:
    return {s.user for s in seqs if s.state is RequestState.QUEUED or s.state.running}


def _decoding(seqs: Iterable[SeqView]) -> list[SeqView]:
    return [s for s in seqs if s.state is RequestState.DECODING]


@dataclass(slots=True)
class Scheduler:
    config: SchedulerConfig
    policy: QueuePolicy = field(init=False)
    counters: VirtualCounters = field(init=False)
    """Per-user virtual token counters: ``snapshot()``/``restore()`` persist them,
    ``set_weight()`` sets a user's share. Kept under every policy (the dashboard shows them,
    and ``fair`` preemption reads them)."""
    _parked_ticks: dict[int, int] = field(default_factory=dict)
    _in_pieces: set[int] = field(default_factory=set)
    """Prompts already given a chunk that did not finish them (documents): the rest of
    such a prompt, its last chunk too, is work that can wait."""
    _stepped: dict[int, SeqView] = field(default_factory=dict)
    _costs: CostModel | None = None
    _seen_at: dict[str, float] = field(default_factory=dict)
    """Per user, when a voice or interactive request of theirs was last live (queued or
    running)."""
    budget: TickBudget | None = None
    """The time budget of the last planned tick (None when prefill is sized in tokens)."""
    ride: bool = True
    """Whether the last planned tick's chunks may ride in the decode step (``Plan.ride``)."""

    def __post_init__(self) -> None:
        self.counters = VirtualCounters(w_in=self.config.w_in, w_out=self.config.w_out)
        self.policy = make_policy(self.config.policy, self.counters, self.config.aging_seconds)

    def step(self, now: float, seqs: Sequence[SeqView], cache_tokens: int = 0,
             costs: CostModel | None = None) -> Plan:
        """Plan one tick. ``cache_tokens``: KV tokens held by cold prompt-cache entries.
        ``costs``: the engine's cost model, fitted from its measured ticks (None: prefill
        is sized in tokens, not time).

        The rule:
        0. Counters: a user who just became backlogged (queued or running) is lifted,
           ``c = max(c, lowest counter of the backlogged users)``: idle time banks no credit.
        1. Memory (with a KV budget): a queued request that cannot fit even alone is
           rejected. If this tick's growth (one token per decoding request plus the prefill
           chunks) would overflow the budget, cold prompt-cache tokens go first; then, with
           preemption on, running requests are preempted in ``preemption_policy`` order
           until it fits (nothing is admitted in that tick); with it off, prefill chunks
           shrink (admission reserved every request's worst case, so decoding always fits).
        2. Admission: free slots (up to ``max_batch_size``) go to queued requests in policy
           order. fair: effective class (one class up per ``aging_seconds`` waited, never
           above the highest class queued), then the lowest counter (counting prefill
           already granted but not yet computed, as VTC charges a prompt on admission),
           then arrival; fcfs: class, then arrival. Background reserve (fair): while
           background work is queued and fewer than ``background_reserve`` background
           requests run, the best background requests take the first free slots.
           Admission stops at the first request whose KV reservation (memory.py) does not
           fit under the budget, less the watermark while a decode batch runs: nothing
           overtakes it for being smaller. Yielding, with every slot taken (KV kept): a
           request of a lower class than the best queued one yields its slot (class
           preemption); else, fair, a user over their weighted share of the class's rows and
           ``share_margin`` ahead of the best queued request's user on the counters yields
           one row (fair.share_victim), so weights shape service, not only admission order.
        3. Prefill budget, in time (Sarathi-Serve's stall-free batching): the tick may last
           the ITL objective while a batch decodes (default 2x the predicted decode step),
           and never more than half the TTFT objective, decoding or not (an arrival waits
           for at most the tick in flight); but while a fresh prompt that is not
           background work has waited half the TTFT objective unread (a burst of
           arrivals), a tick may last the whole TTFT objective, so the burst shares one
           forward instead of one prompt a tick. What the predicted decode step leaves goes to
           prefill chunks in policy order, each as large as the time left allows (and no
           larger than the chunk with the lowest time per token), at least ``min_chunk``
           for the first (a prompt costing at most two such chunks is read whole); several
           short prompts fit one tick. When the decode step alone leaves prefill less than
           twice a forward's fixed cost, the tick grows to the most efficient chunk. While
           voice or interactive work of someone other than the prompts' owners was live in
           the last ``presence_s``, work that can wait (unfinished chunks, background
           prompts) keeps the tick near the time of reading one arrival alone
           (tick_budget), so that person's next arrival waits a short tick; a user alone
           with a long prompt of their own gets it read at the machine's pace. With a fixed
           ``prefill_chunk_size`` (or no cost model) the budget is that many tokens
           instead (2048 idle, 512 decoding without a model). A tick in which a prompt is
           read to its end carries no partial chunk of a prompt behind it in that order:
           a short chat's first token never waits on someone's long document. Chunks ride
           in the decode step's forward (when the engine reads them so), but not in a tick
           that reads a short prompt of someone with nothing decoding (``Plan.ride``): read
           before the step, its first token does not wait for the step.
        4. Parking: a prefill of a lower class than some decoding request waits, so a
           background document never stalls a voice answer; it still gets one chunk at
           least every ``prefill_grant_interval`` decode ticks (one such grant a tick
           beyond the budget; the others stay due).
        """
        self._stepped = {s.rid: s for s in seqs}
        self._costs = costs if self.config.prefill_chunk_size == -1 else None
        since = now - self.config.objectives.presence_s
        self._seen_at = {u: at for u, at in self._seen_at.items() if at >= since}
        for s in seqs:
            if s.klass > Klass.BACKGROUND:
                self._seen_at[s.user] = now
        self.counters.observe(_backlogged(seqs))
        running = [s for s in seqs if s.state.running]
        reject = self._hopeless([s for s in seqs if s.state is RequestState.QUEUED])
        queued = [s for s in seqs if s.state is RequestState.QUEUED and s.rid not in reject]

        evict, victims = self._reclaim(now, running, cache_tokens)
        yielded = () if victims else self._yield_slot(now, queued, running)
        running = [s for s in running if s.rid not in victims and s.rid not in yielded]
        admitted = [] if victims else self._admit(now, queued, running)

        decoding = _decoding(running)
        prefilling = [s for s in running if s.state is RequestState.PREFILLING] + admitted
        chunks = self._prefill_plan(now, prefilling, decoding)
        chunks, more = self._fit(chunks, running, cache_tokens - evict)
        plan = Plan(admit=tuple(s.rid for s in admitted), preempt=victims + yielded,
                    prefill=chunks, reject=tuple(sorted(reject)), evict_tokens=evict + more,
                    keep_kv=yielded, ride=self.ride)
        if self.config.check_invariants:
            check_plan(self.config, plan, seqs, cache_tokens)
        return plan

    def queue_order(self, now: float, seqs: Sequence[SeqView]) -> list[int]:
        """The queued requests' ids in the order admission would take them now (step 2's
        order, background reserve included). A pure read, for showing a person how many
        requests are ahead of theirs."""
        queued = [s for s in seqs if s.state is RequestState.QUEUED]
        if not queued:
            return []
        running = [s for s in seqs if s.state.running]
        return [s.rid for s in self._admission_order(now, queued, running)]

    # ---- 1. memory ----
    def _hopeless(self, queued: list[SeqView]) -> set[int]:
        budget = self.config.budget
        if budget is None:
            return set()
        optimistic = self.config.enable_preemption
        return {s.rid for s in queued if reservation(s, optimistic) > budget.tokens}

    def _growth(self, now: float, running: list[SeqView]) -> dict[int, int]:
        """KV tokens each running request adds this tick (before admission)."""
        decoding = _decoding(running)
        prefilling = [s for s in running if s.state is RequestState.PREFILLING]
        grow = {s.rid: 1 for s in decoding}
        by_id = {s.rid: s for s in prefilling}
        for rid, n in self._prefill_plan(now, prefilling, decoding):
            grow[rid] = chunk_growth(by_id[rid], n)
        return grow

    def _reclaim(self, now: float, running: list[SeqView],
                 cache: int) -> tuple[int, tuple[int, ...]]:
        """(prompt-cache tokens to evict, requests to preempt) so that this tick fits."""
        budget = self.config.budget
        if budget is None:
            return 0, ()
        grow = self._growth(now, running)
        over = sum(held(s) for s in running) + sum(grow.values()) + cache - budget.tokens
        evict = min(cache, max(over, 0))
        over -= evict
        if over <= 0 or not self.config.enable_preemption:
            return evict, ()
        victims: list[int] = []
        for v in victim_order(self.config.preemption_policy, now, running, self.counters,
                              self.config.aging_seconds):
            if over <= 0:
                break
            victims.append(v.rid)
            over -= held(v) + grow.get(v.rid, 0)
        return evict, tuple(victims)

    def _fit(self, chunks: Chunks, running: list[SeqView], cache: int) -> tuple[Chunks, int]:
        """Shrink prefill chunks (after evicting more cold cache) so the tick fits the budget.

        Returns the chunks and the extra prompt-cache tokens to evict."""
        budget = self.config.budget
        if budget is None:
            return chunks, 0
        by_id = {s.rid: s for s in running} | self._stepped
        base = sum(held(s) for s in running) + len(_decoding(running))
        want = sum(chunk_growth(by_id[rid], n) for rid, n in chunks)
        evict = min(cache, max(base + cache + want - budget.tokens, 0))
        room = budget.tokens - base - (cache - evict)
        fitted: list[tuple[int, int]] = []
        for rid, n in chunks:
            s = by_id[rid]
            if chunk_growth(s, n) > room:
                n = min(n, room, s.remaining - 1)  # a partial chunk yields no token
            if n > 0:
                fitted.append((rid, n))
                room -= chunk_growth(s, n)
        return tuple(fitted), evict

    def _yield_slot(self, now: float, queued: list[SeqView],
                    running: list[SeqView]) -> tuple[int, ...]:
        """With every slot taken, one running request of a lower class than the best queued
        one yields (victim in ``preemption_policy`` order). Base classes on both sides, so an
        aged request never pushes out one of the class it aged into; the background
        reserve is kept. Failing that, one of a user over their share (:meth:`_share_yield`)."""
        if not queued or len(running) < self.config.max_batch_size:
            return ()
        best = self._admission_order(now, queued, running)[0]
        if not self.config.class_preemption:
            return self._share_yield(best, queued, running)
        lower = [s for s in running if s.klass < best.klass]
        bg = sum(s.klass is Klass.BACKGROUND for s in running)
        if bg <= self.config.reserved_background_slots:
            lower = [s for s in lower if s.klass is not Klass.BACKGROUND]
        if not lower:
            return self._share_yield(best, queued, running)
        victim = victim_order(self.config.preemption_policy, now, lower, self.counters,
                              self.config.aging_seconds)[0]
        return (victim.rid,)

    def _share_yield(self, best: SeqView, queued: list[SeqView],
                     running: list[SeqView]) -> tuple[int, ...]:
        """fair: a row of a user over their weighted share yields to ``best`` (see
        ``fair.share_victim``), when ``best`` then fits the KV budget."""
        config = self.config
        if not config.share_preemption or config.policy != "fair":
            return ()
        victim = share_victim(self.counters, best, queued, running, config.share_margin)
        if victim is None:
            return ()
        budget = config.budget
        if budget is not None:
            optimistic = config.enable_preemption
            staying = [s for s in running if s.rid != victim.rid]
            room = budget.limit(decoding=bool(_decoding(staying)))
            room -= sum(reservation(s, optimistic) for s in staying)
            if reservation(best, optimistic) > room:
                return ()
        return (victim.rid,)

    # ---- 2. admission ----
    def _admit(self, now: float, queued: list[SeqView],
               running: list[SeqView]) -> list[SeqView]:
        free = self.config.max_batch_size - len(running)
        if free <= 0 or not queued:
            return []
        ordered = self._admission_order(now, queued, running)
        budget = self.config.budget
        if budget is None:
            return ordered[:free]
        optimistic = self.config.enable_preemption
        room = budget.limit(decoding=bool(_decoding(running)))
        room -= sum(reservation(s, optimistic) for s in running)
        admitted: list[SeqView] = []
        for s in ordered[:free]:
            need = reservation(s, optimistic)
            if need > room:
                break
            admitted.append(s)
            room -= need
        return admitted

    def _admission_order(self, now: float, queued: list[SeqView],
                         running: list[SeqView]) -> list[SeqView]:
        ordered = self.policy.admit_order(now, queued, running)
        bg = Klass.BACKGROUND
        short = self.config.reserved_background_slots - sum(s.klass is bg for s in running)
        if short <= 0:
            return ordered
        first = [s for s in ordered if s.klass is bg][:short]
        ids = {s.rid for s in first}
        return first + [s for s in ordered if s.rid not in ids]

    # ---- 3./4. prefill chunks and parking ----
    def _allowance(self, now: float, readable: list[SeqView],
                   decoding: list[SeqView]) -> PrefillAllowance:
        """This tick's prefill share: seconds from the cost model, or fixed tokens.
        ``readable``: the prompts this tick may read. The tick may last the whole TTFT
        objective (``overdue``) when an unread chat turn or voice command (at most twice
        ``arrival_tokens``) has waited half of it, or when nothing decodes and several
        wait unread: read in ticks of half the objective, the first would start streaming
        and then wait through the ticks that read the rest, a gap of up to the burst's whole
        reading; read together, they start together. Not for documents: a chat turn beside
        them would wait out a tick of the whole objective (the light user's owner-less
        tick: its own turn is readable, so nobody else counts as present), nor for a
        document that waited: with a heavy user's documents queued one always has, so every
        tick would last the objective, and the light user's next turn would wait it out
        (docs/decisions/patient-documents.md).

        The tick does not ride (``Plan.ride``) when a prompt that is not background work,
        with at most twice ``arrival_tokens`` left to read, is of someone with nothing
        decoding (a chat turn or voice command, or the end of a document, whose first token
        that person waits for with nothing on screen): read in a forward of its own before
        the decode step, its first token comes when that forward ends, not after the step
        (about a decode step sooner), for about the same tick (riding saves the forward's
        fixed cost; a short prompt's reading costs the rest either way). Beside the
        person's own streams (one client's many requests) it rides as before."""
        turns = [s for s in readable if self._turn(s) and s.computed == 0 and s.generated == 0]
        streaming = {s.user for s in decoding}
        self.ride = not any(self._turn(s) and s.generated == 0 and s.user not in streaming
                            for s in readable)
        costs = self._costs
        if costs is None:
            self.budget = None
            return PrefillAllowance(self.config.chunk(decoding=bool(decoding)))
        kv_len = max((held(s) for s in decoding), default=0)
        since = now - self.config.objectives.ttft_target_s / 2
        overdue = any(s.arrival <= since for s in turns) or (not decoding and len(turns) > 1)
        self.budget = tick_budget(costs, self.config.objectives, len(decoding), kv_len,
                                  present=self._someone_else(readable), overdue=overdue,
                                  ride=self.ride, alone=not decoding and len(readable) == 1)
        return PrefillAllowance(costs=costs, budget=self.budget,
                                min_chunk=self.config.objectives.min_chunk)

    def _someone_else(self, readable: list[SeqView]) -> bool:
        """Whether someone other than the owners of the prompts still to read was live in
        the last ``presence_s`` (voice or interactive work): then those prompts' unfinished
        chunks keep the tick short for that person's next arrival. A user alone with a long
        prompt of their own gets it read at the machine's pace."""
        owners = {s.user for s in readable}
        return any(user not in owners for user in self._seen_at)  # step() dropped the stale

    def _prefill_plan(self, now: float, prefilling: list[SeqView],
                      decoding: list[SeqView]) -> Chunks:
        if not prefilling:
            self.budget = None
            self.ride = True
            return ()
        top_decoding = max((s.klass for s in decoding), default=None)
        due: list[SeqView] = []
        ready: list[SeqView] = []
        for s in self.policy.order(now, prefilling):
            if s.remaining <= 0:
                continue
            if top_decoding is not None and s.klass < top_decoding:
                if self._parked_ticks.get(s.rid, 0) >= self.config.prefill_grant_interval - 1:
                    due.append(s)
            else:
                ready.append(s)
        chunks: list[tuple[int, int]] = []
        allowance = self._allowance(now, [*due, *ready], decoding)
        for i, s in enumerate(due):  # one due grant a tick gets a full chunk, budget or not
            if i and allowance.exhausted():
                break  # the rest stay due, first in line next tick
            n = allowance.size(s.remaining, s.computed, grant=i == 0,
                               patient=self._patient(s), urgent=s.klass is Klass.VOICE,
                               turn=self._turn(s))
            if n <= 0:
                break
            self._chunk(chunks, allowance, s, n)
        finishing = False
        for s in ready:
            if allowance.exhausted():
                break
            n = allowance.size(s.remaining, s.computed, patient=self._patient(s),
                               urgent=s.klass is Klass.VOICE, turn=self._turn(s))
            if n <= 0:
                break
            if finishing and n < s.remaining:
                continue  # a partial chunk here would only delay the first token(s) above
            self._chunk(chunks, allowance, s, n)
            finishing = finishing or n == s.remaining
        return tuple(chunks)

    def _patient(self, s: SeqView) -> bool:
        """Work that can wait (*patient* work): background prompts, the rest of a prompt
        read in pieces, its last chunk too, and a document (more than twice
        ``arrival_tokens`` left, not a voice command) even when it would fit whole, so a
        chat turn beside it never waits out a long tick (docs/decisions/patient-documents.md)."""
        return s.rid in self._in_pieces or (s.klass is not Klass.VOICE and not self._turn(s))

    def _turn(self, s: SeqView) -> bool:
        """A chat turn or voice command: not background work, at most ``_turn_tokens``."""
        return s.klass is not Klass.BACKGROUND and s.remaining <= self._turn_tokens

    @property
    def _turn_tokens(self) -> int:
        """The longest prompt left to read that counts as a chat turn or voice command
        (twice ``arrival_tokens``); more is a document."""
        return 2 * self.config.objectives.arrival_tokens

    def _chunk(self, chunks: list[tuple[int, int]], allowance: PrefillAllowance, s: SeqView,
               n: int) -> None:
        chunks.append((s.rid, n))
        allowance.spend(s.remaining, s.computed, n)
        if n < s.remaining:
            self._in_pieces.add(s.rid)

    # ---- embeddings ----
    def embed_tokens(self, now: float, user: str, offset: int, decode_rows: int, kv_len: int,
                     spent_s: float, costs: CostModel | None = None) -> int:
        """Tokens of ``user``'s embedding (``offset`` of its input already read) that the
        forward after this tick may read. An embedding is work that can wait, read like a
        background prompt in pieces: in the time the tick's budget (:func:`tick_budget`,
        without riding: it is a forward of its own) leaves after ``spent_s`` (what the
        tick's own forwards were predicted to take), within its patient share while
        someone else is present, no more than the most efficient chunk, and at least
        ``min_chunk`` so it always advances. With prefill sized in tokens: that chunk."""
        objectives = self.config.objectives
        if self.config.prefill_chunk_size != -1 or costs is None:
            return self.config.chunk(decoding=decode_rows > 0) or 1 << 30  # 0: whole
        since = now - objectives.presence_s
        present = any(u != user and at >= since for u, at in self._seen_at.items())
        budget = tick_budget(costs, objectives, decode_rows, kv_len, present=present,
                             ride=False)
        share = budget.prefill_s if budget.patient_s is None else budget.patient_s
        n = costs.tokens_within(min(share, budget.target_s - spent_s), offset)
        best = costs.efficient_chunk(offset)
        if best is not None:
            n = min(n, best)
        return max(n, objectives.min_chunk)

    # ---- after the tick ----
    def update(self, plan: Plan, seqs: Sequence[SeqView], decoded: bool,
               served: Mapping[str, tuple[int, int]]) -> None:
        """After the tick: charge the work to the users' counters, note who is still
        backlogged, count decode ticks for parked prefills and forget finished ones.

        ``served``: user -> (prefill tokens computed, output tokens) this tick, as the engine
        counted them (prompt-cache hits excluded).
        """
        for user, (prefill_tokens, output_tokens) in served.items():
            if prefill_tokens or output_tokens:
                self.counters.charge(user, prefill_tokens, output_tokens)
        self.counters.observe(_backlogged(seqs))
        granted = {rid for rid, _ in plan.prefill}
        live = {s.rid for s in seqs if s.state is RequestState.PREFILLING}
        for rid in list(self._parked_ticks):
            if rid not in live:
                del self._parked_ticks[rid]
        self._in_pieces &= live
        for rid in live:
            if rid in granted:
                self._parked_ticks[rid] = 0
            elif decoded:
                self._parked_ticks[rid] = self._parked_ticks.get(rid, 0) + 1
