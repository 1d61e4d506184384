"""tests/unit is pure (no MLX, no tokenizer, no subprocess): its conftest refuses them, but
an import is only seen by a process that has not loaded the module yet, and the whole suite
loads MLX while collecting tests/engine. So tests/unit is collected here on its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_unit_test_module_imports_mlx_or_a_tokenizer() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "tests/unit"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "ImpureTest" not in done.stdout
