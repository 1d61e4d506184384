"""Small random-weight models of each architecture the riding forward reads
(appliance/engine/mixed.py), built with mlx-lm's own model classes and written as model
directories with the demo model's tokenizer, so the engine loads them as it loads any."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

VOCAB = 4096
"""The demo model's tokenizer's vocabulary."""

_BASE: dict[str, Any] = {
    "hidden_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 256, "vocab_size": VOCAB,
    "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "rope_theta": 10000.0,
    "bos_token_id": 1, "eos_token_id": [2, 0], "pad_token_id": 2,
    "tie_word_embeddings": False,
}

CONFIGS: dict[str, dict[str, Any]] = {
    "llama3": {**_BASE, "model_type": "llama", "tie_word_embeddings": True,
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 256}},
    "mistral": {**_BASE, "model_type": "mistral", "head_dim": 32},
    "qwen3": {**_BASE, "model_type": "qwen3", "head_dim": 32, "tie_word_embeddings": True},
    "phi3": {**_BASE, "model_type": "phi3"},
    "gemma3_text": {**_BASE, "model_type": "gemma3_text", "head_dim": 32,
                    "num_hidden_layers": 4, "sliding_window": 16,
                    "sliding_window_pattern": 2, "query_pre_attn_scalar": 32,
                    "rms_norm_eps": 1e-6},
}
"""Per architecture, a config.json of its real shape's kind: Llama 3.x's RoPE scaling, a
Mistral (mlx-lm reads it as Llama), Qwen 3's q/k norms and tied embedding, Phi-3's fused
projections, Gemma 3's sandwich norms, GELU and sliding-window layers (a window shorter
than the tests' prompts)."""


QWEN2: dict[str, Any] = {**_BASE, "model_type": "qwen2"}
"""Qwen 2 reads as Llama does in the riding forward (the same hooks), so most
per-architecture tests leave it out; its q/k/v biases are checked by the decode step's bits
test, and the two-machine tests use it (mlx_lm pipelines it)."""


def build(out: Path, demo_model: Path, arch: str, *, bits: int = 0, seed: int = 0,
          dtype: Any = mx.float32, eight: tuple[str, ...] = ()) -> Path:
    """A model directory for ``arch`` (a key of :data:`CONFIGS`, or qwen2), its float
    parameters in ``dtype``, quantized to ``bits`` with ``nn.quantize`` (group size 32) when
    asked (as mlx-lm's convert does it: cast, then quantized); layers whose path ends with
    one of ``eight`` in 8 bits, named in the config as mlx-lm reads per-layer bits (as a
    Q4_K_M file's import keeps v_proj and down_proj)."""
    from mlx_lm.utils import _get_classes

    config = dict(QWEN2 if arch == "qwen2" else CONFIGS[arch])
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    # nn.Linear's default init keeps activations small; norms of 1 + w (Gemma) stay near 1.
    model.update(nn.utils.tree_map(lambda p: p * 0.5 if p.ndim == 1 and arch.startswith(
        "gemma") else p, model.parameters()))
    model.set_dtype(dtype)
    if bits:
        quantization: dict[str, Any] = {"group_size": 32, "bits": bits}

        def predicate(path: str, module: Any) -> bool | dict[str, int]:
            if not hasattr(module, "to_quantized"):
                return False
            if path.endswith(eight):
                quantization[path] = {"group_size": 32, "bits": 8}
                return quantization[path]
            return True

        nn.quantize(model, group_size=32, bits=bits, class_predicate=predicate)
        config["quantization"] = quantization
    out.mkdir(parents=True)
    weights = dict(nn.utils.tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(demo_model / name, out / name)
    return out
