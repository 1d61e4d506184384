"""Who is asking: API keys for the APIs, session cookies for the browser.

Rules:
- ``/health`` and the login page need nothing; everything else needs a principal.
- ``/v1``, ``/api`` and ``/hooks`` take only ``Authorization: Bearer <key>``: a cookie there
  would let any web page the household visits spend their quota (those paths are also
  outside CSRF protection, which only makes sense for cookie-authenticated requests).
- Other paths take a bearer key or the session cookie; cookie requests that change state
  must carry the CSRF token (requests with a bearer key cannot be forged by a browser).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio
from litestar.connection import ASGIConnection
from litestar.exceptions import NotAuthorizedException, PermissionDeniedException
from litestar.middleware.authentication import (
    AbstractAuthenticationMiddleware,
    AuthenticationResult,
)
from litestar.middleware.csrf import CSRFMiddleware
from litestar.types import Receive, Scope, Send

from appliance.sched.classes import Klass
from appliance.store import keys as store_keys
from appliance.store import websessions
from appliance.store.db import Store

SESSION_COOKIE = "appliance_session"
API_PREFIXES = ("/v1/", "/v1", "/api/", "/hooks/")
PUBLIC_PATHS = ("^/health$", "^/login$", "^/static/")


@dataclass(frozen=True, slots=True)
class Principal:
    user_id: int
    name: str
    role: str
    max_class: str
    """The highest class this principal may use (user's and key's maximum combined)."""
    key_id: int | None = None
    default_class: str | None = None
    """The class of a request that asks for none (a key's ``default_class``, capped);
    None means ``max_class``."""

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    @property
    def klass(self) -> Klass:
        return Klass.parse(self.max_class)


def principal_for_key(store: Store, token: str) -> Principal | None:
    with store.sessions.begin() as s:
        found = store_keys.authenticate_key(s, token)
        if found is None:
            return None
        user, key = found
        return Principal(user.id, user.name, user.role,
                         store_keys.effective_max_class(user, key), key.id,
                         store_keys.effective_default_class(user, key))


def principal_for_session(store: Store, token: str) -> Principal | None:
    with store.read_sessions() as s:
        user = websessions.session_user(s, token)
        if user is None:
            return None
        return Principal(user.id, user.name, user.role, user.max_class)


class AuthMiddleware(AbstractAuthenticationMiddleware):
    async def authenticate_request(self, connection: ASGIConnection[Any, Any, Any, Any]
                                   ) -> AuthenticationResult:
        store: Store = connection.app.state.services.store
        header = connection.headers.get("authorization", "")
        if header[:7].lower() == "bearer ":
            principal = await anyio.to_thread.run_sync(principal_for_key, store,
                                                       header[7:].strip())
            if principal is None:
                raise NotAuthorizedException("Invalid or revoked API key.")
            return AuthenticationResult(principal, "key")
        if connection.url.path.startswith(API_PREFIXES):
            raise NotAuthorizedException(
                "Missing API key: send 'Authorization: Bearer <key>' (create one with "
                "'appliance key create <user>' or on your account page).")
        token = connection.cookies.get(SESSION_COOKIE)
        principal = None
        if token:
            principal = await anyio.to_thread.run_sync(principal_for_session, store, token)
        if principal is None:
            raise NotAuthorizedException("Log in first.")
        return AuthenticationResult(principal, "session")


class CsrfUnlessBearer(CSRFMiddleware):
    """Litestar's CSRF check, skipped for bearer-key requests (a browser cannot forge them)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and any(k == b"authorization" for k, _ in scope["headers"]):
            await self.app(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def admin_only(connection: ASGIConnection[Any, Any, Any, Any], _: Any) -> None:
    """Route guard: admins only (403 for members)."""
    if not connection.user.is_admin:
        raise PermissionDeniedException("Admins only.")


def request_class(principal: Principal, asked: str | None) -> Klass:
    """The class a request runs in: the one asked for, at most the principal's maximum;
    without a request, the key's default class."""
    if not asked:
        return Klass.parse(principal.default_class or principal.max_class)
    try:
        klass = Klass.parse(asked)
    except ValueError as exc:
        from appliance.api.errors import bad_request
        raise bad_request(str(exc), param="class") from None
    if klass > principal.klass:
        raise PermissionDeniedException(
            f"Class '{klass.label}' is above your maximum '{principal.max_class}'.")
    return klass
