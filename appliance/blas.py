"""Where Debian's OpenBLAS lives (Linux): ``appliance serve`` and the benchmarks preload it in
place of the slow reference BLAS bundled in the mlx[cpu] wheel."""

from __future__ import annotations

from pathlib import Path

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)


def openblas_lib() -> str | None:
    """The first OpenBLAS library installed here, if any."""
    return next((p for p in OPENBLAS_CANDIDATES if Path(p).exists()), None)
