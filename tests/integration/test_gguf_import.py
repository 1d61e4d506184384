"""`appliance model import` (appliance/gguf.py): GGUF files into MLX model directories that
mlx_lm.load reads, through the real command; bad files get one clear line and leave nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.gguf_files import write_gguf


def run_import(source: str, out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-m", "appliance", "model", "import", source,
                           "--out", str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def reference(path: Path, name: str) -> np.ndarray:
    """llama.cpp's own dequantization of one tensor of the file."""
    from gguf import GGUFReader, quants

    tensor = next(t for t in GGUFReader(str(path)).tensors if t.name == name)
    return np.asarray(quants.dequantize(tensor.data, tensor.tensor_type), np.float32)


def dequantized(model_dir: Path, base: str, bits: int) -> np.ndarray:
    import mlx.core as mx

    w = mx.load(str(model_dir / "model.safetensors"))
    return np.array(mx.dequantize(w[f"{base}.weight"], w[f"{base}.scales"],
                                  w[f"{base}.biases"], group_size=32, bits=bits))


def loads_and_generates(model_dir: Path) -> str:
    from mlx_lm import generate, load

    model, tok = load(str(model_dir))
    prompt = tok.apply_chat_template([{"role": "user", "content": "the"}],
                                     add_generation_prompt=True, tokenize=False)
    return str(generate(model, tok, prompt, max_tokens=4))


def test_q8_0_stays_quantized_and_matches_llama_cpps_values(tmp_path: Path) -> None:
    gguf = write_gguf(tmp_path / "tiny-q8.gguf", quant="Q8_0")
    out = tmp_path / "tiny-q8"
    done = run_import(str(gguf), out)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "note:" not in done.stdout and ", 0 quantized again," in done.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["rope_traditional"] is True
    assert config["quantization"]["bits"] == 8 and config["quantization"]["group_size"] == 32
    assert config["tie_word_embeddings"] is True and config["num_key_value_heads"] == 2
    got = dequantized(out, "model.layers.1.self_attn.k_proj", 8)
    assert np.abs(got - reference(gguf, "blk.1.attn_k.weight")).max() < 1e-3
    tokenizer = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer["eos_token"] == "<|im_end|>" and "chat_template" in tokenizer
    assert isinstance(loads_and_generates(out), str)


def test_a_k_quant_is_read_by_llama_cpps_code_and_quantized_again(tmp_path: Path) -> None:
    gguf = write_gguf(tmp_path / "tiny-q4k.gguf", quant="Q4_K")
    out = tmp_path / "tiny-q4k"
    done = run_import(str(gguf), out)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "quantized again to MLX's affine 4-bit" in done.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 4
    want = reference(gguf, "blk.0.ffn_up.weight")
    got = dequantized(out, "model.layers.0.mlp.up_proj", 4)
    # affine 4-bit over groups of 32: within a sixteenth of each group's range
    assert np.abs(got - want).max() < (want.max() - want.min()) / 16
    assert isinstance(loads_and_generates(out), str)


def test_a_qwen3_header_maps_its_query_and_key_norms(tmp_path: Path) -> None:
    out = tmp_path / "tiny-qwen3"
    done = run_import(str(write_gguf(tmp_path / "q3.gguf", arch="qwen3")), out)
    assert done.returncode == 0, done.stdout + done.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3" and "rope_traditional" not in config
    import mlx.core as mx

    names = set(mx.load(str(out / "model.safetensors")))
    assert "model.layers.0.self_attn.q_norm.weight" in names
    assert isinstance(loads_and_generates(out), str)


@pytest.mark.parametrize("damage", ["gemma3", "truncated", "not-gguf", "corrupt"])
def test_a_bad_file_gets_one_clear_line_and_leaves_nothing(tmp_path: Path, damage: str) -> None:
    path = write_gguf(tmp_path / "m.gguf", arch="gemma3" if damage == "gemma3" else "llama")
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[:len(data) // 2])
    elif damage == "not-gguf":
        path.write_bytes(b"PK\x03\x04" + data[4:])
    elif damage == "corrupt":
        path.write_bytes(data[:4] + bytes(64) + data[68:])
    out = tmp_path / "out"
    done = run_import(str(path), out)
    assert done.returncode == 1
    lines = [line for line in done.stdout.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stdout + done.stderr
    expect = {"gemma3": "architecture 'gemma3' is not supported", "not-gguf": "not a GGUF file",
              "truncated": "cannot be read", "corrupt": "cannot be read"}[damage]
    assert expect in lines[0]
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


def test_an_ollama_model_is_found_in_its_store(tmp_path: Path) -> None:
    """manifest -> the model layer's blob, as Ollama keeps them under ~/.ollama/models."""
    store = tmp_path / "ollama"
    blob = store / "blobs" / "sha256-0123abcd"
    blob.parent.mkdir(parents=True)
    write_gguf(blob, quant="Q8_0")
    manifest = store / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "q8"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256-ffff"},
        {"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:0123abcd"}]}))
    out = tmp_path / "from-ollama"
    done = run_import("ollama:tiny:q8", out, OLLAMA_MODELS=str(store))
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    missing = run_import("ollama:nothing", tmp_path / "x", OLLAMA_MODELS=str(store))
    assert missing.returncode == 1 and "no Ollama model 'nothing'" in missing.stdout


def test_the_bundled_smollm2_is_imported_as_a_4_bit_instruct_model(smollm2: Path) -> None:
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["model_type"] == "llama" and config["quantization"]["bits"] == 4
    assert config["num_hidden_layers"] == 30 and config["vocab_size"] == 49152


def test_the_imported_model_answers_a_factual_question_through_the_daemon(
        smollm2: Path, tmp_path: Path) -> None:
    from openai import OpenAI

    from tests.daemon import make_household, start_daemon

    keys = make_household(tmp_path)
    d = start_daemon(smollm2, tmp_path)
    try:
        client = OpenAI(base_url=d.url + "/v1", api_key=keys["bob"])
        reply = client.chat.completions.create(
            model="smollm2-135m-instruct", max_tokens=24, temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
    finally:
        assert d.terminate() == 0
    assert "Paris" in (reply.choices[0].message.content or "")


def test_float32_stores_the_dequantized_weights(tmp_path: Path) -> None:
    gguf = write_gguf(tmp_path / "tiny-q8.gguf", quant="Q8_0")
    out = tmp_path / "tiny-f32"
    import os

    done = subprocess.run([sys.executable, "-m", "appliance", "model", "import", str(gguf),
                           "--out", str(out), "--float32"], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "quantization" not in json.loads((out / "config.json").read_text())
    import mlx.core as mx

    w = mx.load(str(out / "model.safetensors"))
    assert not any(name.endswith(".scales") for name in w)
    got = np.array(w["model.layers.1.self_attn.k_proj.weight"])
    assert got.dtype == np.float32
    assert np.abs(got - reference(gguf, "blk.1.attn_k.weight")).max() < 1e-3
    assert isinstance(loads_and_generates(out), str)
