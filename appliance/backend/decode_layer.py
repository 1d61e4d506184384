"""A decoder layer's decode step in one MLX operation on the CPU
(appliance/backend/native/decode_layer.cpp, whose header says why: MLX's eval handles some
twenty nodes a layer one by one on the engine's thread, and cannot walk ahead of more than a
few).

:func:`plan` reads a loaded model's layers once: those it takes are pre-norm Llama, Qwen 2
and Qwen 3 blocks (mlx-lm's modules: RMSNorm, nn.RoPE or Llama 3's RoPE, attention with or
without q/k/v biases or q/k norms, SwiGLU) whose seven linear layers the quantized kernel
adopted as tiles, 4- or 8-bit each as a Q4_K_M file mixes them
(:func:`appliance.backend.quant.tiled_args`), with the fast operations installed, so the
operation computes what the operations one by one compute, bit for bit. Prompt chunks
may ride in the step (their own sequences' plain KV caches): the decode rows keep those
bits, a chunk's attention is summed in another order than the matrix products of its own
forward. Any other layer, and any step whose decode rows are not over a slot cache's
buffers, goes the way it went before (appliance/engine/mixed.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import Llama3RoPE

from appliance.backend import fast_ops, quant

_ATTR = "_appliance_decode_layers"


class Layer(NamedTuple):
    """One layer as the operation takes it."""

    native: Any
    """The extension's ``DecodeLayerWeights``: its arrays and shape, checked once."""
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int


def _norm(module: Any) -> bool:
    return type(module) is nn.RMSNorm and module["weight"].dtype == mx.float32


def _rope(rope: Any) -> tuple[mx.array, float] | None:
    """The inverse frequencies and position scale ``mx.fast.rope`` gets from nn.RoPE or
    mlx-lm's Llama 3 RoPE (the same arrays the fast operation would make), else None."""
    if type(rope) is nn.RoPE and rope.base is not None:
        inv = fast_ops._extension().rope_inv_freq(rope.dims // 2, float(rope.base))
        return inv, float(rope.scale)
    if type(rope) is Llama3RoPE:
        inv = mx.reciprocal(rope._freqs.astype(mx.float32))
        mx.eval(inv)
        return inv, 1.0
    return None


def _tiled(linears: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """``quant.tiled_args`` of ``linears``, adopted as one group or each alone (a Q4_K_M
    file's v_proj is 8-bit beside a 4-bit q and k, so they are no group): tiles, scales,
    biases, n's, group size; None unless every one is tiled, with one group size."""
    whole = quant.tiled_args(linears)
    if whole is not None or len(linears) == 1:
        return whole
    parts = [p for x in linears if (p := quant.tiled_args((x,))) is not None]
    if len(parts) != len(linears) or len({p[4] for p in parts}) != 1:
        return None
    return (*([a for p in parts for a in p[i]] for i in range(4)), parts[0][4])


def _layer(layer: Any, qk_norm: bool) -> Layer | None:
    try:
        attn, mlp = layer.self_attn, layer.mlp
        norms: list[Any] = [layer.input_layernorm, layer.post_attention_layernorm]
        qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
        rest = (attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        qk: list[Any] = [attn.q_norm, attn.k_norm] if qk_norm else []
    except AttributeError:  # another block (Phi-3's fused projections, ...)
        return None
    rope = _rope(attn.rope)
    biased = ["bias" in x for x in qkv]
    if (rope is None or not all(_norm(n) for n in norms + qk) or any("bias" in x for x in rest)
            or (qk and qk[0].eps != qk[1].eps)
            or (any(biased) and not (all(biased)
                                     and all(x["bias"].dtype == mx.float32 for x in qkv)))):
        return None
    groups = [_tiled(g) for g in (qkv, rest[:1], rest[1:3], rest[3:])]
    linears: list[mx.array] = []
    widths: list[int] = []
    sizes = set()
    for g in groups:
        if g is None or any(n % 16 for n in g[3]):
            return None  # every layer tiled, in whole tiles (the operation's shapes)
        tiles, scales, biases, ns, group_size = g
        widths += ns
        sizes.add(group_size)
        for t, s, b in zip(tiles, scales, biases, strict=True):
            linears += [t, s, b]
    if len(sizes) != 1:
        return None
    head_dim = widths[0] // attn.n_heads  # q's outputs, a head's each
    try:
        native = fast_ops._extension().decode_layer_weights(
            [n["weight"] for n in norms], [n["weight"] for n in qk],
            [x["bias"] for x in qkv] if any(biased) else [], linears, sizes.pop(), attn.n_heads,
            attn.n_kv_heads, head_dim, attn.rope.dims, attn.rope.traditional, *rope,
            float(attn.scale), [norms[0].eps, norms[1].eps, qk[0].eps if qk else 0.0])
    except ValueError:  # shapes the operation does not take
        return None
    return Layer(native, int(norms[0]["weight"].shape[0]), attn.n_heads, attn.n_kv_heads,
                 head_dim)


def plan(model: Any, qk_norm: bool) -> list[Layer | None] | None:
    """Each layer of ``model.model.layers`` as :func:`step` takes it, or None where it does
    not; None for the whole model where the operation is not here. Made at the first call and
    kept on the model (a plain attribute, in no parameter tree)."""
    if not (quant.installed() and fast_ops.installed()):
        return None
    made = model.__dict__.get(_ATTR)
    if made is None:
        ext = fast_ops._extension()
        layers = [_layer(layer, qk_norm) for layer in model.model.layers] \
            if hasattr(ext, "decode_layer") else []
        made = layers if any(x is not None for x in layers) else []
        object.__setattr__(model, _ATTR, made)
    return made or None


def step(layer: Layer, h: mx.array, keys: mx.array, values: mx.array, offset: mx.array,
         mask: mx.array | None, at: int, first: int,
         chunks: Sequence[tuple[mx.array, mx.array, int, int]] = (), span: int = 1
         ) -> list[mx.array] | None:
    """``h`` [B, D] through the layer, its new keys and values written at ``at`` of rows
    0..B-1 of the buffers [R, KV, W, d], attention over ``first..at``: [h, keys, values].
    None where the step's arrays are not the operation's (another dtype).

    ``chunks``: prompt chunks riding in the step, each (keys, values, offset, length) of its
    sequence's buffers [1, KV, W, d] with room for its tokens, which are rows after the B of
    ``h``; their keys and values follow in the result, written at offset.. (their queries
    attend causally over their own sequence).

    ``span`` > 1: the first ``span`` rows of ``h`` are one row's tokens (a verify of drafts,
    appliance/engine/lookup.py), written at ``at..`` of buffer row 0, token ``i`` attending
    over ``first..at + i`` (no mask): each gets the bits a plain step at its position gets."""
    if (h.dtype != mx.float32 or keys.dtype not in (mx.float32, mx.float16)
            or values.dtype != keys.dtype or offset.dtype != mx.int32
            or any(k.dtype != keys.dtype or v.dtype != keys.dtype for k, v, _, _ in chunks)):
        return None
    return fast_ops._extension().decode_layer(
        h, keys, values, offset, mask, layer.native, at, first,
        [a for k, v, _, _ in chunks for a in (k, v)], [c[2] for c in chunks],
        [c[3] for c in chunks], span)
