"""Prompt chunks read in the decode step's own forward (a mixed batch, as Sarathi-Serve
builds its ticks).

A forward over a few rows costs about as much as reading the model's weights once: on a CPU
a decode step of 8 rows and a 16-token prompt chunk each take most of a weight read, and
run one after the other they take two. :func:`mixed_step` puts the decode batch's rows and
every chunk's tokens through the model's linear layers as the rows of one product (the
weights are read once), and splits them only for attention, where each part keeps its own
KV cache, positions and mask: the decode rows their batched cache, each prompt its own. So
a sequence's KV stays its own, and its numbers are those of its own forward but for the
rounding of the products the rows share (a row's sums do not depend on its neighbours in
appliance/native/skinny_matmul.c's kernel, up to 16 rows; in OpenBLAS's, beyond, they may).

Only architectures whose layers are mlx-lm's Llama block are read this way (:data:`MIXED`:
Llama and the models on it, SmolLM, Mistral; Qwen 2), with plain KV caches; anything else
gets one forward per part (:func:`supports_mixed` says which).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

MIXED = frozenset({"llama", "qwen2"})
"""mlx-lm model modules whose ``Attention.__call__`` is the one :func:`_attention` follows
(projections, heads, RoPE at the cache's offset, the cache's update, attention, output
projection), whose block is ``x + attn(norm(x))``, then ``h + mlp(norm(h))``, and whose
model is ``backbone -> norm -> lm_head`` (or the tied embedding)."""


def supports_mixed(model: Any) -> bool:
    """Whether :func:`mixed_step` can read this model (else: one forward per part)."""
    name = type(model).__module__.rsplit(".", 1)[-1]
    if name not in MIXED or not hasattr(model, "model"):
        return False
    inner = model.model
    layers = getattr(inner, "layers", None)
    if not layers or getattr(inner, "swa_idx", None) is not None:
        return False
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if (attn is None or type(attn).__module__ != type(model).__module__
                or type(attn).__name__ != "Attention"
                or not all(hasattr(layer, a) for a in
                           ("input_layernorm", "post_attention_layernorm", "mlp"))):
            return False
    return True


@dataclass(slots=True)
class Part:
    """One part of a mixed forward: ``rows`` sequences of ``length`` new tokens each over
    their per-layer caches (the decode batch: rows B, length 1; a prompt chunk: 1, n), at
    ``start`` in the forward's tokens."""

    rows: int
    length: int
    cache: list[Any]
    mask: Any
    start: int

    def heads(self, t: mx.array, n: int) -> mx.array:
        """This part's rows of a projection ``t`` [1, T, n * d], as [rows, n, length, d]."""
        rows = t[0, self.start:self.start + self.rows * self.length]
        return rows.reshape(self.rows, self.length, n, -1).transpose(0, 2, 1, 3)


def _attention(attn: Any, x: mx.array, parts: list[Part], layer: int) -> mx.array:
    """mlx-lm's ``Attention.__call__`` with the projections over every part's rows at once
    and the rest per part. ``x``: [1, T, D], the parts' tokens in order."""
    sdpa = sys.modules[type(attn).__module__].scaled_dot_product_attention
    queries, keys, values = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    out = []
    for part in parts:
        cache = part.cache[layer]
        q = attn.rope(part.heads(queries, attn.n_heads), offset=cache.offset)
        k = attn.rope(part.heads(keys, attn.n_kv_heads), offset=cache.offset)
        k, v = cache.update_and_fetch(k, part.heads(values, attn.n_kv_heads))
        o = sdpa(q, k, v, cache=cache, scale=attn.scale, mask=part.mask)
        out.append(o.transpose(0, 2, 1, 3).reshape(1, part.rows * part.length, -1))
    return attn.o_proj(mx.concatenate(out, axis=1))


def mixed_step(model: Any, batch_cache: list[Any], inputs: Sequence[int],
               chunks: Sequence[tuple[list[Any], Sequence[int], bool]]
               ) -> tuple[mx.array, list[mx.array | None]]:
    """One forward of a decode step (``inputs``: each batch row's next token, over
    ``batch_cache``) and prompt chunks (``chunks``: a sequence's per-layer caches, its
    chunk's tokens, whether its last position's logits are wanted). Returns the decode
    rows' logits [B, V] and, per chunk, its last position's logits [1, V] or None (lazy:
    the caller evaluates them). Every cache advances as its own forward would advance it."""
    inner = model.model
    tokens = [*inputs]
    for _, chunk, _ in chunks:
        tokens.extend(chunk)
    h = inner.embed_tokens(mx.array(tokens))[None]
    # The masks from the caches before they grow, as mlx-lm's model does for each forward.
    parts = [Part(len(inputs), 1, batch_cache,
                  create_attention_mask(h[:, :1], batch_cache[0]), 0)]
    start = len(inputs)
    for cache, chunk, _ in chunks:
        parts.append(Part(1, len(chunk), cache,
                          create_attention_mask(h[:, :len(chunk)], cache[0]), start))
        start += len(chunk)
    for i, layer in enumerate(inner.layers):
        h = h + _attention(layer.self_attn, layer.input_layernorm(h), parts, i)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    # The vocabulary projection of the decode rows and of the wanted chunks' last tokens.
    rows = [h[:, :len(inputs)]]
    wanted: list[int] = []
    end = len(inputs)
    for _, chunk, want in chunks:
        end += len(chunk)
        if want:
            wanted.append(len(rows))
            rows.append(h[:, end - 1:end])
    out = inner.norm(mx.concatenate(rows, axis=1) if len(rows) > 1 else rows[0])
    if getattr(model.args, "tie_word_embeddings", False):
        logits = inner.embed_tokens.as_linear(out)[0]
    else:
        logits = model.lm_head(out)[0]
    b = len(inputs)
    lasts: list[mx.array | None] = []
    k = 0
    for _, _, want in chunks:
        if want:
            lasts.append(logits[b + k:b + k + 1])
            k += 1
        else:
            lasts.append(None)
    return logits[:b], lasts


def save_offsets(caches: Sequence[list[Any]]) -> list[list[tuple[Any, ...]]]:
    """What :func:`restore_offsets` needs to undo a forward's cache updates that never ran
    (a forward that raised while being built): each layer's write position."""
    return [[_offset_state(c) for c in cache] for cache in caches]


def restore_offsets(caches: Sequence[list[Any]], saved: list[list[tuple[Any, ...]]]) -> None:
    for cache, states in zip(caches, saved, strict=True):
        for c, state in zip(cache, states, strict=True):
            if type(c) is KVCache:
                c.offset = state[0]
            else:  # BatchKVCache
                c.offset, c._idx = state


def _offset_state(c: Any) -> tuple[Any, ...]:
    return (c.offset,) if type(c) is KVCache else (c.offset, c._idx)
