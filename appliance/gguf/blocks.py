"""GGUF quantized blocks as MLX's affine quantization, from the file's own codes and scales.

MLX's affine layout (``w = scale * q + bias`` over groups of 32, codes packed little-end
first in uint32 words) holds most of llama.cpp's block types as they are:

- Q4_0, Q4_1 and Q4_K are affine 4-bit groups of 32 (Q4_K: a super-block of 256 is eight
  sub-blocks with scale ``d * sc`` and bias ``-dmin * m``): 4-bit, the file's codes.
- Q8_0, Q5_0, Q5_1, Q5_K, IQ4_NL and IQ4_XS are affine groups of 32 whose codes fit in 8
  bits (IQ4's non-linear table is 16 integers in -127..113): 8-bit, the file's codes.
- Q6_K has a scale per 16 weights: 8-bit groups of 32 at a quarter of the larger scale of the
  pair, so that half is exact and the other is rounded to a quarter of its 6-bit step.
- Anything else gguf-py can read (Q2_K, Q3_K, the IQ2/IQ3 types...) is dequantized by its
  reference code and quantized again to 8-bit.

Only the scales and biases are rounded, to float16 as MLX keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from appliance.gguf.meta import ImportRefused

GROUP = 32
"""Weights per MLX group: GGUF's 32-weight blocks and sub-blocks."""
SAME = {"Q4_0", "Q4_1", "Q4_K", "Q8_0"}
"""Types that are MLX affine groups of their own width."""
EXACT_WIDE = {"Q5_0", "Q5_1", "Q5_K", "IQ4_NL", "IQ4_XS"}
"""Types whose codes MLX's 8-bit groups hold as they are."""
JOINED = {"Q6_K"}
"""Types with 16-weight scales, joined in pairs (half of each group exact)."""
IQ4_VALUES = np.array((-127, -104, -83, -65, -49, -35, -22, -10,
                       1, 13, 25, 38, 53, 69, 89, 113), np.int16)


@dataclass(frozen=True, slots=True)
class Affine:
    weight: np.ndarray
    """uint32 codes, ``bits`` each, MLX's packing; shape (..., columns * bits / 32)."""
    scales: np.ndarray
    biases: np.ndarray
    bits: int
    source: str
    """The GGUF type it was read from."""
    how: str
    """``kept`` (the file's codes at their own width), ``widened`` (the file's codes, 8-bit),
    ``joined`` (Q6_K) or ``again`` (dequantized and quantized again)."""


def kind_of(type_name: str) -> str:
    if type_name in SAME:
        return "kept"
    if type_name in EXACT_WIDE:
        return "widened"
    return "joined" if type_name in JOINED else "again"


def to_affine(data: np.ndarray, type_name: str, shape: tuple[int, ...]) -> Affine:
    """MLX's affine form of one GGUF tensor: ``data`` its raw bytes (rows, bytes per row) as
    gguf-py's reader gives them, ``shape`` the shape of its values (numpy order)."""
    cols = shape[-1]
    if cols % GROUP:
        raise ImportRefused(f"a {type_name} tensor has rows of {cols} weights, not a "
                            f"multiple of {GROUP}")
    decode = DECODERS.get(type_name)
    if decode is None:
        return _again(data, type_name, shape)
    raw = np.ascontiguousarray(data).reshape(-1, _block_bytes(type_name))
    codes, scale, bias, bits = decode(raw)
    codes = codes.reshape(-1, cols)
    return Affine(_pack(codes, bits).reshape(*shape[:-1], -1),
                  _half(scale).reshape(*shape[:-1], cols // GROUP),
                  _half(bias).reshape(*shape[:-1], cols // GROUP), bits, type_name,
                  kind_of(type_name))


def _block_bytes(type_name: str) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return int(GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][1])


def _half(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.asarray(x, np.float32).astype(np.float16)


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """(rows, cols) codes in MLX's packing: code i of a word at bits ``bits * i``."""
    codes = codes.astype(np.uint8)
    if bits == 4:
        codes = codes[:, 0::2] | (codes[:, 1::2] << np.uint8(4))
    return np.ascontiguousarray(codes).view(np.uint32)


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(raw[:, at:at + 2]).view(np.float16).astype(np.float32)[:, 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 16) bytes -> (n, 32) codes: low nibbles are weights 0-15, high ones 16-31."""
    return np.concatenate([qs & np.uint8(15), qs >> np.uint8(4)], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """(n, 4) bytes -> (n, 32): bit i of the little-end word is weight i's fifth bit."""
    word = np.ascontiguousarray(qh).view(np.uint32)
    return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


Decoded = tuple[np.ndarray, np.ndarray, np.ndarray, int]
"""(codes per group of 32, scale per group, bias per group, bits)."""


def _q4_0(raw: np.ndarray) -> Decoded:
    d = _f16(raw, 0)
    return _nibbles(raw[:, 2:18]), d, -8 * d, 4


def _q4_1(raw: np.ndarray) -> Decoded:
    return _nibbles(raw[:, 4:20]), _f16(raw, 0), _f16(raw, 2), 4


def _q8_0(raw: np.ndarray) -> Decoded:
    d = _f16(raw, 0)
    codes = (raw[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return codes, d, -128 * d, 8


def _q5_0(raw: np.ndarray) -> Decoded:
    d = _f16(raw, 0)
    return _nibbles(raw[:, 6:22]) | (_high_bits(raw[:, 2:6]) << np.uint8(4)), d, -16 * d, 8


def _q5_1(raw: np.ndarray) -> Decoded:
    codes = _nibbles(raw[:, 8:24]) | (_high_bits(raw[:, 4:8]) << np.uint8(4))
    return codes, _f16(raw, 0), _f16(raw, 2), 8


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's (scale, bias) per sub-block of 32: ``d * sc`` and ``-dmin * m``."""
    from gguf.quants import Q4_K

    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(raw[:, 4:16]))
    d, dmin = _f16(raw, 0)[:, None], _f16(raw, 2)[:, None]
    return d * sc.astype(np.float32), -dmin * m.astype(np.float32)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 128) bytes -> (n, 8, 32): each 32 bytes hold one sub-block low, the next high."""
    q = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(15)).reshape(-1, 8, 32)


def _q4_k(raw: np.ndarray) -> Decoded:
    scale, bias = _k_scales(raw)
    return _k_nibbles(raw[:, 16:144]), scale, bias, 4


def _q5_k(raw: np.ndarray) -> Decoded:
    scale, bias = _k_scales(raw)
    qh = raw[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    return _k_nibbles(raw[:, 48:176]) | ((qh & np.uint8(1)) << np.uint8(4)), scale, bias, 8


def _q6_k(raw: np.ndarray) -> Decoded:
    """Sixteen 6-bit codes per scale; a group of 32 gets a quarter of the larger scale of its
    two (codes * 4, exact) and the other half is rounded on that finer grid."""
    ql = raw[:, 0:128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & np.uint8(15)).reshape(-1, 8, 32)
    qh = raw[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(
        1, 1, 4, 1)
    qh = (qh & np.uint8(3)).reshape(-1, 8, 32)
    q = (ql | (qh << np.uint8(4))).astype(np.float32).reshape(-1, 8, 2, 16) - 32
    sub = raw[:, 192:208].view(np.int8).astype(np.float32) * _f16(raw, 208)[:, None]
    sub = sub.reshape(-1, 8, 2)
    big = np.where(np.abs(sub[..., 0]) >= np.abs(sub[..., 1]), sub[..., 0], sub[..., 1])
    scale = _half(big / 4).astype(np.float32)
    bias = -128 * scale
    values = (sub[..., None] * q).reshape(-1, 8, 32)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.rint((values - bias[..., None]) / scale[..., None])
    codes = np.where(scale[..., None] == 0, 0, np.clip(codes, 0, 255))
    return codes.astype(np.uint8), scale, bias, 8


def _iq4_nl(raw: np.ndarray) -> Decoded:
    d = _f16(raw, 0)
    return (IQ4_VALUES[_nibbles(raw[:, 2:18])] + 128).astype(np.uint8), d, -128 * d, 8


def _iq4_xs(raw: np.ndarray) -> Decoded:
    d = _f16(raw, 0)[:, None]
    word = np.ascontiguousarray(raw[:, 2:4]).view(np.uint16)
    high = (word >> np.arange(0, 16, 2, dtype=np.uint16)) & np.uint16(3)
    low = raw[:, 4:8].reshape(-1, 4, 1) >> np.array([0, 4], np.uint8).reshape(1, 1, 2)
    low = (low & np.uint8(15)).reshape(-1, 8)
    scale = d * ((low | (high.astype(np.uint8) << np.uint8(4))).astype(np.float32) - 32)
    idx = raw[:, 8:136].reshape(-1, 8, 1, 16) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    idx = (idx & np.uint8(15)).reshape(-1, 8, 32)
    return (IQ4_VALUES[idx] + 128).astype(np.uint8), scale, -128 * scale, 8


DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q5_0": _q5_0, "Q5_1": _q5_1,
            "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "IQ4_NL": _iq4_nl,
            "IQ4_XS": _iq4_xs}


def _again(data: np.ndarray, type_name: str, shape: tuple[int, ...]) -> Affine:
    """Other types: llama.cpp's reference dequantization, then MLX's 8-bit quantization."""
    import mlx.core as mx
    from gguf import GGMLQuantizationType, quants

    try:
        values: Any = quants.dequantize(data, GGMLQuantizationType[type_name])
    except (NotImplementedError, KeyError):
        raise ImportRefused(f"GGUF type {type_name} cannot be read by the importer") from None
    w, s, b = mx.quantize(mx.array(np.asarray(values, np.float32).reshape(shape)),
                          group_size=GROUP, bits=8)
    return Affine(np.array(w), np.array(s.astype(mx.float16)), np.array(b.astype(mx.float16)),
                  8, type_name, "again")
