"""The one percentile function: the dashboard, the simulator, the engine's per-request ITL
and the benchmarks all use it. Pure, no imports from the rest of the appliance."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

Method = Literal["nearest", "linear"]


def percentile(values: Sequence[float], q: float, method: Method = "nearest"
               ) -> float | None:
    """The ``q``-th percentile (0..100) of ``values``; None for no values.

    ``nearest``: the nearest rank, the smallest value with at least ``q`` % of the values at
    or below it (always a value that was measured: what a dashboard shows). ``linear``:
    interpolated between the closest ranks, numpy's default (what the benchmark reports
    compare with other tools)."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be within [0, 100], got {q}")
    if not values:
        return None
    ordered = sorted(values)
    if method == "nearest":
        return float(ordered[max(1, math.ceil(q / 100.0 * len(ordered))) - 1])
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    weight = rank - low
    return float(ordered[low] * (1.0 - weight) + ordered[high] * weight)
