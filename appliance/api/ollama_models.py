"""What ``/api/tags``, ``/api/show`` and ``/api/ps`` say about the served model.

Everything here is read from the model's folder once (file sizes, ``config.json``, the
safetensors headers) and cached; nothing waits for the engine. Ollama's ``digest`` is the
sha256 of a GGUF blob; ours is the sha256 of the model's ``config.json`` and its files'
names and sizes, a stable identifier of what is served (hashing gigabytes of weights at
start-up would cost minutes on a small machine).
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from appliance.api.errors import ApiError
from appliance.service.services import ModelInfo

LATEST = ":latest"


def ollama_name(name: str) -> str:
    """Ollama names carry a tag; ours is always ``latest``."""
    return name if ":" in name else name + LATEST


def matches(info: ModelInfo, wanted: str) -> bool:
    """``demo``, ``demo:latest``, the model's path, or ``default`` all name the served model."""
    w = wanted.strip()
    if w.lower().endswith(LATEST):
        w = w[: -len(LATEST)]
    return w.lower() in (info.name.lower(), info.path.lower(), "default") or w == info.path


def require_model(info: ModelInfo, wanted: str) -> None:
    if not wanted:
        raise ApiError(400, "model is required", param="model")
    if not matches(info, wanted):
        raise ApiError(404, f"model '{wanted}' not found; this server serves "
                       f"'{ollama_name(info.name)}' (see /api/tags)", param="model")


@dataclass(frozen=True, slots=True)
class ModelFacts:
    size: int
    digest: str
    modified_at: str
    family: str
    parameter_count: int
    quantization: str
    config: dict[str, Any]
    template: str

    def details(self) -> dict[str, Any]:
        return {"parent_model": "", "format": "safetensors", "family": self.family,
                "families": [self.family], "parameter_size": parameter_size(
                    self.parameter_count), "quantization_level": self.quantization}


def parameter_size(n: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return str(n)


def _safetensors_params(path: Path, bits: int | None) -> int:
    """Parameters counted from the safetensors headers (packed quantized weights unpacked;
    quantization scales and biases are not parameters)."""
    total = 0
    for f in sorted(path.glob("*.safetensors")):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for d in meta.get("shape", []):
                count *= int(d)
            if bits and name.endswith((".scales", ".biases")):
                continue
            if bits and meta.get("dtype") == "U32":
                count = count * 32 // bits
            total += count
    return total


@functools.lru_cache(maxsize=4)
def model_facts(path_text: str) -> ModelFacts:
    path = Path(path_text)
    files = sorted(f for f in path.rglob("*") if f.is_file())
    config = json.loads((path / "config.json").read_text())
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in files:
        h.update(f"{f.relative_to(path)}:{f.stat().st_size}\n".encode())
    mtime = max((f.stat().st_mtime for f in files), default=0.0)
    quant = config.get("quantization") or config.get("quantization_config") or {}
    bits = int(quant["bits"]) if isinstance(quant, dict) and quant.get("bits") else None
    dtype = str(config.get("torch_dtype") or "").replace("bfloat16", "BF16") \
        .replace("float16", "F16").replace("float32", "F32")
    template = ""
    tok_config = path / "tokenizer_config.json"
    if tok_config.exists():
        template = str(json.loads(tok_config.read_text()).get("chat_template") or "")
    if not template and (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    return ModelFacts(
        size=sum(f.stat().st_size for f in files), digest=h.hexdigest(),
        modified_at=datetime.fromtimestamp(mtime, UTC).isoformat().replace("+00:00", "Z"),
        family=str(config.get("model_type") or "unknown"),
        parameter_count=_safetensors_params(path, bits),
        quantization=f"Q{bits}" if bits else (dtype or "unknown"), config=config,
        template=template)


def model_info(info: ModelInfo, facts: ModelFacts) -> dict[str, Any]:
    """Ollama's ``model_info``: GGUF-style keys from ``config.json``."""
    c = facts.config.get("text_config", facts.config)
    arch = facts.family
    out: dict[str, Any] = {"general.architecture": arch,
                           "general.parameter_count": facts.parameter_count,
                           "general.basename": info.name,
                           f"{arch}.context_length": info.ctx_limit,
                           f"{arch}.vocab_size": info.vocab_size}
    for ours, theirs in (("hidden_size", "embedding_length"), ("num_hidden_layers",
                         "block_count"), ("num_attention_heads", "attention.head_count"),
                         ("num_key_value_heads", "attention.head_count_kv"),
                         ("intermediate_size", "feed_forward_length"),
                         ("rope_theta", "rope.freq_base"),
                         ("rms_norm_eps", "attention.layer_norm_rms_epsilon")):
        if c.get(ours) is not None:
            out[f"{arch}.{theirs}"] = c[ours]
    return out


def tag_entry(info: ModelInfo) -> dict[str, Any]:
    facts = model_facts(info.path)
    name = ollama_name(info.name)
    return {"name": name, "model": name, "modified_at": facts.modified_at,
            "size": facts.size, "digest": facts.digest, "details": facts.details()}
