"""A sequence's KV cache, kept in float16 where the backend says so (:func:`kv_dtype`).

On the CPU a quantized model computes in float32 (appliance/backend/cpu.py:
``float32_on_cpu``), so mlx-lm's caches would keep its keys and values in float32: twice the
bytes the same model keeps on a Mac (its own 16-bit dtype) or in llama.cpp (float16), read
whole by every decode step. There the backend marks the model, and its caches round keys and
values to float16 as they are written; attention reads them back into float32 (the
appliance's decode kernels convert as they load, a prompt's products cast them). Everything
else is float32 as before.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

MARK = "appliance_kv_dtype"
"""The model attribute the CPU plug sets (appliance/backend/cpu.py: ``adopt``) to the KV
dtype."""


class HalfKV(KVCache):
    """mlx-lm's ``KVCache``, its keys and values rounded to float16 as they are written."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return super().update_and_fetch(keys.astype(mx.float16), values.astype(mx.float16))


class HalfBatchKV(BatchKVCache):
    """mlx-lm's ``BatchKVCache`` (prompts read together), kept in float16 as :class:`HalfKV`."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return super().update_and_fetch(keys.astype(mx.float16), values.astype(mx.float16))


PLAIN = (KVCache, HalfKV)
"""A layer's plain (unwindowed, unquantized) KV cache, in either dtype."""


def kv_dtype(model: Any) -> Any | None:
    """The dtype the model's KV is kept in where it is not the activations' (float16), else
    None: also where a layer keeps a windowed or state-space cache (merged as mlx-lm merges
    them, in the activations' dtype)."""
    mark = getattr(model, MARK, None)
    if mark is None or not all(type(c) is KVCache for c in make_prompt_cache(model)):
        return None
    return mark


def sequence_cache(model: Any) -> list[Any]:
    """A new sequence's per-layer caches (mlx-lm's, in float16 where :func:`kv_dtype` says)."""
    caches = list(make_prompt_cache(model))
    return caches if kv_dtype(model) is None else [HalfKV() for _ in caches]


def batch_cache(model: Any, pads: list[int]) -> list[Any]:
    """Per-layer batched caches for prompts read together, left-padded by ``pads``."""
    kind = BatchKVCache if kv_dtype(model) is None else HalfBatchKV
    return [kind(pads) for _ in make_prompt_cache(model)]


def like(keys: mx.array) -> KVCache:
    """An empty plain cache of ``keys``' dtype (a row taken out of the decode batch)."""
    return HalfKV() if keys.dtype == mx.float16 else KVCache()
