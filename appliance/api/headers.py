"""Security headers on every HTML response, whichever handler (or error handler) made it.

The web pages' router sets them too; this middleware covers the rest (``/login``, error
pages, anything a future handler renders), so no page of ours can be framed
(clickjacking) or run script from elsewhere.
"""

from __future__ import annotations

from litestar.datastructures import MutableScopeHeaders
from litestar.types import ASGIApp, Message, Receive, Scope, Send

CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'; "
       "object-src 'none'")
"""No inline script, no eval, nothing from elsewhere: even a markup bug could not run code."""

HTML_HEADERS = {"content-security-policy": CSP, "x-frame-options": "DENY",
                "x-content-type-options": "nosniff", "referrer-policy": "same-origin"}


class HtmlSecurityHeaders:
    """ASGI middleware: add ``HTML_HEADERS`` (those not already set) to text/html answers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableScopeHeaders.from_message(message)
                if headers.get("content-type", "").startswith("text/html"):
                    for name, value in HTML_HEADERS.items():
                        if name not in headers:
                            headers[name] = value
            await send(message)

        await self.app(scope, receive, send_with_headers)
