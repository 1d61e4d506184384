"""Which network addresses a job may reach (server-side request forgery guard).

Rule: every address a host name resolves to must be *public* (globally routable); one
private, loopback, link-local, multicast or reserved address refuses the whole name (a name
that resolves to both could be steered to the private one). An IPv6 address that carries an
IPv4 one (IPv4-mapped, NAT64 ``64:ff9b::/96``, 6to4 ``2002::/16``) is judged by that IPv4
address; IPv4-compatible, local-use NAT64, site-local and Teredo addresses are refused. Private addresses are allowed
only for admins' jobs and only when they match the admin's allow-list setting
(``[jobs] url_allow``), optionally restricted to a port. The connection is then made to the
address that was checked (not re-resolved), so DNS cannot change the answer in between.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str, int], list[str]]


class Refused(Exception):
    """A destination the job may not reach; the message says why, for the run's record."""


class Unresolvable(Refused):
    """The name does not resolve (now): refused at run time, not a reason to refuse a job
    at creation (the household may be offline for a moment)."""


@dataclass(frozen=True, slots=True)
class AllowEntry:
    network: Network
    port: int | None = None

    def matches(self, address: IPAddress, port: int) -> bool:
        return address in self.network and (self.port is None or self.port == port)


def parse_allow_list(text: str) -> tuple[AllowEntry, ...]:
    """``"192.168.1.10:8123, 10.0.0.0/8, [::1]:8080"`` -> entries; ValueError when bad."""
    entries = []
    for raw in (part.strip() for part in text.split(",")):
        if not raw:
            continue
        host, port = raw, None
        if raw.startswith("["):  # [v6]:port or [v6/len]
            host, _, rest = raw[1:].partition("]")
            port = _port(rest.removeprefix(":"), raw) if rest else None
        elif raw.count(":") == 1:
            host, port_text = raw.split(":")
            port = _port(port_text, raw)
        try:
            network = ipaddress.ip_network(host, strict=False)
        except ValueError:
            raise ValueError(f"jobs.url_allow: {raw!r} is not an IP address or network "
                             "(optionally with :port)") from None
        entries.append(AllowEntry(network, port))
    return tuple(entries)


def _port(text: str, raw: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"jobs.url_allow: bad port in {raw!r}")
    return int(text)


NAT64_WELL_KNOWN = ipaddress.IPv6Network("64:ff9b::/96")
"""RFC 6052: the IPv4 address is the last 32 bits (DNS64 networks answer public IPv4-only
hosts with it, so it is judged by that IPv4 address, not refused)."""
REFUSED_V6: tuple[tuple[ipaddress.IPv6Network, str], ...] = (
    # ::/8 holds the IPv4-compatible form (::a.b.c.d, deprecated by RFC 4291), local-use
    # NAT64 (64:ff9b:1::/48, whose IPv4 position is per network) and SIIT: refused outright.
    (ipaddress.IPv6Network("::/8"), "an IPv4-compatible or other IETF-reserved IPv6 address"),
    (ipaddress.IPv6Network("fec0::/10"), "a site-local address"),
    (ipaddress.IPv6Network("2001::/32"), "a Teredo address"),
)
"""Ranges some Python versions call global although they reach no public host directly."""


def embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address inside an IPv4-mapped, well-known-prefix NAT64 or 6to4 address."""
    if not isinstance(address, ipaddress.IPv6Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in NAT64_WELL_KNOWN:
        return ipaddress.IPv4Address(int(address) & 0xFFFF_FFFF)
    return address.sixtofour


def _refused_range(address: IPAddress) -> str | None:
    if isinstance(address, ipaddress.IPv6Address):
        return next((why for net, why in REFUSED_V6 if address in net), None)
    return None


def is_public(address: IPAddress) -> bool:
    inner = embedded_ipv4(address)
    if inner is not None:
        return is_public(inner)
    if _refused_range(address) is not None:
        return False
    return address.is_global and not address.is_multicast


def describe(address: IPAddress) -> str:
    inner = embedded_ipv4(address)
    if inner is not None:
        return f"an IPv6 form of {inner} ({describe(inner)})"
    refused = _refused_range(address)
    if refused is not None:
        return refused
    if address.is_loopback:
        return "a loopback address"
    if address.is_link_local:
        return "a link-local address"
    if address.is_private:
        return "a private address"
    if address.is_multicast:
        return "a multicast address"
    return "not a public address"


def system_resolver(host: str, port: int) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise Unresolvable(f"cannot resolve {host}: {exc.strerror or exc}") from None
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


@dataclass(frozen=True, slots=True)
class Guard:
    """The policy for one job's owner: ``privileged`` (an admin) may use ``allow``."""

    allow: Sequence[AllowEntry] = ()
    privileged: bool = False
    resolver: Resolver = system_resolver

    def check(self, host: str, port: int) -> str:
        """The address to connect to, or ``Refused`` with the reason."""
        if not host:
            raise Refused("the URL has no host")
        addresses = self.resolver(host.strip("[]"), port)
        if not addresses:
            raise Refused(f"{host} has no address")
        for text in addresses:
            address = ipaddress.ip_address(text.split("%")[0])
            if is_public(address):
                continue
            if self.privileged and any(e.matches(address, port) for e in self.allow):
                continue
            who = ("not on the admin's allow-list (jobs.url_allow)" if self.privileged
                   else "members' jobs may reach public addresses only")
            raise Refused(f"refused {host}:{port}: {address} is {describe(address)}; {who}")
        return addresses[0]
