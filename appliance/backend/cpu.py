"""The CPU's plug: the appliance's accelerator for MLX on the CPU, behind the door
(:mod:`~appliance.backend.plug`).

- before MLX loads: Debian's OpenBLAS and the skinny_matmul kernel preloaded, OpenBLAS's
  spin (:mod:`~appliance.backend.process`, :mod:`~appliance.backend.blas`);
- at start: the fast CPU operations (:mod:`~appliance.backend.fast_ops`), the quantized
  matrix product (:mod:`~appliance.backend.quant`), malloc's thresholds
  (:mod:`~appliance.backend.heap`) and the cost profile the scheduler reads
  (:mod:`~appliance.backend.profile`);
- adopting a model: a quantized model's 16-bit arrays in float32, its KV cache in float16,
  its 4-bit weights tiled for the quantized kernel and the products it takes of one input
  made as one;
- for the forward: the fused decode layer (:mod:`~appliance.backend.decode_layer`) and the
  batched quantized products.

MLX and the kernels are imported inside the functions: :meth:`CpuPlug.prepare` runs before
MLX may be imported (the process may restart).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.backend import NOT_TUNED, Backend

log = logging.getLogger(__name__)

class _FusedLayer:
    """The fused decode layer (appliance/backend/decode_layer.py) as the door gives it."""

    _module: Any = None
    """decode_layer, bound by :meth:`plan` (a step's layers come from a plan): imported
    when first used, not at a step's every layer."""

    @property
    def rows(self) -> int:
        from appliance.backend.quant import TILED_ROWS

        return TILED_ROWS  # products of at most the tiled kernel's rows

    def plan(self, model: Any, qk_norm: bool) -> list[Any | None] | None:
        from appliance.backend import decode_layer

        self._module = decode_layer
        return decode_layer.plan(model, qk_norm)

    def step(self, layer: Any, h: Any, keys: Any, values: Any, offset: Any, mask: Any,
             at: int, first: int, chunks: Sequence[tuple[Any, Any, int, int]] = (),
             span: int = 1) -> list[Any] | None:
        out: list[Any] | None = self._module.step(layer, h, keys, values, offset, mask, at,
                                                  first, chunks, span)
        return out


class _Forward:
    """What the CPU gives the neutral forward: its kernels answer None for anything they
    did not adopt, so this is safe for any model (and inert where they are not installed)."""

    _fused = _FusedLayer()

    @property
    def decode_layer(self) -> _FusedLayer:
        return self._fused

    @property
    def products(self) -> Any:
        from appliance.backend import quant

        return quant.products


FORWARD = _Forward()


@dataclass(frozen=True, slots=True)
class CpuPlug(Backend):
    """MLX on the CPU, with the appliance's native code where ``native``."""

    @staticmethod
    def prepare(blas: str, kernel: bool, argv: list[str], data_dir: Path | None) -> None:
        from appliance.backend import process

        process.prepare("cpu", blas, kernel, argv)
        process.log_blas(kernel)

    @classmethod
    def start(cls, *, native: bool, fast_cpu_ops: bool) -> CpuPlug:
        """With ``native``, the fast operations and malloc's thresholds; else MLX as
        shipped."""
        import mlx.core as mx

        from appliance.backend import fast_ops, heap, process, quant
        from appliance.backend.profile import profile_for

        fast = False
        why: str | None = None
        if not (native and fast_cpu_ops):
            stand_down()
        elif (why := fast_ops.install()) is None:
            fast = True
            if (why := quant.install()) is not None:
                log.warning("the quantized matmul kernel cannot be used: %s", why)
        kept = heap.keep_big_buffers() if native else NOT_TUNED
        kernel = process.kernel_in_use()
        missing = _degraded(native and fast_cpu_ops, None if fast else why)
        for reason in missing:
            log.warning("backend degraded: %s", reason)
        return cls(kind="cpu", device=str(mx.default_device()), native=native, kernel=kernel,
                   fast_ops=fast, quant=quant.simd(), heap=kept,
                   profile=profile_for(kernel is not None),
                   fused_layer=fast and fast_ops.has("decode_layer"), degraded=tuple(missing))

    @property
    def look_ahead(self) -> bool:
        # The step and the host share the cores: hiding host time was no faster
        # (docs/backends.md).
        return False

    @property
    def decode_layer(self) -> _FusedLayer:
        return FORWARD.decode_layer

    @property
    def products(self) -> Any:
        return FORWARD.products

    def adopt(self, model: Any) -> int:
        """A quantized model's 16-bit parameters in float32 (:func:`float32_on_cpu`) and its
        KV cache in float16 (:func:`half_kv`); where the quantized kernel runs, its 4-bit
        weights tiled and the products its modules take of one input (q/k/v, gate/up) made
        as one, the tiles then the only copy of those layers (held once: their MLX arrays
        freed as each group is tiled). The bytes this adds to the model's parameters (the
        tiles)."""
        import mlx.core as mx

        from appliance.backend import heap, quant

        if widened := float32_on_cpu(model):
            log.info("16-bit parameters of a quantized model computed in float32: arrays=%d",
                     widened)
        if half_kv(model, self):  # where its layers' caches can (appliance/engine/kvcache.py)
            model.appliance_kv_dtype = mx.float16
        # a plug started without the quantized kernel tiles nothing, whatever an earlier
        # plug of this process installed (None forgets that one's tiles); each group's
        # arrays freed as its tiles are made, so loading peaks near the model's size, not
        # twice it (docs/decisions/weights-held-once.md)
        groups, tiled = quant.adopt(model if self.quant is not None else None, hold=True)
        freed = quant.freed_bytes()
        if groups or tiled:
            log.info("quantized layers adopted: groups=%d tiles=%d bytes, freed=%d bytes",
                     groups, quant.tiled_bytes(), freed)
        if freed:  # the freed arrays' pages back to the system, for the KV budget to count
            heap.give_back()
        return quant.tiled_bytes() if tiled else 0


def _degraded(native_wanted: bool, native_missing: str | None) -> list[str]:
    """This process's facts for :func:`appliance.backend.degraded.reasons`."""
    from appliance.backend import degraded, fast_ops
    from appliance.backend.blas import loaded_libraries, openblas_lib

    maps = loaded_libraries() if sys.platform == "linux" else ""
    return degraded.reasons(kind="cpu", native_wanted=native_wanted,
                            native_missing=native_missing, built_for=fast_ops.built_for(),
                            mlx_version=fast_ops.MLX_VERSION,
                            blas_mapped=("/libopenblas" in maps) if maps else None,
                            blas_installed=openblas_lib() is not None)


def stand_down() -> None:
    """Put MLX's and mlx-lm's own functions back (the fast operations, the quantized
    product): native code off, or another plug starting in this process."""
    from appliance.backend import fast_ops, quant

    fast_ops.uninstall()
    quant.uninstall()


def held_bytes(model: Any, part: Any) -> int:
    """The bytes ``part`` (a module of ``model``; from the shapes: nothing need be loaded)
    will hold once the plug has adopted ``model``: its arrays, the 16-bit ones
    :func:`float32_on_cpu` widens twice their size, and for a layer the quantized kernel
    tiles, its tiles in place of its arrays (``quant.adopt(..., hold=True)``; a tied embedding's scales
    in the 16 bits they are stored in). Machines that split a model by the bytes before
    adoption held 51 and 93 MiB of SmolLM2 (issue 52)."""
    import mlx.core as mx
    import mlx.nn as nn

    from appliance.backend import fast_ops, quant

    quantized = (nn.QuantizedLinear, nn.QuantizedEmbedding)
    widen = fast_ops.on_cpu() and any(isinstance(m, quantized) for _, m in model.named_modules())
    tied = model.get("lm_head") is None
    once = quant.holds_once()
    total = 0
    for _, module in part.named_modules():
        tiles = quant.tiled_nbytes(module, tied, module["scales"].itemsize) \
            if isinstance(module, quantized) else 0
        if tiles and not once:  # the tiles beside its arrays, an embedding's scales widened
            scales = module["scales"]
            wide = widen and isinstance(module, nn.QuantizedEmbedding) and scales.itemsize == 2
            tiles = quant.tiled_nbytes(module, tied, 4 if wide else scales.itemsize)
        total += tiles
        kept = ("scales", "biases") if isinstance(module, nn.QuantizedLinear) else ()
        held = ("weight", "scales", "biases") if tiles and once else ()
        for name, value in module.items():
            if isinstance(value, mx.array) and not name.startswith("_") and name not in held:
                wide = widen and name not in kept and value.dtype in (mx.float16, mx.bfloat16)
                total += value.nbytes * (2 if wide else 1)
    return total


def half_kv(model: Any, backend: Backend) -> bool:
    """Whether the model's KV cache is kept in float16: a quantized model computed in float32
    on the CPU, where the appliance's kernels read a 16-bit cache (half the bytes a decode step
    reads, half the KV budget's; llama.cpp keeps float16 too). The ``kv_dtype`` setting
    ``float32`` keeps float32 (numbers bit for bit mlx-lm's); the CLI exports it as
    ``APPLIANCE_KV_DTYPE`` with the native code's settings (process.export_tuning)."""
    import mlx.nn as nn

    wanted = os.environ.get("APPLIANCE_KV_DTYPE", "float16")
    if wanted not in ("float16", "float32"):
        raise ValueError(f"APPLIANCE_KV_DTYPE must be float16 or float32, not {wanted!r}")
    return (wanted == "float16" and backend.kind == "cpu" and backend.fast_ops
            and any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
                    for _, m in model.named_modules()))


def float32_on_cpu(model: Any) -> int:
    """Cast a quantized model's float16 and bfloat16 arrays to float32 (norms, biases, an
    embedding's scales: what makes its hidden states 16-bit), all but its linear layers'
    own scales and biases (the products read them as they are, in float32 arithmetic, and
    cast they would take twice the memory); how many were cast. MLX's CPU has no 16-bit
    arithmetic of its own: a 4-bit product with bfloat16 activations takes about 8 times
    the float32 one, and none of the appliance's kernels take 16-bit activations (a
    bfloat16 4-bit model stepped 100 times slower than the same weights in float32,
    docs/decisions.md). Unquantized 16-bit models are left as they are: casting their
    matrices would double the model's memory."""
    import mlx.core as mx
    import mlx.nn as nn

    modules = [m for _, m in model.named_modules()]
    if not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for m in modules):
        return 0
    count = 0
    for module in modules:
        kept = ("scales", "biases") if isinstance(module, nn.QuantizedLinear) else ()
        cast = {name: value.astype(mx.float32) for name, value in module.items()
                if isinstance(value, mx.array) and name not in kept
                and value.dtype in (mx.float16, mx.bfloat16)}
        if cast:
            module.update(cast)
            count += len(cast)
    return count
