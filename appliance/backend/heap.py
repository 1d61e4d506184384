"""Big buffers kept by malloc instead of handed back to the kernel (MLX on the CPU, glibc).

MLX's CPU backend takes every array's buffer from ``malloc`` and gives it back with
``free``. glibc serves a request above its mmap threshold (adaptive, at most 32 MiB) with a
fresh ``mmap`` and returns it with ``munmap``, and trims the heap's free top above its trim
threshold, so a buffer of that size costs a page fault for every 4 KiB page each time it is
made. In this VM a fault costs some 10 us: attention's scores for a 256-token chunk after
3,840 tokens (3 x 768 x 3,840 floats, 35 MiB a layer) took 23 ms to multiply out and 23 ms
for the softmax, against 11 and 5 ms with the pages kept; a 4,096-token prompt read in
256-token chunks took 19.0-21.4 s against 15.1-19.0 s (three alternating pairs,
docs/BENCHMARKS.md, Run 18). Prefill at long contexts makes such buffers at every layer; a
decode step makes none.

:func:`keep_big_buffers` raises both thresholds so that freed buffers stay in the heap for
the next forward: the process's resident memory then stays at its peak (the biggest
forward's working set) instead of falling back between forwards. An environment that tunes
malloc itself (``GLIBC_TUNABLES`` with ``glibc.malloc``, or ``MALLOC_MMAP_THRESHOLD_`` /
``MALLOC_TRIM_THRESHOLD_``) is left as it is."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Mapping

KEEP_BYTES = 1 << 30
"""Buffers up to this size come from the heap."""
TRIM_BYTES = (1 << 31) - 1
"""Free heap kept before the top is trimmed (the most mallopt's int takes)."""

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""mallopt's parameter numbers (glibc's malloc.h)."""


def tuned_by_environment(env: Mapping[str, str]) -> bool:
    return ("glibc.malloc" in env.get("GLIBC_TUNABLES", "")
            or "MALLOC_MMAP_THRESHOLD_" in env or "MALLOC_TRIM_THRESHOLD_" in env)


def keep_big_buffers(env: Mapping[str, str] | None = None) -> str:
    """Raise glibc malloc's mmap and trim thresholds (:data:`KEEP_BYTES`,
    :data:`TRIM_BYTES`) for this process.
    Returns what was done, for the log: "kept", or why not."""
    env = os.environ if env is None else env
    if not sys.platform.startswith("linux"):
        return "not Linux"
    if tuned_by_environment(env):
        return "malloc tuned by the environment"
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "no glibc mallopt"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(M_MMAP_THRESHOLD, KEEP_BYTES) and mallopt(M_TRIM_THRESHOLD, TRIM_BYTES)):
        return "mallopt refused"
    return "kept"


def give_back() -> bool:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``, which also
    returns whole free pages inside the heap): the thresholds above keep freed buffers, and
    arrays freed once at load (a model's weights held once, appliance/backend/quant.py's
    ``adopt(..., hold=True)``) would otherwise stay resident, unused, and out of what
    ``psutil.virtual_memory().available`` counts for the KV budget. MLX's own cache of
    buffers is cleared first. Whether anything was trimmed."""
    import mlx.core as mx

    mx.clear_cache()
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))
