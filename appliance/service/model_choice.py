"""Which model the daemon serves: the facts handlers need (``ModelInfo``), a switch to another
model while the daemon runs, and the choice recorded for the next start.

The choice lives in the household settings table as ``{"path", "over"}``: the model chosen
and the configured ``engine.model`` it was chosen over. At start it is served only while the
configuration still says what it said then: a later ``--model`` or config edit wins, the
latest word of the household's.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from appliance.engine.core import EngineDown, SwitchRefused
from appliance.engine.model import LoadedModel, resolve_model_path
from appliance.service.chat_format import longest_token_chars, renders_tools
from appliance.service.services import ModelInfo
from appliance.store.models import HouseholdSetting

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from appliance.service.services import Services
    from appliance.store.db import Store

log = logging.getLogger(__name__)

CHOICE_KEY = "served_model"


class ModelRefused(ValueError):
    """The named model cannot be served (not found, not a model folder): nothing changed."""


class ModelLoadFailed(RuntimeError):
    """The new model failed to load; the old one goes on serving."""


def model_info(loaded: LoadedModel) -> ModelInfo:
    return ModelInfo(name=loaded.name, path=str(loaded.path), is_demo=loaded.is_demo,
                     ctx_limit=loaded.ctx_limit,
                     vocab_size=int(loaded.config.get("vocab_size") or 0) or 1 << 30,
                     tokenizer=loaded.tokenizer,
                     max_token_chars=longest_token_chars(loaded.tokenizer),
                     tools=renders_tools(loaded.tokenizer))


def model_folder(name: str, models_dir: Path | None) -> Path:
    """The folder ``name`` means (a models folder entry, ``demo``, a path); ModelRefused
    when there is none or it holds no ``config.json``."""
    try:
        path = resolve_model_path(name.strip(), models_dir or Path("/nonexistent"))
    except FileNotFoundError:
        raise ModelRefused(f"there is no model “{name}”: give a name from the list or the "
                           "full path of a model folder") from None
    if not (path / "config.json").is_file():
        raise ModelRefused(f"{path} has no config.json, so it is not a model folder; bring "
                           "the model in with the form below first")
    return path.resolve()


@dataclass(frozen=True, slots=True)
class Choice:
    path: str
    over: str
    """The configured ``engine.model`` when the choice was made."""


def recorded(s: Session) -> Choice | None:
    row = s.get(HouseholdSetting, CHOICE_KEY)
    if row is None or not row.value:
        return None
    try:
        data = json.loads(row.value)
        return Choice(str(data["path"]), str(data.get("over", "")))
    except (ValueError, KeyError, TypeError):
        return None


def record(s: Session, path: Path, configured: str) -> None:
    row = s.get(HouseholdSetting, CHOICE_KEY)
    if row is None:
        row = HouseholdSetting(key=CHOICE_KEY, value="")
        s.add(row)
    row.value = json.dumps({"path": str(path), "over": configured})


def at_start(store: Store, configured: str) -> Path | None:
    """The model chosen since the last start, if the configuration has not changed since
    and its folder is still a model; None: serve what the configuration says."""
    with store.read_sessions() as s:
        choice = recorded(s)
    if choice is None or choice.over != configured:
        return None
    path = Path(choice.path)
    if not (path / "config.json").is_file():
        log.warning("the chosen model's folder is gone; serving the configured one")
        return None
    return path


async def use_model(svc: Services, name: str) -> tuple[ModelInfo, bool]:
    """Serve ``name`` from now on and record it for the next start. Returns the model and
    whether it changed. Raises ModelRefused (nothing done), ``SwitchRefused`` or
    ``EngineDown`` from the engine, or ModelLoadFailed (the old model still serves)."""
    path = await anyio.to_thread.run_sync(model_folder, name, svc.models_dir)
    if Path(svc.model.path).resolve() == path:
        await anyio.to_thread.run_sync(_record, svc, path)
        return svc.model, False

    def adopt(loaded: LoadedModel) -> None:
        # every handler reads svc.model per request: from here on they all see the new one
        svc.model = model_info(loaded)

    try:
        await anyio.to_thread.run_sync(
            lambda: svc.engine.switch_model(path, svc.drain_s, then=adopt))
    except (SwitchRefused, EngineDown):
        raise
    except Exception as exc:  # whatever the load raised: the old model still serves
        log.warning("model switch failed: path=%s error=%s", path, type(exc).__name__)
        raise ModelLoadFailed(f"{path.name} did not load ({type(exc).__name__}: {exc}); "
                              f"{svc.model.name} is still served") from exc
    await anyio.to_thread.run_sync(_record, svc, path)
    return svc.model, True


def _record(svc: Services, path: Path) -> None:
    with svc.store.sessions.begin() as s:
        record(s, path, svc.configured_model)
