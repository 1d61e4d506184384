"""MLX's affine-quantized matrix product on the CPU, from the kernel of
appliance/backend/native/quant_matmul.cpp (see its header for why: MLX's own CPU kernel
unpacks the weights once per row, so a decode step of 8 rows costs 8 of one).

:func:`install` puts :func:`quantized_matmul` in place of ``mlx.core.quantized_matmul``,
which ``nn.QuantizedLinear`` and ``nn.QuantizedEmbedding.as_linear`` look up at each call,
when MLX's default device is the CPU: a switch for the whole process, which
:func:`uninstall` turns back. Anything the kernel does not take (another mode, no biases,
``transpose=False``, activations that are not float32, other bit widths or group sizes, an
explicit stream) goes to MLX's own function unchanged.

Products of more than :data:`KERNEL_ROWS` rows (a prompt's) take another path: the weights
dequantized into float32 by the extension, then MLX's matmul (OpenBLAS's sgemm where the
daemon preloads it), which blocks for the cache where the kernel reads the weights once per
few rows. Up to :data:`KERNEL_ROWS` rows a row's sums are the kernel's, in a fixed order
whatever its neighbours: a decode step, and one with small prompt chunks riding in it, gives
each row the same bits alone and in a batch.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

import appliance.backend.fast_ops as fast_ops

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
SCALE_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
ACTIVATIONS = ("float", "int16")  # the kernel's codes 0 and 1
PATHS = ("kernel", "dense")
KERNEL_ROWS = 32
"""The most rows the kernel takes; more go dense. Not below 32: the fixed-order promise
(appliance/engine/mixed.py) holds to 32 rows, as for skinny_matmul's fp32 products. Dense was
faster from 33 rows up on SmolLM2's layers (docs/decisions.md)."""
DENSE_WHOLE = 1 << 20
"""Weights of at most this many elements (4 MiB dequantized) are dequantized whole for the
dense path; bigger ones in pieces of rows of at most :data:`DENSE_PIECE`, which the gemm
reads back from the cache (SmolLM2's 49152 x 576 output layer at 64 rows, one thread: 108 ms
whole, 79 in pieces; docs/decisions.md)."""
DENSE_PIECE = 1 << 18

_original: list[Any] = []


def available() -> str | None:
    """None when the kernel can be used here, else why not (it ships in the fast ops'
    extension and is refused with it)."""
    why = fast_ops.available()
    if why is not None:
        return why
    if not hasattr(fast_ops._extension(), "quantized_matmul"):
        return "appliance.backend._mlx_fast has no quantized kernel (reinstall the appliance)"
    return None


def installed() -> bool:
    return bool(_original)


def simd() -> str | None:
    """The instruction set the kernel runs when it is installed, else None."""
    return str(fast_ops._extension().quant_simd()) if _original else None


def install(activations: str | None = None) -> str | None:
    """Use the kernel for MLX's quantized products, 4-bit ones taking x as ``activations``
    says (None: :func:`activations`); None when done, else why not."""
    if _original:
        return None
    why = available()
    if why is not None:
        return why
    _original.append(mx.quantized_matmul)
    mx.quantized_matmul = _quantized_matmul_with(mx.quantized_matmul, activations)
    return None


def uninstall() -> None:
    """Put MLX's own function back."""
    if _original:
        mx.quantized_matmul = _original.pop()


def mlx_own() -> Any:
    """MLX's own ``mx.quantized_matmul`` (the one the switch passes on to, or in place)."""
    return _original[0] if _original else mx.quantized_matmul


def quantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array,
                     group_size: int, bits: int, activations: str | None = None,
                     path: str | None = None) -> mx.array:
    """``x @ mx.dequantize(w, scales, biases, group_size, bits).T`` for a float32 ``x``.
    ``path``: ``"kernel"`` (each output summed in a fixed order whatever the rows beside it),
    ``"dense"`` (dequantized weights into MLX's matmul, x in float) or None, the kernel for
    at most :data:`KERNEL_ROWS` rows, else dense. ``activations``: how the kernel takes a
    4-bit product's ``x``, ``"int16"`` (rounded per block of 32) or ``"float"``; None takes
    the process's choice (:func:`activations`)."""
    ext = fast_ops._extension()
    assert ext is not None
    k = x.shape[-1]
    rows = x.size // k if k else 0
    if path == "dense" or (path is None and rows > KERNEL_ROWS):
        return _dense(ext, x, w, scales, biases, group_size, bits)
    act = -1 if activations is None else ACTIVATIONS.index(activations)
    return ext.quantized_matmul(x, w, scales, biases, group_size, bits, act)


def _dense(ext: Any, x: mx.array, w: mx.array, scales: mx.array, biases: mx.array,
           group_size: int, bits: int) -> mx.array:
    """The dense path: x's columns in the dequantized weights' block order (the kernel's),
    then a matmul per piece of the weights (:data:`DENSE_WHOLE`)."""
    xb = ext.block_order(x, bits)
    n, k = w.shape[0], x.shape[-1]
    step = n if n * k <= DENSE_WHOLE else max(1, DENSE_PIECE // k)
    parts = [mx.matmul(xb, ext.dequantize_blocked(w[i:i + step], scales[i:i + step],
                                                  biases[i:i + step], group_size, bits).T)
             for i in range(0, n, step)]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)


def activations() -> str:
    """How 4-bit products take x unless told: ``"int16"`` on the AVX2 and AVX-512 variants,
    ``"float"`` on the portable one; ``APPLIANCE_QUANT_ACT=float`` or ``int16`` overrides
    (8-bit products always take it in float)."""
    return str(fast_ops._extension().quant_activations())


def takes(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None,
          transpose: bool, group_size: int | None, bits: int | None, mode: str) -> bool:
    """Whether the kernel computes this product (else MLX's own function does)."""
    return (mode == "affine" and transpose and biases is not None and bits in BITS
            and group_size in GROUP_SIZES and x.dtype == mx.float32 and w.dtype == mx.uint32
            and w.ndim == 2 and x.ndim >= 1 and scales.dtype in SCALE_DTYPES
            and biases.dtype == scales.dtype and x.shape[-1] * bits == w.shape[1] * 32
            and tuple(scales.shape) == (w.shape[0], x.shape[-1] // group_size)
            and tuple(biases.shape) == tuple(scales.shape))


def _quantized_matmul_with(fallback: Any, activations: str | None) -> Any:
    def fast_quantized_matmul(x: mx.array, w: mx.array, /, scales: mx.array,
                              biases: mx.array | None = None, transpose: bool = True,
                              group_size: int | None = None, bits: int | None = None,
                              mode: str = "affine", *, stream: Any = None) -> mx.array:
        if stream is None and takes(x, w, scales, biases, transpose, group_size, bits, mode):
            assert biases is not None and group_size is not None and bits is not None
            return quantized_matmul(x, w, scales, biases, group_size, bits, activations)
        return fallback(x, w, scales=scales, biases=biases, transpose=transpose,
                        group_size=group_size, bits=bits, mode=mode, stream=stream)
    return fast_quantized_matmul
