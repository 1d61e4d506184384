"""The native code's tuning knobs are settings (appliance/settings.py) that the CLI exports
for the native code (appliance/backend/process.export_tuning); a default leaves the choice
to the code (the processor, the machine's cores). Through a started daemon:
tests/integration/test_backend_health.py."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from appliance import settings as settings_mod
from appliance.backend.process import TUNING, export_tuning


def _exported(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> dict[str, str]:
    for var, _ in TUNING.values():
        monkeypatch.setenv(var, "stale")  # what an earlier process left is replaced
    e = settings_mod.load(env=env).engine
    export_tuning(simd=e.simd, quant_act=e.quant_act, quant_threads=e.quant_threads,
                  kv_dtype=e.kv_dtype)
    return {var: os.environ[var] for var, _ in TUNING.values() if var in os.environ}


def test_defaults_leave_the_choice_to_the_native_code(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    assert _exported(monkeypatch, {"APPLIANCE_DATA_DIR": str(tmp_path)}) == {}


def test_chosen_values_reach_the_native_codes_variables(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    (tmp_path / "appliance.toml").write_text('[engine]\nsimd = "avx2"\nquant_threads = 3\n')
    assert _exported(monkeypatch, {"APPLIANCE_DATA_DIR": str(tmp_path),
                                   "APPLIANCE_QUANT_ACT": "float",
                                   "APPLIANCE_KV_DTYPE": "float32"}) == {
        "APPLIANCE_SIMD": "avx2", "APPLIANCE_QUANT_THREADS": "3",
        "APPLIANCE_QUANT_ACT": "float", "APPLIANCE_KV_DTYPE": "float32"}


@pytest.mark.parametrize(("var", "value", "why"), [
    ("APPLIANCE_SIMD", "sse2", "simd must be one of auto, avx512, avx2, portable"),
    ("APPLIANCE_QUANT_ACT", "int8", "quant_act must be one of auto, float, int16"),
    ("APPLIANCE_QUANT_THREADS", "-1", "quant_threads must be >= 0"),
    ("APPLIANCE_KV_DTYPE", "float8", "kv_dtype must be one of float16, float32")])
def test_a_knob_out_of_its_range_is_refused_at_start(tmp_path: Path, var: str, value: str,
                                                     why: str) -> None:
    with pytest.raises(ValueError, match=why):
        settings_mod.load(env={"APPLIANCE_DATA_DIR": str(tmp_path), var: value})


def test_the_backend_reads_no_tuning_variable_the_settings_do_not_declare() -> None:
    backend = Path(__file__).resolve().parents[2] / "appliance" / "backend"
    declared = {settings_mod.env_name(f) for _, f in settings_mod.iter_fields()}
    for path in backend.glob("*.py"):
        for word in path.read_text().replace('"', " ").replace("'", " ").split():
            name = word.strip("`(),.:;*")
            if name.startswith("APPLIANCE_") and name.isupper():
                assert name in declared or name in OWN_MARKS, f"{path.name}: {name}"
    # the native code names its own macros APPLIANCE_*: there, only what it reads counts
    for path in backend.glob("native/*"):
        for name in re.findall(r'getenv\(\s*"(APPLIANCE_[A-Z0-9_]+)"', path.read_text()):
            assert name in declared or name in OWN_MARKS, f"{path.name}: {name}"


OWN_MARKS = {"APPLIANCE_BLAS_REEXEC", "APPLIANCE_BUILD_NATIVE"}
"""Not settings: the mark of the process's own restart (process.py) and the build's switch."""
