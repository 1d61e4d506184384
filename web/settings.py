"""A person's own settings: password, default system prompt (persona), theme; and, for
admins, the household-wide default system prompt.

The theme is kept in the database (it follows the person to other devices: logging in
sets it) and mirrored in a ``theme`` cookie that pages read to colour themselves.
"""

from __future__ import annotations

from typing import Any

import anyio
from litestar import Request, Response, get, post
from litestar.datastructures import Cookie
from litestar.exceptions import PermissionDeniedException
from litestar.params import FromQuery
from litestar.response import Redirect, Template

from appliance.api.account import session_cookie, theme_cookie
from appliance.api.auth import Principal
from appliance.service.services import Services
from appliance.store import auth, preferences, users, websessions
from appliance.store.errors import Invalid
from appliance.store.models import THEMES
from appliance.vocab import Refused
from web.common import PAGE, form_fields, is_htmx, me, page, services


def _load(svc: Services, who: Principal) -> tuple[preferences.Preferences, str]:
    with svc.store.read_sessions() as s:
        return preferences.get_preferences(s, who.user_id), preferences.household_prompt(s)


async def _page(request: Request[Any, Any, Any], status_code: int = 200,
                notice: tuple[str, str] | None = None, section: str = "",
                form: dict[str, str] | None = None,
                cookies: list[Cookie] | None = None) -> Template:
    prefs, household = await anyio.to_thread.run_sync(_load, services(request), me(request))
    template = page(request, "settings.html", status_code=status_code, prefs=prefs,
                    household=household, notice=notice, section=section, form=form or {},
                    themes=THEMES)
    if cookies:
        template.cookies.extend(cookies)
    return template


DONE = {"password": "Password changed.", "preferences": "Saved.",
        "household": "Saved for the household."}


@get("/settings", opt=PAGE)
async def settings_page(request: Request[Any, Any, Any], done: FromQuery[str] = "") -> Template:
    """``done``: which form was just saved (after its redirect), to say so there."""
    if done in DONE:
        return await _page(request, notice=("ok", DONE[done]), section=done)
    return await _page(request)


def _change_password(svc: Services, who: Principal, f: dict[str, str]) -> str:
    """Set the new password; every session of the person ends (anyone who knew the old
    password is logged out), and this browser continues in a new session, whose id is
    returned."""
    new = f.get("new_password", "")
    if new != f.get("repeat_password", ""):
        raise Invalid("The two new passwords are not the same.")
    with svc.store.sessions.begin() as s:
        user = users.get_user(s, who.user_id)
        if user is None or not auth.verify_password(user.password_hash,
                                                     f.get("current_password", "")):
            raise Invalid("Your current password is not right.")
        users.set_password(s, user, new)
        return websessions.start_session(s, user)


@post("/settings/password", status_code=200)
async def change_password(request: Request[Any, Any, Any]) -> Response[Any]:
    f = await form_fields(request)
    try:
        token = await anyio.to_thread.run_sync(_change_password, services(request),
                                               me(request), f)
    except Refused as exc:
        return await _page(request, 400, ("error", str(exc)), "password")
    cookie = session_cookie(request, token)
    if not is_htmx(request):
        return Redirect("/settings?done=password", status_code=303, cookies=[cookie])
    page = await _page(request, notice=("ok", DONE["password"]), section="password")
    page.set_cookie(cookie)
    return page


def _save_preferences(svc: Services, who: Principal, f: dict[str, str]) -> None:
    with svc.store.sessions.begin() as s:
        preferences.set_preferences(s, who.user_id, system_prompt=f.get("system_prompt"),
                                    theme=f.get("theme") or None)


@post("/settings/preferences", status_code=200)
async def save_preferences(request: Request[Any, Any, Any]) -> Response[Any]:
    f = await form_fields(request)
    try:
        await anyio.to_thread.run_sync(_save_preferences, services(request), me(request), f)
    except Refused as exc:
        return await _page(request, 400, ("error", str(exc)), "preferences", form=f)
    cookies = [theme_cookie(f["theme"])] if f.get("theme") in THEMES else []
    if not is_htmx(request):
        return Redirect("/settings?done=preferences", status_code=303, cookies=cookies)
    return await _page(request, notice=("ok", DONE["preferences"]), section="preferences",
                       cookies=cookies)


def _save_household(svc: Services, f: dict[str, str]) -> None:
    with svc.store.sessions.begin() as s:
        preferences.set_household_prompt(s, f.get("household_prompt", ""))


@post("/settings/household", status_code=200)
async def save_household(request: Request[Any, Any, Any]) -> Response[Any]:
    if not me(request).is_admin:
        raise PermissionDeniedException("Only admins set the household's default.")
    f = await form_fields(request)
    try:
        await anyio.to_thread.run_sync(_save_household, services(request), f)
    except Refused as exc:
        return await _page(request, 400, ("error", str(exc)), "household", form=f)
    if not is_htmx(request):
        return Redirect("/settings?done=household", status_code=303)
    return await _page(request, notice=("ok", DONE["household"]), section="household")


ROUTES = [settings_page, change_password, save_preferences, save_household]
