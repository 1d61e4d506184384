"""Errors on browser routes: a page or an inline notice for people, JSON for programs.

- Not logged in: a page answers 303 to /login; a partial, a form post or a stream answers
  401 (JSON) with ``HX-Redirect: /login``, which htmx follows.
- Anything else: HTML when the caller is htmx or asks for text/html (a notice fragment for
  htmx, a full error page otherwise), else the API's JSON error shape.
"""

from __future__ import annotations

from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException, NotAuthorizedException
from litestar.response import Redirect
from sqlalchemy.exc import DatabaseError

from appliance.api.auth import SESSION_COOKIE
from appliance.api.errors import (
    ApiError,
    api_error_handler,
    as_api_error,
    database_error,
    http_error_handler,
    internal_error_handler,
)
from appliance.service.errors import ServiceError
from appliance.store import websessions
from appliance.store.errors import AlreadyExists, LastAdmin, NotFound
from web.common import is_htmx, page, services

TITLES = {400: "That did not work", 401: "Log in first", 403: "Not allowed",
          404: "Not found", 409: "Conflict", 429: "Over your quota", 500: "Something broke",
          503: "Not available right now"}


def _wants_html(request: Request[Any, Any, Any]) -> bool:
    return is_htmx(request) or "text/html" in request.headers.get("accept", "")


def _html(request: Request[Any, Any, Any], status: int, message: str,
          headers: dict[str, str] | None = None, exact: str = "") -> Response[Any]:
    title = TITLES.get(status, "Error")
    template = "_notice.html" if is_htmx(request) else "error.html"
    return page(request, template, status_code=status, headers=headers, kind="error",
                title=title, message=message, status=status, exact=exact)


def _login_url(request: Request[Any, Any, Any]) -> str:
    """/login, with the reason: an admin disabled the account behind the cookie, or the
    session it names has ended (expired, or logged out elsewhere)."""
    token = request.cookies.get(SESSION_COOKIE)
    if not token:
        return "/login"
    with services(request).store.read_sessions() as s:
        disabled = websessions.of_disabled_user(s, token)
    return "/login?reason=disabled" if disabled else "/login?reason=expired"


def not_logged_in(request: Request[Any, Any, Any], exc: NotAuthorizedException) -> Response[Any]:
    handler = request.scope.get("route_handler")
    is_page = bool(handler and handler.opt.get("web_page"))
    if is_page and request.method == "GET" and not is_htmx(request):
        return Redirect(_login_url(request), status_code=303)
    response = http_error_handler(request, exc)
    response.headers["HX-Redirect"] = _login_url(request)
    return response


def http_error(request: Request[Any, Any, Any], exc: HTTPException) -> Response[Any]:
    if _wants_html(request):
        return _html(request, exc.status_code, str(exc.detail), dict(exc.headers or {}))
    return http_error_handler(request, exc)


def api_error(request: Request[Any, Any, Any], exc: ApiError) -> Response[Any]:
    if _wants_html(request):
        return _html(request, exc.status, exc.message, exc.headers,
                     getattr(exc, "exact", ""))
    return api_error_handler(request, exc)


def service_error(request: Request[Any, Any, Any], exc: ServiceError) -> Response[Any]:
    """The service's refusals with the API's status and body, as a page or notice."""
    return api_error(request, as_api_error(exc))


def store_error(status: int) -> Any:
    def handler(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
        return api_error(request, ApiError(status, str(exc), "invalid_request_error"))
    return handler


def database(request: Request[Any, Any, Any], exc: DatabaseError) -> Response[Any]:
    """A locked or failing database: the API's 503, as a page or notice for people."""
    err = database_error(request, exc)
    if err is None:
        return internal_error_handler(request, exc)
    return api_error(request, err)


EXCEPTION_HANDLERS: dict[Any, Any] = {
    NotAuthorizedException: not_logged_in,
    HTTPException: http_error,
    ApiError: api_error,
    ServiceError: service_error,
    NotFound: store_error(404),
    AlreadyExists: store_error(409),
    LastAdmin: store_error(409),
    ValueError: store_error(400),
    DatabaseError: database,
}
