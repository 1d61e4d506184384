"""Which BLAS MLX's CPU backend runs on (Linux).

``appliance serve`` and ``run`` restart themselves once with libraries in ``LD_PRELOAD``
(:func:`preload`), before MLX is imported:

- Debian's OpenBLAS, in place of the slow reference BLAS bundled in the mlx[cpu] wheel
  (~30-50x faster for a forward pass's matmuls);
- before it, our ``skinny_matmul`` library (``appliance/backend/native/skinny_matmul.c``), which
  runs the matrix products of a few rows (the decode steps of small batches) with its own
  kernel instead of OpenBLAS's gemm (decode steps 1.2-1.9x faster here).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)
SKINNY_MODULE = "appliance.backend._skinny_matmul"

THREAD_TIMEOUT = "OPENBLAS_THREAD_TIMEOUT"
SPIN_EXPONENT = "20"
"""OpenBLAS's worker threads spin for 2**N cycles after a product before they sleep; N is
28 by default, about 0.1 s at 2.5 GHz. The engine alternates OpenBLAS's products (prefill,
and decode steps with prompt chunks riding in them) with skinny_matmul's (plain decode
steps, which share their products with the native code's pool). On 2 cores, a worker
still spinning after a prefill takes a core from the decode step that follows it, and that
step ran at half speed. Measured on the SmolLM-135M shape (in-process, 12 prompts of 58
and of 512 tokens read straight into the batch, then 6 decode steps each): the first step
after the prompt took up to 64-83 ms with the default, against 40 ms for the steps after
it. With 20 (about 0.4 ms; a forward's products come closer together than that), it took
at most 43-52 ms, and reading the prompts was no slower. The engine sets it when OpenBLAS
is preloaded, unless the environment already sets it."""


CORETYPE = "OPENBLAS_CORETYPE"
_BEFORE_AVX2 = frozenset({
    "katmai", "coppermine", "northwood", "prescott", "banias", "core2", "penryn",
    "dunnington", "nehalem", "atom", "sandybridge", "unknown"})
"""OpenBLAS cores whose kernels use no AVX2. OpenBLAS (DYNAMIC_ARCH) picks its kernels by
the processor's model number and falls back to one of these for a model newer than the
library: Debian 12's 0.3.21 took a 2023 Xeon (family 6, model 207, AVX-512) for a Prescott,
whose SSE3 gemm read a 512-token chunk of the SmolLM-135M shape's products 5.6x slower than
its SkylakeX kernels (25.6 against 4.5 ms for 512 x 576 x 1536), slower per row than the
skinny_matmul kernel it takes over from."""


def coretype_for(flags: frozenset[str], detected: str) -> str | None:
    """The OpenBLAS core to ask for (``OPENBLAS_CORETYPE``) when its own detection fell
    back below what a processor with these ``/proc/cpuinfo`` flags runs, else None."""
    if detected.lower() not in _BEFORE_AVX2:
        return None
    if {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    return None


def cpu_flags() -> frozenset[str]:
    """The processor's flags (Linux), empty where unknown."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


@functools.cache
def detected_core(lib: str) -> str:
    """The core OpenBLAS picks on its own here, asked of a fresh process (this one may
    hold the library already, told otherwise); "" when it cannot say."""
    env = {k: v for k, v in os.environ.items() if k not in (CORETYPE, "LD_PRELOAD")}
    env["OPENBLAS_NUM_THREADS"] = "1"
    code = ("import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); "
            "lib.openblas_get_corename.restype = ctypes.c_char_p; "
            "print(lib.openblas_get_corename().decode())")
    try:
        done = subprocess.run([sys.executable, "-S", "-c", code, lib], env=env, timeout=30,
                              capture_output=True, text=True, check=True)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip()


def wanted_coretype(lib: str | None = None) -> str | None:
    """``OPENBLAS_CORETYPE`` for the installed OpenBLAS when its detection falls short of
    this processor (:data:`_BEFORE_AVX2`), else None."""
    lib = lib or openblas_lib()
    if lib is None:
        return None
    detected = detected_core(lib)
    return coretype_for(cpu_flags(), detected) if detected else None


def running_core(lib: str) -> str:
    """The core of the OpenBLAS this process has mapped (its kernels in use), or ""."""
    try:
        handle = ctypes.CDLL(lib)
        handle.openblas_get_corename.restype = ctypes.c_char_p
        return str(handle.openblas_get_corename().decode())
    except (OSError, AttributeError):
        return ""


def openblas_lib() -> str | None:
    """The first OpenBLAS library installed here, if any."""
    return next((p for p in OPENBLAS_CANDIDATES if Path(p).exists()), None)


def skinny_matmul_lib() -> str | None:
    """The compiled skinny_matmul library (built by pip on Linux), if any. It is found, never
    imported: it is a plain shared library that only ``LD_PRELOAD`` loads."""
    spec = importlib.util.find_spec(SKINNY_MODULE)
    origin = spec.origin if spec is not None else None
    return origin if origin and Path(origin).exists() else None


def wanted_preload(blas: str, skinny_matmul: bool) -> list[str]:
    """The libraries to preload, in order, for ``--blas`` and ``--skinny-matmul``; raises
    SystemExit when ``--blas openblas`` is asked for and OpenBLAS is not installed."""
    if blas == "bundled":
        return []
    lib = openblas_lib()
    if lib is None:
        if blas == "openblas":
            raise SystemExit("--blas openblas: libopenblas0-pthread is not installed")
        return []
    kernel = skinny_matmul_lib() if skinny_matmul else None
    return [kernel, lib] if kernel else [lib]


def preload_env(blas: str, skinny_matmul: bool) -> dict[str, str] | None:
    """This process's environment with the wanted libraries at the front of ``LD_PRELOAD``
    (other entries kept after them) and OpenBLAS's spin (:data:`SPIN_EXPONENT`), or None
    when it has them already and nothing to restart for (not Linux, or both already as
    wanted)."""
    if sys.platform != "linux":
        return None
    ours = {p for p in (openblas_lib(), skinny_matmul_lib()) if p}
    have = preloaded()
    want = [*wanted_preload(blas, skinny_matmul), *(p for p in have if p not in ours)]
    env = blas_env(want)
    if want == have and all(env.get(v) == os.environ.get(v) for v in (THREAD_TIMEOUT, CORETYPE)):
        return None
    return env


def blas_env(preload: list[str]) -> dict[str, str]:
    """This process's environment with ``LD_PRELOAD`` set to ``preload`` (removed when
    empty) and, when OpenBLAS is among them, its spin as the engine wants it
    (:data:`SPIN_EXPONENT`) and its kernels for this processor (:func:`wanted_coretype`),
    unless the environment sets them already."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    openblas = next((p for p in preload if "libopenblas" in Path(p).name), None)
    if openblas is not None:
        env.setdefault(THREAD_TIMEOUT, SPIN_EXPONENT)
        core = None if CORETYPE in env else wanted_coretype(openblas)
        if core is not None:
            env[CORETYPE] = core
    return env


def preloaded() -> list[str]:
    """The entries of this process's ``LD_PRELOAD``."""
    value = os.environ.get("LD_PRELOAD", "")
    return [p for p in value.replace(" ", ":").split(":") if p]


def loaded_libraries() -> str:
    """This process's mapped files (Linux), for reports of what really loaded."""
    try:
        return Path("/proc/self/maps").read_text()
    except OSError:
        return ""
