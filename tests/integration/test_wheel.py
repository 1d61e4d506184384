"""`pip wheel .` gives a wheel whose install has the fast path (issue 53): scripts/test.sh
builds that wheel in its install phase, as a clean clone would (APPLIANCE_TEST_WHEEL_DIR);
this installs it without dependencies into a fresh environment that reads the test
environment's packages after its own, serves from it, and reads ``/health``."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import httpx
import pytest

from tests.daemon import start_daemon

WHEEL_DIR = os.environ.get("APPLIANCE_TEST_WHEEL_DIR")


def _wheel() -> Path:
    if not WHEEL_DIR:
        why = "no APPLIANCE_TEST_WHEEL_DIR: scripts/test.sh builds the wheel"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{why} (CI must check it)")
        pytest.skip(why)
    [wheel] = Path(WHEEL_DIR).glob("appliance-*.whl")
    return wheel


@pytest.mark.skipif(sys.platform != "linux", reason="the native code is the Linux CPU's")
def test_the_wheel_pip_builds_serves_with_the_fast_path(tiny_model: Path,
                                                         tmp_path: Path) -> None:
    wheel = _wheel()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    # away from the source tree, whose egg-info pip would take for an installed appliance
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "APPLIANCE_NATIVE")}
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], cwd=tmp_path, env=env, check=True,
                   timeout=300)
    site = next((venv / "lib").glob("python3*")) / "site-packages"
    # then the test environment's packages after the wheel's (pip would have taken its
    # appliance for this one), as a plain path: its editable finder is never installed
    (site / "test-env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    data = tmp_path / "data"
    data.mkdir()
    # outside the source tree too: `-m` would import it
    d = start_daemon(tiny_model, data, python=str(python), cwd=tmp_path,
                     unset=("PYTHONPATH", "APPLIANCE_NATIVE"))
    try:
        backend = httpx.get(d.url + "/health", timeout=10).json()["backend"]
        maps = Path(f"/proc/{d.proc.pid}/maps").read_text()
    finally:
        assert d.terminate() == 0
    if backend["kind"] != "cpu":
        pytest.skip("MLX computes on a GPU here")
    assert backend["quant"] in ("avx512", "avx2", "portable"), backend
    assert backend["fused_layer"] and backend["fast_ops"] and backend["degraded"] == []
    assert backend["kernel"] in ("avx512", "avx2", "portable")
    # the libraries that run are the wheel's, not the source tree's
    assert f"{site}/appliance/backend/_mlx_fast" in maps
    assert f"{site}/appliance/backend/_skinny_matmul" in maps
