"""HTTP(S) downloads for url jobs and webhook deliveries, under the network guard.

Each hop: resolve the host, check every address (``netguard``), connect to the checked
address itself (the ``Host`` header and TLS server name stay the original host's), follow a
redirect only after checking its target the same way. The body is read in pieces and
refused past ``max_bytes``; the whole download, redirects included, has one time limit.
The caller's headers go only to the first URL's origin (scheme, host, port): a redirect to
another origin is followed without them.
"""

from __future__ import annotations

import asyncio
import ipaddress
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit, urlunsplit

import httpx

from appliance.jobs.netguard import Guard, Refused

MAX_REDIRECTS = 5
USER_AGENT = "appliance-jobs/1 (household summaries)"


class FetchError(Exception):
    """A download that failed; the message is the run's recorded reason."""


@dataclass(frozen=True, slots=True)
class Fetched:
    url: str
    status: int
    content_type: str
    body: bytes


def check_url(url: str, guard: Guard) -> tuple[str, str, int]:
    """(scheme, host, port) of an http(s) URL whose host the guard lets through."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise Refused(f"only http and https URLs are fetched, not {parts.scheme or 'none'!r}")
    if parts.username or parts.password:
        raise Refused("URLs with user:password@ are not allowed; send a header instead")
    host = parts.hostname or ""
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise Refused("the URL's port is not a number") from None
    guard.check(host, port)
    return parts.scheme, host, port


def _origin(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) with the scheme's default port filled in; a bad port is None
    (``check_url`` refuses it on the hop itself)."""
    parts = urlsplit(url)
    try:
        port = parts.port or {"https": 443, "http": 80}.get(parts.scheme)
    except ValueError:
        port = None
    return parts.scheme, (parts.hostname or "").lower(), port


def _pinned(url: str, address: str) -> tuple[str, str]:
    """The URL with its host replaced by the checked address, and the Host header."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    ip = ipaddress.ip_address(address.split("%")[0])
    literal = f"[{ip}]" if ip.version == 6 else str(ip)
    netloc = literal if parts.port is None else f"{literal}:{parts.port}"
    host_header = host if parts.port is None else f"{host}:{parts.port}"
    if ":" in host and not host.startswith("["):
        host_header = f"[{host}]" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, "")), host_header


async def _send(client: httpx.AsyncClient, method: str, url: str, guard: Guard,
                headers: dict[str, str], content: bytes | None,
                max_bytes: int) -> tuple[httpx.Response, bytes]:
    scheme, host, port = check_url(url, guard)
    address = guard.check(host, port)
    target, host_header = _pinned(url, address)
    extensions = {"sni_hostname": host} if scheme == "https" else {}
    request = client.build_request(method, target, headers={**headers, "Host": host_header},
                                   content=content, extensions=extensions)
    response = await client.send(request, stream=True)
    try:
        if response.is_redirect:
            return response, b""
        length = response.headers.get("content-length", "")
        if length.isdigit() and int(length) > max_bytes:
            raise FetchError(f"the answer is {int(length)} bytes, over the {max_bytes}-byte "
                             "limit (jobs.fetch_max_bytes)")
        parts: list[bytes] = []
        size = 0
        async for piece in response.aiter_bytes():
            size += len(piece)
            if size > max_bytes:
                raise FetchError(f"the answer is over the {max_bytes}-byte limit "
                                 "(jobs.fetch_max_bytes)")
            parts.append(piece)
        return response, b"".join(parts)
    finally:
        await response.aclose()


async def request(method: str, url: str, guard: Guard, *, headers: dict[str, str] | None = None,
                  content: bytes | None = None, max_bytes: int, timeout: float) -> Fetched:
    """One guarded request (GET follows redirects, each re-checked); FetchError or Refused."""
    sent = {"User-Agent": USER_AGENT, **(headers or {})}
    origin = _origin(url)
    try:
        async with asyncio.timeout(timeout), httpx.AsyncClient(
                follow_redirects=False, timeout=timeout, trust_env=False) as client:
            for _ in range(MAX_REDIRECTS + 1):
                if _origin(url) != origin:
                    # The job's headers (tokens, cookies) were meant for its own origin, as a
                    # browser's are; once a redirect leaves it they are gone for good.
                    sent = {"User-Agent": USER_AGENT}
                response, body = await _send(client, method, url, guard, sent, content,
                                             max_bytes)
                if not response.is_redirect:
                    return Fetched(url, response.status_code,
                                   response.headers.get("content-type", ""), body)
                if method != "GET":
                    raise FetchError(f"HTTP {response.status_code} redirect refused for "
                                     f"{method}")
                url = urljoin(url, response.headers.get("location", ""))
            raise FetchError(f"more than {MAX_REDIRECTS} redirects")
    except TimeoutError:
        raise FetchError(f"no complete answer within {timeout:g} s (jobs.fetch_timeout)") \
            from None
    except httpx.HTTPError as exc:
        raise FetchError(f"download failed: {type(exc).__name__}") from None
