"""Admin JSON API: users, roles, classes, weights, quotas, everybody's keys and usage.

All routes are guarded by ``admin_only``; the web UI's admin pages use the same store calls.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import msgspec
from litestar import Request, Router, delete, get, patch, post, put
from litestar.datastructures import State
from litestar.params import FromPath, JSONBody
from sqlalchemy.orm import Session

from appliance.api.account import key_json, usage_json
from appliance.api.auth import admin_only, key_scope, new_key_class
from appliance.api.common import decode_body
from appliance.api.db import threaded
from appliance.api.errors import ApiError
from appliance.service import model_choice
from appliance.service.engine_client import EngineDown, SwitchRefused
from appliance.store import keys as store_keys
from appliance.store import ledger, limits, users, websessions
from appliance.store.db import Store
from appliance.store.errors import NotFound
from appliance.store.models import User
from appliance.vocab import Klass


class NewUser(msgspec.Struct):
    name: str
    password: str
    role: str = "member"
    max_class: str = Klass.INTERACTIVE.label
    weight: float = 1.0


class UserPatch(msgspec.Struct):
    role: str | None = None
    disabled: bool | None = None
    max_class: str | None = None
    weight: float | None = None
    password: str | None = None


class QuotaBody(msgspec.Struct):
    tokens_per_day: int | None = None
    max_concurrent: int | None = None
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None


class NewKey(msgspec.Struct):
    name: str
    max_class: str | None = None
    default_class: str | None = None


class ModelChoice(msgspec.Struct):
    model: str
    """A models folder entry's name, ``demo``, or a model folder's full path."""


class KeyPatch(msgspec.Struct):
    default_class: str | None = None
    """None or "": requests that ask for no class run in the key's maximum."""


def _store(state: State) -> Store:
    return state.services.store


def user_json(u: User) -> dict[str, Any]:
    return {"id": u.id, "name": u.name, "role": u.role, "disabled": u.disabled,
            "max_class": u.max_class, "weight": u.weight, "created_at": u.created_at}


def _user(s: Session, uid: FromPath[int]) -> User:
    u = users.get_user(s, uid)
    if u is None:
        raise NotFound("no such user")
    return u


@get("/users")
@threaded
def list_users(state: State) -> list[dict[str, Any]]:
    with _store(state).read_sessions() as s:
        return [user_json(u) for u in users.list_users(s)]


# Litestar converts bodies leniently ("1" -> 1.0, "true" -> True, 1 -> True): bodies with
# numbers or flags are decoded again strictly, so a wrong type is a 400 naming the field.


@post("/users", status_code=201)
async def add_user(request: Request, state: State, data: JSONBody[NewUser]) -> dict[str, Any]:
    strict = decode_body(await request.body(), NewUser)
    return await anyio.to_thread.run_sync(_add_user, state, strict)


def _add_user(state: State, data: NewUser) -> dict[str, Any]:
    with _store(state).sessions.begin() as s:
        out = user_json(users.create_user(s, data.name, data.password, role=data.role,
                                          max_class=data.max_class, weight=data.weight))
    state.services.policy_changed()  # the running scheduler learns the new weight
    return out


@patch("/users/{uid:int}")
async def change_user(request: Request, state: State, uid: FromPath[int],
                      data: JSONBody[UserPatch]) -> dict[str, Any]:
    strict = decode_body(await request.body(), UserPatch)
    return await anyio.to_thread.run_sync(_change_user, state, uid, strict)


def _change_user(state: State, uid: int, data: UserPatch) -> dict[str, Any]:
    with _store(state).sessions.begin() as s:
        u = _user(s, uid)
        if data.role is not None:
            users.set_role(s, u, data.role)
        if data.max_class is not None:
            users.set_max_class(s, u, data.max_class)
        if data.weight is not None:
            users.set_weight(s, u, data.weight)
        if data.password is not None:
            users.set_password(s, u, data.password)
            websessions.end_user_sessions(s, u.id)
        if data.disabled is not None:
            users.disable_user(s, u, data.disabled)
        out = user_json(u)
    if data.weight is not None:
        state.services.policy_changed()  # after the commit: the scheduler re-reads weights
    if data.disabled is not None:
        state.services.access_changed(uid)  # a disabled user's streams end within a tick
    return out


@get("/users/{uid:int}/quota")
@threaded
def get_quota(state: State, uid: FromPath[int]) -> dict[str, Any]:
    with _store(state).read_sessions() as s:
        _user(s, uid)
        return _quota_dict(limits.get_quota(s, uid))


def _quota_dict(q: limits.QuotaLimits) -> dict[str, int | None]:
    return {"tokens_per_day": q.tokens_per_day, "max_concurrent": q.max_concurrent,
            "max_prompt_tokens": q.max_prompt_tokens, "max_output_tokens": q.max_output_tokens}


@put("/users/{uid:int}/quota")
async def set_quota(request: Request, state: State, uid: FromPath[int],
                    data: JSONBody[QuotaBody]) -> dict[str, Any]:
    # decoded again strictly (see add_user): integers only, bounded by QuotaLimits
    strict = decode_body(await request.body(), QuotaBody)
    q = limits.QuotaLimits(**msgspec.structs.asdict(strict))
    saved = await anyio.to_thread.run_sync(_save_quota, _store(state), uid, q)
    await anyio.to_thread.run_sync(state.services.access_changed, uid)  # a lower day's limit
    return saved


def _save_quota(store: Store, uid: int, q: limits.QuotaLimits) -> dict[str, Any]:
    with store.sessions.begin() as s:
        _user(s, uid)
        limits.set_quota(s, uid, q)
        return _quota_dict(q)


@get("/keys")
@threaded
def list_all_keys(state: State) -> list[dict[str, Any]]:
    with _store(state).read_sessions() as s:
        return [key_json(k) for k in store_keys.list_keys(s, include_revoked=True)]


@post("/users/{uid:int}/keys", status_code=201)
@threaded
def create_key(request: Request, state: State, uid: FromPath[int],
               data: JSONBody[NewKey]) -> dict[str, Any]:
    klass = new_key_class(request.user, data.max_class)  # an admin's key: up to its class
    with _store(state).sessions.begin() as s:
        key, plaintext = store_keys.create_api_key(s, _user(s, uid), data.name, klass,
                                                   default_class=data.default_class,
                                                   at_most=key_scope(request.user))
        return {**key_json(key), "key": plaintext}


@patch("/keys/{prefix:str}")
@threaded
def change_key(state: State, prefix: FromPath[str], data: JSONBody[KeyPatch]
               ) -> dict[str, Any]:
    with _store(state).sessions.begin() as s:
        return key_json(store_keys.set_default_class(s, prefix, data.default_class))


@delete("/keys/{prefix:str}", status_code=204)
@threaded
def revoke_key(state: State, prefix: FromPath[str]) -> None:
    with _store(state).sessions.begin() as s:
        owner = store_keys.revoke_key(s, prefix).user_id
    state.services.access_changed(owner)  # the key's streams end within a tick


@post("/model", status_code=200)
async def use_model(state: State, data: JSONBody[ModelChoice]) -> dict[str, Any]:
    """Serve another model from now on (what runs finishes first; see
    ``Engine.switch_model``) and at the next start; a model that fails to load leaves the
    old one serving (422, saying why)."""
    try:
        info, changed = await model_choice.use_model(state.services, data.model)
    except model_choice.ModelRefused as exc:
        raise ApiError(400, str(exc)) from exc
    except model_choice.ModelLoadFailed as exc:
        raise ApiError(422, str(exc)) from exc
    except (SwitchRefused, EngineDown) as exc:
        raise ApiError(409 if isinstance(exc, SwitchRefused) else 503, str(exc)) from exc
    return {"model": info.name, "path": info.path, "changed": changed}


@get("/usage")
@threaded
def usage(state: State) -> dict[str, Any]:
    now = time.time()
    with _store(state).read_sessions() as s:
        hour = ledger.usage_last_hour(s, now)
        day = ledger.usage_last_day(s, now)
        return {str(u.id): {"name": u.name, "last_hour": usage_json(hour.get(u.id)),
                            "last_day": usage_json(day.get(u.id))}
                for u in users.list_users(s)}


router = Router(path="/admin", guards=[admin_only], route_handlers=[
    list_users, add_user, change_user, get_quota, set_quota, list_all_keys, create_key,
    change_key, revoke_key, usage, use_model])
