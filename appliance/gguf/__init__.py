"""GGUF files (llama.cpp's and Ollama's format) imported as MLX model directories.

``appliance model import FILE.gguf | ollama:NAME[:TAG]`` writes a directory that
``mlx_lm.load`` reads: ``model.safetensors`` with mlx-lm's parameter names, ``config.json``
from the file's metadata, and ``tokenizer.json`` / ``tokenizer_config.json`` built from the
file's own vocabulary, merges (or SentencePiece scores), token types and chat template.

The file is read by llama.cpp's own Python reader (the ``gguf`` package), each tensor checked
against the file's size first; MLX's C parser is not used (crafted files crashed it, and it
cannot read Q5_0). Weights keep the file's own codes where MLX's affine quantization (groups
of 32) holds them: Q4_0, Q4_1 and Q4_K at 4 bits; Q8_0, Q5_0, Q5_1, Q5_K, IQ4_NL and IQ4_XS
widened to 8 bits; Q6_K at 8 bits, half exact (appliance/gguf/blocks.py). The config gives
mlx-lm the bits of each layer that differs, and a note per type says what was kept.
llama.cpp permutes the query and key rows of Llama-family models for
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

import numpy as np

from appliance.gguf.blocks import Affine, to_affine
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
"""Weights per GGUF block or sub-block, which MLX reads as its group size."""


@dataclass(frozen=True, slots=True)
class Imported:
    path: Path
    model_type: str
    quantized: int
    """Quantized tensors holding the file's own codes (4-bit, or widened to 8-bit)."""
    requantized: int
    """Quantized tensors whose values were rounded again (Q6_K's half groups, and types
    read by llama.cpp's reference code), at 8 bits."""


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Affine]]:
    """(float tensors, metadata, quantized tensors in MLX's affine form) of a GGUF file, or
    :class:`ImportRefused`. Read by gguf-py (llama.cpp's own reader, in Python: a crafted
    file is an exception here, where MLX's C parser crashed the process) and checked
    tensor by tensor against the file's size before any is converted."""
    import mlx.core as mx

    if not path.is_file():
        raise ImportRefused(f"{path}: no such file")
    with open(path, "rb") as fh:
        if fh.read(4) != b"GGUF":
            raise ImportRefused(f"{path}: not a GGUF file (no GGUF magic at its start)")
    reader = _reader(path)
    meta = _metadata(reader)
    check_architecture(meta)  # before the tensors are converted
    floats: dict[str, Any] = {}
    quantized: dict[str, Affine] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if tensor.name.split(".")[0] in VISION_PREFIXES:
            floats[tensor.name] = None  # left out by convert_weights, never converted
        elif kind in FLOAT_TYPES:
            floats[tensor.name] = mx.array(np.array(tensor.data))
        elif kind == "BF16":
            raw = np.ascontiguousarray(tensor.data).view(np.uint16).reshape(shape)
            floats[tensor.name] = mx.array(raw).view(mx.bfloat16)
        else:
            quantized[tensor.name] = to_affine(tensor.data, kind, shape)
    return floats, meta, quantized


FLOAT_TYPES = {"F32", "F16"}
MAX_DIM = 1 << 31
"""Largest tensor dimension the importer takes (llama.cpp's widest vocabularies are ~256 k)."""


def _reader(path: Path) -> Any:
    """gguf-py's reader of ``path``, every tensor's dimensions, type and bytes checked."""
    from gguf import GGML_QUANT_SIZES, GGUFReader

    size = path.stat().st_size
    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # a crafted header fails anywhere in the parser
        raise ImportRefused(f"{path}: the GGUF file cannot be read (truncated or corrupt?): "
                            f"{_why(exc)}") from None
    if not reader.tensors:
        raise ImportRefused(f"{path}: the GGUF file cannot be read: it has no tensors")
    for t in reader.tensors:
        dims = [int(d) for d in t.shape.tolist()]
        block, type_size = GGML_QUANT_SIZES[t.tensor_type]
        count = int(np.prod(dims, dtype=object)) if dims else 0
        want = count // block * type_size
        if not 1 <= len(dims) <= 4 or not all(1 <= d < MAX_DIM for d in dims) or (
                dims[0] % block or t.data.nbytes != want
                or t.data_offset + want > size):
            raise ImportRefused(f"{path}: the GGUF file cannot be read (truncated or "
                                f"corrupt?): tensor {t.name!r} of dimensions {dims} and "
                                f"type {t.tensor_type.name} does not fit the file")
    return reader


def _why(exc: Exception) -> str:
    """gguf-py's parser error in words: it reads past the end of a short buffer where a
    count, length or offset in the file is wrong."""
    if isinstance(exc, IndexError):
        return "its header runs past the end of the file (a count or length in it is wrong)"
    if "cannot reshape" in str(exc):
        return "a tensor's data runs past the end of the file"
    return f"{exc.__class__.__name__}: {exc}"


def _metadata(reader: Any) -> dict[str, Any]:
    """The file's key-value pairs as the importer reads them: strings as ``str``, lists of
    strings as lists, numbers and flags as numpy arrays (0-d for one value)."""
    from gguf import GGUFValueType

    out: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if not field.types or name.startswith("GGUF."):
            continue
        try:
            if field.types[0] == GGUFValueType.ARRAY:
                if field.types[-1] == GGUFValueType.STRING:
                    out[name] = [bytes(field.parts[i]).decode() for i in field.data]
                elif len(field.types) == 2:
                    parts = [field.parts[i] for i in field.data]
                    out[name] = np.concatenate(parts) if parts else np.zeros(0)
            elif field.types[0] == GGUFValueType.STRING:
                out[name] = bytes(field.parts[-1]).decode()
            else:
                out[name] = np.array(field.parts[-1][0])
        except UnicodeDecodeError:
            raise ImportRefused(f"the file's metadata {name} is not UTF-8 text") from None
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


HOW = {"kept": "kept as they are (MLX's affine {bits}-bit, group size 32, the file's own "
               "codes and scales)",
        "widened": "kept exactly, widened to MLX's affine 8-bit (group size 32)",
        "joined": "widened to MLX's affine 8-bit (group size 32): each pair of 16-weight "
                  "scales joined, half the weights exact, the other half rounded to a quarter "
                  "of their 6-bit step",
        "again": "read by llama.cpp's reference code and quantized again to MLX's affine "
                 "8-bit (group size 32)"}
"""What the import's note says per GGUF type, by :attr:`blocks.Affine.how`."""


def convert_weights(floats: dict[str, Any], quantized: dict[str, Affine],
                    say: Callable[[str], None], arch: str = "llama"
                    ) -> tuple[dict[str, Any], dict[str, Any], int, int]:
    """mlx-lm's names and quantization (per-layer bits where layers differ); returns
    (weights, quantization config, tensors holding the file's own codes, tensors whose
    values were rounded again); ``quantized`` is emptied as it goes. Tensors that are settings rather than weights (Llama 3.x's
    ``rope_freqs``, Phi-3's ``rope_factors_*``) stay under their GGUF names for
    :func:`model_config`, which takes them out."""
    import mlx.core as mx

    vision = {n for n in [*floats, *quantized] if n.split(".")[0] in VISION_PREFIXES}
    if vision:
        say(f"{len(vision)} vision tensors were left out (the appliance serves text)")
    out: dict[str, Any] = {}
    for name, value in floats.items():
        if name in vision:
            continue
        if name.split(".")[0] in ROPE_TENSORS:
            out[name] = value
            continue
        if arch in SHIFTED_NORMS and name.endswith("norm.weight"):
            value = value.astype(mx.float32) - 1.0
        out[mlx_name(name, arch)] = value
    bits_of: dict[str, int] = {}
    per_type: dict[tuple[str, str, int], int] = {}
    for name in list(quantized):
        q = quantized.pop(name)  # its numpy copy goes once MLX holds it: one copy at a time
        if name in vision:
            continue
        base, _, leaf = mlx_name(name, arch).rpartition(".")
        if leaf != "weight":
            raise ImportRefused(f"the file has a quantized tensor that is no weight: {name}")
        out[f"{base}.weight"] = mx.array(q.weight)
        out[f"{base}.scales"], out[f"{base}.biases"] = mx.array(q.scales), mx.array(q.biases)
        bits_of[base] = q.bits
        key = (q.source, q.how, q.bits)
        per_type[key] = per_type.get(key, 0) + 1
    for (source, how, bits), count in sorted(per_type.items()):
        say(f"{count} {source} tensors {HOW[how].format(bits=bits)}")
    again = sum(n for (_, how, _), n in per_type.items() if how in ("joined", "again"))
    if not bits_of:
        return out, {}, 0, 0
    main = max(set(bits_of.values()), key=list(bits_of.values()).count)
    quant: dict[str, Any] = {"group_size": GGUF_GROUP, "bits": main}
    for base, bits in sorted(bits_of.items()):
        if bits != main:
            quant[base] = {"group_size": GGUF_GROUP, "bits": bits}
    return out, quant, len(bits_of) - again, again


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
    floats, meta, quantized = read_gguf(path)
    arch = check_architecture(meta)
    weights, quant, kept, again = convert_weights(floats, quantized, say, arch)
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
