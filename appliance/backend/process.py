"""The CPU backend's process set-up, before MLX is imported (Linux): ``appliance serve`` and
``run`` restart themselves once with Debian's OpenBLAS, and before it the skinny_matmul
kernel, in ``LD_PRELOAD`` (:mod:`appliance.backend.blas` says why). Nothing is preloaded
where MLX computes on Metal or CUDA, or off Linux."""

from __future__ import annotations

import ctypes
import logging
import os
import sys

from appliance.backend.blas import (
    CORETYPE,
    THREAD_TIMEOUT,
    detected_core,
    loaded_libraries,
    openblas_lib,
    preload_env,
    running_core,
    skinny_matmul_lib,
)
from appliance.backend.degraded import reinstall_command

log = logging.getLogger("appliance")

REEXEC_MARK = "APPLIANCE_BLAS_REEXEC"
TUNING = {"simd": ("APPLIANCE_SIMD", "auto"), "quant_act": ("APPLIANCE_QUANT_ACT", "auto"),
          "quant_threads": ("APPLIANCE_QUANT_THREADS", 0),
          "kv_dtype": ("APPLIANCE_KV_DTYPE", "float16")}
"""The engine settings the native code reads (once, from its process's environment) and the
default that leaves the choice to it."""
_tuned = False
"""export_tuning changed a variable a library preloaded before it may already have read."""


def export_tuning(**values: str | int) -> None:
    """Put the engine settings of :data:`TUNING` (appliance/settings.py, validated there) in
    this process's environment, where the native code reads them when it first runs; a
    default removes the variable, so the code's own choice (the processor, its cores)
    stands. Called before MLX loads, and before :func:`prepare` restarts the process."""
    global _tuned
    for name, value in values.items():
        var, default = TUNING[name]
        before = os.environ.get(var)
        if value == default:
            os.environ.pop(var, None)
        else:
            os.environ[var] = str(value)
        _tuned = _tuned or os.environ.get(var) != before


def prepare(kind: str, blas: str, kernel: bool, argv: list[str]) -> None:
    """Restart once with the wanted libraries preloaded when ``kind`` is the CPU and they
    are not preloaded yet; ``kernel``: skinny_matmul too (the native setting and its own)."""
    if kind != "cpu" or os.environ.get(REEXEC_MARK):
        return
    env = preload_env(blas, kernel)
    if env is None and _tuned and os.environ.get("LD_PRELOAD"):
        # preloaded already (a parent set LD_PRELOAD), but before the settings reached the
        # environment: skinny_matmul chose its instruction set at load, so load it again
        env = dict(os.environ)
    if env is None:
        return
    env[REEXEC_MARK] = "1"
    os.execve(sys.executable, [sys.executable, "-m", "appliance", *argv], env)


def log_blas(kernel: bool) -> None:
    """Say which BLAS libraries this process really mapped (Linux), and warn when the
    skinny_matmul kernel was asked for but never built."""
    maps = loaded_libraries()
    if not maps:
        return
    lib = skinny_matmul_lib()
    openblas = "/libopenblas" in maps
    spin = f" ({THREAD_TIMEOUT}={os.environ.get(THREAD_TIMEOUT, 'unset')})" if openblas else ""
    log.info("BLAS: %s%s%s", "Debian's OpenBLAS" if openblas else "the BLAS bundled with mlx",
             ", with skinny_matmul" if lib and lib in maps else "", spin)
    core = running_core(openblas_lib() or "") if openblas else ""
    if core:
        why = (f" ({CORETYPE}={os.environ[CORETYPE]}; its own detection: "
               f"{detected_core(openblas_lib() or '') or 'unknown'})"
               if CORETYPE in os.environ else "")
        log.info("BLAS: OpenBLAS runs its %s kernels%s", core, why)
    if kernel and openblas and lib is None:
        log.warning("skinny_matmul is on but was not built (the package was built with "
                    "APPLIANCE_BUILD_NATIVE=off?): decode steps run on OpenBLAS's gemm, about "
                    "1.2-1.7x slower; fix: %s, or set --no-skinny-matmul", reinstall_command())


def kernel_in_use() -> str | None:
    """The skinny_matmul kernel's instruction set ("avx512", "avx2", "portable") when this
    process has it preloaded, else None. Only a library already mapped is opened."""
    lib = skinny_matmul_lib()
    if lib is None or lib not in loaded_libraries():
        return None
    handle = ctypes.CDLL(lib)
    handle.appliance_skinny_simd.restype = ctypes.c_char_p
    if not handle.appliance_skinny_active():
        return None
    return str(handle.appliance_skinny_simd().decode())
