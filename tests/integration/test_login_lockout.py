"""Issue 37, item 6: failures elsewhere never lock a real user out.

Two addresses failed 15 times each for made-up names (each under its own limit of 20);
together they reached the global ceiling of 30 a minute, and the right password from a
third address got 429 for a minute. The ceiling now holds back only addresses that failed
themselves. A real server on loopback that trusts 127.0.0.1 as a reverse proxy speaks for
the three addresses with ``X-Forwarded-For``. Personas: carol (member).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import LiveServer, live_server, make_settings
from tests.integration.test_authz_matrix import login


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[LiveServer]:
    with live_server(make_settings(tiny_model, trusted_proxies="127.0.0.1")) as s:
        yield s


def test_two_guessing_addresses_do_not_lock_the_real_user_out(server: LiveServer) -> None:
    guessers = [httpx.Client(base_url=server.url, headers={"X-Forwarded-For": a})
                for a in ("10.37.0.1", "10.37.0.2")]
    try:
        for i in range(15):
            for g in guessers:
                assert login(g, f"made-up-{i}", "guess-guess").status_code == 401
        # the global ceiling (30 a minute) is reached: the guessers themselves now wait
        r = login(guessers[0], "made-up-99", "guess-guess")
        assert r.status_code == 429 and int(r.headers["retry-after"]) > 0
    finally:
        for g in guessers:
            g.close()
    with httpx.Client(base_url=server.url, headers={"X-Forwarded-For": "10.37.0.3"}) as carol:
        assert login(carol, "carol").status_code == 303
