"""Admin pages for people: add users, role, status, maximum class, weight, password, quotas.

The same store calls as the admin JSON API; every change is one transaction and then
``services.policy_changed()`` so the running scheduler re-reads weights, classes and quotas
(no restart). A form that fails comes back with the reason and the values as typed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import anyio
from litestar import Request, Response, Router, get, post
from litestar.params import FromPath
from litestar.response import Redirect, Template

from appliance.api.auth import admin_only
from appliance.service.services import Services
from appliance.store import limits, users, websessions
from appliance.store.errors import AlreadyExists, Invalid, LastAdmin, NotFound
from appliance.store.models import User
from appliance.vocab import Klass
from web.common import PAGE, form_fields, is_htmx, page, services

QUOTA_FIELDS = ("tokens_per_day", "max_concurrent", "max_prompt_tokens", "max_output_tokens")
LABELS = {"tokens_per_day": "Tokens per day", "max_concurrent": "Concurrent requests",
          "max_prompt_tokens": "Max prompt tokens", "max_output_tokens": "Max output tokens",
          "weight": "Weight", "password": "Password", "name": "Name", "role": "Role",
          "class": "Maximum class", "max_class": "Maximum class"}
"""The form's own words for each field, used in error messages (never the internal name)."""


def plain(message: str) -> str:
    """A store or validation message whose leading field name is an internal one
    (``max_concurrent``, ``class``) named as the form labels it instead."""
    for name, label in sorted(LABELS.items(), key=lambda kv: -len(kv[0])):
        if label.lower() == name.replace("_", " "):
            continue  # already the form's word
        for said in (name, name.replace("_", " ")):
            if message.startswith(said + " "):
                return f"{label} {message[len(said):].lstrip()}"
    return message
FAILURES = (ValueError, AlreadyExists, LastAdmin, NotFound)


@dataclass(frozen=True, slots=True)
class UserView:
    id: int
    name: str
    role: str
    disabled: bool
    max_class: str
    weight: float
    quota: limits.QuotaLimits
    created_at: float


def _view(u: User, q: limits.QuotaLimits) -> UserView:
    return UserView(u.id, u.name, u.role, u.disabled, u.max_class, u.weight, q, u.created_at)


def _all(svc: Services) -> list[UserView]:
    with svc.store.read_sessions() as s:
        quotas = limits.load_quotas(s)
        return [_view(u, quotas.get(u.id, limits.UNLIMITED)) for u in users.list_users(s)]


def _one(svc: Services, uid: int) -> UserView:
    with svc.store.read_sessions() as s:
        u = users.get_user(s, uid)
        if u is None:
            raise NotFound("no such user")
        return _view(u, limits.get_quota(s, uid))


def _status(exc: Exception) -> int:
    return 404 if isinstance(exc, NotFound) else 409 if isinstance(
        exc, AlreadyExists | LastAdmin) else 400


@get("/manage/users", opt=PAGE)
async def users_page(request: Request[Any, Any, Any]) -> Template:
    people = await anyio.to_thread.run_sync(_all, services(request))
    return page(request, "manage_users.html", people=people, form={}, notice=None)


def _add(svc: Services, f: dict[str, str]) -> None:
    with svc.store.sessions.begin() as s:
        users.create_user(s, f.get("name", "").strip(), f.get("password", ""),
                          role=f.get("role") or "member",
                          max_class=f.get("max_class") or Klass.INTERACTIVE.label,
                          weight=_number(f.get("weight") or "1", "weight"))


def _number(text: str, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise Invalid(f"{LABELS.get(what, what)} must be a number") from None


@post("/manage/users", status_code=200)
async def add_user(request: Request[Any, Any, Any]) -> Response[Any]:
    svc = services(request)
    f = await form_fields(request)
    try:
        await anyio.to_thread.run_sync(_add, svc, f)
    except FAILURES as exc:
        people = await anyio.to_thread.run_sync(_all, svc)
        # The name goes back into the page as typed: autoescaping keeps it text.
        notice = f"Could not add “{f.get('name', '')}”: {plain(str(exc))}"
        return page(request, "_users_panel.html", status_code=_status(exc), people=people,
                    form=f, notice=("error", notice))
    svc.policy_changed()
    if not is_htmx(request):
        return Redirect("/manage/users", status_code=303)
    people = await anyio.to_thread.run_sync(_all, svc)
    return page(request, "_users_panel.html", status_code=201, people=people, form={},
                notice=("ok", f"Added {f.get('name', '').strip()}."))


def _change(svc: Services, uid: int, f: dict[str, str]) -> None:
    """Apply the fields present (a form sends them all; an API client may send some)."""
    with svc.store.sessions.begin() as s:
        u = users.get_user(s, uid)
        if u is None:
            raise NotFound("no such user")
        if f.get("role"):
            users.set_role(s, u, f["role"])
        if f.get("max_class"):
            users.set_max_class(s, u, f["max_class"])
        if f.get("weight"):
            users.set_weight(s, u, _number(f["weight"], "weight"))
        if f.get("password"):
            users.set_password(s, u, f["password"])
            websessions.end_user_sessions(s, u.id)
        if f.get("status") in ("active", "disabled"):
            users.disable_user(s, u, f["status"] == "disabled")
        if any(k in f for k in QUOTA_FIELDS):
            old = dataclasses.asdict(limits.get_quota(s, uid))
            new = {k: _limit(f[k], k) if k in f else old[k] for k in QUOTA_FIELDS}
            limits.set_quota(s, uid, limits.QuotaLimits(**new))
    svc.access_changed(uid)  # committed: running requests obey a disabling or a lower quota


def _limit(text: str, name: str) -> int | None:
    """A quota field: blank means unlimited."""
    text = text.strip().replace(",", "").replace("_", "")
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise Invalid(f"{LABELS.get(name, name)} must be a whole number of at least 1, "
                         "or blank for unlimited")
    return int(text)


@post("/manage/users/{uid:int}", status_code=200)
async def change_user(request: Request[Any, Any, Any], uid: FromPath[int]) -> Response[Any]:
    svc = services(request)
    f = await form_fields(request)
    try:
        await anyio.to_thread.run_sync(_change, svc, uid, f)
    except FAILURES as exc:
        person = await anyio.to_thread.run_sync(_one, svc, uid)
        # the card comes back as typed (but never the password), with the reason
        typed = {k: v for k, v in f.items() if k != "password"}
        return page(request, "_user_card.html", status_code=_status(exc), p=person,
                    notice=("error", plain(str(exc))), form=typed)
    svc.policy_changed()
    if not is_htmx(request):
        return Redirect("/manage/users", status_code=303)
    person = await anyio.to_thread.run_sync(_one, svc, uid)
    return page(request, "_user_card.html", p=person, notice=("ok", "Saved."))


router = Router(path="/", guards=[admin_only], route_handlers=[users_page, add_user,
                                                                 change_user])
