"""API keys page: create (the key is shown once) and revoke.

Admins see and manage everybody's keys and may make one for any user; a member sees and
manages their own. A key's maximum class can be at most its user's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio
from litestar import Request, Response, get, post
from litestar.params import FromPath
from litestar.response import Redirect, Template

from appliance.api.auth import Principal, key_scope, new_key_class
from appliance.service.services import Services
from appliance.store import keys as store_keys
from appliance.store import users
from appliance.store.errors import NotFound
from appliance.vocab import Refused
from web.common import PAGE, form_fields, is_htmx, me, page, services


@dataclass(frozen=True, slots=True)
class KeyView:
    prefix: str
    name: str
    user_name: str
    max_class: str
    default_class: str
    created_at: float
    last_used_at: float | None
    revoked: bool


@dataclass(frozen=True, slots=True)
class Panel:
    keys: list[KeyView]
    people: list[tuple[int, str]]
    """Whom a key can be made for: everyone (admins) or oneself."""


def panel_for(svc: Services, who: Principal) -> Panel:
    with svc.store.read_sessions() as s:
        found = store_keys.list_keys(s, user_id=None if who.is_admin else who.user_id,
                                     include_revoked=True,
                                     at_most=None if who.is_admin else key_scope(who))
        keys = [KeyView(k.prefix, k.name, k.user.name, k.max_class,
                        k.default_class or k.max_class, k.created_at,
                        k.last_used_at, k.revoked_at is not None) for k in reversed(found)]
        people = [(u.id, u.name) for u in users.list_users(s, include_disabled=False)] \
            if who.is_admin else [(who.user_id, who.name)]
        return Panel(keys, people)


@get("/keys", opt=PAGE)
async def keys_page(request: Request[Any, Any, Any]) -> Template:
    panel = await anyio.to_thread.run_sync(panel_for, services(request), me(request))
    return page(request, "keys.html", panel=panel, created=None, notice=None, form={})


def _create(svc: Services, who: Principal, f: dict[str, str]) -> tuple[str, str]:
    uid = who.user_id
    if who.is_admin and f.get("user_id", "").isdigit():
        uid = int(f["user_id"])
    with svc.store.sessions.begin() as s:
        user = users.get_user(s, uid)
        if user is None:
            raise NotFound("no such user")
        key, plaintext = store_keys.create_api_key(s, user, f.get("name", ""),
                                                   new_key_class(who, f.get("max_class") or None),
                                                   default_class=f.get("default_class") or None,
                                                   at_most=key_scope(who))
        return key.prefix, plaintext


@post("/keys", status_code=201)
async def create_key(request: Request[Any, Any, Any]) -> Response[Any]:
    svc, who = services(request), me(request)
    f = await form_fields(request)
    created: str | None = None
    try:
        _, created = await anyio.to_thread.run_sync(_create, svc, who, f)
        notice = ("ok", "Copy the key now: it is shown only once.")
        status = 201
    except (Refused, NotFound) as exc:
        notice = ("error", f"Could not create the key: {exc}. {_advice(str(exc))}".rstrip())
        status = 404 if isinstance(exc, NotFound) else 400
    panel = await anyio.to_thread.run_sync(panel_for, svc, who)
    return page(request, "_keys_panel.html", status_code=status, panel=panel, created=created,
                notice=notice, form={} if created else f, headers={"Cache-Control": "no-store"})


def _advice(refusal: str) -> str:
    """What to do about a class refusal, in words (the store says only what is wrong)."""
    if "above the key's maximum" in refusal:
        return ("Choose a maximum class at least as high as the default class. For Home "
                "Assistant, use “Make a key for Home Assistant” instead: it does all of it.")
    if "above the user's maximum" in refusal:
        return ("Raise the person's maximum class on the Users page first, or make the key "
                "for someone whose maximum is that high. For Home Assistant, use “Make a key "
                "for Home Assistant”: it makes a user of its own with maximum class voice.")
    return ""


def _revoke(svc: Services, who: Principal, prefix: str) -> None:
    with svc.store.sessions.begin() as s:
        key = store_keys.revoke_key(s, prefix, user_id=None if who.is_admin else who.user_id,
                                    at_most=None if who.is_admin else key_scope(who))
        owner = key.user_id
    svc.access_changed(owner)  # its streams end now, not at their length


@post("/keys/{prefix:str}/revoke", status_code=200)
async def revoke_key(request: Request[Any, Any, Any], prefix: FromPath[str]) -> Response[Any]:
    svc, who = services(request), me(request)
    await anyio.to_thread.run_sync(_revoke, svc, who, prefix)  # another's key: 404
    if not is_htmx(request):
        return Redirect("/keys", status_code=303)
    panel = await anyio.to_thread.run_sync(panel_for, svc, who)
    return page(request, "_keys_panel.html", panel=panel, created=None,
                notice=("ok", f"Revoked {prefix}."), form={})


ROUTES = [keys_page, create_key, revoke_key]
