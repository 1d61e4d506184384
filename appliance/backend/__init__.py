"""The device boundary: everything that depends on where MLX computes lives here.

- :mod:`~appliance.backend.process`: before MLX loads, the CPU backend's process set-up on
  Linux (Debian's OpenBLAS and the skinny_matmul kernel preloaded, OpenBLAS's spin).
- :func:`start`, on the engine thread when the model loads: the fast CPU operations
  (:mod:`~appliance.backend.fast_ops`), the quantized matrix product
  (:mod:`~appliance.backend.quant`), malloc's thresholds (:mod:`~appliance.backend.heap`)
  and the cost profile the scheduler reads (:mod:`~appliance.backend.profile`);
  :func:`adopt` once it has loaded: on the CPU a quantized model's 16-bit arrays in
  float32, its 4-bit weights tiled for the quantized kernel and
  the products it takes of one input made as one; on CUDA, its quantized kernels compiled.
- :mod:`~appliance.backend.gpu`: MLX's CUDA kernel cache kept in the data directory.

The kind of backend is read once from the installed MLX, without importing it (the
process may still restart): Metal on macOS, CUDA where MLX's CUDA build is installed, the
CPU otherwise. Metal and CUDA take none of the CPU's tuning. ``native`` off (the setting,
``APPLIANCE_NATIVE=off``) runs MLX as shipped on every backend: none of the appliance's
compiled code and no malloc tuning; the BLAS library stays the ``blas`` setting's.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any

from appliance.sched.cost import CostProfile

log = logging.getLogger(__name__)

KINDS = ("cpu", "metal", "cuda")
CUDA_DISTRIBUTIONS = ("mlx-cuda", "mlx-cuda-12", "mlx-cuda-13")


def _installed(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def installed_kind(platform: str = sys.platform) -> str:
    """"metal", "cuda" or "cpu": what the installed MLX computes on (it is not imported)."""
    if platform == "darwin":
        return "metal"
    if any(_installed(name) for name in CUDA_DISTRIBUTIONS):
        return "cuda"
    return "cpu"


@dataclass(frozen=True, slots=True)
class Backend:
    """What serves the model here, as the log line and ``/health`` report it."""

    kind: str
    """"cpu", "metal" or "cuda" (:data:`KINDS`)."""
    device: str
    """MLX's default device, as MLX names it."""
    native: bool
    """The appliance's native code may run here (the setting, and a CPU device)."""
    kernel: str | None
    """The skinny_matmul kernel's instruction set when it is loaded, else None."""
    fast_ops: bool
    """The fast CPU operations are installed in mlx-lm's model modules."""
    quant: str | None
    """The quantized matmul kernel's instruction set when it replaces MLX's, else None."""
    heap: str
    """What malloc's tuning did ("kept", or why not)."""
    profile: CostProfile

    def describe(self) -> dict[str, Any]:
        out = asdict(self)
        out["profile"] = self.profile.name
        return out


def start(*, native: bool = True, fast_cpu_ops: bool = True) -> Backend:
    """Set up the device for the model about to load (the engine thread, once): on the CPU
    with ``native``, the fast operations and malloc's thresholds; elsewhere, MLX as shipped.
    Logs one line saying what runs."""
    import mlx.core as mx

    from appliance.backend import fast_ops, heap, process, quant
    from appliance.backend.profile import profile_for

    on_cpu = fast_ops.on_cpu()
    native = native and on_cpu
    fast = False
    if not (native and fast_cpu_ops):
        fast_ops.uninstall()
        quant.uninstall()
    elif (why := fast_ops.install()) is None:
        fast = True
        if (why := quant.install()) is not None:
            log.warning("the quantized matmul kernel cannot be used: %s", why)
    else:
        log.warning("fast CPU ops are on but cannot be used: %s; prefill runs 1.7-2.3x "
                    "slower (install a C++ compiler and reinstall, or set --no-fast-cpu-ops)",
                    why)
    kept = heap.keep_big_buffers() if native else "not tuned (native code off or not the CPU)"
    kernel = process.kernel_in_use() if on_cpu else None
    backend = Backend(kind=installed_kind() if not on_cpu else "cpu",
                      device=str(mx.default_device()), native=native, kernel=kernel,
                      fast_ops=fast, quant=quant.simd(), heap=kept,
                      profile=profile_for(kernel is not None))
    log.info("backend: kind=%s device=%s native=%s kernel=%s fast_ops=%s quant=%s heap=%s "
             "profile=%s", backend.kind, backend.device, backend.native,
             backend.kernel or "none", backend.fast_ops, backend.quant or "none", backend.heap,
             backend.profile.name)
    return backend


def adopt(model: Any, backend: Backend) -> int:
    """Fit the loaded ``model`` to what :func:`start` set up: on the CPU, a quantized
    model's 16-bit parameters in float32 (:func:`float32_on_cpu`) and its KV cache in float16
    (:func:`half_kv`); where the quantized kernel runs, its 4-bit weights tiled and the
    products its modules take of one input (q/k/v, gate/up) made as one; on CUDA, its
    quantized products' kernels compiled now (:mod:`~appliance.backend.gpu`). The bytes this
    adds to the model's."""
    import mlx.core as mx

    from appliance.backend import gpu, quant

    if backend.kind == "cuda":
        gpu.warm_quantized(model)
    if backend.kind == "cpu" and (widened := float32_on_cpu(model)):
        log.info("16-bit parameters of a quantized model computed in float32: arrays=%d",
                 widened)
    if half_kv(model, backend):  # where its layers' caches can (appliance/engine/kvcache.py)
        model.appliance_kv_dtype = mx.float16
    groups, tiled = quant.adopt(model)
    if groups or tiled:
        log.info("quantized layers adopted: groups=%d tiles=%d bytes", groups, tiled)
    return tiled


def held_bytes(model: Any, part: Any) -> int:
    """The bytes ``part`` (a module of ``model``; from the shapes: nothing need be loaded)
    will hold once :func:`adopt` has fitted ``model`` to the backend :func:`start` set up:
    its arrays, the 16-bit ones :func:`float32_on_cpu` widens twice their size, and the
    tiles the quantized kernel keeps beside 4-bit weights. Machines that split a model by
    the bytes before adoption held 51 and 93 MiB of SmolLM2 (issue 52)."""
    import mlx.core as mx
    import mlx.nn as nn

    from appliance.backend import fast_ops, quant

    quantized = (nn.QuantizedLinear, nn.QuantizedEmbedding)
    widen = fast_ops.on_cpu() and any(isinstance(m, quantized) for _, m in model.named_modules())
    tied = model.get("lm_head") is None
    total = 0
    for _, module in part.named_modules():
        kept = ("scales", "biases") if isinstance(module, nn.QuantizedLinear) else ()
        for name, value in module.items():
            if isinstance(value, mx.array) and not name.startswith("_"):  # as parameters()
                wide = widen and name not in kept and value.dtype in (mx.float16, mx.bfloat16)
                total += value.nbytes * (2 if wide else 1)
        if isinstance(module, quantized):
            scales = module["scales"]
            wide = widen and isinstance(module, nn.QuantizedEmbedding) and scales.itemsize == 2
            total += quant.tiled_nbytes(module, tied, 4 if wide else scales.itemsize)
    return total


def half_kv(model: Any, backend: Backend) -> bool:
    """Whether the model's KV cache is kept in float16: a quantized model computed in float32
    on the CPU, where the appliance's kernels read a 16-bit cache (half the bytes a decode step
    reads, half the KV budget's; llama.cpp keeps float16 too). ``APPLIANCE_KV_DTYPE=float32``
    keeps float32 (numbers bit for bit mlx-lm's)."""
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
