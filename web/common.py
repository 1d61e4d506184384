"""What every page handler shares: the services, the caller, form fields, page context."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec
from litestar import Request
from litestar.response import Template

from appliance.api.auth import Principal, shared_session
from appliance.api.headers import CSP as CSP  # re-exported for the pages
from appliance.service.services import Services
from appliance.vocab import CLASS_LABELS
from web.assets import vendor_scripts
from web.checklist import checklist
from web.format import HELPERS
from web.hints import HINTS

if TYPE_CHECKING:
    from web.state import WebState

PAGE = {"web_page": True}
"""``opt`` of a handler that renders a whole page: an anonymous visitor is sent to /login."""


ROLES = ("member", "admin")


def services(request: Request[Any, Any, Any]) -> Services:
    return request.app.state.services


def me(request: Request[Any, Any, Any]) -> Principal:
    return request.user


def web_state(request: Request[Any, Any, Any]) -> WebState:
    """The web UI's own state (live streams, the dashboard hub), built with the app
    (``web.routes.setup``)."""
    return request.app.state.web


def is_htmx(request: Request[Any, Any, Any]) -> bool:
    return request.headers.get("hx-request") == "true"


async def form_fields(request: Request[Any, Any, Any]) -> dict[str, str]:
    """A form's fields, or a JSON object's (API clients and tests may send either)."""
    if request.content_type[0] == "application/json":
        raw = await request.body()
        try:
            data = msgspec.json.decode(raw) if raw.strip() else {}
        except msgspec.DecodeError:
            data = {}
        if not isinstance(data, dict):
            return {}
        return {str(k): "" if v is None else str(v) for k, v in data.items()}
    form = await request.form()
    return {k: str(v) for k, v in form.items() if k != "_csrf_token"}



def base_context(request: Request[Any, Any, Any]) -> dict[str, Any]:
    svc = services(request)
    user = request.scope.get("user")
    theme = request.cookies.get("theme", "")
    admin = isinstance(user, Principal) and user.is_admin
    return {"me": user if isinstance(user, Principal) else None, "model": svc.model,
            "shared": shared_session(request), "shared_minutes": int(svc.shared_idle_s // 60),
            # the first hour's checklist, on admins' whole pages only (a few indexed reads)
            "first_hour": checklist(svc) if admin and not is_htmx(request) else None,
            "theme": theme if theme in ("light", "dark") else "",
            "scripts": vendor_scripts(), "h": HELPERS, "hints": HINTS, "classes": CLASS_LABELS, "roles": ROLES}


def page(request: Request[Any, Any, Any], template: str, *, status_code: int = 200,
         headers: Mapping[str, str] | None = None, **context: Any) -> Template:
    """A whole page or a partial, with the shared context (who, which model, helpers)."""
    return Template(template, context={**base_context(request), **context},
                    status_code=status_code, headers=dict(headers or {}))
