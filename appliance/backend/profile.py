"""Cost profiles: what each backend tells the scheduler's cost model about its device.

The scheduler knows a profile (:class:`~appliance.sched.cost.CostProfile`), never a kernel:
only this module knows why a device's products change cost at some row count."""

from __future__ import annotations

from appliance.sched.cost import CostProfile

WIDE_ROWS = 16
"""The skinny_matmul kernel computes up to 16 rows in two groups of 8 over a block of the
weights held in the cache; a third group reads the weights again (docs/decisions.md)."""
KERNEL_ROWS = 32
"""The skinny_matmul kernel takes at most 32 rows; OpenBLAS's gemm, which packs the weights
first, takes the rest. The quantized kernel hands over at the same count (to dequantized
weights in that gemm: appliance/backend/quant.py's ``KERNEL_ROWS``)."""

CPU_KERNEL = CostProfile("cpu-kernel", (WIDE_ROWS, KERNEL_ROWS))
"""MLX on the CPU with the appliance's skinny_matmul kernel preloaded before OpenBLAS."""
PLAIN = CostProfile("plain")
"""Anything else (MLX's own CPU BLAS or OpenBLAS alone, Metal, CUDA): no step the
appliance knows of; the fit still learns the rest of the device's costs online."""


def profile_for(kernel_active: bool) -> CostProfile:
    return CPU_KERNEL if kernel_active else PLAIN
