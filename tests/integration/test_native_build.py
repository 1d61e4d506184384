"""The native code's build (setup.py, CMakeLists.txt; docs/decisions/native-build.md): it
stops naming what is missing, builds without the native code when told, and compiles
against the MLX the package runs with. The wheel itself: tests/integration/test_wheel.py."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _build_ext(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    # an empty PATH: no cmake, no ninja, no compiler to be found
    return subprocess.run([sys.executable, "setup.py", "-q", "build_ext",
                           "--build-temp", str(tmp_path / "temp"),
                           "--build-lib", str(tmp_path / "lib")],
                          cwd=ROOT, env={"PATH": str(tmp_path), **env}, capture_output=True,
                          text=True, timeout=120)


def test_a_build_without_its_tools_stops_and_names_them(tmp_path: Path) -> None:
    out = _build_ext(tmp_path)
    if sys.platform != "linux":  # nothing is compiled off Linux
        assert out.returncode == 0, out.stderr
        return
    assert out.returncode != 0
    # nanobind is named too where this environment lacks it (CI's venv does)
    missing = re.search(r"cannot build the native CPU code: missing (.*?)\. ", out.stderr)
    assert missing, out.stderr
    named = missing.group(1).split(", ")
    assert named[-3:] == ["cmake", "ninja", "a C++ compiler (g++)"], named
    assert set(named[:-3]) <= {"nanobind"}, named
    assert "APPLIANCE_BUILD_NATIVE=off" in out.stderr


def test_the_off_switch_builds_without_the_native_code(tmp_path: Path) -> None:
    out = _build_ext(tmp_path, APPLIANCE_BUILD_NATIVE="off")
    assert out.returncode == 0, out.stderr
    assert not list(tmp_path.rglob("*.so"))
    wrong = _build_ext(tmp_path, APPLIANCE_BUILD_NATIVE="maybe")
    assert "APPLIANCE_BUILD_NATIVE must be on or off, not 'maybe'" in wrong.stderr


def test_the_build_compiles_against_the_mlx_the_package_runs_with() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pins = [r for r in (*project["build-system"]["requires"],
                        *project["project"]["dependencies"],
                        *project["project"]["optional-dependencies"]["cpu"],
                        *project["project"]["optional-dependencies"]["cuda"])
            if r.startswith("mlx") and "sys_platform == 'linux'" in r]
    versions = {m.group(1) for r in pins if (m := re.search(r"==([\d.]+)", r))}
    assert len(pins) == 4 and len(versions) == 1, pins
    assert {"cmake", "ninja", "nanobind"} <= {re.split(r"[<>=\[; ]", r)[0]
                                              for r in project["build-system"]["requires"]}
    if sys.platform == "linux":  # what this environment installed from those pins
        assert importlib.metadata.version("mlx") in versions
