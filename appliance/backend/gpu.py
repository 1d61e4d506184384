"""What MLX's CUDA build needs from the appliance: the kernels it compiles kept where a
restart finds them, and the quantized ones compiled while the model loads rather than
while the first household member waits.

MLX compiles CUDA kernels when they are first used (NVRTC) and keeps the results in
``MLX_PTX_CACHE_DIR``, by default under the temporary directory, which the systemd unit's
``PrivateTmp`` empties at every restart. A 4-bit product compiles one kernel per tile of
rows, each about 20 s on an H200 (docs/backends.md). So the cache lives in the data
directory, one folder per MLX version and GPU, and the quantized layers' products are run
once at start for row counts that reach each tile.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CACHE_ENV = "MLX_PTX_CACHE_DIR"
WARM_ROWS = (1, 4, 8, 12, 24, 48, 96, 512)
"""Rows of the products run at start: decode batches and prompt chunks of each size class
MLX's quantized kernels choose a tile by."""


def gpu_name() -> str:
    """The first NVIDIA GPU's name and compute capability ("NVIDIA H200 9.0"), or "gpu"
    when ``nvidia-smi`` cannot say."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "gpu"
    try:
        out = subprocess.run([smi, "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return "gpu"
    first = out.strip().splitlines()[0] if out.strip() else ""
    return first.replace(",", " ") or "gpu"


def kernel_cache_dir(data_dir: Path, mlx_version: str, gpu: str) -> Path:
    """Where MLX keeps its compiled kernels for this version and GPU: kernels built for one
    GPU must not be read on another."""
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", f"{mlx_version}-{gpu}").strip("-")
    return data_dir / "cache" / "mlx-ptx" / slug


def keep_kernel_cache(kind: str, data_dir: Path) -> Path | None:
    """On CUDA, point MLX's kernel cache into ``data_dir`` (before its first compile) unless
    the environment already chose one. The directory, or None where nothing was set."""
    if kind != "cuda" or os.environ.get(CACHE_ENV):
        return None
    try:
        version = importlib.metadata.version("mlx")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    path = kernel_cache_dir(data_dir, version, gpu_name())
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        log.warning("MLX's kernel cache stays in the temporary directory (%s cannot be made: "
                    "%s): each restart compiles the kernels again", path, exc.strerror)
        return None
    os.environ[CACHE_ENV] = str(path)
    log.info("MLX kernel cache: %s", path)
    return path


def warm_quantized(model: Any, rows: tuple[int, ...] = WARM_ROWS) -> int:
    """Run one product of each distinct quantized layer (its sizes, bits, group size, mode
    and dtype) at each of ``rows``, so that MLX compiles its kernels now; a quantized
    embedding only where the model has no ``lm_head`` (it is then the head). Logs and
    returns how many products ran."""
    import mlx.core as mx
    import mlx.nn as nn

    seen: set[tuple[Any, ...]] = set()
    start = time.perf_counter()
    count = 0
    tied = getattr(model, "lm_head", None) is None  # the embedding is then the head
    for _, module in model.named_modules():
        product: Any
        if isinstance(module, nn.QuantizedLinear):
            product = module
        elif isinstance(module, nn.QuantizedEmbedding) and tied:
            product = module.as_linear
        else:
            continue
        dims = module.weight.shape[-1] * 32 // module.bits
        key = (dims, module.weight.shape[0], module.bits, module.group_size,
               getattr(module, "mode", "affine"), module.scales.dtype)
        if key in seen:
            continue
        seen.add(key)
        for n in rows:
            mx.eval(product(mx.zeros((n, dims), dtype=module.scales.dtype)))
            count += 1
    if count:
        log.info("quantized kernels warmed: layers=%d products=%d seconds=%.1f", len(seen),
                 count, time.perf_counter() - start)
    return count
