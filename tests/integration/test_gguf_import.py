"""`appliance model import` (appliance/gguf/): GGUF files into MLX model directories that
mlx_lm.load reads, through the real command; bad files get one clear line and leave nothing."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from appliance.backend import installed_kind
from tests.gguf_files import ollama_store, write_gguf
from tests.helpers import NATIVE


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
    assert "Q8_0 tensors kept as they are (MLX's affine 8-bit" in done.stdout
    assert ", 0 rounded again," in done.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["rope_traditional"] is True
    assert config["quantization"]["bits"] == 8 and config["quantization"]["group_size"] == 32
    assert config["tie_word_embeddings"] is True and config["num_key_value_heads"] == 2
    got = dequantized(out, "model.layers.1.self_attn.k_proj", 8)
    assert np.abs(got - reference(gguf, "blk.1.attn_k.weight")).max() < 1e-3
    tokenizer = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer["eos_token"] == "<|im_end|>" and "chat_template" in tokenizer
    assert isinstance(loads_and_generates(out), str)


def test_a_q4_k_file_keeps_its_own_scales_and_mins(tmp_path: Path) -> None:
    """A Q4_K sub-block is an affine 4-bit group of 32: the file's codes, not a second
    rounding (appliance/gguf/blocks.py; per-type fidelity in test_gguf_fidelity.py)."""
    gguf = write_gguf(tmp_path / "tiny-q4k.gguf", quant="Q4_K")
    out = tmp_path / "tiny-q4k"
    done = run_import(str(gguf), out)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Q4_K tensors kept as they are (MLX's affine 4-bit" in done.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 4
    want = reference(gguf, "blk.0.ffn_up.weight")
    got = dequantized(out, "model.layers.0.mlp.up_proj", 4)
    # only the scales' and mins' rounding to float16 (a 4-bit step is ~7 % of a group's range)
    assert np.abs(got - want).max() < (want.max() - want.min()) / 200
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


@pytest.mark.parametrize("damage", ["falcon", "truncated", "not-gguf", "corrupt"])
def test_a_bad_file_gets_one_clear_line_and_leaves_nothing(tmp_path: Path, damage: str) -> None:
    path = write_gguf(tmp_path / "m.gguf", arch="falcon" if damage == "falcon" else "llama")
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
    expect = {"falcon": "architecture 'falcon' is not supported", "not-gguf": "not a GGUF file",
              "truncated": "cannot be read", "corrupt": "cannot be read"}[damage]
    assert expect in lines[0]
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
         "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
         "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
         "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
         "ffn_gate": "mlp.gate_proj", "ffn_down": "mlp.down_proj"}
"""llama.cpp's tensor names (the gguf package's MODEL_TENSORS) and the parameters of
mlx-lm's modules they are; per architecture below where a block differs."""
ARCH_NAMES = {
    "llama": {"ffn_norm": "post_attention_layernorm", "ffn_up": "mlp.up_proj"},
    "gemma3": {"post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm", "ffn_up": "mlp.up_proj"},
    "phi3": {"ffn_norm": "post_attention_layernorm", "ffn_up": "mlp.gate_up_proj"},
}


def direct(path: Path, config: dict[str, object]) -> object:
    """mlx-lm's model of ``config`` with the file's weights as llama.cpp's reference code
    reads them (float32), named by hand; Gemma's norms as its modules want them (llama.cpp's
    converter stores 1 + w)."""
    import mlx.core as mx
    from gguf import GGUFReader, quants
    from mlx_lm.utils import _get_classes

    arch = {"llama": "llama", "gemma3_text": "gemma3", "phi3": "phi3"}[str(config["model_type"])]
    names = {**NAMES, **ARCH_NAMES[arch]}
    weights = {}
    for t in GGUFReader(str(path)).tensors:
        value = np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32)
        if t.name.startswith(("rope_freqs", "v.", "mm.")):
            continue
        if arch == "gemma3" and t.name.endswith("norm.weight"):
            value = value - 1
        parts = t.name.split(".")
        if parts[0] == "blk":
            name = f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
        else:
            name = f"{names[parts[0]]}.{parts[1]}"
        weights[name] = mx.array(value)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    sanitize = getattr(model, "sanitize", lambda w: w)
    model.load_weights(list(sanitize(weights).items()))
    return model


def same_answers(out: Path, path: Path, expect: dict[str, object]) -> None:
    """The imported model (through mlx_lm.load) and the file's weights loaded directly into
    the config ``expect`` give close logits and the same greedy tokens."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    imported, _ = load(str(out))
    config = {**json.loads((out / "config.json").read_text()), **expect}
    config.pop("quantization", None)
    reference_model = direct(path, config)
    prompt = mx.array([5, 80, 130, 42, 7, 99, 200, 13, 64, 250, 3, 17])
    ours, theirs = imported(prompt[None]), reference_model(prompt[None])  # type: ignore[operator]
    assert mx.abs(ours - theirs).max().item() < 0.02 * mx.abs(theirs).max().item()

    def greedy(model: object) -> list[int]:
        steps = generate_step(prompt, model, max_tokens=8,  # type: ignore[arg-type]
                              sampler=lambda x: mx.argmax(x, axis=-1))
        return [int(t) for t, _ in steps]

    assert greedy(imported) == greedy(reference_model)


def test_a_gemma3_header_maps_its_norms_window_and_scale(tmp_path: Path) -> None:
    """With a vision tower beside it, as in Ollama's Gemma 3 file: left out, with a note."""
    gguf = write_gguf(tmp_path / "g3.gguf", arch="gemma3", quant="Q8_0", vision=True)
    out = tmp_path / "tiny-gemma3"
    done = run_import(str(gguf), out)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 vision tensors were left out" in done.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and "rope_traditional" not in config
    assert config["sliding_window"] == 8 and config["sliding_window_pattern"] == 2
    assert config["query_pre_attn_scalar"] == 64 and config["rope_local_base_freq"] == 10000
    import mlx.core as mx

    w = mx.load(str(out / "model.safetensors"))
    assert "lm_head.weight" not in w  # tied, as Gemma 3's files are
    stored = reference(gguf, "blk.1.post_ffw_norm.weight")
    got = np.array(w["model.layers.1.post_feedforward_layernorm.weight"])
    assert np.abs(got - (stored - 1)).max() < 1e-6
    same_answers(out, gguf, {
        "model_type": "gemma3_text", "hidden_size": 256, "num_hidden_layers": 2,
        "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "rms_norm_eps": 1e-5, "vocab_size": 261, "rope_theta": 10000.0,
        "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 64, "sliding_window": 8,
        "sliding_window_pattern": 2, "max_position_embeddings": 512})


def test_a_phi3_header_maps_its_fused_projections(tmp_path: Path) -> None:
    gguf = write_gguf(tmp_path / "p3.gguf", arch="phi3", quant="Q8_0")
    out = tmp_path / "tiny-phi3"
    done = run_import(str(gguf), out)
    assert done.returncode == 0, done.stdout + done.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "phi3" and config["tie_word_embeddings"] is False
    same_answers(out, gguf, {
        "model_type": "phi3", "hidden_size": 256, "num_hidden_layers": 2,
        "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "vocab_size": 261, "rope_theta": 10000.0,
        "tie_word_embeddings": False})


def llama3_rope_freqs(head_dim: int, theta: float, factor: float) -> np.ndarray:
    """llama.cpp's converter's rope_freqs for Llama 3.1's RoPE scaling (low and high
    frequency factors 1 and 4, 8,192 original positions)."""
    import math

    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < 8192 / 4:
            out.append(1.0)
        elif wavelen > 8192 / 1:
            out.append(factor)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def test_a_llama3_files_rope_freqs_become_its_rope_scaling(tmp_path: Path) -> None:
    gguf = write_gguf(tmp_path / "l3.gguf", rope_freqs=llama3_rope_freqs(64, 10000.0, 8.0))
    out = tmp_path / "tiny-llama3"
    done = run_import(str(gguf), out)
    assert done.returncode == 0, done.stdout + done.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}
    import mlx.core as mx

    assert "rope_freqs.weight" not in mx.load(str(out / "model.safetensors"))
    same_answers(out, gguf, {"model_type": "llama", "rope_traditional": True,
                             "rope_scaling": config["rope_scaling"]})
    odd = write_gguf(tmp_path / "odd.gguf", rope_freqs=np.linspace(1, 3, 32))
    refused = run_import(str(odd), tmp_path / "odd")
    assert refused.returncode == 1 and "rope_freqs are not Llama 3.x" in refused.stdout
    assert not (tmp_path / "odd").exists()


@pytest.mark.parametrize(("arch", "pieces"), [("gemma3", ["t", "he", "\u2581a"]),
                                              ("phi3", ["\u2581the", "\u2581a"]),
                                              ("llama", ["\u2581the", "\u2581a"])])
def test_a_sentencepiece_vocabulary_is_built_as_its_architecture_spells_it(
        tmp_path: Path, arch: str, pieces: list[str]) -> None:
    """Gemma's, Phi-3's and Llama 2's files carry SentencePiece vocabularies (scores, byte
    fallback, no merges): Gemma puts no space before the text, the others do."""
    out = tmp_path / f"sp-{arch}"
    done = run_import(str(write_gguf(tmp_path / "sp.gguf", arch=arch, vocab="llama")), out)
    assert done.returncode == 0, done.stdout + done.stderr
    from mlx_lm import load

    _, tok = load(str(out))
    ids = tok.encode("the a", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == pieces
    assert tok.decode(ids) == "the a"
    assert tok.decode(tok.encode("\u00e9t\u00e9", add_special_tokens=False)) == "\u00e9t\u00e9"
    assert tok.eos_token == "</s>" and tok.bos_token == "<s>"
    assert isinstance(loads_and_generates(out), str)


@pytest.mark.parametrize(("pre", "pieces"), [("llama-bpe", ["12", "3", "4", "5"]),
                                             ("qwen2", ["1", "2", "3", "4", "5"]),
                                             ("smollm", ["12", "34", "5"])])
def test_a_byte_level_vocabulary_splits_text_as_its_file_says(
        tmp_path: Path, pre: str, pieces: list[str]) -> None:
    """Llama 3 groups digits by three before the merges, Qwen one by one, GPT-2 (and SmolLM)
    not at all: the merge "3 4" applies only where the split leaves 3 and 4 together."""
    out = tmp_path / f"pre-{pre}"
    done = run_import(str(write_gguf(tmp_path / "pre.gguf", pre=pre)), out)
    assert done.returncode == 0, done.stdout + done.stderr
    from mlx_lm import load

    _, tok = load(str(out))
    ids = tok.encode("12345", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == pieces and tok.decode(ids) == "12345"


def test_an_ollama_model_is_found_in_its_store(tmp_path: Path) -> None:
    """manifest -> the model layer's blob, as Ollama keeps them under ~/.ollama/models."""
    store = ollama_store(tmp_path / "ollama")
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


def test_the_imported_model_answers_through_the_daemon_alone_and_beside_a_stream(
        smollm2: Path, tmp_path: Path) -> None:
    from openai import OpenAI

    from tests.daemon import make_household, start_daemon

    keys = make_household(tmp_path)
    d = start_daemon(smollm2, tmp_path)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    try:
        client = OpenAI(base_url=d.url + "/v1", api_key=keys["bob"])
        reply = client.chat.completions.create(
            model="smollm2-135m-instruct", max_tokens=24, temperature=0, messages=question)
        # a question while bob's own story streams: read riding in its decode steps
        story = client.chat.completions.create(
            model="smollm2-135m-instruct", max_tokens=96, temperature=0, stream=True,
            messages=[{"role": "user", "content": "Tell me a long story about the sea."}])
        chunks = iter(story)
        told = ""
        while not told:  # its first text: the story decodes (the first chunk is the role)
            told = next(c.choices[0].delta.content or "" for c in chunks if c.choices)
        beside = client.chat.completions.create(
            model="smollm2-135m-instruct", max_tokens=24, temperature=0,
            messages=[{"role": "user", "content": "Which city is the capital of France?"}])
        told += "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        rode = 0.0
        for _ in range(50):  # the counters reach /metrics when the engine goes idle
            found = re.search(r"^appliance_engine_mixed_forwards_total (\S+)$",
                              d.client(keys["alice"]).get("/metrics").text, re.M)
            rode = float(found.group(1)) if found else 0.0
            if rode:
                break
            time.sleep(0.2)
        health = d.client(keys["alice"]).get("/health").json()
    finally:
        assert d.terminate() == 0
    assert "Paris" in (reply.choices[0].message.content or "")
    assert "Paris" in (beside.choices[0].message.content or "") and len(told.split()) > 20
    assert rode > 0, "the second question's chunk rode in the story's decode steps"
    # the daemon took its 30 layers' q/k/v and gate/up into the kernel's forms (tiles too,
    # where x is rounded to 16 bits): the path the answer came through
    assert "quantized layers adopted: groups=60 " in d.log.read_text()
    # its KV cache in float16 where the native kernels read it (appliance/engine/kvcache.py):
    # 30 layers x 3 KV heads x 64 features x K and V x 2 bytes
    half = NATIVE and installed_kind() == "cpu"
    assert health["kv_cache"] == {"dtype": "float16" if half else "float32",
                                  "bytes_per_token": 30 * 3 * 64 * 2 * (2 if half else 4)}


def test_an_mlx_4_bit_model_in_bfloat16_answers_through_the_daemon(
        smollm2: Path, tmp_path: Path) -> None:
    """The same weights written as MLX's 4-bit models are published (mlx-lm's convert:
    scales and norms in bfloat16; group size 32 as the file's, since quantizing this small
    model twice at 64 loses its answers), served on the CPU: computed in float32 (MLX's CPU
    has no 16-bit arithmetic; a step took 100 times as long), and the answer is right."""
    from mlx_lm import convert
    from openai import OpenAI

    from tests.daemon import make_household, start_daemon

    dense, model = tmp_path / "dense", tmp_path / "smollm2-bf16-4bit"
    convert(str(smollm2), str(dense), dequantize=True)
    convert(str(dense), str(model), quantize=True, q_group_size=32, q_bits=4,
            dtype="bfloat16")
    keys = make_household(tmp_path)
    d = start_daemon(model, tmp_path)
    try:
        reply = OpenAI(base_url=d.url + "/v1", api_key=keys["bob"]).chat.completions.create(
            model="smollm2-135m-instruct", max_tokens=24, temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
    finally:
        assert d.terminate() == 0
    assert "Paris" in (reply.choices[0].message.content or "")
    log = d.log.read_text()
    assert "16-bit parameters of a quantized model computed in float32" in log
    assert "quantized layers adopted: groups=60 " in log


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
