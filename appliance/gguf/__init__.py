"""GGUF files (llama.cpp's and Ollama's format) imported as MLX model directories.

``appliance model import FILE.gguf | ollama:NAME[:TAG]`` writes a directory that
``mlx_lm.load`` reads: ``model.safetensors`` with mlx-lm's parameter names, ``config.json``
from the file's metadata, and ``tokenizer.json`` / ``tokenizer_config.json`` built from the
file's own vocabulary, merges (or SentencePiece scores), token types and chat template.

Weights: MLX reads Q4_0, Q4_1 and Q8_0 blocks as its own affine quantization (group size 32,
scales and biases), so they stay as they are. Every other quantized type (the K-quants most
GGUFs use) is dequantized by llama.cpp's own reference code (the ``gguf`` package; MLX's
reader gave other values than it for half of a Q4_K block's sub-blocks) and quantized again
to MLX's affine 4 bits, with a line saying so. llama.cpp permutes the query and key rows of Llama-family models for
its interleaved RoPE; the config then asks mlx-lm for the same (``rope_traditional``).

A bad file (not GGUF, truncated, an architecture or tokenizer we do not map) is a
:class:`ImportRefused` naming what is missing, and nothing is left on disk: the directory
is written beside its target and renamed into place only when complete.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                 "gemma3": "gemma3_text", "phi3": "phi3"}
"""GGUF ``general.architecture`` -> mlx-lm ``model_type``."""
PERMUTED_QK = {"llama", "mistral"}
"""Architectures whose query and key rows llama.cpp's converter permutes for interleaved
RoPE (the others it keeps in the halves order mlx-lm computes)."""

LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
ARCH_LAYER_NAMES = {
    "gemma3": {"post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
"""Where an architecture's blocks differ from :data:`LAYER_NAMES`: Gemma 3's four norms, and
Phi-3's fused projections (``ffn_up`` holds the gate's rows, then the up projection's)."""
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
             "output": "lm_head"}
SHIFTED_NORMS = {"gemma3"}
"""Architectures whose norms compute ``x * (1 + w)``: llama.cpp's converter stores ``1 + w``,
mlx-lm's module wants ``w``."""
GEMMA3_SWA_PATTERN = 6
"""Every sixth Gemma 3 layer is global, the rest slide (llama.cpp fixes it so for gemma3;
a file may say otherwise in ``gemma3.attention.sliding_window_pattern``)."""
GEMMA3_LOCAL_THETA = 10000.0
"""RoPE base of Gemma 3's sliding layers (fixed by llama.cpp and Hugging Face alike)."""
VISION_PREFIXES = ("v", "mm")
"""llama.cpp's and Ollama's names of a vision tower and its projector (``v.blk.0...``,
``mm.input_projection``), which some files (Ollama's Gemma 3) carry beside the text model:
dropped, the appliance serves text."""
ROPE_TENSORS = {"rope_freqs", "rope_factors_long", "rope_factors_short"}
"""Tensors that are RoPE settings, not weights: they go into config.json."""
GGUF_GROUP = 32
"""Weights per block of GGUF's Q4_0, Q4_1 and Q8_0, which MLX reads as its group size."""
REQUANT_BITS = 4
"""Bits of the affine quantization other types are converted to (MLX's own 4-bit)."""
CONTROL = 3
"""GGUF token type of control tokens (special tokens the tokenizer never splits)."""


class ImportRefused(ValueError):
    """The file cannot be imported; the message says what is missing or wrong."""


@dataclass(frozen=True, slots=True)
class Imported:
    path: Path
    model_type: str
    quantized: int
    """Tensors kept in the file's own quantization."""
    requantized: int
    """Tensors that came as floats (other GGUF types) and were quantized again."""


def _meta(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    if value is None:
        raise ImportRefused(f"the file's metadata has no {key}")
    if hasattr(value, "item") and getattr(value, "size", 2) == 1:
        return value.item()
    return value


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, Any], set[str]]:
    """(tensors, metadata, names of tensors in types MLX does not keep quantized) of a GGUF
    file, or :class:`ImportRefused`."""
    import mlx.core as mx

    if not path.is_file():
        raise ImportRefused(f"{path}: no such file")
    with open(path, "rb") as fh:
        if fh.read(4) != b"GGUF":
            raise ImportRefused(f"{path}: not a GGUF file (no GGUF magic at its start)")
    try:
        loaded: Any = mx.load(str(path), format="gguf", return_metadata=True)
    except (RuntimeError, ValueError, OSError) as exc:
        raise ImportRefused(f"{path}: the GGUF file cannot be read (truncated or corrupt?): "
                            f"{exc}") from None
    weights, meta = loaded
    weights = dict(weights)
    other = _reference_dequantized(path)
    for name, values in other.items():
        weights[name] = mx.array(values)
    return weights, dict(meta), set(other)


MLX_NATIVE = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0"}
"""GGUF tensor types MLX's reader keeps exactly (floats) or as its own quantization."""


def _reference_dequantized(path: Path) -> dict[str, Any]:
    """Float32 values of the tensors of other types, from llama.cpp's reference code."""
    from gguf import GGUFReader, quants

    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise ImportRefused(f"{path}: the GGUF file cannot be read: {exc}") from None
    out = {}
    for tensor in reader.tensors:
        if tensor.tensor_type.name in MLX_NATIVE:
            continue
        try:
            out[tensor.name] = quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise ImportRefused(f"tensor {tensor.name} is of GGUF type "
                                f"{tensor.tensor_type.name}, which the importer cannot "
                                "read") from None
    return out


def mlx_name(name: str, arch: str = "llama") -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    parts = name.split(".")
    layer_names = {**LAYER_NAMES, **ARCH_LAYER_NAMES.get(arch, {})}
    if parts[0] == "blk" and len(parts) >= 4 and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{'.'.join(parts[3:])}"
    if parts[0] in TOP_NAMES and len(parts) >= 2:
        return f"{TOP_NAMES[parts[0]]}.{'.'.join(parts[1:])}"
    raise ImportRefused(f"the file has a tensor this importer does not map: {name}")


def _bits(weight: Any, scales: Any) -> int:
    """Bits of an affine-quantized matrix from its packed and scale shapes."""
    columns = scales.shape[-1] * GGUF_GROUP
    return int(weight.shape[-1] * 32 // columns)


def convert_weights(tensors: dict[str, Any], other: set[str], say: Callable[[str], None],
                    arch: str = "llama") -> tuple[dict[str, Any], dict[str, Any], int, int]:
    """mlx-lm's names and quantization (``other``: GGUF names of tensors dequantized from
    types MLX does not keep, to quantize again); returns (weights, quantization config,
    tensors kept quantized, tensors quantized again). Tensors that are settings rather than
    weights (Llama 3.x's ``rope_freqs``, Phi-3's ``rope_factors_*``) stay under their GGUF
    names for :func:`model_config`, which takes them out."""
    import mlx.core as mx

    out: dict[str, Any] = {}
    bits_of: dict[str, int] = {}
    vision = {name for name in tensors if name.split(".")[0] in VISION_PREFIXES}
    if vision:
        say(f"{len(vision)} vision tensors were left out (the appliance serves text)")
        tensors = {k: v for k, v in tensors.items() if k not in vision}
        other = other - vision
    for name, value in tensors.items():
        if name.split(".")[0] in ROPE_TENSORS:
            out[name] = value
            continue
        if arch in SHIFTED_NORMS and name.endswith("norm.weight"):
            value = value.astype(mx.float32) - 1.0
        out[mlx_name(name, arch)] = value
    for name in list(out):
        if name.endswith(".scales"):
            base = name[:-len(".scales")]
            bits_of[base] = _bits(out[base + ".weight"], out[name])
    kept = len(bits_of)
    again = 0
    for name in sorted(other):
        if name.split(".")[0] in ROPE_TENSORS:
            continue
        target = mlx_name(name, arch)
        base, _, leaf = target.rpartition(".")
        value = out[target]
        if leaf == "weight" and value.ndim == 2 and value.shape[-1] % GGUF_GROUP == 0:
            w, s, b = mx.quantize(value.astype(mx.float32), group_size=GGUF_GROUP,
                                  bits=REQUANT_BITS)
            out[target], out[base + ".scales"], out[base + ".biases"] = w, s, b
            bits_of[base] = REQUANT_BITS
            again += 1
        else:  # a vector or an odd width: kept as floats
            out[target] = value.astype(mx.float16)
    if again:
        say(f"{again} tensors were not in a type MLX reads quantized (K-quants and others); "
            f"they were quantized again to MLX's affine {REQUANT_BITS}-bit, group size "
            f"{GGUF_GROUP} (answers may differ slightly from llama.cpp's)")
    for name, value in list(out.items()):  # scales and biases as MLX makes them
        if name.endswith((".scales", ".biases")) and value.dtype != mx.float16:
            out[name] = value.astype(mx.float16)
    if not bits_of:
        return out, {}, 0, 0
    main = max(set(bits_of.values()), key=list(bits_of.values()).count)
    quant: dict[str, Any] = {"group_size": GGUF_GROUP, "bits": main}
    for base, bits in sorted(bits_of.items()):
        if bits != main:
            quant[base] = {"group_size": GGUF_GROUP, "bits": bits}
    return out, quant, kept, again


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


def _merge(line: str) -> tuple[str, str]:
    left, sep, right = line.partition(" ")
    if not sep:
        raise ImportRefused(f"the file's merges have an entry without two parts: {line!r}")
    return left, right


def tokenizer_files(meta: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tokenizer.json, tokenizer_config.json) for a byte-level BPE vocabulary (built here)
    or a SentencePiece one (built by transformers' GGUF tokenizer builders)."""
    kind = str(_meta(meta, "tokenizer.ggml.model"))
    if kind == "gpt2":
        tokenizer = _byte_level(meta)
    elif kind == "llama":
        tokenizer = _sentencepiece(meta)
    else:
        raise ImportRefused(f"tokenizer model {kind!r} is not supported by the importer "
                            "(it builds byte-level BPE, 'gpt2', and SentencePiece, 'llama', "
                            "vocabularies)")
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        value = meta.get(key)
        return None if value is None else str(tokens[int(value.item())])

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
        "add_bos_token": bool(meta["tokenizer.ggml.add_bos_token"].item())
        if "tokenizer.ggml.add_bos_token" in meta else kind == "llama",
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(1 << 30),
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = str(meta["tokenizer.chat_template"])
    return tokenizer, config


def _byte_level(meta: dict[str, Any]) -> dict[str, Any]:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens = [str(t) for t in _meta(meta, "tokenizer.ggml.tokens")]
    merges = [_merge(str(m)) for m in _meta(meta, "tokenizer.ggml.merges")]
    types = meta.get("tokenizer.ggml.token_type")
    kinds = types.tolist() if types is not None else [1] * len(tokens)
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                     ignore_merges=False)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, kinds, strict=True) if k == CONTROL])
    return dict(json.loads(tok.to_str()))


def _sentencepiece(meta: dict[str, Any]) -> dict[str, Any]:
    """transformers' reading of a GGUF SentencePiece vocabulary (Llama 2, Gemma and Phi-3
    each have their own spaces and merges rules there), from the metadata MLX read."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            convert_gguf_tokenizer,
        )
    except ImportError:
        raise ImportRefused("this file has a SentencePiece vocabulary ('llama'), and the "
                            "installed transformers cannot build one from a GGUF file "
                            "(it needs transformers 5)") from None
    tokens = [str(t) for t in _meta(meta, "tokenizer.ggml.tokens")]
    spec: dict[str, Any] = {"tokenizer_type": "llama", "tokens": tokens}
    for key, name in (("scores", "scores"), ("token_type", "token_type"), ("merges", "merges"),
                      ("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("unknown_token_id", "unk_token_id"),
                      ("padding_token_id", "pad_token_id"),
                      ("add_space_prefix", "add_prefix_space")):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None:
            spec[name] = value.tolist() if hasattr(value, "tolist") else value
    if "scores" not in spec and "merges" not in spec:
        raise ImportRefused("the file's SentencePiece vocabulary has neither scores nor "
                            "merges (tokenizer.ggml.scores)")
    try:
        backend, _ = convert_gguf_tokenizer(str(_meta(meta, "general.architecture")), spec)
    except (ValueError, KeyError, TypeError) as exc:
        raise ImportRefused(f"the file's SentencePiece vocabulary cannot be built: {exc}"
                            ) from None
    return dict(json.loads(backend.to_str()))


def as_float32(weights: dict[str, Any], quant: dict[str, Any]) -> dict[str, Any]:
    """Every quantized matrix dequantized to float32 (and every float tensor as float32)."""
    import mlx.core as mx

    out: dict[str, Any] = {}
    for name, value in weights.items():
        base, _, leaf = name.rpartition(".")
        if leaf in ("scales", "biases") and base + ".weight" in weights:
            continue
        if leaf == "weight" and base + ".scales" in weights:
            bits = quant.get(base, quant)["bits"]
            value = mx.dequantize(value, weights[base + ".scales"], weights[base + ".biases"],
                                  group_size=GGUF_GROUP, bits=bits)
        out[name] = value.astype(mx.float32)
    return out


def import_gguf(path: Path, out: Path, say: Callable[[str], None] = print, *,
                float32: bool = False) -> Imported:
    """Write ``out`` (which must not exist) from the GGUF file at ``path``; ``float32``: with
    the weights dequantized (four times the memory; on a CPU the appliance's float32 kernels
    make it several times faster today)."""
    import mlx.core as mx

    if out.exists():
        raise ImportRefused(f"{out} exists already; remove it or choose another --out")
    tensors, meta, other = read_gguf(path)
    arch = check_architecture(meta)
    weights, quant, kept, again = convert_weights(tensors, other, say, arch)
    if float32:
        weights, quant = as_float32(weights, quant), {}
    config = model_config(meta, weights, quant)
    config["appliance_name"] = out.name
    tokenizer, tok_config = tokenizer_files(meta)
    generation = {"eos_token_id": int(_meta(meta, "tokenizer.ggml.eos_token_id"))}
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        mx.save_safetensors(str(work / "model.safetensors"), weights, metadata={"format": "mlx"})
        (work / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (work / "tokenizer.json").write_text(json.dumps(tokenizer) + "\n")
        (work / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
        (work / "generation_config.json").write_text(json.dumps(generation) + "\n")
        work.rename(out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return Imported(out, config["model_type"], kept, again)


def ollama_blob(ref: str, root: Path | None = None) -> Path:
    """The GGUF blob of ``NAME[:TAG]`` in a local Ollama store (``~/.ollama/models``, or
    ``OLLAMA_MODELS``): manifest -> the layer of media type ``...image.model``."""
    import os

    root = root or Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models")
    name, _, tag = ref.partition(":")
    if "/" not in name:
        name = f"library/{name}"
    if name.count("/") == 1:
        name = f"registry.ollama.ai/{name}"
    manifest = root / "manifests" / name / (tag or "latest")
    if not manifest.is_file():
        raise ImportRefused(f"no Ollama model {ref!r} in {root} (no manifest at {manifest})")
    try:
        layers = json.loads(manifest.read_text())["layers"]
        digest = next(layer["digest"] for layer in layers
                      if layer.get("mediaType") == "application/vnd.ollama.image.model")
    except (ValueError, KeyError, StopIteration, TypeError):
        raise ImportRefused(f"the Ollama manifest {manifest} names no model layer") from None
    blob = root / "blobs" / str(digest).replace(":", "-")
    if not blob.is_file():
        raise ImportRefused(f"the Ollama blob {blob} of {ref!r} is missing")
    return blob
