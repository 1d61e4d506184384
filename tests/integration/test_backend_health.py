"""What computes is said once, at start-up, and by ``/health`` (appliance/backend): a started
`appliance serve` reports its backend as the environment chose it. CI runs this in both legs:
with the native code (kernel, fast ops, malloc kept) and with APPLIANCE_NATIVE=off."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from appliance.backend import installed_kind
from appliance.backend.blas import loaded_libraries, skinny_matmul_lib
from tests.daemon import start_daemon
from tests.helpers import NATIVE


def test_health_names_the_backend_the_daemon_really_runs(tiny_model: Path,
                                                         tmp_path: Path) -> None:
    d = start_daemon(tiny_model, tmp_path)
    try:
        health = httpx.get(d.url + "/health", timeout=10).json()
        backend = health["backend"]
        maps = Path(f"/proc/{d.proc.pid}/maps").read_text()
    finally:
        assert d.terminate() == 0
    assert backend["kind"] == installed_kind()
    # an unquantized model's cache in its own dtype (a 4-bit one's: tests/integration/
    # test_gguf_import.py)
    assert health["kv_cache"]["dtype"] == "float32" and health["kv_cache"]["bytes_per_token"] > 0
    if backend["kind"] != "cpu":  # Metal and CUDA: MLX as shipped, none of the CPU's tuning
        assert backend["device"] == "Device(gpu, 0)" and not backend["native"]
        assert backend["kernel"] is None and backend["quant"] is None
        assert backend["heap"].startswith("not tuned")
        return
    assert backend["device"] == "Device(cpu, 0)"
    kernel = skinny_matmul_lib()
    assert backend["degraded"] == []  # native off by the setting is not degraded
    if NATIVE:
        assert backend["native"] and backend["fast_ops"] and backend["heap"] == "kept"
        assert backend["fused_layer"] and backend["quant"] in ("avx512", "avx2", "portable")
        assert backend["kernel"] in ("avx512", "avx2", "portable")
        assert backend["profile"] == "cpu-kernel"
        assert kernel is not None and kernel in maps
    else:  # MLX as shipped, over OpenBLAS: none of our code mapped, no steps to plan around
        assert not backend["native"] and not backend["fast_ops"] and not backend["fused_layer"]
        assert backend["kernel"] is None and backend["profile"] == "plain"
        assert kernel is None or kernel not in maps
        assert "_mlx_fast" not in maps
    assert "/libopenblas" in maps
    assert loaded_libraries()  # /proc is readable here: the maps above are real


def test_a_kv_dtype_the_daemon_cannot_keep_stops_it_with_a_clear_error(
        tiny_model: Path, tmp_path: Path) -> None:
    d = start_daemon(tiny_model, tmp_path, env={"APPLIANCE_KV_DTYPE": "float8"}, wait=False)
    try:
        code = d.proc.wait(timeout=120)
    finally:
        if d.proc.poll() is None:
            d.proc.kill()
    assert code != 0
    assert "kv_dtype must be one of float16, float32, got 'float8'" in d.log.read_text()


@pytest.mark.skipif(not NATIVE, reason="the native code is off in this leg")
def test_the_simd_setting_reaches_the_native_code(tiny_model: Path, tmp_path: Path) -> None:
    # a flag (not the variable the code reads): the CLI exports it before MLX loads
    d = start_daemon(tiny_model, tmp_path, "--simd", "portable")
    try:
        backend = httpx.get(d.url + "/health", timeout=10).json()["backend"]
    finally:
        assert d.terminate() == 0
    if backend["kind"] != "cpu":
        pytest.skip("MLX computes on a GPU here")
    assert backend["kernel"] == "portable" and backend["quant"] == "portable"
