"""Qwen 2-shaped model directories for the two-rank serving benchmark.

mlx_lm pipelines only some architectures across ranks (qwen2 among them, llama not), and
its ``sharded_load`` reads ``model.safetensors.index.json`` to pick each rank's layers. A
Llama model becomes a Qwen 2 one that computes exactly the same function by adding zero
q/k/v biases (Qwen 2 has them, Llama has not) and keeping the rest: same weight names, the
same RoPE (``rope_traditional`` carries over), the same norms and tied embedding. So the
benchmark's SmolLM-135M-shaped random model, or the real SmolLM2-135M 4-bit import,
converts in a second.

Run: ``python -m bench.qwen2_model SOURCE OUT [--bits 4]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
QKV = ("q_proj", "k_proj", "v_proj")
DROPPED_KEYS = ("attention_bias", "mlp_bias", "head_dim", "architectures", "appliance_demo")
"""Llama-only keys (Qwen 2's head dim is hidden / heads; its q/k/v always have biases)."""
GROUP_SIZE = 32
"""Group size of ``--bits`` quantization: the one the SmolLM2 4-bit import uses."""
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "generation_config.json", "chat_template.jinja")


def qwen2_config(llama: Mapping[str, Any]) -> dict[str, Any]:
    """The config.json of the Qwen 2 twin of a Llama config."""
    if llama.get("model_type") not in ("llama", "qwen2"):
        raise ValueError(f"expected a llama model, got model_type {llama.get('model_type')!r}")
    heads, hidden = int(llama["num_attention_heads"]), int(llama["hidden_size"])
    if llama.get("head_dim", hidden // heads) != hidden // heads:
        raise ValueError("Qwen 2 needs head_dim == hidden_size / num_attention_heads")
    if llama.get("attention_bias") or llama.get("mlp_bias"):
        raise ValueError("a llama with biases has no exact Qwen 2 twin")
    config = {k: v for k, v in llama.items() if k not in DROPPED_KEYS}
    config.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    config.setdefault("rope_theta", 10000.0)  # Qwen 2's own default is 1e6
    config.setdefault("tie_word_embeddings", False)  # Llama's default; Qwen 2's is True
    return config


def weight_index(weights: Mapping[str, Any], filename: str = WEIGHTS) -> dict[str, Any]:
    """``model.safetensors.index.json`` for weights kept in one file."""
    total = sum(int(w.nbytes) for w in weights.values())
    return {"metadata": {"total_size": total},
            "weight_map": {name: filename for name in sorted(weights)}}


def add_qkv_biases(weights: dict[str, mx.array], config: Mapping[str, Any]) -> None:
    """Zero q/k/v biases for every layer, in the dtype of the norms (fp32 stays fp32)."""
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = hidden // heads
    dtype = weights["model.norm.weight"].dtype
    for layer in range(int(config["num_hidden_layers"])):
        for proj, width in zip(QKV, (heads, kv_heads, kv_heads), strict=True):
            weights.setdefault(f"model.layers.{layer}.self_attn.{proj}.bias",
                               mx.zeros((width * head_dim,), dtype=dtype))


def write_index(model_dir: Path) -> bool:
    """Write the index of a one-file model directory when it has none; True if written."""
    index = model_dir / INDEX
    if index.exists():
        return False
    weights = mx.load(str(model_dir / WEIGHTS))
    assert isinstance(weights, dict)
    index.write_text(json.dumps(weight_index(weights), indent=2) + "\n")
    return True


def quantize_dir(model_dir: Path, bits: int, group_size: int = GROUP_SIZE) -> None:
    """Quantize a model directory's linear layers and embedding in place (nn.quantize)."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    model, config = load_model(model_dir)
    if config.get("quantization"):
        raise ValueError(f"{model_dir} is already quantized")
    nn.quantize(model, group_size=group_size, bits=bits)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(model_dir / WEIGHTS), weights, metadata={"format": "mlx"})
    config["quantization"] = {"group_size": group_size, "bits": bits}
    (model_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (model_dir / INDEX).write_text(json.dumps(weight_index(weights), indent=2) + "\n")


def convert(source: Path, out: Path, *, bits: int = 0) -> Path:
    """The Qwen 2 twin of the one-file Llama model directory ``source``, in ``out``
    (replaced), quantized to ``bits`` when asked."""
    config = qwen2_config(json.loads((source / "config.json").read_text()))
    weights = mx.load(str(source / WEIGHTS))
    assert isinstance(weights, dict)
    add_qkv_biases(weights, config)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / WEIGHTS), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / INDEX).write_text(json.dumps(weight_index(weights), indent=2) + "\n")
    for name in SIDE_FILES:
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    if bits:
        quantize_dir(out, bits)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.qwen2_model",
                                description="Write the Qwen 2 twin of a Llama model directory.")
    p.add_argument("source", type=Path, help="a one-file llama model directory")
    p.add_argument("out", type=Path, help="the new model directory (replaced)")
    p.add_argument("--bits", type=int, choices=(0, 4, 8), default=0,
                   help="quantize the fp32 twin to this many bits (default: 0, keep)")
    args = p.parse_args(argv)
    print(convert(args.source, args.out, bits=args.bits))
    return 0


if __name__ == "__main__":
    sys.exit(main())
