"""What git keeps of the benchmarks: summaries, never raw traces (issue 53 item 7)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench.summary import SUMMARY_LIMIT

REPO = Path(__file__).resolve().parents[2]
TREE_LIMIT = 15 * 1024 * 1024


def tracked(*paths: str) -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z", *paths], cwd=REPO, check=True,
                             capture_output=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout")
    return [REPO / p for p in out.decode().split("\0") if p]


def test_every_tracked_result_is_a_small_summary() -> None:
    files = tracked("bench/results")
    assert files
    big = {str(p.relative_to(REPO)): p.stat().st_size for p in files
           if p.exists() and p.stat().st_size > SUMMARY_LIMIT}
    assert big == {}, "bench/results keeps summaries (--summary); traces go outside the tree"


def test_the_tracked_tree_stays_under_15_mb() -> None:
    total = sum(p.stat().st_size for p in tracked() if p.is_file() and not p.is_symlink())
    assert total < TREE_LIMIT, f"tracked tree is {total / 1e6:.1f} MB"
