"""The decode batch: one row per decoding sequence over mlx-lm's batched KV caches.

Each sequence is prefilled alone into its own per-layer caches (so its KV is isolated and its
numbers do not depend on its neighbours), then merged into the batch with
``BatchKVCache.merge``/``extend``; finished or preempted rows leave with ``filter``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from appliance.engine.mixed import mixed_step, restore_offsets, save_offsets, supports_mixed

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
    return list(make_prompt_cache(model))


def plain_kv(model: Any) -> bool:
    """Whether every layer keeps a plain KV cache (then prompts can be prefilled together)."""
    return all(type(c) is KVCache for c in make_prompt_cache(model))


def prefill_batch(model: Any, prompts: list[list[int]]) -> tuple[list[Any], mx.array]:
    """Whole prompts through the model at once, left-padded to the longest; returns the
    batched per-layer caches (one row per prompt) and each row's last-position logits."""
    longest = max(len(p) for p in prompts)
    pads = [longest - len(p) for p in prompts]
    x = mx.array([[0] * pad + p for pad, p in zip(pads, prompts, strict=True)])
    cache = [BatchKVCache(pads) for _ in make_prompt_cache(model)]
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


class DecodeBatch:
    def __init__(self, model: Any) -> None:
        self.model = model
        self.rids: list[int] = []
        self._caches: list[Any] | None = None
        self.lean = supports_mixed(model) and plain_kv(model)
        """Decode steps run :func:`~appliance.engine.mixed.mixed_step` (the same numbers as
        the model's own forward, with fewer MLX operations) instead of the model's call."""

    def __len__(self) -> int:
        return len(self.rids)

    @property
    def padded_len(self) -> int:
        """KV positions every row holds (rows are left-padded to the longest)."""
        return int(self._caches[0].size()) if self._caches and self.rids else 0

    @property
    def nbytes(self) -> int:
        return cache_nbytes(self._caches)

    def add(self, rid: int, cache: list[Any]) -> None:
        merged = [c.merge([c]) for c in cache]
        if self._caches is None or not self.rids:
            self._caches = merged
        else:
            for mine, theirs in zip(self._caches, merged, strict=True):
                mine.extend(theirs)
        self.rids.append(rid)

    def add_rows(self, rids: list[int], cache: list[Any], keep: list[int]) -> None:
        """Rows ``keep`` of a batched prefill cache join the batch as ``rids``."""
        if len(keep) < len(cache[0].offset):
            for c in cache:
                c.filter(keep)
        if self._caches is None or not self.rids:
            self._caches = cache
        else:
            for mine, theirs in zip(self._caches, cache, strict=True):
                mine.extend(theirs)
        self.rids.extend(rids)

    def step(self, inputs: list[int]) -> mx.array:
        """One decode step for every row; returns logits [B, V] (lazy)."""
        assert len(inputs) == len(self.rids)
        if self.lean:
            assert self._caches is not None
            return mixed_step(self.model, self._caches, inputs, [])[0]
        logits = self.model(mx.array(inputs)[:, None], cache=self._caches)
        return logits[:, -1, :]

    def step_mixed(self, inputs: list[int], chunks: list[tuple[list[Any], list[int], bool]]
                   ) -> tuple[mx.array, list[mx.array | None]]:
        """One decode step for every row with prompt chunks read in the same forward
        (:func:`appliance.engine.mixed.mixed_step`), evaluated. When it raises, the batch's
        caches and the chunks' are as they were before it."""
        assert len(inputs) == len(self.rids) and self._caches is not None
        caches = [self._caches, *(cache for cache, _, _ in chunks)]
        saved = save_offsets(caches)
        try:
            logits, lasts = mixed_step(self.model, self._caches, inputs, chunks)
            mx.eval(logits, *(last for last in lasts if last is not None))
        except Exception:
            restore_offsets(caches, saved)
            raise
        return logits, lasts

    def extract(self, rid: int) -> list[Any]:
        """A copy of one row's KV (per layer, without the row's left padding)."""
        assert self._caches is not None
        idx = self.rids.index(rid)
        rows = [c.extract(idx) for c in self._caches]
        # Evaluated now: mlx-lm's copy is lazy, and until it runs it holds the whole batch's
        # KV (every row, every layer). Kept so in the prompt cache, those buffers stayed
        # alive after the batch moved on, and decode steps beside them took 3-6x as long.
        mx.eval([c.state for c in rows])
        return rows

    def remove(self, rids: set[int]) -> None:
        keep = [i for i, rid in enumerate(self.rids) if rid not in rids]
        if len(keep) == len(self.rids):
            return
        self.rids = [self.rids[i] for i in keep]
        if not keep:
            self._caches = None
            return
        assert self._caches is not None
        for c in self._caches:
            c.filter(keep)
