"""The mixed-forward benchmark's report: each tick's three times and the chunk's cost."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.mixed import main, report


def test_the_report_gives_the_chunks_cost_apart_and_riding() -> None:
    result = {"8,32": {"step": 100.0, "apart": 274.0, "mixed": 221.0},
              "1,8": {"step": 50.0, "apart": 60.0, "mixed": 49.0}}
    text = report(Path("models/m"), result, "python -m bench.mixed", "a machine")
    assert "| 8 | 32 | 100 | 274 | 221 | 174 / 121 ms: 1.44x |" in text
    assert "| 1 | 8 | 50 | 60 | 49 | 10 / -1 ms: - |" in text  # riding cost nothing: no ratio
    assert "`models/m`" in text and "/work" not in text


@pytest.mark.parametrize("flag,value", [("--chunks", "0,8"), ("--rows", "4,x"), ("--rows", "")])
def test_sizes_that_are_not_positive_integers_are_refused_before_any_model_loads(
        flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([flag, value, "--model", "no/such/model"])
    assert exc.value.code == 2
    assert "expected positive integers like 8,16,32" in capsys.readouterr().err
