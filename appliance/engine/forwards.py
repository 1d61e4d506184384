"""The forward passes of a tick (engine thread only): the decode step, prompt chunks read
in it (a mixed forward) or in forwards of their own, whole fresh prompts read together, and
the retries that find which request a failed forward was to blame for.

:class:`Forwards` owns the decode batch and computes tokens; it returns what each row got
(:data:`Outcome`: a token, or a :class:`Failure`; :class:`Read` for a prompt chunk) and
changes no request. What a token, a finish or a failure does to a request is the
:class:`~appliance.engine.runner.Runner`'s, which applies these results.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx

from appliance.engine.batch import Ahead, DecodeBatch, plain_kv, prefill, prefill_batch
from appliance.engine.lookup import Drafting, StreamDrafts, agreed
from appliance.engine.mixed import mixed_step, restore_offsets, save_offsets
from appliance.engine.request import FaultHook, GroupLost
from appliance.engine.sampling import read_tokens, sample_batch, sample_lazy, sample_positions
from appliance.engine.seq import Seq
from appliance.engine.ticks import TickTiming
from appliance.sched.budget import TickObjectives

log = logging.getLogger("appliance.engine.runner")  # one logger for the whole tick, as ticks.py


class Link(Protocol):
    """Rank 0's link to the other machines of a group (appliance/distributed/link.py)."""

    live: Any
    """Called for the sequences whose own caches rank 0 holds (the runner sets it)."""

    sent: bool
    """The forward last expected went out to the other machines."""

    def record(self, op: list[Any]) -> None: ...

    def expect(self, rows: int, chunks: list[list[int]]) -> None: ...

    def lose(self, reason: str) -> bool: ...


@dataclass(frozen=True, slots=True)
class Failure:
    """Why a row got no token: its request ends with an error, the others go on."""

    phase: str
    error: BaseException | str


Outcome = int | list[int] | Failure
"""A decode row's result: its next token (or tokens, when drafts were kept:
appliance/engine/lookup.py), or why it has none."""


@dataclass(frozen=True, slots=True)
class Read:
    """A prompt chunk of ``n`` tokens read into ``seq``'s KV. ``token``: the first generated
    token when the chunk reached the prompt's end, None before it, or the read's failure."""

    seq: Seq
    n: int
    token: int | None | Failure


@dataclass(frozen=True, slots=True)
class Reads:
    """Chunks read by one forward. Their KV is each sequence's own ``cache``, unless
    ``shared`` (a batched cache of whole prompts, row ``i`` for ``chunks[i]``) or
    ``in_batch`` (read straight into the empty decode batch's slots)."""

    chunks: list[Read]
    shared: list[Any] | None = None
    in_batch: bool = False


DRAFT_ROWS = 4
"""The most rows that verify drafts together: each keeps as many as the one that keeps
fewest, so with more rows the chance that all of them quote falls fast."""


class Forwards:
    """The model side of a tick: the decode batch and the forwards over it."""

    def __init__(self, model: Any, max_rows: int, timing: TickTiming,
                 fault: FaultHook | None, look_ahead: bool = True,
                 link: Link | None = None, drafts: int = 0,
                 objectives: TickObjectives | None = None) -> None:
        self.model = model
        self.max_rows = max_rows
        self.timing = timing
        self.fault = fault
        self.link = link
        """Rank 0's link when the model is split across machines (appliance/distributed):
        every forward is then :func:`mixed_step`, each described to the link before it
        runs, and no forward is retried (the other machines ran their part)."""
        self.plain_kv = plain_kv(model)
        self.batch = self.new_batch()
        self.mixed_forwards = 0
        """Decode steps that read prompt chunks in their forward."""
        self.look_ahead = look_ahead
        """Build each decode step's successor while it computes (:meth:`decode`)."""
        self._ahead: Ahead | None = None
        self.steps_ahead = 0
        """Decode steps that ran the graph built ahead."""
        self.room: Callable[[Seq], int] = lambda s: s.max_tokens - s.generated
        """Tokens a row may still generate (the runner's: its daily quota too), so that
        drafts kept never take it past what a plain step would have stopped at."""
        self.objectives = objectives or TickObjectives()
        self.drafting = Drafting(drafts, self.objectives.itl_factor) \
            if drafts > 0 and link is None and fault is None else None
        """Streams' drafts by prompt lookup (appliance/engine/lookup.py); not across
        machines (each would need the verify), nor under a fault hook (tests that place
        faults by forward)."""

    def new_batch(self) -> DecodeBatch:
        return DecodeBatch(self.model, self.max_rows,
                           None if self.link is None else self.link.record)

    def reset(self) -> None:
        """Start from an empty batch (after a tick failed as a whole)."""
        self._ahead = None
        if self.link is not None:
            self.link.record(["reset"])
        self.batch = self.new_batch()

    # ---- decode ----
    def decode(self, rows: list[Seq], draft: bool = True) -> list[Outcome]:
        """One decode step of the batch, whose rows are ``rows``: each row's token or
        failure. A batched step that raises is retried one row at a time. Up to
        :data:`DRAFT_ROWS` rows may verify drafts instead (:meth:`_verify`), unless not
        ``draft`` (the tick read prompt chunks in forwards of their own: it has had its
        time).

        With ``look_ahead``, the next step's graph is built while this one computes (on
        its tokens, still lazy), as mlx-lm's generator does: the host's graph building,
        some 4 ms of a C = 8 step on the SmolLM-135M shape, then hides behind the device.
        The next tick runs it only if nothing changed the batch in between (a row that
        finished, joined or was preempted; a mixed forward); else it is dropped unrun, and
        the batch was never touched by it."""
        if (draft and self.drafting is not None and len(rows) <= DRAFT_ROWS
                and self.batch.lean):
            kept = self._verify(rows, self.drafting)
            if kept is not None:
                return kept
        ahead, self._ahead = self._ahead, None
        failed = self._decode_faults(rows)
        start = self.timing.timer()
        kv_len = self.batch.padded_len + 1
        try:
            if self.fault:
                for s in rows:
                    self.fault(s.handle.request, "batch")
            logits = None if ahead is None else self.batch.launch(ahead)
            ahead = None  # unrun, it would hold the buffers the step below writes
            if logits is None:
                if self.link is not None:
                    self.link.expect(len(rows), [])
                logits = self.batch.step([s.next_token for s in rows])
            else:
                self.steps_ahead += 1
            lazy, live = sample_lazy(logits, [s.sampler for s in rows], [s.tokens for s in rows],
                                     on_row_error=lambda i, e: failed.setdefault(rows[i].rid,
                                                                                 repr(e)))
            if lazy is not None:
                launched = self.timing.timer()
                mx.async_eval(lazy)  # on the CPU it returns only near the step's end
                if self.look_ahead and self.batch.lean and len(live) == len(rows):
                    self._ahead = self._build_ahead(lazy)
                mx.eval(lazy)
                self.timing.waited(launched)
            tokens = read_tokens(lazy, live, len(rows))
            self.timing.forward("decode", len(rows), 1, kv_len, start)
        except Exception:
            self._ahead = None
            self._check_parted()
            if self.link is not None:  # the other machines hold the batch too: no retries
                log.exception("decode step of %d rows failed", len(rows))
                failed.update({s.rid: "the decode step failed" for s in rows})
                tokens = [None] * len(rows)
            else:
                log.exception("batched decode step failed; retrying its %d rows alone",
                              len(rows))
                tokens = self._decode_alone(rows, failed)
        return _outcomes(rows, tokens, failed)

    def _verify(self, rows: list[Seq], drafting: Drafting) -> list[Outcome] | None:
        """The rows' step with the drafts worth verifying: each row's new tokens, the drafts
        kept and the sample after them (appliance/engine/lookup.py); None, with the batch as
        it was, when there are none or the verify failed (then the plain step runs)."""
        if any(s.sampler.grammar is not None for s in rows):
            return None
        streams = []
        for s in rows:
            if s.drafts is None:
                s.drafts = StreamDrafts()
            streams.append(s.drafts)
        kv_len = self.batch.padded_len + 1
        costs = self.timing.costs
        step_s = costs.decode(len(rows), kv_len)
        try:  # drafts are a shortcut: a fault in planning them costs the plain step, no more
            drafts = self._plan_drafts(rows, streams, drafting, kv_len, step_s)
        except Exception:
            log.exception("planning drafts for %d rows failed; the plain step reads them",
                          len(rows))
            return None
        if not drafts:
            return None
        k = len(drafts[0])
        self._ahead = None  # built on a plain step: dropped unrun
        start = self.timing.timer()
        try:
            logits, before = self.batch.verify(
                [[s.next_token, *d] for s, d in zip(rows, drafts, strict=True)])
        except Exception:
            log.exception("verifying %d drafts a row of %d failed; plain steps go on",
                          k, len(rows))
            return None
        try:
            tokens = [_ints(sample_positions(logits[i * (k + 1):(i + 1) * (k + 1)], s.sampler,
                                             s.tokens, d))
                      for i, (s, d) in enumerate(zip(rows, drafts, strict=True))]
        except Exception:
            log.exception("sampling a verify failed; the plain step reads the rows")
            self.batch.undo(before)
            return None
        kept = [agreed(row, d) for row, d in zip(tokens, drafts, strict=True)]
        least = min(kept)  # every row keeps as many: the batch's KV stays aligned
        self.batch.keep(k - least)
        if len(rows) == 1:
            seconds = self.timing.verify(k, kv_len, start, drafting.verify_cost(k) * step_s)
            drafting.observe(streams[0], k, least, seconds, step_s)
        else:
            predicted = self._rows_verify_s(len(rows), k, kv_len)
            seconds = self.timing.verify(k * len(rows), kv_len, start,
                                         predicted * drafting.rows_fit.predict((1.0,)),
                                         rows=len(rows))
            drafting.observe_rows(streams, k, kept, seconds, predicted)
        return [row[:least + 1] for row in tokens]

    def _plan_drafts(self, rows: list[Seq], streams: list[StreamDrafts], drafting: Drafting,
                     kv_len: int, step_s: float) -> list[list[int]]:
        """Each row's drafts worth verifying (as many each), or none."""
        itl = self.objectives.itl_target_s
        longest = itl / step_s if itl > 0 and step_s > 0 else None
        if len(rows) == 1:
            found = drafting.plan(streams[0], rows[0].tokens, self.room(rows[0]), longest)
            return [found] if found else []
        if not step_s > 0:  # a cost model that prices steps at nothing prices no verify
            return []
        return drafting.plan_rows(
            streams, [s.tokens for s in rows], [self.room(s) for s in rows],
            lambda k: self._rows_verify_s(len(rows), k, kv_len) / step_s, longest)

    def _rows_verify_s(self, rows: int, drafts: int, kv_len: int) -> float:
        """The cost model's price of a verify of ``drafts`` drafts in each of ``rows`` rows:
        their decode step with the drafts riding in it as one chunk, for they go through
        the model as a prompt's tokens do. Priced as a plain step of all its tokens (a
        fused step's rows, which cost little more than one), four rows with a draft each
        took 17 ms in-process against 9.5 for eight rows' step (SmolLM2, Zen 5), and 52 ms
        against 23 predicted in a server, the longest gap of its streams."""
        return self.timing.costs.decode(rows, kv_len, [(rows * drafts, kv_len)])

    def _check_parted(self) -> None:
        """After a forward raised: when the other machines had run their part of it, this
        machine's caches and theirs may now differ, and the group cannot go on."""
        if self.link is not None and self.link.sent:
            reason = "a forward failed on this machine after the others had run their part"
            log.exception(reason)
            self.link.lose(reason)
            raise GroupLost(reason)

    def _build_ahead(self, tokens: mx.array) -> Ahead | None:
        try:
            return self.batch.step_ahead(tokens)
        except Exception:  # the next step is built the ordinary way, and fails there if it must
            log.exception("building the next decode step ahead failed")
            return None

    def _decode_faults(self, rows: list[Seq]) -> dict[int, str]:
        failed: dict[int, str] = {}
        for s in rows:
            try:
                if self.fault:
                    self.fault(s.handle.request, "decode")
            except Exception as exc:
                failed[s.rid] = repr(exc)
        return failed

    def _decode_alone(self, rows: list[Seq], failed: dict[int, str]) -> list[int | None]:
        """After a failed batched step, step each row on its own: a row that fails alone
        fails, the others go on in a rebuilt batch."""
        self._ahead = None
        caches = {s.rid: self.batch.extract(s.rid) for s in rows}
        self.batch = self.new_batch()
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

    def mixed(self, rows: list[Seq], chunks: list[tuple[Seq, int]]
              ) -> tuple[list[Outcome], list[Read]] | None:
        """The decode step with every chunk read in its forward: the rows' outcomes and
        the chunks' reads. None, with every cache as it was, when that forward (or a
        fault hook on the way) raised: the caller then reads the chunks and steps the
        batch one forward each, whose own handling blames only the culprit."""
        self._ahead = None  # the step reads chunks: not the one built ahead
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
            if self.link is not None:
                self.link.expect(len(rows), [[s.rid, s.computed, n] for s, n in chunks])
            logits, lasts = self.batch.step_mixed([s.next_token for s in rows], parts)
        except Exception:
            self._check_parted()
            log.exception("mixed forward of %d rows and %d chunks failed; reading them one "
                          "forward each", len(rows), len(chunks))
            return None
        try:  # the forward has run: a failure now ends these rows, it is not retried
            tokens = _sample_rows(logits, rows, failed)
        except Exception as exc:
            log.exception("sampling the decode rows of a mixed forward failed")
            tokens = [None] * len(rows)
            failed.update({s.rid: repr(exc) for s in rows})
        reads = _chunk_reads(chunks, lasts)
        self.mixed_forwards += 1
        self.timing.forward("decode", len(rows), 1, kv_len, start, riding)
        return _outcomes(rows, tokens, failed), reads

    # ---- prefill ----
    def prefill(self, chunks: list[tuple[Seq, int]]) -> Iterator[Reads]:
        """Read prefill chunks in forwards of their own, yielding each forward's reads as it
        ends, so a prompt read to its end shows its first token before the tick's next
        forward runs (a chat turn read beside the end of someone's document waited for it:
        docs/decisions/first-token-before-the-next-forward.md). Fresh prompts read
        whole in this tick go through the model together (left-padded, one row each in a
        batched KV cache: still isolated), first; everything else (partial chunks,
        prompt-cache hits) one sequence at a time."""
        whole: list[Seq] = []
        parts: list[tuple[Seq, int]] = []
        if chunks:
            self._ahead = None  # its buffers may be written: a prompt read into the batch
        if self.link is not None:
            if chunks:
                yield from self._read_chunks(chunks)
            return
        for s, n in chunks:
            if self.plain_kv and s.computed == 0 and n == len(s.tokens):
                whole.append(s)
            else:
                parts.append((s, n))
        if len(whole) > 1:
            yield from self._prefill_together(whole)
        else:
            parts = [(s, len(s.tokens)) for s in whole] + parts
        for s, n in parts:
            yield Reads([self._prefill_one(s, n)])

    def _read_chunks(self, chunks: list[tuple[Seq, int]]) -> list[Reads]:
        """Every chunk in one forward of its own (a model split across machines): each
        into its sequence's cache; a failure before the forward left fails every chunk."""
        start = self.timing.timer()
        caches = [s.cache for s, _ in chunks if s.cache is not None]
        saved = save_offsets(caches)
        try:
            parts = []
            for s, n in chunks:
                if self.fault:
                    self.fault(s.handle.request, "prefill")
                assert s.cache is not None
                parts.append((s.cache, s.tokens[s.computed:s.computed + n],
                              s.computed + n == len(s.tokens)))
            assert self.link is not None
            self.link.expect(0, [[s.rid, s.computed, n] for s, n in chunks])
            _, lasts = mixed_step(self.model, None, [], parts)
            mx.eval(*(last for last in lasts if last is not None))
        except Exception as exc:
            self._check_parted()
            restore_offsets(caches, saved)
            log.exception("prefill forward of %d chunks failed", len(chunks))
            return [Reads([Read(s, n, Failure("prefill", exc)) for s, n in chunks])]
        reads = _chunk_reads(chunks, lasts)
        self.timing.forward("prefill", len(chunks), max(n for _, n in chunks),
                            min(s.computed for s, _ in chunks), start)
        return [Reads(reads)]

    def _prefill_one(self, s: Seq, n: int) -> Read:
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
            return Read(s, n, Failure("prefill", exc))
        return Read(s, n, token)

    def _prefill_together(self, seqs: list[Seq]) -> list[Reads]:
        """Whole fresh prompts in one forward: straight into the batch's slots when nothing
        decodes (their rows then step from the next tick on), else into a batched cache
        that joins after this tick's decode step. When it raises, each is read alone."""
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
                self.batch = self.new_batch()
            return [Reads([self._prefill_one(s, len(s.tokens))]) for s in seqs]
        reads = [Read(s, len(s.tokens), token) for s, token in zip(seqs, tokens, strict=True)]
        return [Reads(reads, shared=cache, in_batch=into)]


def _chunk_reads(chunks: list[tuple[Seq, int]], lasts: list[Any]) -> list[Read]:
    """Each chunk's read after its forward: its first token when ``lasts`` has its prompt's
    last logits, None before the prompt's end, or why sampling failed."""
    reads = []
    for (s, n), last in zip(chunks, lasts, strict=True):
        try:
            token = None if last is None else sample_batch(last, [s.sampler], [s.tokens])[0]
            reads.append(Read(s, n, token))
        except Exception as exc:
            reads.append(Read(s, n, Failure("prefill", exc)))
    return reads


def _sample_rows(logits: Any, rows: list[Seq], failed: dict[int, str]) -> list[int | None]:
    """Each decode row's next token; a row whose sampling raises is noted in ``failed``."""
    return sample_batch(logits, [s.sampler for s in rows], [s.tokens for s in rows],
                        on_row_error=lambda i, e: failed.setdefault(rows[i].rid, repr(e)))


def _ints(tokens: mx.array) -> list[int]:
    values: list[int] = tokens.tolist()  # type: ignore[assignment]
    return [int(t) for t in values]


def _outcomes(rows: list[Seq], tokens: list[int | None], failed: dict[int, str]
              ) -> list[Outcome]:
    return [Failure("decode", failed.get(s.rid, "no token")) if s.rid in failed or tok is None
            else tok for s, tok in zip(rows, tokens, strict=True)]
