"""The forward passes of a tick (engine thread only): the decode step, prompt chunks read
in it (a mixed forward) or in forwards of their own, whole fresh prompts read together, and
the retries that find which request a failed forward was to blame for.

:class:`TickForwards` is the half of the :class:`~appliance.engine.runner.Runner` that
touches the model. The runner owns the state it declares (the batch, the sequences, the
timing, the fault hook) and the bookkeeping it calls (:meth:`TickForwards._accept`,
:meth:`~TickForwards._finish`, :meth:`~TickForwards._fail`, :meth:`~TickForwards._serve`):
what a token, a finish or a failure does to a request is the runner's, how the tokens are
computed is this module's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from appliance.engine.batch import DecodeBatch, prefill, prefill_batch
from appliance.engine.request import FaultHook
from appliance.engine.sampling import sample_batch
from appliance.engine.seq import Seq
from appliance.engine.ticks import TickTiming
from appliance.sched.states import RequestState
from appliance.sched.types import Plan
from appliance.sched.usage import RollingUsage
from appliance.vocab import FinishReason

log = logging.getLogger("appliance.engine.runner")  # one logger for the whole tick, as ticks.py

BACKEND_ERROR = "inference backend error"


class TickForwards:
    """The forwards of a tick over the runner's state (declared here, set by the runner)."""

    model: Any
    batch: DecodeBatch
    seqs: dict[int, Seq]
    timing: TickTiming
    fault: FaultHook | None
    clock: Callable[[], float]
    usage: RollingUsage
    _plain_kv: bool
    _joining: list[tuple[list[int], list[Any], list[int] | None]]
    """Rows prefilled this tick, merged into the batch after its decode step."""
    mixed_forwards: int
    """Decode steps that read prompt chunks in their forward."""
    prompt_total: int

    # ---- the runner's bookkeeping ----
    def _new_batch(self) -> DecodeBatch:
        raise NotImplementedError

    def _accept(self, s: Seq, token: int, now: float) -> bool:
        """Record one new token; True when the sequence finished."""
        raise NotImplementedError

    def _finish(self, s: Seq, reason: FinishReason, error: str | None = None) -> None:
        raise NotImplementedError

    def _fail(self, s: Seq, phase: str, exc: BaseException | str) -> None:
        """End one request with an error; the others go on."""
        raise NotImplementedError

    def _serve(self, s: Seq, prefill: int, output: int) -> None:
        """Count work for the fairness counters and the daily quota."""
        raise NotImplementedError

    # ---- the forwards ----
    def _decode(self) -> bool:
        if not len(self.batch):
            return False
        rows = [self.seqs[rid] for rid in self.batch.rids]
        failed = self._decode_faults(rows)
        start = self.timing.timer()
        kv_len = self.batch.padded_len + 1
        try:
            if self.fault:
                for s in rows:
                    self.fault(s.handle.request, "batch")
            logits = self.batch.step([s.next_token for s in rows])
            tokens = self._sample_rows(logits, rows, failed)
            self.timing.forward("decode", len(rows), 1, kv_len, start)
        except Exception:
            log.exception("batched decode step failed; retrying its %d rows alone", len(rows))
            tokens = self._decode_alone(rows, failed)
        self._decoded(rows, tokens, failed)
        return True

    @staticmethod
    def _sample_rows(logits: Any, rows: list[Seq], failed: dict[int, str]) -> list[int | None]:
        """Each decode row's next token; a row whose sampling raises is noted in ``failed``."""
        return sample_batch(logits, [s.sampler for s in rows], [s.tokens for s in rows],
                            on_row_error=lambda i, e: failed.setdefault(rows[i].rid, repr(e)))

    def _decode_faults(self, rows: list[Seq]) -> dict[int, str]:
        failed: dict[int, str] = {}
        for s in rows:
            try:
                if self.fault:
                    self.fault(s.handle.request, "decode")
            except Exception as exc:
                failed[s.rid] = repr(exc)
        return failed

    def _decoded(self, rows: list[Seq], tokens: list[int | None],
                 failed: dict[int, str]) -> None:
        """Hand each row its new token (or its error) and drop the rows that finished."""
        now = self.clock()
        done: set[int] = set()
        for s, tok in zip(rows, tokens, strict=True):
            if s.rid in failed or tok is None:
                log.error("request failed rid=%d phase=decode: %s", s.rid, failed.get(s.rid))
                self._finish(s, FinishReason.ERROR, error=BACKEND_ERROR)
                done.add(s.rid)
            else:
                self._serve(s, 0, 1)
                try:
                    if self._accept(s, tok, now):
                        done.add(s.rid)
                except Exception as exc:
                    done.add(s.rid)
                    self._fail(s, "token", exc)
        self.batch.remove(done)

    def _mixed_tick(self, chunks: list[tuple[Seq, int]]) -> bool | None:
        """The decode step with every chunk of the plan read in its forward; None, with
        every cache as it was, when that forward (or a fault hook on the way) raised: the
        caller then reads the chunks and steps the batch one forward each, whose own
        handling ends only the culprit."""
        rows = [self.seqs[rid] for rid in self.batch.rids]
        start = self.timing.timer()
        kv_len = self.batch.padded_len + 1
        riding = [(n, s.computed) for s, n in chunks]
        parts = []
        for s, n in chunks:
            assert s.cache is not None
            parts.append((s.cache, s.tokens[s.computed:s.computed + n],
                          s.computed + n == len(s.tokens)))
        try:
            failed = self._decode_faults(rows)
            if self.fault:
                for s, _ in chunks:
                    self.fault(s.handle.request, "prefill")
                for s in rows:
                    self.fault(s.handle.request, "batch")
            logits, lasts = self.batch.step_mixed([s.next_token for s in rows], parts)
        except Exception:
            log.exception("mixed forward of %d rows and %d chunks failed; reading them one "
                          "forward each", len(rows), len(chunks))
            return None
        try:  # the forward has run: a failure now ends these rows, it is not retried
            tokens = self._sample_rows(logits, rows, failed)
        except Exception as exc:
            log.exception("sampling the decode rows of a mixed forward failed")
            tokens = [None] * len(rows)
            failed.update({s.rid: repr(exc) for s in rows})
        firsts: list[int | None] = []
        for (s, _), last in zip(chunks, lasts, strict=True):
            try:
                firsts.append(None if last is None
                              else sample_batch(last, [s.sampler], [s.tokens])[0])
            except Exception as exc:
                firsts.append(None)
                self._fail(s, "prefill", exc)
        self.mixed_forwards += 1
        self.timing.forward("decode", len(rows), 1, kv_len, start, riding)
        for (s, n), token in zip(chunks, firsts, strict=True):
            if s.rid in self.seqs:
                self._first_token(s, n, token)
        self._decoded(rows, tokens, failed)
        return True

    def _decode_alone(self, rows: list[Seq], failed: dict[int, str]) -> list[int | None]:
        """After a failed batched step, step each row on its own: a row that fails alone
        ends with an error, the others go on in a rebuilt batch."""
        caches = {s.rid: self.batch.extract(s.rid) for s in rows}
        self.batch = self._new_batch()
        tokens: list[int | None] = []
        for s in rows:
            single = DecodeBatch(self.model, 1)
            single.add(s.rid, caches[s.rid])
            try:
                if self.fault:
                    self.fault(s.handle.request, "batch")
                token = sample_batch(single.step([s.next_token]), [s.sampler], [s.tokens])[0]
            except Exception as exc:
                failed[s.rid] = repr(exc)
                token = None
            tokens.append(token)
            self.batch.add(s.rid, single.extract(s.rid))
        return tokens

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

    def _prefill(self, chunks: list[tuple[Seq, int]]) -> None:
        """Read prefill chunks in forwards of their own. Fresh prompts read whole in this
        tick go through the model together (left-padded, one row each in a batched KV cache:
        still isolated); everything else (partial chunks, prompt-cache hits) one sequence
        at a time."""
        whole: list[Seq] = []
        parts: list[tuple[Seq, int]] = []
        for s, n in chunks:
            if self._plain_kv and s.computed == 0 and n == len(s.tokens):
                whole.append(s)
            else:
                parts.append((s, n))
        if len(whole) > 1:
            self._prefill_together(whole)
        else:
            parts = [(s, len(s.tokens)) for s in whole] + parts
        for s, n in parts:
            self._prefill_one(s, n)

    def _prefill_one(self, s: Seq, n: int) -> None:
        assert s.cache is not None
        last = s.computed + n == len(s.tokens)
        start = self.timing.timer()
        try:
            if self.fault:
                self.fault(s.handle.request, "prefill")
            logits = prefill(self.model, s.cache, s.tokens[s.computed:s.computed + n], last)
            token = (sample_batch(logits, [s.sampler], [s.tokens])[0]
                     if logits is not None else None)
            self.timing.forward("prefill", 1, n, s.computed, start)
        except Exception as exc:
            self._fail(s, "prefill", exc)
            return
        self._first_token(s, n, token)

    def _first_token(self, s: Seq, n: int, token: int | None) -> None:
        """Book a chunk read into ``s.cache``; with the prompt's first token, the sequence
        joins the batch after this tick's decode step."""
        try:
            self._prefilled(s, n, token)
        except Exception as exc:
            self._fail(s, "token", exc)
            return
        if token is not None and s.state is RequestState.PREFILLING:
            assert s.cache is not None
            s.move(RequestState.DECODING)
            self._joining.append(([s.rid], s.cache, None))
            s.cache = None

    def _prefill_together(self, seqs: list[Seq]) -> None:
        """Whole fresh prompts in one forward: straight into the batch's slots when nothing
        decodes (their rows then step from the next tick on), else into a batched cache
        that joins after this tick's decode step."""
        start = self.timing.timer()
        into = self.batch.slots is not None and not len(self.batch)
        cache = None
        try:
            if self.fault:
                for s in seqs:
                    self.fault(s.handle.request, "prefill")
            prompts = [s.tokens for s in seqs]
            if into:
                logits = self.batch.prefill([s.rid for s in seqs], prompts)
            else:
                cache, logits = prefill_batch(self.model, prompts)
            tokens = sample_batch(logits, [s.sampler for s in seqs], prompts)
            self.timing.forward("prefill", len(seqs), max(len(s.tokens) for s in seqs), 0, start)
        except Exception:  # find the culprit: each one alone
            log.warning("batched prefill of %d prompts failed; reading them one by one",
                        len(seqs))
            if into:
                self.batch = self._new_batch()
            for s in seqs:
                self._prefill_one(s, len(s.tokens))
            return
        keep: list[int] = []
        for i, (s, token) in enumerate(zip(seqs, tokens, strict=True)):
            s.cache = None
            try:
                self._prefilled(s, len(s.tokens), token)
            except Exception as exc:
                self._fail(s, "token", exc)
                continue
            if s.state is RequestState.PREFILLING:
                s.move(RequestState.DECODING)
                keep.append(i)
        if into:
            self.batch.remove({s.rid for i, s in enumerate(seqs) if i not in keep})
        elif keep:
            assert cache is not None
            self._joining.append(([seqs[i].rid for i in keep], cache, keep))

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
