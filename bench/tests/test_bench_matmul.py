"""The kernel benchmark's report: both configurations and their ratio per row."""

from __future__ import annotations

from pathlib import Path

from bench.matmul import report


def test_the_report_gives_both_times_and_their_ratio() -> None:
    plain = {"steps": {"B = 1": 150.0}, "products": {"1 x 576 @ (1536 x 576).T": 0.4}}
    skinny = {"steps": {"B = 1": 75.0}, "products": {"1 x 576 @ (1536 x 576).T": 0.1}}
    text = report(Path("models/m"), plain, skinny, "python -m bench.matmul")
    assert "| B = 1 | 150.0 | 75.0 | 2.00x |" in text
    assert "| 1 x 576 @ (1536 x 576).T | 0.400 | 0.100 | 4.00x |" in text
    assert "`models/m`" in text and "/work" not in text
