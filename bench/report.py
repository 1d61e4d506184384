"""What the benchmarks' reports say besides their measurements: means and ratios that
tolerate missing values, the model under test, the commit, and where the report is kept.
(Percentiles: :func:`appliance.percentiles.percentile`, ``method="linear"`` as numpy.)
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def mean(values: Sequence[float]) -> float | None:
    """Arithmetic mean, None for an empty sequence."""
    return sum(values) / len(values) if values else None


def safe_ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def git_commit(repo: Path) -> str:
    """Short HEAD commit, with `-dirty` when the work tree has changes; `unknown` without git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()

    try:
        head = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}-dirty" if dirty else head


def safetensors_summary(model_dir: Path) -> dict[str, Any]:
    """Parameter count, their bytes and dtypes from the safetensors headers (no weights are
    read)."""
    params = nbytes = 0
    dtypes: set[str] = set()
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtypes.add(str(info["dtype"]))
            params += math.prod(info["shape"])
            start, end = info["data_offsets"]
            nbytes += end - start
    return {"parameters": params, "parameter_bytes": nbytes, "dtypes": sorted(dtypes)}


MODEL_SHAPE_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
)


def model_facts(model_dir: Path) -> dict[str, Any]:
    """The shape of the model under test, from `config.json` and the weight headers."""
    facts: dict[str, Any] = {"path": str(model_dir.resolve())}
    config_path = model_dir / "config.json"
    if config_path.exists():
        config = json.loads(config_path.read_text())
        facts.update({key: config[key] for key in MODEL_SHAPE_KEYS if key in config})
        quant = config.get("quantization")
        if isinstance(quant, Mapping):
            facts["quantization"] = dict(quant)
    facts.update(safetensors_summary(model_dir))
    return facts


def describe_model(facts: Mapping[str, Any]) -> str:
    """One line: `llama, 30 layers, hidden 576, ...`."""
    parts = [str(facts.get("model_type", "?"))]
    labels = (
        ("num_hidden_layers", "layers"),
        ("hidden_size", "hidden"),
        ("num_attention_heads", "heads"),
        ("num_key_value_heads", "kv heads"),
        ("intermediate_size", "ffn"),
        ("vocab_size", "vocab"),
    )
    parts += [f"{label} {facts[key]}" for key, label in labels if key in facts]
    if facts.get("parameters"):
        parts.append(f"{facts['parameters'] / 1e6:.1f}M params")
    if facts.get("dtypes"):
        parts.append("/".join(facts["dtypes"]))
    if facts.get("quantization"):
        parts.append(f"quantized {facts['quantization']}")
    return ", ".join(parts)


def relative(path: str | Path) -> str:
    """A path as the report shows it: relative to the working directory (no machine paths)."""
    text = str(path)
    try:
        return os.path.relpath(text)
    except ValueError:
        return text


def display_command(argv: Sequence[str]) -> str:
    """A command line as the report shows it: absolute paths made relative."""
    return shlex.join(relative(a) if os.path.isabs(a) else a for a in argv)


def run_facts(meta: Mapping[str, Any]) -> list[str]:
    """The report lines every benchmark opens with: command, model, BLAS, commit, versions."""
    versions = meta["versions"]
    return [
        f"- command: `{meta['command']}`",
        f"- model: `{relative(meta['model']['path'])}` ({describe_model(meta['model'])})",
        f"- BLAS: {meta['blas_report']}",
        f"- git commit: `{meta['git_commit']}`; mlx {versions.get('mlx', '?')}, "
        f"mlx-lm {versions.get('mlx_lm', '?')}, python {versions['python']}",
    ]
