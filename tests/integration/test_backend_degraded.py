"""A daemon that runs without its native code says so where an admin looks: a WARNING with
the one command that fixes it at start, ``backend.degraded`` in ``/health`` and a notice on
the dashboard (appliance/backend/degraded.py). The package here is the source tree with its
compiled libraries left out, as ``APPLIANCE_BUILD_NATIVE=off`` builds it."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from tests.daemon import make_household, start_daemon
from tests.integration.test_authz_matrix import login

ROOT = Path(__file__).resolve().parents[2]


def _tree_without_native(into: Path) -> Path:
    """The source packages as links, but for appliance/backend's compiled parts."""
    into.mkdir()
    for top in ("web", "migrations"):
        (into / top).symlink_to(ROOT / top)
    for package in ("appliance", "appliance/backend"):
        (into / package).mkdir(parents=True)
        for entry in (ROOT / package).iterdir():
            made_here = package == "appliance" and entry.name == "backend"
            if not (made_here or entry.name == "__pycache__"
                    or entry.name.startswith(("_mlx_fast", "_skinny_matmul"))):
                (into / package / entry.name).symlink_to(entry)
    return into


@pytest.mark.skipif(sys.platform != "linux", reason="the native code is the Linux CPU's")
def test_a_daemon_without_its_native_code_says_so_with_the_fix(tiny_model: Path,
                                                                 tmp_path: Path) -> None:
    src = _tree_without_native(tmp_path / "src")
    data = tmp_path / "data"
    data.mkdir()
    make_household(data)
    # the leg without native code asks for none: this daemon must want it
    d = start_daemon(tiny_model, data, env={"PYTHONPATH": str(src)}, cwd=tmp_path,
                     unset=("APPLIANCE_NATIVE",))
    log = d.log
    try:
        backend = httpx.get(d.url + "/health", timeout=10).json()["backend"]
        with httpx.Client(base_url=d.url, timeout=60) as browser:
            login(browser, "alice")
            page = browser.get("/dashboard").text
    finally:
        assert d.terminate() == 0
    if backend["kind"] != "cpu":
        pytest.skip("MLX computes on a GPU here")
    assert not backend["fast_ops"] and backend["quant"] is None and not backend["fused_layer"]
    [reason] = [r for r in backend["degraded"] if "native CPU code" in r]
    what, _, fix = reason.rpartition("; fix: ")
    assert "_mlx_fast was not built" in what and "--force-reinstall" in fix
    [warning] = [line for line in log.read_text().splitlines() if "backend degraded" in line]
    assert "WARNING" in warning and warning.endswith(f"backend degraded: {reason}")
    assert "Running slower than this machine can." in page
    assert "_mlx_fast was not built" in page and fix.replace("'", "&#39;") in page
