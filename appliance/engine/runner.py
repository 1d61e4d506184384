"""One tick of the engine: run the scheduler's plan on the model (engine thread only).

The :class:`Runner` keeps the requests (intake, admission, tokens, finishing, preemption,
quotas and access as access.py rules them, the prompt cache, the snapshot) and applies what
the forwards it runs return (:class:`~appliance.engine.forwards.Forwards`, forwards.py: a
token or a failure per row)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from appliance.engine.access import AccessRules
from appliance.engine.batch import DecodeBatch, cache_nbytes, new_sequence_cache, plain_kv
from appliance.engine.embed import Embedder
from appliance.engine.forwards import Failure, Forwards, Link, Outcome, Reads
from appliance.engine.grammar import GrammarRow, ll_tokenizer
from appliance.engine.mixed import supports_mixed
from appliance.engine.model import LoadedModel
from appliance.engine.prompt_cache import PromptCache
from appliance.engine.request import (
    FaultHook,
    FinishEvent,
    GenerationRequest,
    RequestHandle,
    TokenEvent,
    Usage,
    UserAccess,
)
from appliance.engine.sampling import RowSampler
from appliance.engine.seq import Seq
from appliance.engine.snapshot import EngineSnapshot, SlotInfo
from appliance.engine.textstream import TextStream
from appliance.engine.ticks import Meter, TickTiming
from appliance.sched.cost import CostModel
from appliance.sched.memory import held, reservation
from appliance.sched.scheduler import Scheduler
from appliance.sched.states import RequestState, finish_state
from appliance.sched.types import Plan, SeqView
from appliance.sched.usage import RollingUsage
from appliance.store.records import LedgerRecord
from appliance.vocab import FinishReason

log = logging.getLogger(__name__)

BACKEND_ERROR = "inference backend error"
TOO_LARGE = "the request cannot fit in the KV cache budget"
COUNTERS_EVERY_S = 2.0
"""How often the fairness counters are handed to the store writer while busy (and once
more when the engine goes idle, so an idle daemon has its latest counters on disk)."""


class Runner:
    """The engine's requests and the tick that serves them (engine thread only)."""

    def __init__(self, loaded: LoadedModel, scheduler: Scheduler,
                 clock: Callable[[], float], fault: FaultHook | None,
                 on_finish: Callable[[LedgerRecord], None] | None = None, *,
                 usage: RollingUsage | None = None,
                 on_done: Callable[[RequestHandle], None] | None = None,
                 on_counters: Callable[[dict[str, float]], None] | None = None,
                 prompt_cache_entries: int = 0, timer: Callable[[], float] = time.perf_counter,
                 meter: Meter | None = None, mixed: bool = True,
                 look_ahead: bool | None = None, link: Link | None = None,
                 drafts: int = 0) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.scheduler = scheduler
        self.clock = clock
        self.fault = fault
        self.on_finish = on_finish
        self.on_done = on_done
        self.on_counters = on_counters
        self.usage = usage or RollingUsage()
        self.access = AccessRules(self.usage)
        self._served: dict[str, list[int]] = {}
        self.prompt_cache = PromptCache(prompt_cache_entries) if prompt_cache_entries else None
        self._counters_at = 0.0
        self._counters_dirty = False
        self.vocab_size = int(loaded.config.get("vocab_size") or 0) or 1 << 30
        self.eos = loaded.eos_token_ids
        self.seqs: dict[int, Seq] = {}
        self._joining: list[tuple[list[int], list[Any], list[int] | None]] = []
        """Rows prefilled this tick, merged into the batch after its decode step."""
        self._mixed = mixed and plain_kv(self.model) and supports_mixed(self.model)
        """Prompt chunks are read in the decode step's forward (appliance/engine/mixed.py)."""
        self.costs = CostModel(profile=loaded.backend.profile, rides=self._mixed)
        """Prefill and decode time, fitted from this engine's own forwards."""
        self.timing = TickTiming(self.costs, timer, meter)
        if look_ahead is None:
            # The plug says whether a step ahead pays on its device (docs/backends.md).
            # Across machines a step is sent when it is built: none is built ahead.
            look_ahead = loaded.backend.look_ahead and link is None
        self.forwards = Forwards(self.model, scheduler.config.max_batch_size, self.timing,
                                 fault, look_ahead, link, drafts,
                                 scheduler.config.objectives)
        self.forwards.room = self._room
        if link is not None:  # caches of their own: partly read, or read and about to join
            link.live = lambda: [s.rid for s in self.seqs.values() if s.cache is not None] + [
                rid for rids, _, _ in self._joining for rid in rids]
        self._left_queue: list[int] = []
        self.completed = 0
        self.ticks = 0
        self.prompt_total = 0
        self.generated_total = 0
        self.preemptions_total = 0
        self.errors_total = 0
        self.cancelled_total = 0

    @property
    def batch(self) -> DecodeBatch:
        """The decode batch (the forwards' own)."""
        return self.forwards.batch

    @property
    def mixed_forwards(self) -> int:
        return self.forwards.mixed_forwards

    # ---- intake ----
    def take(self, handles: list[RequestHandle]) -> None:
        """Queue new requests. One that cannot even be set up (bad sampling parameters, a
        detokenizer that fails, any error at all) ends alone, with an error."""
        now = self.clock()
        for h in handles:
            try:
                self._take_one(h, now)
            except Exception as exc:
                log.error("request failed rid=%d phase=intake: %s", h.rid, type(exc).__name__)
                self._left_queue.append(h.rid)
                self.errors_total += 1
                self.completed += 1
                error = str(exc) if isinstance(exc, ValueError) else BACKEND_ERROR
                h.emit(FinishEvent(FinishReason.ERROR, Usage(len(h.request.prompt), 0),
                                   error=error))
                self._done(h)

    def _take_one(self, h: RequestHandle, now: float) -> None:
        r = h.request
        if self.fault:
            self.fault(r, "intake")
        sampler = RowSampler(r.sampling, self.vocab_size, self._grammar_row(r))
        max_tokens = min(r.max_tokens, self.loaded.ctx_limit - len(r.prompt))
        seq = Seq(handle=h, arrival=now, tokens=list(r.prompt), n_prompt=len(r.prompt),
                  max_tokens=max_tokens, sampler=sampler,
                  text=TextStream(self.loaded.tokenizer.detokenizer, r.stop,
                                  keep_leading_space=r.continues))
        self.seqs[seq.rid] = seq
        log.info("request queued rid=%d id=%s user_id=%d class=%s prompt_tokens=%d "
                 "max_tokens=%d", seq.rid, r.request_id, r.user_id, r.klass.label,
                 seq.n_prompt, max_tokens)

    def _done(self, h: RequestHandle) -> None:
        if self.on_done is not None:
            try:
                self.on_done(h)
            except Exception:
                log.exception("on_done failed rid=%d", h.rid)

    def _fail(self, s: Seq, phase: str, exc: BaseException | str) -> None:
        """End one request with an error, whatever state it is in; the others go on."""
        what = exc if isinstance(exc, str) else type(exc).__name__
        log.error("request failed rid=%d phase=%s: %s", s.rid, phase, what)
        if s.rid not in self.seqs:
            return
        if s.rid in self.batch.rids:
            self.batch.remove({s.rid})
        self._finish(s, FinishReason.ERROR, error=BACKEND_ERROR)

    def _grammar_row(self, r: GenerationRequest) -> GrammarRow | None:
        if r.grammar is None:
            return None
        tok = ll_tokenizer(self.loaded.tokenizer, self.vocab_size, self.eos)
        return GrammarRow(tok, r.grammar, len(r.prompt))

    def left_queue(self) -> list[int]:
        """The requests (rids) that left the waiting queue for good since the last call."""
        rids, self._left_queue = self._left_queue, []
        return rids

    # ---- the tick ----
    def tick(self) -> bool:
        """One tick. Prefill runs before the decode step so a prompt read to its end this
        tick shows its first token without waiting for the step; its row joins the batch
        after the step (the tick costs what the plan was sized for)."""
        self._reap_cancelled()
        self._enforce_access()
        if not self.seqs:
            if self._counters_dirty:  # gone idle: persist the last tick's counters now
                self.flush_counters()
                self.timing.report_longest()
            return False
        now = self.clock()
        self.timing.begin()
        copies = self.batch.kv_copies
        rows = set(self.batch.rids)
        cached = self.prompt_cache.nbytes if self.prompt_cache else 0
        plan = self.scheduler.step(now, self._views(),
                                   cache_tokens=cached // self.loaded.kv_bytes_per_token,
                                   costs=self.costs)
        self._served = {}
        chunks = [(rid, n, self.seqs[rid].computed) for rid, n in plan.prefill
                  if rid in self.seqs]
        self._apply(plan, now)
        self._expect(plan)
        decoded = self._forwards(plan)
        self._join()
        self._enforce_quotas()
        served = {u: (p, o) for u, (p, o) in self._served.items()}
        self.scheduler.update(plan, self._views(), decoded, served)
        self.ticks += 1
        self._counters_dirty = True
        budget = self.scheduler.budget
        now_rows = set(self.batch.rids)
        self.timing.end(self.ticks, None if budget is None else budget.target_s, chunks,
                        plan.ride, self.batch.kv_copies - copies,
                        left=len(rows - now_rows), joined=len(now_rows - rows))
        if now - self._counters_at >= COUNTERS_EVERY_S:
            self.flush_counters()
            self._counters_at = now
        return True

    def embed(self, embedder: Embedder, ticked: bool) -> bool:
        """Read one piece of the embeddings waiting, in a forward after the tick (whether
        it ``ticked``): as many tokens as the scheduler gives what the tick's budget leaves
        (``Scheduler.embed_tokens``), charged to its user's fairness counter as prefill
        tokens are, its time fitted into the cost model as a prefill forward's. Returns
        whether there was work."""
        order = self.scheduler.counters.get
        job = embedder.next_job(order)
        if job is None:
            return False
        spent = self.timing.log[-1].predicted_s if ticked and self.timing.log else 0.0
        tokens = self.scheduler.embed_tokens(self.clock(), job.user, job.at,
                                             len(self.batch.rids), self.batch.padded_len,
                                             spent, self.costs)
        start = self.timing.timer()
        piece = embedder.step(tokens, order, self.ticks)
        if piece is None or piece.tokens == 0:
            return piece is not None
        seconds = self.timing.timer() - start
        if self.timing.meter is not None:
            seconds = self.timing.meter("prefill", piece.rows, piece.width, piece.offset,
                                        seconds)
        self.costs.observe_prefill(piece.rows, piece.width, piece.offset, seconds)
        self.scheduler.counters.charge(piece.user, piece.tokens, 0)
        self._counters_dirty = True
        return True

    def _forwards(self, plan: Plan) -> bool:
        """Run the plan's forwards and apply their results; whether the batch stepped."""
        chunks = self._chunks(plan)
        rows = [self.seqs[rid] for rid in self.batch.rids]
        if self._mixed and plan.ride and chunks and rows:
            mixed = self.forwards.mixed(rows, chunks)
            if mixed is not None:
                outcomes, reads = mixed
                self._apply_reads(Reads(reads))
                self._decoded(rows, outcomes)
                return True
        # rows read straight into an empty batch step from the next tick on
        for group in self.forwards.prefill(chunks):
            self._apply_reads(group)
        if not rows:
            return False
        self._decoded(rows, self.forwards.decode(rows, draft=not chunks))
        return True

    def _expect(self, plan: Plan) -> None:
        """Tell the batch which prompts being read will join it: how many, the longest,
        and in how many ticks at this tick's chunk (one token a tick if it has none).
        Only prompts begun count: room for every document queued behind them made at
        once cost a copy of 8 rows' windows a tick while one row decoded."""
        reading = [s for s in self.seqs.values()
                   if s.state is RequestState.PREFILLING and s.computed > 0]
        if not reading or not self.batch.rids:
            self.batch.expect(0, 0, 1)
            return
        longest = max(reading, key=lambda s: len(s.tokens))
        chunk = max(dict(plan.prefill).get(longest.rid, 0), 1)
        left = len(longest.tokens) - longest.computed
        self.batch.expect(len(reading), len(longest.tokens), -(-left // chunk))

    def _chunks(self, plan: Plan) -> list[tuple[Seq, int]]:
        """The plan's prefill chunks still to read: (sequence, tokens) each."""
        chunks: list[tuple[Seq, int]] = []
        for rid, n in plan.prefill:
            s = self.seqs.get(rid)
            if s is None or s.state is not RequestState.PREFILLING:
                continue
            n = min(n, len(s.tokens) - s.computed)  # a cache hit may have done part of it
            if n > 0:
                chunks.append((s, n))
        return chunks

    def _decoded(self, rows: list[Seq], outcomes: list[Outcome]) -> None:
        """Hand each decode row its new token (or its error); drop the rows that finished."""
        now = self.clock()
        done: set[int] = set()
        for s, out in zip(rows, outcomes, strict=True):
            if isinstance(out, Failure):
                log.error("request failed rid=%d phase=%s: %s", s.rid, out.phase, out.error)
                self._finish(s, FinishReason.ERROR, error=BACKEND_ERROR)
                done.add(s.rid)
                continue
            for token in out if isinstance(out, list) else [out]:
                self._serve(s, 0, 1)
                try:
                    if self._accept(s, token, now):
                        done.add(s.rid)
                except Exception as exc:
                    done.add(s.rid)
                    self._fail(s, "token", exc)
                if s.rid in done:  # drafts kept past a stop are not the answer's
                    break
        self.batch.remove(done)

    def _apply_reads(self, reads: Reads) -> None:
        """Book the chunks one forward read; a sequence whose prompt is read, with its
        first token, goes on decoding: its KV joins the batch after the decode step (or is
        there already, ``in_batch``)."""
        keep: list[int] = []
        ended: set[int] = set()
        for i, r in enumerate(reads.chunks):
            s = r.seq
            if isinstance(r.token, Failure):
                self._fail(s, r.token.phase, r.token.error)
                continue
            if reads.shared is not None or reads.in_batch:
                s.cache = None  # its KV is a row of the forward's batched cache
            try:
                self._prefilled(s, r.n, r.token)
            except Exception as exc:
                self._fail(s, "token", exc)
                continue
            if r.token is None:  # more of the prompt to read
                continue
            if s.state is not RequestState.PREFILLING:  # finished at its first token
                ended.add(s.rid)
                continue
            s.move(RequestState.DECODING)
            keep.append(i)
            if reads.shared is None and not reads.in_batch:
                assert s.cache is not None
                self._joining.append(([s.rid], s.cache, None))
                s.cache = None
        if reads.in_batch:
            self.batch.remove(ended)
        elif reads.shared is not None and keep:
            self._joining.append(([reads.chunks[i].seq.rid for i in keep], reads.shared, keep))

    def _prefilled(self, s: Seq, n: int, token: int | None) -> None:
        """Book a prefill chunk; with the prompt's first token, accept it (which may finish)."""
        s.computed += n
        self.prompt_total += n
        self._serve(s, n, 0 if token is None else 1)
        if token is None:
            return
        if not s.prompt_charged:  # the daily quota counts the prompt once
            self.usage.add(s.handle.request.user_key, time.time(), s.n_prompt)
            s.prompt_charged = True
        self._accept(s, token, self.clock())

    def _join(self) -> None:
        self.batch.join(self._joining)
        self._joining = []

    def _views(self) -> list[SeqView]:
        padded = self.batch.padded_len
        return [s.view(padded if s.state is RequestState.DECODING else None)
                for s in self.seqs.values()]

    def _serve(self, s: Seq, prefill: int, output: int) -> None:
        """Count work for the fairness counters and the daily quota."""
        user = s.handle.request.user_key
        row = self._served.setdefault(user, [0, 0])
        row[0] += prefill
        row[1] += output
        self.usage.add(user, time.time(), output)

    def _room(self, s: Seq) -> int:
        """Tokens ``s`` may still generate: to its ``max_tokens`` and its user's quota."""
        room = s.max_tokens - s.generated
        left = self.access.tokens_left(s, time.time())
        return room if left is None else min(room, left)

    def restrict(self, user_key: str, access: UserAccess) -> None:
        """What an admin left ``user_key`` allowed; the requests already running obey it from
        the next tick (:meth:`_enforce_access`), and so do the ones taken later."""
        self.access.restrict(user_key, access)

    def _enforce_quotas(self) -> None:
        """A request whose user has used up the day's tokens finishes with ``quota`` (the
        limit an admin set since it was submitted, if one did)."""
        over = self.access.over_quota(self.seqs.values(), time.time())
        if over:
            self.batch.remove({s.rid for s in over})
        for s in over:
            self._finish(s, FinishReason.QUOTA)

    def _enforce_access(self) -> None:
        """End the requests of a disabled user or made with a revoked key: ``cancelled``,
        with the reason as the error, and a ledger row, as a caller's cancellation."""
        ended = self.access.cut_off(self.seqs.values())
        if ended:
            self.batch.remove({s.rid for s, _ in ended})
        for s, why in ended:
            log.info("request ended rid=%d user_id=%d: %s", s.rid, s.handle.request.user_id,
                     why)
            self._finish(s, FinishReason.CANCELLED, error=why)

    def flush_counters(self) -> None:
        self._counters_dirty = False
        if self.on_counters is not None:
            self.on_counters(self.scheduler.counters.snapshot())

    def _apply(self, plan: Plan, now: float) -> None:
        if plan.evict_tokens and self.prompt_cache is not None:
            self.prompt_cache.evict_bytes(plan.evict_tokens * self.loaded.kv_bytes_per_token)
        for rid in plan.reject:
            s = self.seqs[rid]
            self._finish(s, FinishReason.LENGTH if s.generated else FinishReason.ERROR,
                         error=None if s.generated else TOO_LARGE)
        for rid in plan.preempt:
            self._preempt(self.seqs[rid], keep_kv=rid in plan.keep_kv)
        for rid in plan.admit:
            s = self.seqs[rid]
            s.move(RequestState.PREFILLING)
            first = s.admitted_at is None
            if first:
                s.admitted_at = now
                s.handle.queue_s = now - s.arrival
                self._left_queue.append(s.rid)
            try:
                s.cache, s.computed = self._cached_prefix(s)
            except Exception as exc:
                self._fail(s, "admit", exc)
                continue
            if first:
                s.cached_tokens = min(s.computed, s.n_prompt)

    # ---- per-token bookkeeping ----
    def _accept(self, s: Seq, token: int, now: float) -> bool:
        """Record one new token; return True when the sequence finished."""
        if s.first_token_at is None:
            s.first_token_at = now
        elif s.last_token_at is not None:
            s.itl.append(now - s.last_token_at)
        s.last_token_at = now
        s.tokens.append(token)
        self.generated_total += 1
        if self.fault:
            self.fault(s.handle.request, "token")
        if token in self.eos:
            self._finish(s, FinishReason.STOP)
            return True
        text = s.text.push(token)
        if text:
            s.handle.emit(TokenEvent(token, text))
        if s.text.stopped:
            self._finish(s, FinishReason.STOP)
            return True
        if s.generated >= s.max_tokens:
            self._finish(s, FinishReason.LENGTH)
            return True
        s.next_token = token
        return False

    def _cached_prefix(self, s: Seq) -> tuple[list[Any], int]:
        """Fresh caches for an admitted request, starting from its user's longest cached
        prefix when there is one."""
        if self.prompt_cache is not None:
            cache, reused = self.prompt_cache.fetch(s.handle.request.user_key, s.tokens)
            if cache is not None:
                return cache, reused
        return new_sequence_cache(self.model), 0

    def _keep_prefix(self, s: Seq) -> None:
        """Keep a request's KV in the prompt cache under the tokens it covers (when it
        finished: all its tokens but the last, which was never fed back)."""
        if self.prompt_cache is None:
            return
        if s.rid in self.batch.rids:
            cache = self.batch.extract(s.rid)
        elif s.cache is not None and s.state is RequestState.PREFILLING:
            cache = s.cache
        else:
            return
        size = int(cache[0].size()) if cache else 0
        if size >= len(s.tokens) > 1:  # drafts kept past its stop: their KV is not its
            for c in cache:
                c.trim(size - len(s.tokens) + 1)
            size = len(s.tokens) - 1
        if 0 < size < len(s.tokens):
            self.prompt_cache.store(s.handle.request.user_key, s.tokens[:size], cache)

    def release_cache(self, user_key: str) -> None:
        """Forget one user's prompt-cache entries (Ollama's ``keep_alive: 0``)."""
        if self.prompt_cache is not None:
            dropped = self.prompt_cache.drop_user(user_key)
            log.info("prompt cache released user=%s entries=%d", user_key, dropped)

    def _finish(self, s: Seq, reason: FinishReason, error: str | None = None,
                unavailable: bool = False) -> None:
        """Finish one sequence: it leaves the engine, its caller gets the finish event, the
        ledger gets its row. Never raises: what fails on the way (keeping its prefix, the
        detokenizer's tail, the ledger hand-off) is logged and the request still ends."""
        if s.rid not in self.seqs:
            return
        tail = ""
        try:
            if self.fault:
                self.fault(s.handle.request, "finish")
            if not s.handle.request.keep_cache:
                self.release_cache(s.handle.request.user_key)
            elif reason.answered:
                self._keep_prefix(s)
            tail = s.text.finish() if reason.complete else ""
        except Exception as exc:
            log.error("request failed rid=%d phase=finish: %s", s.rid, type(exc).__name__)
            reason, error, tail = FinishReason.ERROR, BACKEND_ERROR, ""
        if s.state is RequestState.QUEUED and s.admitted_at is None:
            self._left_queue.append(s.rid)
        s.move(finish_state(reason))
        s.cache = None
        del self.seqs[s.rid]
        self.completed += 1
        if reason is FinishReason.ERROR:
            self.errors_total += 1
        elif reason is FinishReason.CANCELLED:
            self.cancelled_total += 1
        ttft = None if s.first_token_at is None else s.first_token_at - s.arrival
        usage = s.usage()
        queued = None if s.admitted_at is None else s.admitted_at - s.arrival
        s.hand_ledger(self.on_finish, reason, usage, self.clock())  # before the caller hears
        s.handle.emit(FinishEvent(reason, usage, tail, error, ttft, s.preemptions,
                                  queue_s=queued, unavailable=unavailable))
        self._done(s.handle)
        # itl_max_ms: the longest gap between its tokens as the engine made them; a longer
        # one seen by the client arose after the engine (the event loop, the network).
        log.info("request finished rid=%d id=%s reason=%s prompt_tokens=%d output_tokens=%d "
                 "ttft_ms=%s itl_max_ms=%s preemptions=%d", s.rid,
                 s.handle.request.request_id, reason, usage.prompt_tokens,
                 usage.completion_tokens, "-" if ttft is None else f"{ttft * 1000:.1f}",
                 f"{max(s.itl) * 1000:.1f}" if s.itl else "-", s.preemptions)

    def _preempt(self, s: Seq, keep_kv: bool = False) -> None:
        """Back to the queue with its tokens kept. Its KV is freed and rebuilt on
        readmission, or, when it only yields a slot (``keep_kv``), parked in the prompt cache
        so readmission computes just the last token."""
        if keep_kv:
            self._keep_prefix(s)
        self.batch.remove({s.rid})
        s.cache = None
        s.computed = 0
        s.move(RequestState.QUEUED)
        s.preemptions += 1
        self.preemptions_total += 1
        log.info("request preempted rid=%d tokens=%d", s.rid, len(s.tokens))

    def _reap_cancelled(self) -> None:
        gone = [s for s in self.seqs.values() if s.handle.cancelled]
        if gone:
            self.batch.remove({s.rid for s in gone})
        for s in gone:
            self._finish(s, FinishReason.CANCELLED)

    def cancel_everything(self) -> None:
        for s in list(self.seqs.values()):
            s.handle.cancel()
        self._reap_cancelled()

    def fail_everything(self, error: str = BACKEND_ERROR, unavailable: bool = False) -> None:
        """After a tick failed where no single request was to blame: end every request in
        flight with an error (``unavailable``: the service is, HTTP 503), start from an
        empty batch, keep serving."""
        self._joining = []  # rows of the failed tick that had not joined the batch yet
        for s in list(self.seqs.values()):
            self._finish(s, FinishReason.ERROR, error=error, unavailable=unavailable)
        self.forwards.reset()

    # ---- monitoring ----
    def _reserved_tokens(self) -> int:
        optimistic = self.scheduler.config.enable_preemption
        return sum(max(reservation(v, optimistic) - held(v), 0) for v in self._views()
                   if v.state.running)

    def snapshot(self) -> EngineSnapshot:
        now = self.clock()
        slots: list[SlotInfo] = []
        waiting: list[SlotInfo] = []
        for s in self.seqs.values():
            (waiting if s.state is RequestState.QUEUED else slots).append(s.slot_info(now))
        if len(waiting) > 1:  # in the order the scheduler will admit them
            rank = {rid: i for i, rid in enumerate(self.scheduler.queue_order(now, self._views()))}
            waiting.sort(key=lambda q: rank.get(q.rid, len(rank)))
        kv = self.batch.nbytes + sum(cache_nbytes(s.cache) for s in self.seqs.values())
        pc = self.prompt_cache
        drafting = self.forwards.drafting
        return EngineSnapshot(
            active=len(slots), queued=len(waiting), completed=self.completed,
            slots=tuple(slots), queue=tuple(waiting), kv_bytes=kv, ticks=self.ticks,
            prompt_tokens_total=self.prompt_total, generated_tokens_total=self.generated_total,
            preemptions_total=self.preemptions_total, errors_total=self.errors_total,
            cancelled_total=self.cancelled_total,
            counters=self.scheduler.counters.snapshot(),
            weights=self.scheduler.counters.weights(),
            prompt_cache=None if pc is None else dataclasses.asdict(pc.stats),
            kv_reserved_bytes=self._reserved_tokens() * self.loaded.kv_bytes_per_token,
            ticks_over_target=self.timing.over_target, mixed_forwards=self.mixed_forwards,
            draft_tokens=0 if drafting is None else drafting.drafted,
            draft_tokens_kept=0 if drafting is None else drafting.accepted)
