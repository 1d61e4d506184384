"""What computes is said once, at start-up, and by ``/health`` (appliance/backend): a started
`appliance serve` reports its backend as the environment chose it. CI runs this in both legs:
with the native code (kernel, fast ops, malloc kept) and with APPLIANCE_NATIVE=off."""

from __future__ import annotations

from pathlib import Path

import httpx

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
    if NATIVE:
        assert backend["native"] and backend["fast_ops"] and backend["heap"] == "kept"
        assert backend["kernel"] in ("avx512", "avx2", "portable")
        assert backend["profile"] == "cpu-kernel"
        assert kernel is not None and kernel in maps
    else:  # MLX as shipped, over OpenBLAS: none of our code mapped, no steps to plan around
        assert not backend["native"] and not backend["fast_ops"]
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
    assert "APPLIANCE_KV_DTYPE must be float16 or float32, not 'float8'" in d.log.read_text()
