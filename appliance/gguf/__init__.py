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

from appliance.gguf.config import ARCHITECTURES, check_architecture, model_config
from appliance.gguf.meta import ImportRefused
from appliance.gguf.meta import meta_value as _meta
from appliance.gguf.vocab import tokenizer_files

__all__ = ["ARCHITECTURES", "ImportRefused", "Imported", "convert_weights", "import_gguf",
           "mlx_name", "model_config", "ollama_blob", "read_gguf", "tokenizer_files"]

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


@dataclass(frozen=True, slots=True)
class Imported:
    path: Path
    model_type: str
    quantized: int
    """Tensors kept in the file's own quantization."""
    requantized: int
    """Tensors that came as floats (other GGUF types) and were quantized again."""


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
