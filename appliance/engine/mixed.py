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
appliance/backend/native/skinny_matmul.c's kernel, up to 32 rows; in OpenBLAS's, beyond, they may).

Only architectures whose layers are mlx-lm's Llama block are read this way (:data:`MIXED`:
Llama and the models on it, SmolLM, Mistral; Qwen 2), with plain KV caches; anything else
gets one forward per part (:func:`supports_mixed` says which).

The same forward is the plain decode step of those models (no chunks): it computes what
mlx-lm's model computes, bit for bit, with fewer MLX operations, which is most of a
one-row step's cost beyond its products (a one-row step of the SmolLM-135M shape had some
2,500, 120 of them products). The hidden states are 2-D ``[tokens, hidden]``, so no linear
layer flattens and unflattens a 3-D input; each linear weight is transposed once
(:class:`Weights`), not at every call; and decode rows none of which is left-padded get no
mask (a query at the end of its row sees every key anyway).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

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
    module = type(model).__module__
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if (attn is None or type(attn).__module__ != module
                or type(attn).__name__ != "Attention"
                or mlp is None or type(mlp).__module__ != module or type(mlp).__name__ != "MLP"
                or not all(hasattr(layer, a) for a in
                           ("input_layernorm", "post_attention_layernorm"))):
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
    whole: bool = False
    """The only part: its rows are the whole projection (no slice)."""

    def heads(self, t: mx.array, n: int) -> mx.array:
        """This part's rows of a projection ``t`` [T, n * d], as [rows, n, length, d]."""
        rows = t if self.whole else t[self.start:self.start + self.rows * self.length]
        return rows.reshape(self.rows, self.length, n, -1).transpose(0, 2, 1, 3)


class Weights:
    """Every linear layer's weight of a model, transposed once: an evaluated view that
    shares the weight's buffer (no copy), so a forward does not add a transpose to its graph
    for each product (``nn.Linear`` computes ``x @ weight.T`` at every call)."""

    def __init__(self, model: Any) -> None:
        self._t: dict[int, mx.array] = {}
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for linear in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                           mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                if type(linear) is nn.Linear:  # a quantized one keeps its own call
                    self._t[id(linear)] = linear["weight"].T
        mx.eval(list(self._t.values()))

    @staticmethod
    def of(model: Any) -> Weights:
        """The model's transposed weights, made at the first call (kept on the model object,
        as a plain attribute: not a parameter, so it is in no parameter tree)."""
        weights = model.__dict__.get("_appliance_weights")
        if weights is None:
            weights = Weights(model)
            object.__setattr__(model, "_appliance_weights", weights)
        return weights

    def linear(self, linear: Any, x: mx.array) -> mx.array:
        """``linear(x)`` (mlx's ``nn.Linear``: ``x @ W.T``, plus the bias by ``addmm``)."""
        w = self._t.get(id(linear))
        if w is None:
            return linear(x)
        return mx.addmm(linear["bias"], x, w) if "bias" in linear else x @ w


def _attention(weights: Weights, attn: Any, x: mx.array, parts: list[Part], layer: int
               ) -> mx.array:
    """mlx-lm's ``Attention.__call__`` with the projections over every part's rows at once
    and the rest per part. ``x``: [T, D], the parts' tokens in order."""
    sdpa = sys.modules[type(attn).__module__].scaled_dot_product_attention
    queries = weights.linear(attn.q_proj, x)
    keys, values = weights.linear(attn.k_proj, x), weights.linear(attn.v_proj, x)
    out = []
    for part in parts:
        cache = part.cache[layer]
        q = attn.rope(part.heads(queries, attn.n_heads), offset=cache.offset)
        k = attn.rope(part.heads(keys, attn.n_kv_heads), offset=cache.offset)
        k, v = cache.update_and_fetch(k, part.heads(values, attn.n_kv_heads))
        o = sdpa(q, k, v, cache=cache, scale=attn.scale, mask=part.mask)
        out.append(o.transpose(0, 2, 1, 3).reshape(part.rows * part.length, -1))
    return weights.linear(attn.o_proj, out[0] if len(out) == 1 else mx.concatenate(out))


def _mlp(weights: Weights, mlp: Any, x: mx.array) -> mx.array:
    """mlx-lm's Llama and Qwen 2 ``MLP.__call__``: ``down(swiglu(gate(x), up(x)))``."""
    swiglu = sys.modules[type(mlp).__module__].swiglu
    return weights.linear(mlp.down_proj, swiglu(weights.linear(mlp.gate_proj, x),
                                                weights.linear(mlp.up_proj, x)))


def decode_mask(cache: Any, h: mx.array) -> Any:
    """The decode rows' mask (``cache``: layer 0's batched cache); None when no row is
    left-padded, as a query at the end of its row sees every key."""
    return create_attention_mask(h[None, :1], cache)


def mixed_step(model: Any, batch_cache: list[Any], inputs: Sequence[int],
               chunks: Sequence[tuple[list[Any], Sequence[int], bool]]
               ) -> tuple[mx.array, list[mx.array | None]]:
    """One forward of a decode step (``inputs``: each batch row's next token, over
    ``batch_cache``) and prompt chunks (``chunks``: a sequence's per-layer caches, its
    chunk's tokens, whether its last position's logits are wanted; none for a plain decode
    step). Returns the decode rows' logits [B, V] and, per chunk, its last position's
    logits [1, V] or None (lazy: the caller evaluates them). Every cache advances as its
    own forward would advance it."""
    weights = Weights.of(model)
    inner = model.model
    tokens = [*inputs]
    for _, chunk, _ in chunks:
        tokens.extend(chunk)
    h = inner.embed_tokens(mx.array(tokens))
    # The masks from the caches before they grow, as mlx-lm's model does for each forward.
    parts = [Part(len(inputs), 1, batch_cache, decode_mask(batch_cache[0], h), 0,
                  whole=not chunks)]
    start = len(inputs)
    for cache, chunk, _ in chunks:
        parts.append(Part(1, len(chunk), cache,
                          create_attention_mask(h[None, :len(chunk)], cache[0]), start))
        start += len(chunk)
    for i, layer in enumerate(inner.layers):
        h = h + _attention(weights, layer.self_attn, layer.input_layernorm(h), parts, i)
        h = h + _mlp(weights, layer.mlp, layer.post_attention_layernorm(h))
    # The vocabulary projection of the decode rows and of the wanted chunks' last tokens.
    b = len(inputs)
    rows = [h[:b] if chunks else h]
    end = b
    for _, chunk, want in chunks:
        end += len(chunk)
        if want:
            rows.append(h[end - 1:end])
    out = inner.norm(mx.concatenate(rows) if len(rows) > 1 else rows[0])
    if getattr(model.args, "tie_word_embeddings", False):
        logits = inner.embed_tokens.as_linear(out)
    else:
        logits = model.lm_head(out)
    lasts: list[mx.array | None] = []
    k = b
    for _, _, want in chunks:
        if want:
            lasts.append(logits[k:k + 1])
            k += 1
        else:
            lasts.append(None)
    return (logits[:b] if len(rows) > 1 else logits), lasts


def save_offsets(caches: Sequence[list[Any]]) -> list[list[int]]:
    """What :func:`restore_offsets` needs to undo a forward's cache updates that never ran
    (a forward that raised while being built): each layer's write position, for
    sequences' own plain caches (the decode batch moves on only after its forward, see
    appliance/engine/slots.py)."""
    return [[c.offset for c in cache] for cache in caches]


def restore_offsets(caches: Sequence[list[Any]], saved: list[list[int]]) -> None:
    for cache, offsets in zip(caches, saved, strict=True):
        for c, offset in zip(cache, offsets, strict=True):
            c.offset = offset
