"""Attention and SwiGLU for MLX on the CPU, from the two vectorised operations of
appliance/backend/native/mlx_fast.cpp (see its header for why: MLX computes exp and sigmoid one
element at a time there, and they were three quarters of a 512-token prefill).

:func:`install` puts :func:`attention` and :func:`swiglu` in place of mlx-lm's
``scaled_dot_product_attention`` and ``swiglu`` in the model modules that use them
(:data:`MODULES`) when MLX's default device is the CPU: a switch for the whole process,
which :func:`uninstall` turns back. Anything they do
not handle (another dtype, quantized KV caches, attention sinks, the GPU) goes to mlx-lm's
own functions unchanged.

It also puts :func:`rope` and :func:`rms_norm` in place of ``mlx.core.fast.rope`` and
``mlx.core.fast.rms_norm`` themselves, which every RoPE and RMSNorm module calls (nn.RoPE,
mlx-lm's scaled variants, nn.RMSNorm): MLX has no CPU kernels for them, and their fallbacks
of some fifteen operations took 140 and 67 us a call, 60 and 61 calls a decode step of the
SmolLM-135M shape (9 and 4 ms of a 54 ms step at one row).

Attention over prompt chunks is computed as MLX's own CPU fallback computes it (scores by
a matrix product, mask, softmax, a second product), with two differences: the query heads
that share a KV head are stacked as rows of one product instead of broadcasting the keys,
and the softmax is the vectorised one. A decode step's (one query position) is one
operation of the extension, which reads the cache's views where they lie. A query row with
nothing to attend to (left padding) gets zeros instead of NaN.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

import mlx.core as mx

MODULES = ("llama", "qwen2", "qwen3", "qwen3_moe", "phi3", "gemma", "gemma3_text", "olmo2",
           "granite")
"""mlx-lm model modules whose attention (and, but for the Gemmas, MLP) call
``scaled_dot_product_attention`` and ``swiglu`` by those names; models built on them
(SmolLM 2 and 3, Mistral) follow."""


MLX_VERSION: str = getattr(mx, "__version__", "")
STAMP = Path(__file__).with_name("_mlx_fast.mlx-version")
"""The MLX version the extension was built against (CMakeLists.txt writes it beside it)."""


def _load_extension() -> tuple[Any, str | None]:
    """The compiled extension, or None and why not. An extension built for another MLX is
    refused before it is loaded: a C++ library loaded into another MLX's process may not
    even fail cleanly."""
    if importlib.util.find_spec("appliance.backend._mlx_fast") is None:
        return None, "appliance.backend._mlx_fast was not built"
    built = STAMP.read_text().strip() if STAMP.exists() else "an unknown version"
    if built != MLX_VERSION:
        return None, (f"appliance.backend._mlx_fast was built for MLX {built}, this is MLX "
                      f"{MLX_VERSION} (reinstall the appliance)")
    try:
        return importlib.import_module("appliance.backend._mlx_fast"), None
    except ImportError as exc:
        return None, f"appliance.backend._mlx_fast did not load: {exc}"



_mlx_fast: Any = None
_unavailable: str | None = None
_tried = False
_installed: dict[str, dict[str, Any]] = {}


def _extension() -> Any:
    """The extension, loaded on first use only: with the native code off it is never
    mapped into the process."""
    global _mlx_fast, _unavailable, _tried
    if not _tried:
        _mlx_fast, _unavailable = _load_extension()
        _tried = True
    return _mlx_fast


def on_cpu() -> bool:
    return bool(mx.default_device() == mx.cpu)


def available() -> str | None:
    """None when the operations can be used here, else why not."""
    if _extension() is None:
        return _unavailable
    if not on_cpu():
        return "MLX runs on the GPU here"
    return None


def installed() -> bool:
    return bool(_installed)


def has(name: str) -> bool:
    """The extension loads here and has the operation ``name``."""
    return _extension() is not None and hasattr(_mlx_fast, name)


def built_for() -> str | None:
    """The MLX version the extension beside this module was built against, if there is one."""
    return STAMP.read_text().strip() if STAMP.exists() else None


def install() -> str | None:
    """Use the fast attention and SwiGLU in every model module of :data:`MODULES`; None when
    done, else why they cannot be used here."""
    if _installed:
        return None
    why = available()
    if why is not None:
        return why
    replaced = {"scaled_dot_product_attention": _attention_with, "swiglu": _swiglu_with}
    ours = {"rope": _rope_with, "rms_norm": _rms_norm_with}
    _installed["mlx.core.fast"] = {attr: getattr(mx.fast, attr) for attr in ours}
    for attr, wrap in ours.items():
        setattr(mx.fast, attr, wrap(getattr(mx.fast, attr)))
    for name in MODULES:
        try:
            module = importlib.import_module(f"mlx_lm.models.{name}")
        except ImportError:
            continue
        originals = {attr: getattr(module, attr) for attr in replaced if hasattr(module, attr)}
        if originals:
            _installed[name] = originals
            for attr, original in originals.items():
                setattr(module, attr, replaced[attr](original))
    if len(_installed) == 1:
        uninstall()
        return "no mlx-lm model module to install them in"
    return None


def uninstall() -> None:
    """Put mlx-lm's own functions back."""
    for name, originals in _installed.items():
        module = mx.fast if name == "mlx.core.fast" else importlib.import_module(
            f"mlx_lm.models.{name}")
        for attr, original in originals.items():
            setattr(module, attr, original)
    _installed.clear()


def softmax(x: mx.array, causal: int = 0) -> mx.array:
    """Softmax over the last axis of a float32 array. ``causal`` > 0: the rows are queries
    ``causal`` at a time, the last ``causal`` positions of the keys, and each sees only the
    keys up to its own (attention's causal mask, applied as the scores are read)."""
    assert _extension() is not None
    return _mlx_fast.softmax(x, causal)


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    assert _extension() is not None
    return _mlx_fast.silu_mul(gate, x)


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float,
              mask: mx.array | str | None) -> mx.array:
    """softmax(q k^T * scale + mask) v for q [B, H, Lq, D], k and v [B, KV, L, D] (H a
    multiple of KV; float32, or float16 read as float32); ``mask`` None, "causal", or
    boolean or additive, broadcastable to [B, H, Lq, L]."""
    b, h, lq, d = q.shape
    if lq == 1:  # a decode step: one node, the cache's views read in place
        if isinstance(mask, str):  # "causal": the last position sees every key
            mask = None
        elif mask is not None and mask.dtype not in (mx.bool_, mx.float32):
            mask = mask.astype(mx.float32)
        return _mlx_fast.decode_attention(q, k, v, scale, mask)
    if k.dtype != mx.float32:  # a cache kept in float16 (appliance/engine/kvcache.py)
        k, v = k.astype(mx.float32), v.astype(mx.float32)
    kv, length = k.shape[1], k.shape[2]
    rep = h // kv
    scores = (q * scale).reshape(b, kv, rep * lq, d) @ k.swapaxes(-1, -2)
    if isinstance(mask, str):  # "causal": masked as the softmax reads the scores
        return (softmax(scores, causal=lq) @ v).reshape(b, h, lq, d)
    if mask is not None:
        scores = scores.reshape(b, kv, rep, lq, length)
        mask = _per_group(mask, kv, rep)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
        else:
            scores = scores + mask.astype(scores.dtype)
        scores = scores.reshape(b, kv, rep * lq, length)
    out = softmax(scores) @ v
    return out.reshape(b, h, lq, d)


def rope(x: mx.array, dims: int, traditional: bool, base: float | None, scale: float,
         offset: int | mx.array, freqs: mx.array | None = None) -> mx.array:
    """``mx.fast.rope``'s arithmetic for a float32 ``x`` of at least 3 axes (positions on
    the second last); ``offset`` one, or one per batch row (axis 0)."""
    assert _extension() is not None
    if not isinstance(offset, mx.array):
        offset = mx.array(offset, dtype=mx.int32)
    return _mlx_fast.rope(x, dims, traditional, base, scale, offset, freqs)


def mlx_own(name: str) -> Any:
    """MLX's own ``mx.fast.<name>`` (the one the switch passes on to, or in place)."""
    return _installed.get("mlx.core.fast", {}).get(name, getattr(mx.fast, name))


def rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    """``mx.fast.rms_norm``'s arithmetic over the last axis of a float32 ``x``."""
    assert _extension() is not None
    return _mlx_fast.rms_norm(x, weight, eps)


def _rms_norm_with(fallback: Any) -> Any:
    def fast_rms_norm(x: mx.array, weight: mx.array | None, eps: float,
                      stream: Any = None) -> mx.array:
        if stream is not None or x.dtype != mx.float32 or x.ndim < 1:
            return fallback(x, weight, eps, stream=stream)
        return rms_norm(x, weight, eps)
    return fast_rms_norm


def _rope_with(fallback: Any) -> Any:
    def fast_rope(a: mx.array, dims: int, *, traditional: bool, base: float | None,
                  scale: float, offset: int | mx.array, freqs: mx.array | None = None,
                  stream: Any = None) -> mx.array:
        if stream is not None or a.dtype != mx.float32 or a.ndim < 3:
            return fallback(a, dims, traditional=traditional, base=base, scale=scale,
                            offset=offset, freqs=freqs, stream=stream)
        return rope(a, dims, traditional, base, scale, offset, freqs)
    return fast_rope


def _per_group(mask: mx.array, kv: int, rep: int) -> mx.array:
    """A mask shaped for [B, H, Lq, L] scores reshaped for [B, KV, rep, Lq, L] ones."""
    while mask.ndim < 4:
        mask = mask[None]
    if mask.shape[1] == 1:
        return mask[:, :, None]
    return mask.reshape(mask.shape[0], kv, rep, *mask.shape[2:])


def _attention_with(fallback: Any) -> Any:
    def scaled_dot_product_attention(queries: mx.array, keys: mx.array, values: mx.array,
                                     cache: Any, scale: float, mask: Any,
                                     sinks: Any = None) -> mx.array:
        if (sinks is not None or hasattr(cache, "bits") or queries.dtype != mx.float32
                or keys.dtype not in (mx.float32, mx.float16) or values.dtype != keys.dtype
                or queries.shape[1] % keys.shape[1]):
            return fallback(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
        return attention(queries, keys, values, scale, mask)
    return scaled_dot_product_attention


def _swiglu_with(fallback: Any) -> Any:
    def fast_swiglu(gate: mx.array, x: mx.array) -> mx.array:
        if gate.dtype != mx.float32 or x.dtype != mx.float32 or gate.shape != x.shape:
            return fallback(gate, x)
        return swiglu(gate, x)
    return fast_swiglu
