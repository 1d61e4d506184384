"""The CPU backend's process set-up, before MLX is imported (Linux): ``appliance serve`` and
``run`` restart themselves once with Debian's OpenBLAS, and before it the skinny_matmul
kernel, in ``LD_PRELOAD`` (:mod:`appliance.backend.blas` says why). Nothing is preloaded
where MLX computes on Metal or CUDA, or off Linux."""

from __future__ import annotations

import ctypes
import logging
import os
import sys

from appliance.backend.blas import THREAD_TIMEOUT, loaded_libraries, preload_env, skinny_matmul_lib

log = logging.getLogger("appliance")

REEXEC_MARK = "APPLIANCE_BLAS_REEXEC"


def prepare(kind: str, blas: str, kernel: bool, argv: list[str]) -> None:
    """Restart once with the wanted libraries preloaded when ``kind`` is the CPU and they
    are not preloaded yet; ``kernel``: skinny_matmul too (the native setting and its own)."""
    if kind != "cpu" or os.environ.get(REEXEC_MARK):
        return
    env = preload_env(blas, kernel)
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
    if kernel and openblas and lib is None:
        log.warning("skinny_matmul is on but was not built (no C compiler when the package "
                    "was installed?): decode steps run on OpenBLAS's gemm, about 1.2-1.7x "
                    "slower; install gcc and reinstall, or set --no-skinny-matmul")


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
