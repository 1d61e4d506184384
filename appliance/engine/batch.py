"""The decode batch: one row per decoding sequence, its KV in slots (or mlx-lm's batched caches).

Each sequence is prefilled alone into its own per-layer caches (so its KV is isolated and its
numbers do not depend on its neighbours), then joins the batch: its KV is written into a
slot of the batch's buffers (appliance/engine/slots.py), or, for models whose layers do not
all keep a plain KV cache, merged with ``BatchKVCache.merge``/``extend``; finished or
preempted rows leave the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from appliance.engine.kvcache import batch_cache, kv_dtype, sequence_cache
from appliance.engine.mixed import mixed_step, restore_offsets, save_offsets, supports_mixed
from appliance.engine.slots import SlotBatch, SlotState

HEAD_ONLY_LAST = frozenset({"llama", "qwen2", "qwen3", "phi3", "smollm3"})
"""Architectures whose forward is ``backbone -> lm_head`` and nothing else (mlx-lm's
``Model.__call__``), so a prefill may apply the head to the last position alone."""


def last_logits(model: Any, x: mx.array, cache: list[Any]) -> mx.array:
    """Logits of the last position only, [B, V]. The vocabulary projection of every other
    prompt position is never needed; for a 135M model with a 49k vocabulary it is a fifth
    of a prefill's work. Other architectures run the whole model and slice."""
    if type(model).__module__.rsplit(".", 1)[-1] in HEAD_ONLY_LAST and hasattr(model, "model"):
        h = model.model(x, cache)[:, -1:, :]
        if getattr(model.args, "tie_word_embeddings", False):
            return model.model.embed_tokens.as_linear(h)[:, -1, :]
        return model.lm_head(h)[:, -1, :]
    return model(x, cache=cache)[:, -1, :]


def new_sequence_cache(model: Any) -> list[Any]:
    return sequence_cache(model)


def plain_kv(model: Any) -> bool:
    """Whether every layer keeps a plain KV cache (then prompts can be prefilled together)."""
    return all(type(c) is KVCache for c in make_prompt_cache(model))


def prefill_batch(model: Any, prompts: list[list[int]]) -> tuple[list[Any], mx.array]:
    """Whole prompts through the model at once, left-padded to the longest; returns the
    batched per-layer caches (one row per prompt) and each row's last-position logits."""
    longest = max(len(p) for p in prompts)
    pads = [longest - len(p) for p in prompts]
    x = mx.array([[0] * pad + p for pad, p in zip(pads, prompts, strict=True)])
    cache = batch_cache(model, pads)
    logits = last_logits(model, x, cache)
    mx.eval(logits)
    return cache, logits


def cache_nbytes(cache: list[Any] | None) -> int:
    return sum(c.nbytes for c in cache) if cache else 0


def prefill(model: Any, cache: list[Any], tokens: list[int], want_logits: bool) -> mx.array | None:
    """Run ``tokens`` through the model into ``cache``; the last position's logits if asked."""
    x = mx.array(tokens)[None]
    if want_logits:
        last = last_logits(model, x, cache)
        mx.eval(last)
        return last
    model(x, cache=cache)  # the logits stay lazy and are never computed
    mx.eval([c.state for c in cache])
    return None


class MergedKV:
    """The batch's KV in mlx-lm's batched caches (``BatchKVCache`` and kin), for models whose
    layers do not all keep a plain KV cache (sliding windows, state-space layers): a row
    joins by ``merge``/``extend`` (a copy of every row's KV) and leaves by ``filter``."""

    def __init__(self) -> None:
        self.layers: list[Any] | None = None

    @property
    def size(self) -> int:
        return int(self.layers[0].size()) if self.layers else 0

    @property
    def nbytes(self) -> int:
        return cache_nbytes(self.layers)

    def join(self, cache: list[Any]) -> None:
        """``cache``: batched per-layer caches of the rows joining."""
        if self.layers is None:
            self.layers = cache
        else:
            for mine, theirs in zip(self.layers, cache, strict=True):
                mine.extend(theirs)

    def remove(self, keep: list[int]) -> None:
        if not keep:
            self.layers = None
            return
        assert self.layers is not None
        for c in self.layers:
            c.filter(keep)

    def extract(self, i: int) -> list[Any]:
        assert self.layers is not None
        rows = [c.extract(i) for c in self.layers]
        # Evaluated now: mlx-lm's copy is lazy, and until it runs it holds the whole batch's
        # KV (every row, every layer). Kept so in the prompt cache, those buffers stayed
        # alive after the batch moved on, and decode steps beside them took 3-6x as long.
        mx.eval([c.state for c in rows])
        return rows


@dataclass(frozen=True, slots=True)
class Ahead:
    """A decode step built ahead (:meth:`DecodeBatch.step_ahead`), not yet run."""

    rids: tuple[int, ...]
    before: SlotState
    after: SlotState
    logits: mx.array


class DecodeBatch:
    """The decoding rows and their KV: in slots (appliance/engine/slots.py) when every layer
    keeps a plain KV cache, else in mlx-lm's batched caches (:class:`MergedKV`)."""

    def __init__(self, model: Any, max_rows: int = 8,
                 journal: Callable[[list[Any]], None] | None = None) -> None:
        self.model = model
        self.journal = journal
        """Told each change of the rows (a model split across machines: the others make
        the same changes to their own batches, appliance/distributed/plan.py)."""
        self.rids: list[int] = []
        self.slots = SlotBatch(len(make_prompt_cache(model)), max_rows, kv_dtype(model)) \
            if plain_kv(model) else None
        self.merged = MergedKV()
        self.lean = supports_mixed(model) and self.slots is not None
        """Decode steps run :func:`~appliance.engine.mixed.mixed_step` (the same numbers as
        the model's own forward, with fewer MLX operations) instead of the model's call."""

    def __len__(self) -> int:
        return len(self.rids)

    @property
    def layers(self) -> list[Any] | None:
        """The per-layer caches a forward of the batch reads (None: no rows)."""
        if not self.rids:
            return None
        return self.slots.layers if self.slots is not None else self.merged.layers

    @property
    def padded_len(self) -> int:
        """KV positions every row holds (rows are left-padded to the longest)."""
        if not self.rids:
            return 0
        return self.slots.size if self.slots is not None else self.merged.size

    @property
    def nbytes(self) -> int:
        return self.slots.nbytes if self.slots is not None else self.merged.nbytes

    @property
    def kv_copies(self) -> int:
        """KV layers copied into new windows so far (slots only; 0 otherwise)."""
        return self.slots.reallocations if self.slots is not None else 0

    def join(self, entries: list[tuple[list[int], list[Any], list[int] | None]]) -> None:
        """Rows joining the batch together, ``(rids, cache, keep)`` each: a sequence's own
        per-layer caches (``keep`` None, one rid), or rows ``keep`` of a batched prefill
        cache. In slots, room is made for them all at once."""
        if not entries:
            return
        if self.journal is not None:
            assert all(keep is None for _, _, keep in entries), "a batched cache joins alone"
            self.journal(["join", [rid for rids, _, _ in entries for rid in rids]])
        if self.slots is None:
            for _, cache, keep in entries:
                if keep is None:
                    self.merged.join([c.merge([c]) for c in cache])
                    continue
                if len(keep) < len(cache[0].offset):
                    for c in cache:
                        c.filter(keep)
                self.merged.join(cache)
        else:
            rows = []
            for _, cache, keep in entries:
                if keep is None:
                    rows.append([(c.keys[..., :c.offset, :], c.values[..., :c.offset, :])
                                 for c in cache])
                    continue
                pads, end = cache[0].left_padding.tolist(), cache[0]._idx
                rows += [[(c.keys[i:i + 1, :, pads[i]:end, :], c.values[i:i + 1, :, pads[i]:end, :])
                          for c in cache] for i in keep]
            self.slots.join(rows)
        for rids, _, _ in entries:
            self.rids.extend(rids)

    def expect(self, rows: int, length: int, ticks: int) -> None:
        """Prompts being read that will join (:meth:`SlotBatch.expect`)."""
        if self.slots is None:
            return
        before = self.slots.awaited
        self.slots.expect(rows, length, ticks)
        if self.journal is not None and self.slots.awaited != before:
            self.journal(["expect", rows, length, ticks])

    def add(self, rid: int, cache: list[Any]) -> None:
        """A sequence's own per-layer caches join the batch as row ``rid``."""
        self.join([([rid], cache, None)])

    def prefill(self, rids: list[int], prompts: list[list[int]]) -> mx.array:
        """Whole prompts read by one forward straight into the empty batch's slots
        (left-padded, as :func:`prefill_batch`, with no batched cache to copy in after);
        they become rows ``rids``. Returns each row's last-position logits, evaluated. When
        the forward raises, the batch is as empty as it was."""
        assert self.slots is not None and not self.rids
        longest = max(len(p) for p in prompts)
        x = mx.array([[0] * (longest - len(p)) + p for p in prompts])
        self.slots.start_rows([len(p) for p in prompts])
        try:
            logits = last_logits(self.model, x, self.slots.layers)
            mx.eval(logits)
        except Exception:
            self.slots.abandon()
            raise
        self.slots.advance(longest)
        self.rids = list(rids)
        return logits

    def step(self, inputs: list[int] | mx.array) -> mx.array:
        """One decode step for every row; returns logits [B, V] (lazy). ``inputs``: each
        row's next token (an array of them may be lazy)."""
        assert len(inputs) == len(self.rids)
        if self.slots is not None:
            self.slots.reserve(1)
        if self.lean:
            assert self.slots is not None
            logits = mixed_step(self.model, self.slots.layers, inputs, [])[0]  # type: ignore[arg-type]
        else:
            logits = self.model(mx.array(inputs)[:, None], cache=self.layers)[:, -1, :]
        if self.slots is not None:
            self.slots.advance(1)
        return logits

    def verify(self, rows: list[list[int]]) -> tuple[mx.array, SlotState]:
        """Each row's next token and drafts after it (``n`` tokens a row, the batch's rows in
        order) read by one forward of a lean batch: the logits at every position,
        [rows * n, V], evaluated, and the batch's state before it. Every row has taken all
        ``n`` positions; :meth:`keep` gives back those of the drafts not kept. When the
        forward raises, the batch is as it was."""
        n = len(rows[0])
        assert self.lean and self.slots is not None and len(rows) == len(self.rids)
        assert n > 1 and all(len(r) == n for r in rows)
        before = self.slots.state()
        try:
            self.slots.reserve(n)
            logits = mixed_step(self.model, self.slots.layers,
                                [t for r in rows for t in r], [], span=n)[0]
            mx.eval(logits)
        except Exception:
            self.slots.set_state(before)
            raise
        self.slots.advance(n)
        return logits, before

    def keep(self, drop: int) -> None:
        """After :meth:`verify`: the last ``drop`` positions were drafts not kept."""
        assert self.slots is not None
        self.slots.rewind(drop)

    def undo(self, before: SlotState) -> None:
        """After :meth:`verify`: back to the batch before it (its tokens were not taken)."""
        assert self.slots is not None
        self.slots.set_state(before)

    def step_ahead(self, inputs: mx.array) -> Ahead:
        """The next decode step's graph, built on ``inputs`` (the rows' tokens, still being
        computed) while the batch stays as it is: :meth:`launch` puts it in place if
        nothing has changed the batch by then (lean batches only). Its graph is built while
        the device computes the tokens it reads."""
        assert self.lean and self.slots is not None
        before = self.slots.state()
        try:
            logits = self.step(inputs)
            after = self.slots.state()
        finally:
            self.slots.set_state(before)
        return Ahead(tuple(self.rids), before, after, logits)

    def launch(self, ahead: Ahead) -> mx.array | None:
        """The logits of the step built ahead, which is now the batch's step; None (and
        the batch untouched) when the batch has changed since it was built."""
        if (self.slots is None or ahead.rids != tuple(self.rids)
                or not self.slots.holds(ahead.before)):
            return None
        self.slots.set_state(ahead.after)
        return ahead.logits

    def step_mixed(self, inputs: list[int], chunks: list[tuple[list[Any], list[int], bool]]
                   ) -> tuple[mx.array, list[mx.array | None]]:
        """One decode step for every row with prompt chunks read in the same forward
        (:func:`appliance.engine.mixed.mixed_step`; lean batches only), evaluated. When it
        raises, the batch's caches and the chunks' are as they were before it."""
        assert len(inputs) == len(self.rids) and self.lean and self.slots is not None
        self.slots.reserve(1)
        caches = [cache for cache, _, _ in chunks]
        saved = save_offsets(caches)
        try:
            logits, lasts = mixed_step(self.model, self.slots.layers, inputs, chunks)
            mx.eval(logits, *(last for last in lasts if last is not None))
        except Exception:
            restore_offsets(caches, saved)
            raise
        self.slots.advance(1)
        return logits, lasts

    def extract(self, rid: int) -> list[Any]:
        """A copy of one row's KV (per layer, without the row's left padding), evaluated."""
        idx = self.rids.index(rid)
        return self.slots.extract(idx) if self.slots is not None else self.merged.extract(idx)

    def remove(self, rids: set[int]) -> None:
        gone = {i for i, rid in enumerate(self.rids) if rid in rids}
        if not gone:
            return
        if self.journal is not None:
            self.journal(["remove", sorted(self.rids[i] for i in gone)])
        if self.slots is not None:
            self.rids = [self.rids[i] for i in self.slots.remove(gone)]
            return
        keep = [i for i in range(len(self.rids)) if i not in gone]
        self.rids = [self.rids[i] for i in keep]
        self.merged.remove(keep)
