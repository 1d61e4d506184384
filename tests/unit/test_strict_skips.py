"""CI=true turns a skipped engine or browser test into a failure; other skips stay skips."""

from __future__ import annotations

import pytest

SKIPS = """
import pytest

def test_needs_something():
    pytest.skip("Chromium is not installed")
"""


def _layout(pytester: pytest.Pytester) -> None:
    for folder in ("engine", "browser", "unit"):
        pytester.mkpydir(folder)
        (pytester.path / folder / f"test_{folder}_skip.py").write_text(SKIPS)
    pytester.mkpydir("engine2")
    (pytester.path / "engine2" / "test_module_skip.py").write_text(
        "import pytest\npytest.importorskip('no_such_module_here')\n")
    (pytester.path / "browser" / "test_module_skip.py").write_text(
        "import pytest\npytest.importorskip('no_such_module_here')\n")


def test_in_ci_an_engine_or_browser_skip_fails_the_run(pytester: pytest.Pytester,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    _layout(pytester)
    result = pytester.runpytest("-p", "tests.strict_skips", "-rs",
                                "--continue-on-collection-errors")
    result.assert_outcomes(failed=2, skipped=2, errors=1)
    result.stdout.fnmatch_lines(["*skipped in CI (CI=true), which fails the run*"])
    assert result.ret != 0


def test_outside_ci_skips_are_skips_with_their_reason(pytester: pytest.Pytester,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    _layout(pytester)
    result = pytester.runpytest("-p", "tests.strict_skips", "-rs")
    result.assert_outcomes(skipped=5)
    result.stdout.fnmatch_lines(["SKIPPED*Chromium is not installed*"])
    assert result.ret == 0
