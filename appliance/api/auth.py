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

import contextlib
import time
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

from appliance.api.errors import InvalidApiKey
from appliance.service.identity import Principal
from appliance.store import keys as store_keys
from appliance.store import websessions
from appliance.store.db import Store
from appliance.vocab import CLASS_LABELS, Klass

SESSION_COOKIE = "appliance_session"
API_PREFIXES = ("/v1/", "/v1", "/api/", "/hooks/")
PUBLIC_PATHS = ("^/health$", "^/login$", "^/static/")


def principal_for_key(store: Store, token: str, now: float | None = None
                      ) -> tuple[Principal, bool] | None:
    """The key's principal, and whether its ``last_used_at`` is due for a refresh.
    A read-only transaction: authentication never waits for (or takes) the write lock."""
    now = time.time() if now is None else now
    with store.read_sessions() as s:
        found = store_keys.find_key(s, token)
        if found is None:
            return None
        user, key = found
        return (Principal(user.id, user.name, user.role,
                          store_keys.effective_max_class(user, key), key.id,
                          store_keys.effective_default_class(user, key)),
                store_keys.needs_touch(key, now))


def principal_for_session(store: Store, token: str) -> Principal | None:
    with store.read_sessions() as s:
        user = websessions.session_user(s, token)
        if user is None:
            return None
        return Principal(user.id, user.name, user.role, user.max_class)


def _slide(store: Store, token: str, idle_s: float) -> None:
    with store.sessions.begin() as s:
        websessions.slide_shared(s, token, idle_s)


class AuthMiddleware(AbstractAuthenticationMiddleware):
    async def authenticate_request(self, connection: ASGIConnection[Any, Any, Any, Any]
                                   ) -> AuthenticationResult:
        services = connection.app.state.services
        store: Store = services.store
        header = connection.headers.get("authorization", "")
        if header[:7].lower() == "bearer ":
            found = await anyio.to_thread.run_sync(principal_for_key, store,
                                                   header[7:].strip())
            if found is None:
                raise InvalidApiKey()
            principal, touch = found
            if touch and services.note_key_used is not None and principal.key_id is not None:
                with contextlib.suppress(RuntimeError):  # the writer has closed: shutting down
                    services.note_key_used(principal.key_id, time.time())
            return AuthenticationResult(principal, "key")
        if connection.url.path.startswith(API_PREFIXES):
            raise NotAuthorizedException(
                "Missing API key: send 'Authorization: Bearer <key>' (create one with "
                "'appliance key create <user>' or on your account page).")
        token = connection.cookies.get(SESSION_COOKIE)
        by_session: Principal | None = None
        if token:
            by_session = await anyio.to_thread.run_sync(principal_for_session, store, token)
        if by_session is None:
            raise NotAuthorizedException("Log in first.")
        if token and token.startswith(websessions.SHARED):  # the shared tablet is in use
            await anyio.to_thread.run_sync(_slide, store, token, services.shared_idle_s)
        return AuthenticationResult(by_session, "session")


def shared_session(connection: ASGIConnection[Any, Any, Any, Any]) -> bool:
    """Whether the caller is logged in with 'Shared device' (the pages show a marker)."""
    token = connection.cookies.get(SESSION_COOKIE, "")
    return connection.scope.get("auth") == "session" and token.startswith(websessions.SHARED)


class CsrfUnlessBearer(CSRFMiddleware):
    """Litestar's CSRF check, skipped only for requests that ``AuthMiddleware`` (outside this
    one) authenticated by a valid bearer key: a browser cannot forge those. The mere presence
    of an ``Authorization`` header proves nothing (``Basic …`` plus the session cookie is
    still a cookie request)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("auth") == "key":
            await self.app(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def key_scope(principal: Principal) -> str | None:
    """The highest class of keys this caller may create, see and revoke: a request made with
    an API key acts only on keys up to its own class (a ``background`` key can neither mint
    an ``interactive`` key nor list or revoke one); a browser session is not limited (its
    user's maximum class still bounds what it creates)."""
    return principal.max_class if principal.key_id is not None else None


def new_key_class(principal: Principal, asked: str | None) -> str | None:
    """The class asked for a new key, refused (403) when it outranks the calling key. Pass
    ``at_most=key_scope(principal)`` to the store too: its default is then no higher."""
    scope = key_scope(principal)
    if (scope is not None and asked in CLASS_LABELS
            and store_keys.class_rank(asked) < store_keys.class_rank(scope)):
        raise PermissionDeniedException(
            f"An API key of class '{scope}' cannot create a key of class '{asked}'.")
    return asked


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
