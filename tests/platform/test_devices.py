"""The engine on Metal (macOS) and CUDA (MLX's CUDA build on Linux): run where the platform
matches, skipped with the reason elsewhere (no CI machine has either; docs/backends.md says
what was verified where). Each serves the bundled demo model through the real engine, checks
that none of the CPU's tuning is used, and that greedy output is mlx-lm's own."""

from __future__ import annotations

import queue
import sys
from pathlib import Path

import pytest

from appliance.backend import installed_kind

KIND = installed_kind()


def _serve_and_compare(demo_model: Path, kind: str) -> None:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    from appliance.app import start_engine
    from appliance.engine.request import FinishEvent, GenerationRequest, blocking_sink
    from tests.helpers import make_settings

    assert mx.default_device() == mx.gpu
    engine = start_engine(make_settings(demo_model, prompt_cache_entries=0))
    try:
        backend = engine.loaded.backend  # type: ignore[union-attr]
        assert backend.kind == kind and not backend.native and backend.kernel is None
        assert not backend.fast_ops and backend.profile.step_rows == ()
        tok = engine.loaded.tokenizer  # type: ignore[union-attr]
        prompt = tuple(tok.apply_chat_template([{"role": "user", "content": "Hello"}],
                                               add_generation_prompt=True))
        q: queue.SimpleQueue = queue.SimpleQueue()  # type: ignore[type-arg]
        engine.submit(GenerationRequest(prompt=prompt, max_tokens=12), blocking_sink(q))
        text = ""
        while not isinstance(ev := q.get(timeout=120), FinishEvent):
            text += ev.text
        text += ev.text
    finally:
        engine.stop()
    model, tok = load(str(demo_model))
    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=12):
        if token in tok.eos_token_ids:
            break
        out.append(int(token))
    assert text == tok.decode(out)


@pytest.mark.skipif(sys.platform != "darwin", reason="Metal: macOS on Apple silicon only")
def test_metal_serves_greedy_like_mlx_lm_without_cpu_tuning(demo_model: Path) -> None:
    _serve_and_compare(demo_model, "metal")


@pytest.mark.skipif(KIND != "cuda", reason="CUDA: needs MLX's CUDA build (appliance[cuda]) "
                    "and an NVIDIA GPU")
def test_cuda_serves_greedy_like_mlx_lm_without_cpu_tuning(demo_model: Path) -> None:
    _serve_and_compare(demo_model, "cuda")


@pytest.mark.skipif(KIND != "cuda", reason="CUDA: needs MLX's CUDA build (appliance[cuda]) "
                    "and an NVIDIA GPU")
def test_cuda_compiles_a_4bit_models_kernels_at_load_into_the_data_dir(
        demo_model: Path, tmp_path: Path) -> None:
    """MLX compiles a 4-bit product's kernels at first use, about 20 s each on an H200: the
    daemon does it while it loads, into its data directory (appliance/backend/gpu.py)."""
    import os

    from mlx_lm import convert

    from tests.daemon import start_daemon

    if os.environ.get("MLX_PTX_CACHE_DIR"):
        pytest.skip("MLX_PTX_CACHE_DIR is set here: the daemon keeps the admin's choice")
    model = tmp_path / "demo-4bit"
    convert(str(demo_model), mlx_path=str(model), quantize=True, q_bits=4, q_group_size=32)
    data = tmp_path / "data"
    data.mkdir()
    d = start_daemon(model, data)
    try:
        log = d.log.read_text()
    finally:
        assert d.terminate() == 0
    cache = data / "cache" / "mlx-ptx"
    assert f"MLX kernel cache: {cache}" in log, log[-2000:]
    assert "quantized kernels warmed" in log, log[-2000:]
    assert any(p.name.startswith("qmm") for p in cache.rglob("*")), sorted(cache.rglob("*"))
