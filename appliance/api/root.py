"""``GET|HEAD /``: ``Ollama is running`` for API clients, the web UI for browsers.

Ollama clients and monitors probe ``/`` to see whether a server is up. A request that
carries ``Authorization: Bearer``, or that neither accepts HTML nor carries a session
cookie, is such a probe; a browser (``Accept: text/html`` or a session cookie) goes on to
the web UI. A probe without a key gets the
same liveness answer as ``/health`` (public); a probe with a key must present a valid one.
"""

from __future__ import annotations

from typing import Any

import anyio
from litestar.types import ASGIApp, Receive, Scope, Send

from appliance.api.auth import SESSION_COOKIE, principal_for_key
from appliance.service.services import Services

RUNNING = b"Ollama is running"


def _header(scope: Scope, name: bytes) -> str:
    for k, v in scope.get("headers", []):
        if k == name:
            return str(v.decode("latin-1"))
    return ""


def is_api_probe(scope: Scope) -> bool:
    if scope["type"] != "http" or scope["path"] != "/" or scope.get("method") not in (
            "GET", "HEAD"):
        return False
    if _header(scope, b"authorization")[:7].lower() == "bearer ":
        return True
    browser = "text/html" in _header(scope, b"accept") or \
        f"{SESSION_COOKIE}=" in _header(scope, b"cookie")
    return not browser


async def _send(send: Send, status: int, body: bytes, head: bool,
                content_type: bytes = b"text/plain; charset=utf-8") -> None:
    start: Any = {"type": "http.response.start", "status": status,
                  "headers": [(b"content-type", content_type),
                              (b"content-length", str(len(body)).encode())]}
    await send(start)
    await send({"type": "http.response.body", "body": b"" if head else body,
                "more_body": False})


def ollama_root(app: ASGIApp) -> ASGIApp:
    """Wraps the app's whole ASGI handler (``create_app``), so that it runs before routing
    (``HEAD /`` has no route) and before the session/key check."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if not is_api_probe(scope):
            await app(scope, receive, send)
            return
        head = scope.get("method") == "HEAD"
        header = _header(scope, b"authorization")
        if header[:7].lower() == "bearer ":
            services: Services = scope["app"].state.services
            who = await anyio.to_thread.run_sync(principal_for_key, services.store,
                                                 header[7:].strip())
            if who is None:
                await _send(send, 401, b'{"error":"Invalid or revoked API key."}', head,
                            b"application/json")
                return
        await _send(send, 200, RUNNING, head)

    return middleware

