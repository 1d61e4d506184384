"""How uvicorn serves the app so that idle or half-sent connections cannot take the house down.

uvicorn accepts every connection and only times out *idle keep-alive* ones: a client that
opens a connection and sends half a request head keeps a file descriptor forever, and
``limit_concurrency`` answers 503 only once a whole request has arrived. Two thousand such
clients exhausted the open-file limit (``accept`` then fails in a loop and nothing is
served). ``GuardedH11`` adds what mature servers have (nginx ``client_header_timeout``,
Apache ``mod_reqtimeout``, a ``worker_connections`` cap):

- **header timeout**: a connection that has not sent a whole request head within
  ``header_timeout`` seconds of opening (or of its previous response) is closed;
- **connection cap**: beyond ``max_connections`` open connections a new one is answered
  ``503`` with ``Retry-After`` in the API's error shape and closed at once, so descriptors
  are never exhausted. The cap is kept below the process's open-file limit, which
  :func:`raise_open_file_limit` first raises to the hard limit where that is allowed.

The proxy headers (``X-Forwarded-For``, ``X-Forwarded-Proto``) are believed only from
``trusted_proxies`` (uvicorn's own ``ProxyHeadersMiddleware``); by default from nobody —
uvicorn would otherwise trust any process on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from appliance.settings import ServerSettings

log = logging.getLogger(__name__)

FD_RESERVE = 128
"""Descriptors kept for everything but client connections (database, model files, logs)."""
MAX_NOFILE = 65536

BUSY_BODY = (b'{"error":{"message":"Too many open connections. Retry later.",'
             b'"type":"overloaded","param":null,"code":"too_many_connections"}}')
BUSY_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                 b"retry-after: 2\r\nconnection: close\r\ncontent-length: "
                 + str(len(BUSY_BODY)).encode() + b"\r\n\r\n" + BUSY_BODY)


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a header timeout and a connection cap (class attributes
    set by :func:`protocol_class`)."""

    max_connections: int = 1000
    header_timeout: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            log.warning("connection refused: %d open connections (cap %d)",
                        len(self.connections), self.max_connections)
            transport.write(BUSY_RESPONSE)
            transport.close()
            return
        self._arm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        if not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.header_timeout,
                                                      self._header_timeout_fired)

    def _cancel_header_timer(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _header_timeout_fired(self) -> None:
        self._header_timer = None
        busy = self.cycle is not None and not self.cycle.response_complete
        if not busy and not self.transport.is_closing():  # no whole request head in time
            self.transport.close()


def protocol_class(max_connections: int, header_timeout: float) -> type[GuardedH11]:
    return type("GuardedH11", (GuardedH11,), {"max_connections": max_connections,
                                              "header_timeout": header_timeout})


def raise_open_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (at most ``MAX_NOFILE``) where the
    platform allows it; return the soft limit in force."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on a POSIX system
        return MAX_NOFILE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = MAX_NOFILE if hard == resource.RLIM_INFINITY else min(hard, MAX_NOFILE)
    if sys.platform == "darwin":
        target = min(target, 10240)  # OPEN_MAX: macOS refuses a larger soft limit
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d: %s", soft, exc)
    return MAX_NOFILE if soft == resource.RLIM_INFINITY else int(soft)


def connection_cap(max_connections: int, nofile: int) -> int:
    """The cap in force: the setting, kept ``FD_RESERVE`` below the open-file limit."""
    return max(1, min(max_connections, nofile - FD_RESERVE))


def server_options(server: ServerSettings, nofile: int | None = None) -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments for these settings."""
    import resource

    if nofile is None:
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    cap = connection_cap(server.max_connections, nofile)
    proxies = [p.strip() for p in server.trusted_proxies.split(",") if p.strip()]
    return {"http": protocol_class(cap, server.header_timeout),
            "timeout_keep_alive": max(1, math.ceil(server.header_timeout)),
            "proxy_headers": bool(proxies), "forwarded_allow_ips": proxies or [],
            "backlog": min(2048, cap)}
