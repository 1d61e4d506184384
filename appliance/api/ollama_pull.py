"""``POST /api/pull``: Home Assistant pulls the model it was told to use when ``/api/tags``
does not list it.

- The served model (any of its names): success at once, for everyone.
- Another model, a member: 404 (members cannot fill the machine's disk).
- Another model, an admin: a real download of that Hugging Face repo into the models folder
  (``appliance model pull`` does the same), one progress line per file. It is served after
  a restart with ``--model <repo>``: one daemon serves one model.
- An Ollama name, an admin (``ollama:NAME[:TAG]``, or a name without a slash, as Ollama's
  own client spells them: ``llama3.2:3b``): the model's GGUF imported from this machine's
  Ollama store (``appliance model import ollama:NAME`` does the same), so a household moving
  from Ollama brings its models with ``ollama pull``. Not in the store: 404, naming where
  it looked. The import runs in a process of its own; a failure ends the stream with an
  error line (422 unstreamed) and leaves nothing in the models folder.
"""

from __future__ import annotations

import fnmatch
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio

from appliance.api.auth import Principal
from appliance.api.errors import ApiError, bad_request
from appliance.api.ollama_models import matches, model_facts, ollama_name
from appliance.api.ollama_schemas import ModelBody
from appliance.api.ollama_stream import line, stream_response
from appliance.models import PULL_PATTERNS, ImportFailed, as_ollama, import_apart, import_source
from appliance.service.services import Services


def _served(services: Services) -> list[dict[str, Any]]:
    facts = model_facts(services.model.path)
    digest = f"sha256:{facts.digest}"
    return [{"status": "pulling manifest"},
            {"status": f"pulling {facts.digest[:12]}", "digest": digest, "total": facts.size,
             "completed": facts.size},
            {"status": "verifying sha256 digest"}, {"status": "writing manifest"},
            {"status": "success"}]


def _files(repo: str) -> list[tuple[str, int]]:
    from huggingface_hub import HfApi

    info = HfApi().model_info(repo, files_metadata=True)
    return [(s.rfilename, int(s.size or 0)) for s in info.siblings or []
            if any(fnmatch.fnmatch(s.rfilename, p) for p in PULL_PATTERNS)]


def _download(repo: str, filename: str, target: Path) -> None:
    from huggingface_hub import hf_hub_download

    hf_hub_download(repo, filename, local_dir=target)


async def _pull_lines(repo: str, target: Path) -> AsyncIterator[dict[str, Any]]:
    yield {"status": "pulling manifest"}
    files = await anyio.to_thread.run_sync(_files, repo)
    if not any(name == "config.json" for name, _ in files):
        raise RuntimeError(f"{repo} has no config.json; is it an MLX model?")
    for name, size in files:
        yield {"status": f"pulling {name}", "digest": name, "total": size, "completed": 0}
        await anyio.to_thread.run_sync(_download, repo, name, target)
        yield {"status": f"pulling {name}", "digest": name, "total": size, "completed": size}
    yield {"status": "verifying sha256 digest"}
    yield {"status": "writing manifest"}
    yield {"status": f"success: restart with --model {repo} to serve it"}
    yield {"status": "success"}


async def _import_lines(ref: str, blob: Path, target: Path) -> AsyncIterator[dict[str, Any]]:
    digest, size = blob.name.replace("-", ":", 1), blob.stat().st_size
    yield {"status": "pulling manifest"}
    if (target / "config.json").is_file():
        yield {"status": f"already imported into {target.name}"}
    else:
        yield {"status": f"importing {ref}", "digest": digest, "total": size, "completed": 0}
        for note in await import_apart(f"ollama:{ref}", target):
            yield {"status": f"note: {note}"}
        yield {"status": f"importing {ref}", "digest": digest, "total": size, "completed": size}
    yield {"status": "writing manifest"}
    yield {"status": f"success: restart with --model {target.name} to serve it"}
    yield {"status": "success"}


async def _ndjson(lines: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    try:
        async for item in lines:
            yield line(item)
    except Exception as exc:  # network, hub or disk errors end the stream with an error line
        yield line({"error": f"pull failed: {exc.__class__.__name__}: {exc}"})


async def _listed(items: list[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    for item in items:
        yield item


async def pull_response(services: Services, who: Principal, body: ModelBody) -> Any:
    wanted = body.wanted.strip()
    if not wanted:
        raise bad_request("model is required", param="model")
    if matches(services.model, wanted):
        if not body.stream:
            return {"status": "success"}
        return stream_response(_ndjson(_listed(_served(services))))
    if not who.is_admin or services.models_dir is None:
        raise ApiError(404, f"model '{wanted}' not found; this server serves "
                       f"'{ollama_name(services.model.name)}' and only an admin may pull "
                       "another model", param="model")
    ref = as_ollama(wanted)
    if ref is not None:
        return await _import_response(ref, services.models_dir, body.stream)
    repo = wanted.removesuffix(":latest")
    if repo.count("/") != 1:
        raise bad_request(f"'{wanted}' is not a Hugging Face repo id like "
                          "'mlx-community/Qwen2.5-1.5B-Instruct-4bit'.", param="model")
    target = services.models_dir / repo.replace("/", "--")
    if body.stream:
        return stream_response(_ndjson(_pull_lines(repo, target)))
    try:
        async for _ in _pull_lines(repo, target):
            pass
    except Exception as exc:
        raise ApiError(502, f"pull failed: {exc.__class__.__name__}: {exc}",
                       "server_error") from None
    return {"status": "success"}


async def _import_response(ref: str, models_dir: Path, stream: bool) -> Any:
    from appliance import gguf

    try:
        blob, target = import_source(f"ollama:{ref}", models_dir)
    except gguf.ImportRefused as exc:
        raise ApiError(404, f"model '{ref}' not found: {exc}. A Hugging Face repo id has a "
                       "slash ('mlx-community/Qwen2.5-1.5B-Instruct-4bit').",
                       param="model") from None
    except ValueError as exc:  # not a name Ollama could have (too long a part)
        raise ApiError(400, str(exc), code="invalid_value", param="model") from None
    if stream:
        return stream_response(_ndjson(_import_lines(ref, blob, target)))
    try:
        async for _ in _import_lines(ref, blob, target):
            pass
    except ImportFailed as exc:
        raise ApiError(422, f"import failed: {exc}", "invalid_request_error") from None
    return {"status": "success"}
