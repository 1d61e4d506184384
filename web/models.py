"""The admin's Models page: the models folder as the daemon sees it (which one it serves),
and a model brought in from a GGUF file on this machine, the local Ollama store or the
bundled SmolLM2, by the same import as ``appliance model import`` and an admin's
``ollama pull`` (run apart, in a process of its own, while the daemon keeps serving). One
daemon serves one model; "Serve this" changes it while the daemon runs
(``appliance.service.model_choice``: what runs finishes first, a model that fails to load
leaves the old one serving)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from litestar import Request, Response, Router, get, post
from litestar.response import Redirect, Template

from appliance.api.auth import admin_only
from appliance.api.ollama_models import model_facts
from appliance.models import ImportFailed, as_ollama, import_apart, import_source
from appliance.service import model_choice
from appliance.service.engine_client import DEMO_MODEL_DIR, EngineDown, SwitchRefused
from appliance.service.services import Services
from appliance.store.errors import Invalid
from web.common import PAGE, form_fields, is_htmx, page, services

HINT = ("an Ollama model's name (llama3.2:3b), the full path of a .gguf file on this machine, "
        "or smollm2")


@dataclass(frozen=True, slots=True)
class ModelRow:
    name: str
    """What "Serve this" sends: the folder's name, ``demo``, or a full path."""
    label: str
    size: int
    arch: str
    quant: str
    where: str
    served: bool


def _row(path: Path, name: str, label: str, where: str, served: Path) -> ModelRow:
    try:
        facts = model_facts(str(path))
        size, arch, quant = facts.size, facts.family, facts.quantization
    except (OSError, ValueError):  # a broken config.json: listed, it fails when chosen
        size, arch, quant = 0, "unreadable config.json", "?"
    return ModelRow(name, label, size, arch, quant, where, path.resolve() == served)


def _rows(svc: Services) -> list[ModelRow]:
    """The served model first (wherever it lives), the bundled demo, then the folder's."""
    served = Path(svc.model.path).resolve()
    folder = svc.models_dir
    rows = []
    seen = set()
    if folder is not None and folder.is_dir():
        for d in sorted(folder.iterdir()):
            if (d / "config.json").is_file():
                rows.append(_row(d, d.name, d.name, "models folder", served))
                seen.add(d.resolve())
    if DEMO_MODEL_DIR.resolve() not in seen:
        rows.insert(0, _row(DEMO_MODEL_DIR, "demo", "demo", "bundled demo model", served))
        seen.add(DEMO_MODEL_DIR.resolve())
    if served not in seen:
        rows.insert(0, _row(served, str(served), svc.model.name, str(served.parent), served))
    rows.sort(key=lambda r: not r.served)  # stable: the served one on top
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


@post("/manage/models/use", status_code=200)
async def use_model(request: Request[Any, Any, Any]) -> Response[Any]:
    """Make another model the served one (the page's "Serve this")."""
    svc = services(request)
    f = await form_fields(request)
    name = f.get("model", "")
    status, changed = 200, False
    try:
        info, changed = await model_choice.use_model(svc, name)
        notice = ("ok", f"Now serving {info.name}." if changed else
                  f"{info.name} is already served; it stays the choice after a restart.")
    except model_choice.ModelRefused as exc:
        status, notice = 400, ("error", f"Could not serve it: {exc}")
    except model_choice.ModelLoadFailed as exc:
        status, notice = 422, ("error", str(exc))
    except (SwitchRefused, EngineDown) as exc:
        status, notice = 409, ("error", f"Could not change the model now: {exc}")
    if not is_htmx(request) and notice[0] == "ok":
        return Redirect("/manage/models", status_code=303)
    rows = await anyio.to_thread.run_sync(_rows, svc)
    return page(request, "_models_panel.html", status_code=status, rows=rows, hint=HINT,
                form={}, notice=notice, switched=changed)


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
            notice = ("ok", f"Imported {target.name}. Choose “Serve this” on its row to "
                            "serve it.")
    except (ValueError, gguf.ImportRefused, ImportFailed) as exc:
        status = 404 if isinstance(exc, gguf.ImportRefused) else (
            422 if isinstance(exc, ImportFailed) else 400)
        notice = ("error", f"Could not import “{f.get('source', '')}”: {exc}")
    if not is_htmx(request) and notice[0] == "ok":
        return Redirect("/manage/models", status_code=303)
    rows = await anyio.to_thread.run_sync(_rows, svc)
    return page(request, "_models_panel.html", status_code=status, rows=rows, hint=HINT,
                form=f if notice[0] == "error" else {}, notice=notice)


router = Router(path="/", guards=[admin_only], route_handlers=[models_page, bring_in, use_model])
