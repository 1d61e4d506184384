"""The admin's first hour: a short checklist (add the household, a key for Home Assistant,
the model) shown above the admin's pages until it is done or hidden, and the one-step
"key for Home Assistant" (docs/home-assistant.md's recipe, said in words).

The checklist's state is read from what the household already has, not kept apart: people
besides the admin, a live key whose default class is voice, a model chosen or a real one
served. Only "hidden" is a setting of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio
from litestar import Request, Response, post
from litestar.exceptions import PermissionDeniedException
from litestar.response import Template

from appliance.api.ollama_models import ollama_name
from appliance.service.services import Services
from appliance.store import keys as store_keys
from appliance.store import users
from appliance.store.auth import generate_password
from appliance.store.models import HouseholdSetting
from appliance.vocab import Klass, Refused
from web.checklist import HA_USER, HIDDEN_KEY
from web.common import is_htmx, me, page, services
from web.keys import panel_for

HA_KEY_NAME = "Home Assistant"


def _hide(svc: Services) -> None:
    with svc.store.sessions.begin() as s:
        row = s.get(HouseholdSetting, HIDDEN_KEY)
        if row is None:
            s.add(HouseholdSetting(key=HIDDEN_KEY, value="1"))
        else:
            row.value = "1"


@post("/start/hide", status_code=200)
async def hide(request: Request[Any, Any, Any]) -> Response[str]:
    """"Hide this list": the panel goes (htmx swaps it for nothing)."""
    if not me(request).is_admin:
        raise PermissionDeniedException("Only an admin can hide the getting-started list.")
    await anyio.to_thread.run_sync(_hide, services(request))
    return Response("", media_type="text/html")


@dataclass(frozen=True, slots=True)
class HaKey:
    key: str
    said: list[str]
    """What was made and why, in words."""


def _ha_key(svc: Services) -> HaKey:
    """The user ``home-assistant`` (maximum class voice; a password nobody is told, so it
    never logs in) made or brought up to voice, and a key for it whose default class is
    voice: Home Assistant cannot ask for a class per request."""
    said = []
    with svc.store.sessions.begin() as s:
        user = users.get_user_by_name(s, HA_USER)
        if user is None:
            user = users.create_user(s, HA_USER, generate_password(),
                                     max_class=Klass.VOICE.label)
            said.append(f"Made the user “{HA_USER}” with maximum class voice, so Home "
                        "Assistant's requests go ahead of chats and background work. Its "
                        "password was never shown: nobody logs in as it.")
        elif user.disabled:
            raise Refused(f"the user “{HA_USER}” is disabled. Enable it on the Users page "
                             "(or rename it there to start afresh), then press this again.")
        elif user.max_class != Klass.VOICE.label:
            users.set_max_class(s, user, Klass.VOICE.label)
            said.append(f"Raised “{HA_USER}”'s maximum class to voice (it was "
                        f"{user.max_class}).")
        else:
            said.append(f"Used the existing user “{HA_USER}” (maximum class voice).")
        _, plaintext = store_keys.create_api_key(s, user, HA_KEY_NAME, Klass.VOICE.label,
                                                 default_class=Klass.VOICE.label)
    said.append("Made a key for it whose default class is voice, because Home Assistant "
                "cannot choose a class per request.")
    return HaKey(plaintext, said)


def base_url(request: Request[Any, Any, Any]) -> str:
    """The address this page was reached at (what Home Assistant's URL field takes)."""
    return str(request.base_url).rstrip("/")


@post("/keys/home-assistant", status_code=201)
async def make_ha_key(request: Request[Any, Any, Any]) -> Template:
    """The one-step key for Home Assistant, shown once with what to type into HA."""
    svc, who = services(request), me(request)
    if not who.is_admin:
        raise PermissionDeniedException("Only an admin can make Home Assistant's key.")
    status, made, notice = 201, None, None
    try:
        made = await anyio.to_thread.run_sync(_ha_key, svc)
    except Refused as exc:
        status, notice = 409, ("error", f"Could not make Home Assistant's key: {exc}")
    url = base_url(request)
    local = request.url.hostname in ("127.0.0.1", "localhost", "::1")
    panel = await anyio.to_thread.run_sync(panel_for, svc, who)
    # without htmx the whole page: the key cannot wait behind a redirect, it is shown once
    return page(request, "_keys_panel.html" if is_htmx(request) else "keys.html",
                status_code=status, panel=panel, created=None, notice=notice, form={},
                ha=made, ha_url=url, ha_local=local, ha_model=ollama_name(svc.model.name),
                headers={"Cache-Control": "no-store"})


ROUTES = [hide, make_ha_key]
