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


@dataclass(frozen=True, slots=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    value: int
    label: str


def bars(values: Sequence[int], labels: Sequence[str], width: int = 240,
         height: int = 48) -> list[Bar]:
    """A bar per value, left (oldest) to right, scaled to the largest; each with its label
    and value for a tooltip."""
    top = max(max(values, default=0), 1)
    n = max(len(values), 1)
    step = width / n
    out = []
    for i, (v, label) in enumerate(zip(values, labels, strict=True)):
        h = round((height - 1) * v / top, 1) if v else 0.0
        out.append(Bar(round(i * step + 0.5, 1), round(height - h, 1),
                       round(max(step - 1.0, 0.5), 1), h, int(v), label))
    return out
