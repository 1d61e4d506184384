"""The admin's Models page: the models folder as the daemon sees it (which one it serves),
and a model brought in from a GGUF file on this machine, the local Ollama store or the
bundled SmolLM2, by the same import as ``appliance model import`` and an admin's
``ollama pull`` (run apart, in a process of its own, while the daemon keeps serving). One
daemon serves one model: a new one is served after a restart with ``--model NAME``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from litestar import Request, Response, Router, get, post
from litestar.response import Redirect, Template

from appliance.api.auth import admin_only
from appliance.models import ImportFailed, as_ollama, import_apart, import_source
from appliance.service.services import Services
from appliance.store.errors import Invalid
from web.common import PAGE, form_fields, is_htmx, page, services

HINT = ("an Ollama model's name (llama3.2:3b), the full path of a .gguf file on this machine, "
        "or smollm2")


@dataclass(frozen=True, slots=True)
class ModelRow:
    name: str
    size: int
    served: bool


def _rows(svc: Services) -> list[ModelRow]:
    served = Path(svc.model.path).resolve()
    folder = svc.models_dir
    rows = []
    if folder is not None and folder.is_dir():
        for d in sorted(folder.iterdir()):
            if (d / "config.json").is_file():
                size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
                rows.append(ModelRow(d.name, size, d.resolve() == served))
    return rows


def _source(text: str) -> str:
    """What the form names, as ``appliance model import`` takes it; ValueError if nothing
    it can take (a relative path, a repo id: the pull downloads those)."""
    text = text.strip()
    if text == "smollm2" or (text.endswith(".gguf") and Path(text).expanduser().is_absolute()):
        return text
    ref = None if text.endswith(".gguf") else as_ollama(text)
    if ref is None:
        raise Invalid(f"Give {HINT}.")
    return f"ollama:{ref}"


@get("/manage/models", opt=PAGE)
async def models_page(request: Request[Any, Any, Any]) -> Template:
    rows = await anyio.to_thread.run_sync(_rows, services(request))
    return page(request, "manage_models.html", rows=rows, hint=HINT, form={}, notice=None)


@post("/manage/models", status_code=200)
async def bring_in(request: Request[Any, Any, Any]) -> Response[Any]:
    from appliance import gguf

    svc = services(request)
    f = await form_fields(request)
    status, notice = 201, ("ok", "")
    try:
        if svc.models_dir is None:
            raise Invalid("this daemon has no models folder")
        source = _source(f.get("source", ""))
        _, target = import_source(source, svc.models_dir)
        if (target / "config.json").is_file():
            status, notice = 200, ("ok", f"{target.name} is here already.")
        else:
            await import_apart(source, target)
            notice = ("ok", f"Imported {target.name}. Restart the appliance with --model "
                            f"{target.name} to serve it.")
    except (ValueError, gguf.ImportRefused, ImportFailed) as exc:
        status = 404 if isinstance(exc, gguf.ImportRefused) else (
            422 if isinstance(exc, ImportFailed) else 400)
        notice = ("error", f"Could not import “{f.get('source', '')}”: {exc}")
    if not is_htmx(request) and notice[0] == "ok":
        return Redirect("/manage/models", status_code=303)
    rows = await anyio.to_thread.run_sync(_rows, svc)
    return page(request, "_models_panel.html", status_code=status, rows=rows, hint=HINT,
                form=f if notice[0] == "error" else {}, notice=notice)


router = Router(path="/", guards=[admin_only], route_handlers=[models_page, bring_in])
