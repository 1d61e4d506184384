"""How uvicorn serves the app so that idle or half-sent connections cannot take the house down.

uvicorn accepts every connection and only times out *idle keep-alive* ones: a client that
opens a connection and sends half a request head keeps a file descriptor forever, and
``limit_concurrency`` answers 503 only once a whole request has arrived. Two thousand such
clients exhausted the open-file limit (``accept`` then fails in a loop and nothing is
served). ``GuardedH11`` adds what mature servers have (nginx ``client_header_timeout``,
Apache ``mod_reqtimeout``, a ``worker_connections`` cap):

- **header timeout**: a connection that has not sent a whole request head within
  ``header_timeout`` seconds of opening (or of its previous response) is closed;
- **body timeout**: a request whose whole body has not arrived within ``body_timeout``
  seconds of its head is answered ``408`` and closed (nginx ``client_body_timeout``; a body
  trickled a byte every few seconds otherwise held its connection for good);
- **connection cap**: beyond ``max_connections`` open connections a new one is answered
  ``503`` with ``Retry-After`` in the API's error shape and closed at once, so descriptors
  are never exhausted. The cap is kept below the process's open-file limit, which
  :func:`raise_open_file_limit` first raises to the hard limit where that is allowed;
- **per-address share**: one client address may hold at most ``per_address`` of those
  connections (a share of the cap); its further ones get the same 503, so one machine
  cannot fill the cap and shut every other client (and ``/health``) out. Trusted proxies
  are exempt: their connections carry many clients.

The proxy headers (``X-Forwarded-For``, ``X-Forwarded-Proto``) are believed only from
``trusted_proxies`` (uvicorn's own ``ProxyHeadersMiddleware``); by default from nobody —
uvicorn would otherwise trust any process on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import sys
from collections.abc import Sequence
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from appliance.settings import ServerSettings

log = logging.getLogger(__name__)

FD_RESERVE = 128
"""Descriptors kept for everything but client connections (database, model files, logs)."""
MAX_NOFILE = 65536



def _raw_error(status: bytes, message: bytes, type_: bytes, code: bytes,
               retry_after: bool) -> bytes:
    """A whole HTTP/1.1 error response in the API's error shape, closing the connection."""
    body = (b'{"error":{"message":"' + message + b'","type":"' + type_
            + b'","param":null,"code":"' + code + b'"}}')
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
            + (b"retry-after: 2\r\n" if retry_after else b"")
            + b"connection: close\r\ncontent-length: " + str(len(body)).encode()
            + b"\r\n\r\n" + body)


BUSY_RESPONSE = _raw_error(b"503 Service Unavailable", b"Too many open connections. Retry later.",
                           b"overloaded", b"too_many_connections", True)
ADDRESS_BUSY_RESPONSE = _raw_error(
    b"503 Service Unavailable", b"Too many open connections from your address. Retry later.",
    b"overloaded", b"too_many_connections", True)
BODY_TIMEOUT_RESPONSE = _raw_error(
    b"408 Request Timeout", b"The request body did not arrive in time.",
    b"invalid_request_error", b"request_timeout", False)


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with header and body timeouts, a connection cap and a
    per-address share of it (class attributes set by :func:`protocol_class`)."""

    max_connections: int = 1000
    per_address: int = 1000
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    trusted: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    by_address: dict[str, int]
    """Open connections per client address (one dict per server, made by protocol_class)."""
    _header_timer: asyncio.TimerHandle | None = None
    _body_timer: asyncio.TimerHandle | None = None
    _counted: str | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            log.warning("connection refused: %d open connections (cap %d)",
                        len(self.connections), self.max_connections)
            transport.write(BUSY_RESPONSE)
            transport.close()
            return
        host = self.client[0] if self.client else None
        if host is not None and not self._is_trusted(host):
            held = self.by_address.get(host, 0)
            if held >= self.per_address:
                log.warning("connection refused: one address holds %d connections (share %d "
                            "of %d)", held, self.per_address, self.max_connections)
                transport.write(ADDRESS_BUSY_RESPONSE)
                transport.close()
                return
            self.by_address[host] = held + 1
            self._counted = host
        self._arm_header_timer()

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        cycle = self.cycle
        if cycle is not None and cycle is not before and cycle.more_body:
            self._arm_body_timer()  # a new request head: its body has a deadline
        if cycle is None or not cycle.more_body:
            self._cancel_body_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        self._cancel_body_timer()
        if self._counted is not None:
            left = self.by_address.get(self._counted, 1) - 1
            if left > 0:
                self.by_address[self._counted] = left
            else:
                self.by_address.pop(self._counted, None)
            self._counted = None
        super().connection_lost(exc)

    def _is_trusted(self, host: str) -> bool:
        if not self.trusted:
            return False
        try:
            addr = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(addr in net for net in self.trusted)

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

    def _arm_body_timer(self) -> None:
        self._cancel_body_timer()
        if not self.transport.is_closing():
            self._body_timer = self.loop.call_later(self.body_timeout, self._body_timeout_fired)

    def _cancel_body_timer(self) -> None:
        timer = getattr(self, "_body_timer", None)
        if timer is not None:
            timer.cancel()
            self._body_timer = None

    def _body_timeout_fired(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if cycle is None or not cycle.more_body or self.transport.is_closing():
            return
        log.warning("request body timed out after %.0f s", self.body_timeout)
        if not cycle.response_started:
            self.transport.write(BODY_TIMEOUT_RESPONSE)
        # the handler still waiting for the body reads a disconnect; what it answers is
        # dropped (the 408 above is the answer)
        cycle.disconnected = True
        cycle.message_event.set()
        self.transport.close()


def protocol_class(max_connections: int, header_timeout: float, body_timeout: float = 30.0,
                   share: float = 1.0, trusted: Sequence[str] = ()) -> type[GuardedH11]:
    per_address = max(1, int(max_connections * share))
    return type("GuardedH11", (GuardedH11,), {
        "max_connections": max_connections, "header_timeout": header_timeout,
        "body_timeout": body_timeout, "per_address": per_address,
        "trusted": tuple(_networks(trusted)), "by_address": {}})


def _networks(entries: Sequence[str]) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    nets = []
    for entry in entries:
        if entry == "*":
            return [ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0")]
        try:
            nets.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            log.warning("trusted proxy %r is not an address or network; ignored for the "
                        "per-address connection share", entry)
    return nets


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
    return {"http": protocol_class(cap, server.header_timeout, server.body_timeout,
                                   server.address_connection_share, proxies),
            "timeout_keep_alive": max(1, math.ceil(server.header_timeout)),
            "proxy_headers": bool(proxies), "forwarded_allow_ips": proxies or [],
            "ws": "none",  # no websockets here: an upgrade would leave the per-address count
            "backlog": min(2048, cap)}
