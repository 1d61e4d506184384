"""A quantized model's weights are held once (appliance/backend/quant.py's ``hold_once``): a
started `appliance serve` of a small 4-bit GGUF import reports in ``/health`` resident weights
within 5 % of the file's tensor bytes (the tiles the kernels read in place of MLX's arrays,
not beside them), answers from them, and counts its KV budget from what is then free."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from tests.daemon import make_household, start_daemon
from tests.gguf_files import write_gguf
from tests.helpers import NATIVE


def tensor_bytes(path: Path) -> int:
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)


def test_a_4_bit_files_weights_are_resident_once_and_answer(tmp_path: Path) -> None:
    # Q4_1 holds a block of 32 as MLX's affine 4-bit does (16 bytes of codes, a 16-bit
    # scale and minimum): the same bytes when held once, twice them with tiles beside
    gguf = write_gguf(tmp_path / "tiny-q4.gguf", quant="Q4_1", hidden=256, layers=2)
    model = tmp_path / "tiny-q4"
    done = subprocess.run([sys.executable, "-m", "appliance", "model", "import", str(gguf),
                           "--out", str(model)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    keys = make_household(tmp_path)
    d = start_daemon(model, tmp_path, "--kv-cache-budget", "auto")
    try:
        health = httpx.get(d.url + "/health", timeout=10).json()
        answer = httpx.post(d.url + "/v1/completions", timeout=120,
                            headers={"Authorization": f"Bearer {keys['bob']}"},
                            json={"model": health["model"], "prompt": "the the the",
                                  "max_tokens": 8, "temperature": 0}).json()
    finally:
        assert d.terminate() == 0
    memory = health["memory"]
    assert 0 < memory["weights_bytes"] <= 1.05 * tensor_bytes(gguf), memory
    assert memory["kv_budget_bytes"] > 0
    assert answer["choices"][0]["finish_reason"] in ("length", "stop"), answer
    log = d.log.read_text()
    if NATIVE and health["backend"]["quant"] in ("avx512", "avx2"):
        # every 4-bit layer tiled (x in 16 bits), its arrays freed
        freed = int(log.split("freed=", 1)[1].split()[0])
        assert freed >= memory["weights_bytes"] // 2, log[-2000:]
