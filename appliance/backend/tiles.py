"""The tiled layout of a quantized weight (appliance/backend/native/quant_kernels.h, "Tiled
4-bit weights"): 16 columns side by side, so that the tiled kernel's vector lanes are
columns. Made from MLX's arrays (:func:`tile`), turned back into them (:func:`untile`),
looked up by rows where the tiles are an embedding's only copy (:func:`lookup`), and
multiplied (:func:`tiled_matmul`). appliance/backend/quant.py decides which layers take it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np

import appliance.backend.fast_ops as fast_ops


class Tiled(NamedTuple):
    """A 4- or 8-bit weight as the tiled kernel reads it (quant_kernels.h, "Tiled 4-bit
    weights")."""

    tiles: mx.array
    """uint8 [ceil(n / 16), k * 8]: 16 columns side by side, 256 bytes a block of 32 (8
    bits: k * 16, 512 bytes)."""
    scales: mx.array
    """[ceil(n / 16), k / group, 16], the dtype MLX stored (zero past n)."""
    biases: mx.array
    n: int
    group_size: int
    bits: int = 4


TILE_PIECE = 1024
"""Rows :func:`tile` converts at a time (a multiple of 16)."""


def tile(w: mx.array, scales: mx.array, biases: mx.array, group_size: int) -> Tiled:
    """MLX's 4-bit ``w`` [n, k / 8] (8-bit: [n, k / 4]) with its scales and biases
    [n, k / group] as tiles."""
    n = w.shape[0]
    bits = 8 if w.shape[1] * 4 == scales.shape[1] * group_size else 4
    k = w.shape[1] * 32 // bits
    t = -(-n // 16)
    packed = np.empty((t, k * 2 * bits), np.uint8)
    # a piece of rows at a time: the whole weight's temporaries were 3-4 times its size,
    # the load's peak (docs/decisions/weights-held-once.md)
    for r0 in range(0, n, TILE_PIECE):
        r1 = min(n, r0 + TILE_PIECE)
        # little-endian words: 4 bits, element 2i low, 2i + 1 high; 8 bits, element i
        raw = np.array(w[r0:r1]).view(np.uint8)
        values = raw if bits == 8 else np.stack((raw & 15, raw >> 4), axis=-1).reshape(r1 - r0, -1)
        p = -(-(r1 - r0) // 16)
        values = np.pad(values, ((0, p * 16 - (r1 - r0)), (0, 0)))
        if bits == 8:  # [tile, column, block, chunk, element] -> [tile, block, chunk, column, element]
            piece = values.reshape(p, 16, k // 32, 16, 2).transpose(0, 2, 3, 1, 4).reshape(p, -1)
        else:
            v = values.reshape(p, 16, k // 32, 8, 4).transpose(0, 2, 3, 1, 4)
            piece = (v[..., 0:2] | (v[..., 2:4] << 4)).astype(np.uint8).reshape(p, -1)
        packed[r0 // 16:r0 // 16 + p] = piece

    def side(a: mx.array) -> mx.array:
        raw = np.array(a.view(mx.uint16) if a.dtype != mx.float32 else a)
        raw = np.pad(raw, ((0, t * 16 - n), (0, 0))).reshape(t, 16, -1).transpose(0, 2, 1)
        out = mx.array(np.ascontiguousarray(raw))
        return out.view(a.dtype) if a.dtype != mx.float32 else out

    return Tiled(mx.array(np.ascontiguousarray(packed)), side(scales), side(biases), n,
                 group_size, bits)


def tiled_matmul(x: mx.array, *parts: Tiled) -> list[mx.array]:
    """``x @ W.T`` for each tiled W (of one K and group size), x rounded to 16 bits once."""
    ext = fast_ops._extension()
    return list(ext.tiled_matmul(x, [p.tiles for p in parts], [p.scales for p in parts],
                                 [p.biases for p in parts], [p.n for p in parts],
                                 parts[0].group_size, None, parts[0].bits))


def untile(t: Tiled) -> tuple[mx.array, mx.array, mx.array]:
    """MLX's arrays (w, scales, biases) from ``t``: :func:`tile` undone (MLX's operations;
    the extension's ``dequantize_tiled`` does this a tile at a time)."""
    rows, k = t.tiles.shape[0], t.tiles.shape[1] // (2 * t.bits)
    if t.bits == 8:  # [tile, chunk, column, element] -> [tile, column, chunk, element]
        raw = t.tiles.reshape(rows, k // 2, 16, 2).transpose(0, 2, 1, 3).reshape(rows * 16, k)
    else:  # a chunk's bytes (4c | 4c + 2, 4c + 1 | 4c + 3) as MLX's (4c | 4c + 1, 4c + 2 | 4c + 3)
        b = t.tiles.reshape(rows, k // 4, 16, 2)
        lo, hi = b[..., 0], b[..., 1]
        pair = mx.stack([(lo & 15) | ((hi & 15) << 4), (lo >> 4) | (hi & 0xF0)], axis=-1)
        raw = pair.transpose(0, 2, 1, 3).reshape(rows * 16, k // 2)
    w = mx.contiguous(raw[:t.n]).view(mx.uint32)

    def side(a: mx.array) -> mx.array:
        return mx.contiguous(a.transpose(0, 2, 1).reshape(rows * 16, -1)[:t.n])

    # left lazy: a model forgotten as another loads (a switch of model) is dropped unread
    return w, side(t.scales), side(t.biases)


def lookup(t: Tiled, ids: mx.array, group_size: int, dtype: Any) -> mx.array:
    """Rows ``ids`` of a tiled embedding, dequantized as ``nn.QuantizedEmbedding`` does
    from MLX's arrays (its words and scales gathered from the tiles, then
    ``mx.dequantize``, the scales in ``dtype``: the same floats)."""
    k = t.tiles.shape[1] // (2 * t.bits)
    groups = t.scales.shape[1]
    flat = ids.reshape(-1).astype(mx.int64)
    tile_of, column = flat // 16, flat % 16
    chunks = k * t.bits // 16  # a column's 2 bytes in each chunk of 32
    at = ((tile_of * t.tiles.shape[1] + 2 * column)[:, None, None]
          + (mx.arange(chunks, dtype=mx.int64) * 32)[None, :, None]
          + mx.arange(2, dtype=mx.int64)[None, None, :])
    b = mx.take(t.tiles.reshape(-1), at)
    if t.bits == 4:
        lo, hi = b[..., 0], b[..., 1]
        b = mx.stack([(lo & 15) | ((hi & 15) << 4), (lo >> 4) | (hi & 0xF0)], axis=-1)
    w = mx.contiguous(b.reshape(flat.size, -1)).view(mx.uint32)
    side_at = (tile_of * (groups * 16) + column)[:, None] + \
        (mx.arange(groups, dtype=mx.int64) * 16)[None, :]
    scales = mx.take(t.scales.reshape(-1), side_at).astype(dtype)
    biases = mx.take(t.biases.reshape(-1), side_at).astype(dtype)
    out = mx.dequantize(w, scales, biases, group_size=group_size, bits=t.bits)
    return out.reshape(*ids.shape, out.shape[-1])


def narrowed(t: Tiled) -> Tiled:
    """An embedding's tiles with its scales and biases in 16 bits where they hold them
    exactly (float32_on_cpu widened them from there): the kernel reads both kinds as the
    same floats, and the lookup widens them again."""
    for dtype in (mx.float16, mx.bfloat16):
        if t.scales.dtype == mx.float32 and all(
                mx.array_equal(a.astype(dtype).astype(mx.float32), a).item()
                for a in (t.scales, t.biases)):
            scales, biases = t.scales.astype(dtype), t.biases.astype(dtype)
            mx.eval(scales, biases)
            return t._replace(scales=scales, biases=biases)
    return t
