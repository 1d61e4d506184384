"""The browser UI's routes and state (``create_app`` includes ``ROUTES`` and calls ``setup``
when this module exists)."""

from __future__ import annotations

from litestar import Litestar, Router
from litestar.datastructures import CacheControlHeader, ResponseHeader
from litestar.static_files import create_static_files_router

from web import (
    chat,
    dashboard,
    docs,
    export,
    first_hour,
    jobs,
    keys,
    manage,
    models,
    settings,
)
from web.assets import STATIC
from web.common import CSP
from web.errors import EXCEPTION_HANDLERS
from web.state import WebState

SECURITY_HEADERS = [
    ResponseHeader(name="Content-Security-Policy", value=CSP),
    ResponseHeader(name="X-Content-Type-Options", value="nosniff"),
    ResponseHeader(name="Referrer-Policy", value="same-origin"),
]

PRIVATE = [ResponseHeader(name="Cache-Control", value="no-store")]
"""Signed-in pages hold someone's conversations: never kept in the browser's cache, so Back
after Log out (a shared family tablet) reloads them, which sends the browser to the login."""

pages = Router(
    path="/", route_handlers=[*chat.ROUTES, *export.ROUTES, *dashboard.ROUTES, *keys.ROUTES, *jobs.ROUTES,
                              *settings.ROUTES, *first_hour.ROUTES, *docs.ROUTES, manage.router,
                              models.router],
    exception_handlers=EXCEPTION_HANDLERS, response_headers=[*SECURITY_HEADERS, *PRIVATE],
    include_in_schema=False)

static = create_static_files_router(
    path="/static", directories=[STATIC], cache_control=CacheControlHeader(max_age=3600))

ROUTES = [pages, static]


def setup(app: Litestar) -> None:
    """Build the web UI's state once, with the app (live answers, the dashboard hub)."""
    app.state.web = WebState(app.state.services, app.template_engine, app.state.get("jobs"))
