"""Models on disk: the bundled demo model and the ones pulled from the Hugging Face hub."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from appliance.engine.model import DEMO_MODEL_DIR

log = logging.getLogger(__name__)

PULL_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def list_models(models_dir: Path) -> list[str]:
    rows = [f"demo\t{DEMO_MODEL_DIR}\t{_size(DEMO_MODEL_DIR)} bytes\t(bundled demo model)"]
    if models_dir.is_dir():
        for d in sorted(models_dir.iterdir()):
            if (d / "config.json").exists():
                rows.append(f"{d.name.replace('--', '/')}\t{d}\t{_size(d)} bytes")
    return rows


def pull(repo: str, models_dir: Path, revision: str | None = None) -> int:
    """Download an MLX model repo into ``models_dir`` (huggingface_hub shows a progress bar)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    if repo.count("/") != 1:
        print(f"error: {repo!r} is not a Hugging Face repo id like 'mlx-community/name'")
        return 2
    target = models_dir / repo.replace("/", "--")
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        snapshot_download(repo, revision=revision, local_dir=target,
                          allow_patterns=PULL_PATTERNS)
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        print(f"error: could not pull {repo}: {exc.__class__.__name__}: {exc}")
        return 1
    config = target / "config.json"
    if not config.exists():
        print(f"error: {repo} has no config.json; is it an MLX model?")
        return 1
    model_type = json.loads(config.read_text()).get("model_type", "?")
    print(f"pulled {repo} ({model_type}, {_size(target)} bytes) into {target}")
    print(f"serve it with: appliance serve --model {repo}")
    return 0
