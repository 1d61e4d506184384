"""The URL guard over IPv6 forms that carry or hide an IPv4 address (issue #37, item 9):
each is judged by the IPv4 address inside, or refused outright, never taken as public
because Python's ``is_global`` says so."""

from __future__ import annotations

import ipaddress

import pytest

from appliance.jobs.netguard import AllowEntry, Guard, Refused, is_public


def _guard(address: str, *, admin: bool = False,
           allow: tuple[AllowEntry, ...] = ()) -> Guard:
    return Guard(allow, privileged=admin, resolver=lambda host, port: [address])


REFUSED = [
    ("::7f00:1", "IPv4-compatible"),            # ::127.0.0.1
    ("::a00:1", "IPv4-compatible"),             # ::10.0.0.1
    ("::808:808", "IPv4-compatible"),           # ::8.8.8.8: deprecated form, refused too
    ("::ffff:127.0.0.1", "IPv6 form of 127.0.0.1 (a loopback address)"),
    ("::ffff:192.168.1.10", "IPv6 form of 192.168.1.10 (a private address)"),
    ("64:ff9b::7f00:1", "IPv6 form of 127.0.0.1 (a loopback address)"),      # NAT64
    ("64:ff9b::a9fe:a9fe", "IPv6 form of 169.254.169.254 (a link-local address)"),
    ("64:ff9b::c0a8:10a", "IPv6 form of 192.168.1.10 (a private address)"),
    ("64:ff9b:1::a00:1", "IETF-reserved"),      # local-use NAT64, RFC 8215
    ("64:ff9b:1::808:808", "IETF-reserved"),
    ("2002:7f00:1::", "IPv6 form of 127.0.0.1 (a loopback address)"),        # 6to4
    ("2002:a00:1::1", "IPv6 form of 10.0.0.1 (a private address)"),
    ("2002:a9fe:a9fe::1", "IPv6 form of 169.254.169.254 (a link-local address)"),
    ("fec0::1", "a site-local address"),
    ("fefe::1", "a site-local address"),
    ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "a Teredo address"),
]


@pytest.mark.parametrize("address, why", REFUSED, ids=[a for a, _ in REFUSED])
def test_a_members_job_is_refused_each_hidden_or_embedded_private_form(address: str,
                                                                       why: str) -> None:
    assert not is_public(ipaddress.ip_address(address))
    with pytest.raises(Refused) as refused:
        _guard(address).check("sneaky.example", 80)
    assert why in str(refused.value)
    assert "public addresses only" in str(refused.value)


@pytest.mark.parametrize("address", [
    "2606:4700:4700::1111",   # an ordinary public IPv6 address
    "::ffff:8.8.8.8",         # IPv4-mapped public
    "64:ff9b::808:808",       # DNS64's answer for a public IPv4-only host
    "2002:808:808::1",        # 6to4 of a public address
    "8.8.8.8",
])
def test_public_hosts_in_these_forms_are_still_reached(address: str) -> None:
    assert is_public(ipaddress.ip_address(address))
    assert _guard(address).check("public.example", 443) == address


def test_an_admin_reaches_a_refused_form_only_when_it_is_on_the_allow_list() -> None:
    entry = AllowEntry(ipaddress.ip_network("fec0::/10"))
    with pytest.raises(Refused, match="allow-list"):
        _guard("fec0::1", admin=True).check("old-lan.example", 80)
    assert _guard("fec0::1", admin=True, allow=(entry,)).check("old-lan.example", 80) == "fec0::1"
