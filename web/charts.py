"""Small inline SVG charts: geometry only (numbers in, a points string out), no text."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Spark:
    """A polyline and its filled area, scaled into ``width`` x ``height``."""

    width: int
    height: int
    line: str
    area: str
    peak: float


def spark(values: Sequence[float], width: int = 120, height: int = 28,
          peak: float | None = None) -> Spark:
    """Values left (oldest) to right (newest); the top of the chart is ``peak`` or the max."""
    if len(values) < 2:  # nothing to draw yet: a flat line at zero
        values = [values[0], values[0]] if values else [0.0, 0.0]
    top = max(peak if peak is not None else 0.0, *values, 1e-9) * 1.15  # headroom
    n = len(values)
    step = width / max(n - 1, 1)
    pts = [(round(i * step, 1), round(height - 1 - (height - 2) * v / top, 1))
           for i, v in enumerate(values)]
    line = " ".join(f"{x},{y}" for x, y in pts)
    area = f"0,{height} {line} {pts[-1][0]},{height}"
    return Spark(width, height, line, area, float(max(values)))
