"""In CI (``CI=true``) a skipped engine or browser test fails the run: those skips mean the
machine lacks MLX, Playwright or Chromium, and a green run must not hide that.

Loaded by tests/conftest.py. Skips elsewhere (and every skip outside CI) stay skips; pytest
runs with ``-rs`` so each shows its reason.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

STRICT_DIRS = frozenset({"engine", "browser"})


def strict(path: Path | str | None) -> bool:
    if path is None or os.environ.get("CI", "").lower() != "true":
        return False
    return Path(path).parent.name in STRICT_DIRS


def _fail(report: Any) -> None:
    why = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"skipped in CI (CI=true), which fails the run: {why}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail") and strict(item.path):
        _fail(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if report.skipped and strict(getattr(collector, "path", None)):
        _fail(report)
