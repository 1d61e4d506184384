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
appliance/backend/native/skinny_matmul.c's kernel, nor in quant_matmul.cpp's for 4- and 8-bit
weights, up to 32 rows; in OpenBLAS's, which both hand bigger products to, they may).

The architectures read this way are mlx-lm's modules in :data:`ARCHS`, each described by
a few hooks (projections, q/k norms, MLP, how a block adds its parts, its masks): Llama and
the models on it (Llama 3.x, SmolLM, Mistral), Qwen 2 and 3, Phi-3 and Gemma 3 text. Anything
else gets one forward per part (:func:`supports_mixed` says which). The engine rides only
models whose layers all keep plain KV caches; Gemma 3's sliding-window layers keep rotating
ones, so it goes one forward per part there (docs/models.md).

The same forward is the plain decode step of those models (no chunks): it computes what
mlx-lm's model computes, bit for bit, with fewer MLX operations, which is most of a
one-row step's cost beyond its products (a one-row step of the SmolLM-135M shape had some
2,500, 120 of them products). The hidden states are 2-D ``[tokens, hidden]``, so no linear
layer flattens and unflattens a 3-D input; each linear weight is transposed once
(:class:`Weights`), not at every call; and decode rows none of which is left-padded get no
mask (a query at the end of its row sees every key anyway). What is device-specific comes
through the model's plug (appliance/backend/plug.py, ``plug.of``): its batched quantized
products, and, where the device has a layer's step in one operation (the CPU's tiled 4-bit
pre-norm layers), each layer of a decode step, chunks riding or not, as that operation.
This module names no device module (scripts/layers.py's door rule).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from appliance.backend import plug
from appliance.engine.kvcache import PLAIN

Projections = Callable[["Weights", Any, mx.array], tuple[mx.array, mx.array, mx.array]]
Mlp = Callable[["Weights", Any, mx.array, "mx.array | None"], mx.array]
Sublayer = Callable[[mx.array, "mx.array | None"], mx.array]
"""A block's attention or MLP: ``part(x, residual)`` is ``residual + part(x)`` (or ``part(x)``
with no residual), the add made in the last product's own operation where it can be."""
Block = Callable[[Any, mx.array, Sublayer, Sublayer], mx.array]


@dataclass(frozen=True, slots=True)
class Arch:
    """How one mlx-lm model module computes its forward, in the pieces :func:`mixed_step`
    runs over every part's rows at once (each piece follows that module's code exactly)."""

    projections: Projections
    """The attention's queries, keys and values, [T, heads * head_dim] each."""
    mlp: Mlp
    block: Block
    """A layer from its attention and MLP: ``block(layer, h, attend, mlp)``."""
    masks: Callable[[Any, mx.array, list[Any]], list[Any]]
    """Each layer's attention mask for one part (hidden [rows, length, D], its caches), made
    from the caches before they grow, as the module's model makes them."""
    linears: tuple[str, ...]
    """The attention's and the MLP's linear layers, by attribute name."""
    norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    """The block's norms, by attribute name."""
    qk_norm: bool = False
    """Queries and keys go through ``q_norm``/``k_norm`` over each head before RoPE."""
    embed_scale: bool = False
    """The embedding is scaled by sqrt(hidden) (Gemma, rounded through bfloat16 as it does)."""


def _separate(weights: Weights, attn: Any, x: mx.array
              ) -> tuple[mx.array, mx.array, mx.array]:
    q, k, v = weights.products(attn, ("q_proj", "k_proj", "v_proj"), x)
    return q, k, v


def _fused(weights: Weights, attn: Any, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """Phi-3's ``qkv_proj``: queries, then keys, then values along the last axis."""
    qkv = weights.linear(attn.qkv_proj, x)
    q = attn.n_heads * attn.head_dim
    k = q + attn.n_kv_heads * attn.head_dim
    return qkv[:, :q], qkv[:, q:k], qkv[:, k:]


def _swiglu(weights: Weights, mlp: Any, x: mx.array, residual: mx.array | None) -> mx.array:
    """``down(swiglu(gate(x), up(x)))`` (Llama, Qwen 2 and 3)."""
    swiglu = sys.modules[type(mlp).__module__].swiglu
    gate, up = weights.products(mlp, ("gate_proj", "up_proj"), x)
    return weights.linear(mlp.down_proj, swiglu(gate, up), residual)


def _swiglu_fused(weights: Weights, mlp: Any, x: mx.array, residual: mx.array | None
                  ) -> mx.array:
    """Phi-3's ``gate_up_proj``: the gate's half first."""
    swiglu = sys.modules[type(mlp).__module__].swiglu
    gate, up = mx.split(weights.linear(mlp.gate_up_proj, x), 2, axis=-1)
    return weights.linear(mlp.down_proj, swiglu(gate, up), residual)


def _gelu(weights: Weights, mlp: Any, x: mx.array, residual: mx.array | None) -> mx.array:
    """Gemma 3's ``down(gelu_approx(gate(x)) * up(x))``."""
    return weights.linear(mlp.down_proj, nn.gelu_approx(weights.linear(mlp.gate_proj, x))
                          * weights.linear(mlp.up_proj, x), residual)


def _pre_norm(layer: Any, h: mx.array, attend: Sublayer, mlp: Sublayer) -> mx.array:
    h = attend(layer.input_layernorm(h), h)  # h + attention
    return mlp(layer.post_attention_layernorm(h), h)


def _sandwich(layer: Any, h: mx.array, attend: Sublayer, mlp: Sublayer) -> mx.array:
    """Gemma 3: a norm before and after each of attention and MLP, residuals clipped in
    float16 (its module's ``clip_residual``)."""
    clip = sys.modules[type(layer).__module__].clip_residual
    h = clip(h, layer.post_attention_layernorm(attend(layer.input_layernorm(h), None)))
    return clip(h, layer.post_feedforward_layernorm(mlp(layer.pre_feedforward_layernorm(h),
                                                        None)))


def _one_mask(inner: Any, h: mx.array, cache: list[Any]) -> list[Any]:
    return [create_attention_mask(h, cache[0])] * len(cache)


def _windowed_masks(inner: Any, h: mx.array, cache: list[Any]) -> list[Any]:
    """Gemma 3: every ``sliding_window_pattern``-th layer global, the rest in a window."""
    pattern = inner.sliding_window_pattern
    full = create_attention_mask(h, cache[pattern - 1])
    window = create_attention_mask(h, cache[0], window_size=inner.window_size) \
        if pattern > 1 else None
    return [full if i % pattern == pattern - 1 else window for i in range(len(cache))]


_LLAMA = Arch(_separate, _swiglu, _pre_norm, _one_mask,
              ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
ARCHS: dict[str, Arch] = {
    "llama": _LLAMA,  # also Mistral (mlx-lm maps model_type mistral here), SmolLM
    "qwen2": _LLAMA,
    "qwen3": Arch(_separate, _swiglu, _pre_norm, _one_mask, _LLAMA.linears, qk_norm=True),
    "phi3": Arch(_fused, _swiglu_fused, _pre_norm, _one_mask,
                 ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
    "gemma3_text": Arch(_separate, _gelu, _sandwich, _windowed_masks, _LLAMA.linears,
                        ("input_layernorm", "post_attention_layernorm",
                         "pre_feedforward_layernorm", "post_feedforward_layernorm"),
                        qk_norm=True, embed_scale=True),
}
"""mlx-lm model modules :func:`mixed_step` reads, each a model ``embedding -> blocks ->
norm -> lm_head`` (or the tied embedding) whose ``Attention.__call__`` is projections,
heads (then q/k norms), RoPE at the cache's offset, the cache's update, attention and the
output projection."""

MIXED = frozenset(ARCHS)

def _arch(model: Any) -> Arch | None:
    return ARCHS.get(type(model).__module__.rsplit(".", 1)[-1])


def supports_mixed(model: Any) -> bool:
    """Whether :func:`mixed_step` can read this model (else: one forward per part). The
    engine rides only models whose layers all keep plain KV caches besides (its decode
    batch's slots hold no rotating cache): Gemma 3's sliding-window layers do not."""
    arch = _arch(model)
    if arch is None or not hasattr(model, "model"):
        return False
    inner = model.model
    layers = getattr(inner, "layers", None)
    if not layers or getattr(inner, "swa_idx", None) is not None:
        return False  # Llama's own sliding-window layers (layer_types) are not followed
    module = type(model).__module__
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if (attn is None or type(attn).__module__ != module
                or type(attn).__name__ != "Attention"
                or mlp is None or type(mlp).__module__ != module or type(mlp).__name__ != "MLP"
                or not all(hasattr(layer, a) for a in arch.norms)
                or not all(hasattr(attn, a) or hasattr(mlp, a) for a in arch.linears)):
            return False
    return True


@dataclass(slots=True)
class Part:
    """One part of a mixed forward: ``rows`` sequences of ``length`` new tokens each over
    their per-layer caches (the decode batch: rows B, length 1; a prompt chunk: 1, n), at
    ``start`` in the forward's tokens, with each layer's mask."""

    rows: int
    length: int
    cache: list[Any]
    masks: list[Any]
    start: int
    whole: bool = False
    """The only part: its rows are the whole projection (no slice)."""

    def heads(self, t: mx.array, n: int) -> mx.array:
        """This part's rows of a projection ``t`` [T, n * d], as [rows, n, length, d]."""
        rows = t if self.whole else t[self.start:self.start + self.rows * self.length]
        if self.length == 1:  # the same order: a transpose would only add a graph node
            return rows.reshape(self.rows, n, 1, -1)
        return rows.reshape(self.rows, self.length, n, -1).transpose(0, 2, 1, 3)


class Weights:
    """Every linear layer's weight of a model, transposed once: an evaluated view that
    shares the weight's buffer (no copy), so a forward does not add a transpose to its graph
    for each product (``nn.Linear`` computes ``x @ weight.T`` at every call)."""

    def __init__(self, model: Any, names: tuple[str, ...],
                 forward: plug.Forward | None = None) -> None:
        self._t: dict[int, mx.array] = {}
        self._forward = forward
        self._products = None if forward is None else forward.products
        """The device's batched quantized products (the plug's), if it has them."""
        for layer in model.model.layers:
            for owner in (layer.self_attn, layer.mlp):
                for name in names:
                    linear = getattr(owner, name, None)
                    if type(linear) is nn.Linear:  # a quantized one keeps its own call
                        self._t[id(linear)] = linear["weight"].T
        mx.eval(list(self._t.values()))

    @staticmethod
    def of(model: Any, names: tuple[str, ...], forward: plug.Forward) -> Weights:
        """The model's transposed weights, made at the first call (kept on the model object,
        as a plain attribute: not a parameter, so it is in no parameter tree), with
        ``forward``'s products (read again when another plug has adopted the model since)."""
        weights = model.__dict__.get("_appliance_weights")
        if weights is None:
            weights = Weights(model, names, forward)
            object.__setattr__(model, "_appliance_weights", weights)
        elif weights._forward is not forward:
            weights._forward, weights._products = forward, forward.products
        return weights

    def linear(self, linear: Any, x: mx.array, residual: mx.array | None = None) -> mx.array:
        """``linear(x)`` (mlx's ``nn.Linear``: ``x @ W.T``, plus the bias by ``addmm``), and
        ``residual + linear(x)`` with a residual (a 4-bit layer's product adds it in its own
        operation: an MLX operation less a layer, the same bits)."""
        w = self._t.get(id(linear))
        if w is None:
            done = None if self._products is None else self._products(x, (linear,), residual)
            if done is not None:
                return done[0]
            y = linear(x)
        else:
            y = mx.addmm(linear["bias"], x, w) if "bias" in linear else x @ w
        return y if residual is None else residual + y

    def products(self, owner: Any, names: tuple[str, ...], x: mx.array) -> list[mx.array]:
        """``[linear(owner.<name>, x) for name in names]``: one operation where the
        backend took them as one group of quantized siblings (the operation their first
        call through mlx-lm would make, without the calls' Python)."""
        linears = tuple(owner[name] for name in names)
        done = None if id(linears[0]) in self._t or self._products is None \
            else self._products(x, linears)
        return [self.linear(linear, x) for linear in linears] if done is None else done


def _per_head(norm: Any, t: mx.array, n: int) -> mx.array:
    """``norm`` over each head's slice of a projection [T, n * d]."""
    return norm(t.reshape(t.shape[0], n, -1)).reshape(t.shape[0], -1)


def _attention(arch: Arch, weights: Weights, attn: Any, x: mx.array,
               residual: mx.array | None, *, parts: list[Part], layer: int) -> mx.array:
    """mlx-lm's ``Attention.__call__`` with the projections (and q/k norms) over every
    part's rows at once and the rest per part (plus ``residual``). ``x``: [T, D], the
    parts' tokens in order."""
    sdpa = sys.modules[type(attn).__module__].scaled_dot_product_attention
    queries, keys, values = arch.projections(weights, attn, x)
    if arch.qk_norm:
        queries = _per_head(attn.q_norm, queries, attn.n_heads)
        keys = _per_head(attn.k_norm, keys, attn.n_kv_heads)
    out = []
    for part in parts:
        cache = part.cache[layer]
        q = attn.rope(part.heads(queries, attn.n_heads), offset=cache.offset)
        k = attn.rope(part.heads(keys, attn.n_kv_heads), offset=cache.offset)
        k, v = cache.update_and_fetch(k, part.heads(values, attn.n_kv_heads))
        o = sdpa(q, k, v, cache=cache, scale=attn.scale, mask=part.masks[layer])
        out.append(o.reshape(part.rows, -1) if part.length == 1 else
                   o.transpose(0, 2, 1, 3).reshape(part.rows * part.length, -1))
    return weights.linear(attn.o_proj, out[0] if len(out) == 1 else mx.concatenate(out),
                          residual)


def _room(cache: KVCache, n: int, like: mx.array) -> tuple[mx.array, mx.array]:
    """A sequence's buffers with room for ``n`` more positions, grown as mlx-lm's
    ``KVCache.update_and_fetch`` grows them (``like``: the layer's keys' dtype and sizes)."""
    prev, keys, values = cache.offset, cache.keys, cache.values
    if keys is None or values is None or prev + n > keys.shape[2]:
        shape = (1, like.shape[1], (cache.step + n - 1) // cache.step * cache.step,
                 like.shape[3])
        new_k, new_v = mx.zeros(shape, like.dtype), mx.zeros(shape, like.dtype)
        if keys is None or values is None:
            keys, values = new_k, new_v
        else:
            if prev % cache.step:
                keys, values = keys[..., :prev, :], values[..., :prev, :]
            keys = mx.concatenate([keys, new_k], axis=2)
            values = mx.concatenate([values, new_v], axis=2)
        cache.keys, cache.values = keys, values
    return keys, values


def _decode_layer(fused: plug.DecodeLayer, layer: Any, h: mx.array, parts: list[Part], i: int
                  ) -> mx.array | None:
    """Layer ``i`` of a decode step in one operation, with any prompt chunks riding in it,
    every cache's buffers written as ``update_and_fetch`` writes them; None where it cannot
    be (the caller goes on as before). A decode part of several tokens a row is a verify:
    each row's tokens go as its span."""
    part, chunks = parts[0], parts[1:]
    cache = part.cache[i]
    window = getattr(cache, "decode_window", None)  # a slot cache's (appliance/engine/slots.py)
    found = window() if window is not None else None
    span = part.length
    if (layer is None or found is None or h.dtype != mx.float32
            or (span > 1 and chunks)
            or found[0].dtype not in (mx.float32, mx.float16)
            or any(type(c.cache[i]) not in PLAIN or c.masks[i] not in (None, "causal")
                   or (c.cache[i].keys is not None and c.cache[i].keys.dtype != found[0].dtype)
                   for c in chunks)):
        return None  # before a chunk's buffers grow: the old way grows them as it would
    keys, values, at, first = found
    riding = [(*_room(c.cache[i], c.length, keys), c.cache[i].offset, c.length) for c in chunks]
    mask = part.masks[i]
    if span > 1 and mask is not None and mask.ndim < 4:
        mask = None  # causal, no row padded: the span's own order
    out = fused.step(layer, h, keys, values, cache.offset, mask, at, first, riding, span)
    if out is None:
        return None
    cache.took(out[1], out[2])
    for c, k, v in zip(chunks, out[3::2], out[4::2], strict=True):
        own = c.cache[i]
        own.keys, own.values = k, v
        own.offset += c.length
    return out[0]


def decode_mask(cache: Any, h: mx.array) -> Any:
    """The decode rows' mask (``cache``: layer 0's batched cache); None when no row is
    left-padded, as a query at the end of its row sees every key."""
    return create_attention_mask(h[None, :1], cache)


def _embed(arch: Arch, inner: Any, tokens: list[int]) -> mx.array:
    h = inner.embed_tokens(mx.array(tokens))
    if arch.embed_scale:
        h = h * mx.array(inner.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)
    return h


def mixed_step(model: Any, batch_cache: list[Any] | None, inputs: Sequence[int],
               chunks: Sequence[tuple[list[Any], Sequence[int], bool]], *,
               span: int = 1) -> tuple[mx.array, list[mx.array | None]]:
    """One forward of a decode step (``inputs``: each batch row's next token, over
    ``batch_cache``; none: the chunks alone) and prompt chunks (``chunks``: a sequence's
    per-layer caches, its chunk's tokens, whether its last position's logits are wanted;
    none for a plain decode step). Returns the decode rows' logits [B, V] and, per chunk, its
    last position's logits [1, V] or None (lazy: the caller evaluates them). Every cache
    advances as its own forward would advance it. ``span`` > 1 (a verify,
    appliance/engine/lookup.py; no chunks): ``inputs`` are ``span`` tokens a row, row by
    row, and the logits are every position's, [B * span, V].

    A model split across machines (appliance/distributed) carries its :class:`Stage`: the
    first stage embeds, runs its layers, passes the hidden states on and gets the last
    stage's back for the head; a later stage receives them instead of embedding (the
    tokens are then placeholders of the right count) and returns what it passes on, with
    no logits."""
    arch = _arch(model)
    assert arch is not None, "mixed_step of a model supports_mixed refuses"
    stage = model.__dict__.get("_appliance_stage")
    forward = plug.of(model)
    weights = Weights.of(model, arch.linears, forward)
    inner = model.model
    tokens = [*inputs]
    for _, chunk, _ in chunks:
        tokens.extend(chunk)
    h = _embed(arch, inner, tokens) if stage is None or stage.first \
        else stage.receive(len(tokens))
    # The masks from the caches before they grow, as mlx-lm's model does for each forward.
    b = len(inputs)  # an array's truth is ambiguous: the look-ahead's tokens are one
    parts = []
    if b:
        assert batch_cache is not None
        assert span == 1 or not chunks, "a verify reads no prompt chunks"
        parts.append(Part(b // span, span, batch_cache,
                          arch.masks(inner, h[None, :span], batch_cache), 0, whole=not chunks))
    start = len(inputs)
    for cache, chunk, _ in chunks:
        parts.append(Part(1, len(chunk), cache,
                          arch.masks(inner, h[None, :len(chunk)], cache), start,
                          whole=not b and len(chunks) == 1))
        start += len(chunk)
    # A decode step's layers, chunks riding or not, in one operation each where the device
    # has it (for at most the rows it takes); a verify's too.
    op = forward.decode_layer
    fused = op.plan(model, arch.qk_norm) \
        if op is not None and b and arch.block is _pre_norm and len(tokens) <= op.rows else None
    for i, layer in enumerate(inner.layers):
        done = None if fused is None or op is None else _decode_layer(op, fused[i], h, parts, i)
        if done is not None:
            h = done
            continue
        attn, mlp = layer.self_attn, layer.mlp
        h = arch.block(layer, h, partial(_attention, arch, weights, attn, parts=parts, layer=i),
                       partial(arch.mlp, weights, mlp))
    if stage is not None:
        h = stage.pass_on(h)
        if not stage.first:
            return h, []
    # The vocabulary projection of the decode rows and of the wanted chunks' last tokens.
    rows = [h[:b] if chunks else h] if b else []
    end = b
    for _, chunk, want in chunks:
        end += len(chunk)
        if want:
            rows.append(h[end - 1:end])
    if not rows:
        return h[:0], [None] * len(chunks)
    out = inner.norm(mx.concatenate(rows) if len(rows) > 1 else rows[0])
    # Tied models have no lm_head (mlx-lm's Gemma 3 pops it at load when the file has none).
    head = getattr(model, "lm_head", None)
    logits = inner.embed_tokens.as_linear(out) if head is None else head(out)
    lasts: list[mx.array | None] = []
    k = b
    for _, _, want in chunks:
        if want:
            lasts.append(logits[k:k + 1])
            k += 1
        else:
            lasts.append(None)
    return (logits[:b] if len(rows) > 1 or not b else logits), lasts


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
