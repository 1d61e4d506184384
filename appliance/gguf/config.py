"""config.json from a GGUF file's metadata, per architecture (appliance/gguf)."""

from __future__ import annotations

from typing import Any

from appliance.gguf.meta import ImportRefused
from appliance.gguf.meta import meta_value as _meta

ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                 "gemma3": "gemma3_text", "phi3": "phi3"}
"""GGUF ``general.architecture`` -> mlx-lm ``model_type``."""
PERMUTED_QK = {"llama", "mistral"}
"""Architectures whose query and key rows llama.cpp's converter permutes for interleaved
RoPE (the others it keeps in the halves order mlx-lm computes)."""

GEMMA3_SWA_PATTERN = 6
"""Every sixth Gemma 3 layer is global, the rest slide (llama.cpp fixes it so for gemma3;
a file may say otherwise in ``gemma3.attention.sliding_window_pattern``)."""
GEMMA3_LOCAL_THETA = 10000.0
"""RoPE base of Gemma 3's sliding layers (fixed by llama.cpp and Hugging Face alike)."""


def check_architecture(meta: dict[str, Any]) -> str:
    """The file's GGUF architecture, or :class:`ImportRefused` naming it."""
    arch = str(_meta(meta, "general.architecture"))
    if arch not in ARCHITECTURES:
        raise ImportRefused(f"architecture {arch!r} is not supported by the importer (it maps "
                            f"{', '.join(sorted(ARCHITECTURES))})")
    return arch


def model_config(meta: dict[str, Any], weights: dict[str, Any],
                 quant: dict[str, Any]) -> dict[str, Any]:
    """config.json from the file's metadata; takes the RoPE tensors out of ``weights``."""
    arch = check_architecture(meta)
    heads = int(_meta(meta, f"{arch}.attention.head_count"))
    hidden = int(_meta(meta, f"{arch}.embedding_length"))
    config: dict[str, Any] = {
        "model_type": ARCHITECTURES[arch],
        "hidden_size": hidden,
        "num_hidden_layers": int(_meta(meta, f"{arch}.block_count")),
        "intermediate_size": int(_meta(meta, f"{arch}.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_meta(meta, f"{arch}.attention.head_count_kv", heads)),
        "rms_norm_eps": float(_meta(meta, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_meta(meta, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_meta(meta, f"{arch}.context_length")),
        "vocab_size": len(_meta(meta, "tokenizer.ggml.tokens")),
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "head_dim": int(_meta(meta, f"{arch}.attention.key_length", hidden // heads)),
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in weights,
    }
    if arch in PERMUTED_QK:
        config["rope_traditional"] = True
    if arch == "gemma3":
        config.update(_gemma3(meta, config))
    elif arch == "phi3":
        config.update(_phi3(meta, weights, config))
    scaling = _linear_rope(meta, arch)
    if scaling and "rope_scaling" not in config:
        config["rope_scaling"] = scaling
    if "rope_freqs.weight" in weights:
        config["rope_scaling"] = llama3_scaling(weights.pop("rope_freqs.weight"), config)
    if quant:
        config["quantization"] = quant
        config["quantization_config"] = quant
    return config


def _linear_rope(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind is None or str(kind) == "none":
        return None
    if str(kind) != "linear":
        raise ImportRefused(f"RoPE scaling {str(kind)!r} is not supported by the importer")
    return {"rope_type": "linear", "factor": float(_meta(meta, f"{arch}.rope.scaling.factor"))}


def _gemma3(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's sliding-window layout and attention scale, as llama.cpp reads them."""
    pattern: Any = meta.get("gemma3.attention.sliding_window_pattern")
    if pattern is None:
        every = GEMMA3_SWA_PATTERN
    elif getattr(pattern, "size", 1) == 1:
        every = int(pattern.item() if hasattr(pattern, "item") else pattern)
    else:  # one flag per layer (sliding or not): the period of the first global layer
        flags = [bool(f) for f in pattern.tolist()]
        every = flags.index(False) + 1 if False in flags else len(flags) + 1
        if flags != [(i + 1) % every != 0 for i in range(len(flags))]:
            raise ImportRefused("the file's Gemma 3 sliding-window layers have no fixed period")
    # llama.cpp scales queries by 1/sqrt(head_dim), but by 1/sqrt(hidden / heads) for the
    # 27B model (62 layers), as Hugging Face's query_pre_attn_scalar says.
    scalar = (config["hidden_size"] // config["num_attention_heads"]
              if config["num_hidden_layers"] == 62 else config["head_dim"])
    return {"sliding_window": int(_meta(meta, "gemma3.attention.sliding_window")),
            "sliding_window_pattern": every, "query_pre_attn_scalar": scalar,
            "rope_local_base_freq": GEMMA3_LOCAL_THETA}


def _phi3(meta: dict[str, Any], weights: dict[str, Any], config: dict[str, Any]
          ) -> dict[str, Any]:
    """Phi-3's partial rotary dimension and its long-context RoPE factors (stored as
    tensors by llama.cpp, as lists in a config)."""
    head_dim = config["head_dim"]
    rotary = int(_meta(meta, "phi3.rope.dimension_count", head_dim))
    out: dict[str, Any] = {"partial_rotary_factor": rotary / head_dim}
    original = meta.get("phi3.rope.scaling.original_context_length")
    if original is not None:
        out["original_max_position_embeddings"] = int(original.item())
    if "rope_factors_long.weight" in weights:
        long = weights.pop("rope_factors_long.weight")
        short = weights.pop("rope_factors_short.weight", long)
        out["rope_scaling"] = {"type": "longrope", "long_factor": long.tolist(),
                               "short_factor": short.tolist()}
    return out


LLAMA3_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}
"""Llama 3.1-3.3's RoPE scaling besides its factor: GGUF keeps only the factors it computes
from them (``rope_freqs``), so these are checked against it, not read."""


def llama3_scaling(freqs: Any, config: dict[str, Any]) -> dict[str, Any]:
    """Llama 3.x's ``rope_scaling`` whose per-frequency factors are the file's
    ``rope_freqs`` (llama.cpp divides each rotary frequency by its factor)."""
    import numpy as np

    factors = np.asarray(freqs, np.float32).reshape(-1)
    scaling = {"rope_type": "llama3", "factor": float(factors.max()), **LLAMA3_DEFAULTS}
    want = _llama3_factors(config["head_dim"], config["rope_theta"], scaling)
    if want.shape != factors.shape or not np.allclose(want, factors, rtol=1e-3):
        raise ImportRefused("the file's rope_freqs are not Llama 3.x's RoPE scaling with "
                            "low/high frequency factors 1 and 4 over 8192 positions")
    return scaling


def _llama3_factors(head_dim: int, theta: float, scaling: dict[str, Any]) -> Any:
    """llama.cpp's converter's ``rope_freqs`` for a Llama 3 ``rope_scaling``."""
    import numpy as np

    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    old = scaling["original_max_position_embeddings"]
    low, high = old / scaling["low_freq_factor"], old / scaling["high_freq_factor"]
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < high:
            out.append(1.0)
        elif wavelen > low:
            out.append(scaling["factor"])
        else:
            smooth = (old / wavelen - scaling["low_freq_factor"]) / (
                scaling["high_freq_factor"] - scaling["low_freq_factor"])
            out.append(1 / ((1 - smooth) / scaling["factor"] + smooth))
    return np.asarray(out, np.float32)
