"""Slow request bodies against the real daemon (``appliance serve`` as a process).

Issue 37, item 1: a thousand anonymous connections that fetched the login page's CSRF
cookie and then sent a ``POST /login`` body one byte every few seconds held the whole
connection cap; ``/health`` and every new client got 503 for as long as they liked. Now a
body has a deadline (``--body-timeout``: 408, then closed) and one address may hold only a
share of the cap (``--address-connection-share``), so other addresses still get in.

Bounded: 60 connections against a cap of 40 (a share of 10 per address), a body timeout
of 8 s. A second client address is 127.0.0.2 (Linux routes all of 127/8 to loopback).
"""

from __future__ import annotations

import contextlib
import re
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.daemon import Daemon, cli, start_daemon

CAP = 40
SHARE = 0.25
PER_ADDRESS = int(CAP * SHARE)
BODY_TIMEOUT = 8.0
CLIENTS = 60
OTHER = "127.0.0.2"


@pytest.fixture(scope="module")
def daemon(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    data_dir = tmp_path_factory.mktemp("slow-bodies")
    cli(data_dir, "migrate")
    d = start_daemon(tiny_model, data_dir, "--ctx-size", "256", "--max-connections", str(CAP),
                     "--address-connection-share", str(SHARE), "--header-timeout", "5",
                     "--body-timeout", str(BODY_TIMEOUT))
    try:
        yield d
    finally:
        if d.proc.poll() is None:
            assert d.terminate(120) == 0


def second_address_available() -> bool:
    try:
        with socket.socket() as s:
            s.bind((OTHER, 0))
        return True
    except OSError:
        return False


def read_response(s: socket.socket, timeout: float) -> bytes:
    """One whole HTTP response (head and ``content-length`` body), or what came before the
    peer closed; b"" when it closed at once."""
    s.settimeout(timeout)
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                return data
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        m = re.search(rb"content-length:\s*(\d+)", head, re.I)
        want = int(m.group(1)) if m else 0
        while len(body) < want:
            chunk = s.recv(65536)
            if not chunk:
                break
            body += chunk
        return head + b"\r\n\r\n" + body
    except (ConnectionResetError, BrokenPipeError):
        return data


def get(s: socket.socket, path: str) -> bytes:
    # refused at once: the 503 is already waiting to be read
    with contextlib.suppress(ConnectionResetError, BrokenPipeError):
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return read_response(s, 30)


def csrf_cookie(response: bytes) -> str:
    m = re.search(rb"set-cookie:\s*csrftoken=([^;\r\n]+)", response, re.I)
    assert m, response[:500]
    return m.group(1).decode()


def is_busy_503(response: bytes) -> bool:
    return (response.startswith(b"HTTP/1.1 503") and b'"too_many_connections"' in response
            and b"retry-after: 2" in response.lower())


def trickle(socks: list[socket.socket], stop: threading.Event) -> None:
    """One byte of body to each connection every second, as long as they stay open."""
    while not stop.wait(1.0):
        for s in socks:
            with contextlib.suppress(OSError):
                s.send(b"a")


def test_slow_bodies_from_one_address_cannot_hold_the_connection_cap(daemon: Daemon) -> None:
    if not second_address_available():
        pytest.skip("127.0.0.2 is not a local address here")
    port = int(daemon.url.rsplit(":", 1)[1])
    socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(CLIENTS)]
    stop = threading.Event()
    try:
        # the free page that sets the CSRF cookie: a share of them get it, the rest are
        # refused at once with 503 + Retry-After
        # refused at once with 503 + Retry-After; each of the others then starts a login
        # whose body never finishes
        held: list[socket.socket] = []
        refused = 0
        for s in socks:
            answer = get(s, "/login")
            if is_busy_503(answer):
                refused += 1
                continue
            assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
            token = csrf_cookie(answer)
            s.sendall(("POST /login HTTP/1.1\r\nHost: x\r\n"
                       f"Cookie: csrftoken={token}\r\nx-csrftoken: {token}\r\n"
                       "Content-Type: application/x-www-form-urlencoded\r\n"
                       "Content-Length: 400\r\n\r\nn").encode())
            held.append(s)
        sent_heads = time.monotonic()
        assert (len(held), refused) == (PER_ADDRESS, CLIENTS - PER_ADDRESS)
        threading.Thread(target=trickle, args=(held, stop), daemon=True).start()

        # while the slow bodies are held: another address gets in at once, this one is
        # refused quickly
        with httpx.Client(base_url=daemon.url, timeout=10,
                          transport=httpx.HTTPTransport(local_address=OTHER)) as other:
            assert other.get("/health").status_code == 200
            assert other.get("/login").status_code == 200
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            assert is_busy_503(get(s, "/health"))
        ready, _, _ = select.select(held, [], [], 0)
        assert not ready, "the slow bodies were answered before the checks above"

        # every slow body is answered 408 at its deadline and its connection closed
        for s in held:
            answer = read_response(s, BODY_TIMEOUT + 30)
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert b'"request_timeout"' in answer
            assert read_response(s, 10) == b""  # closed
        assert time.monotonic() - sent_heads >= BODY_TIMEOUT - 0.5
    finally:
        stop.set()
        for s in socks:
            s.close()
    # the address's share is free again
    with httpx.Client(base_url=daemon.url, timeout=10) as c:
        assert c.get("/health").status_code == 200
    assert daemon.proc.poll() is None
    assert "Traceback" not in daemon.log.read_text()


def test_a_body_sent_in_time_is_served(daemon: Daemon) -> None:
    """The deadline is for the whole body, not for each read: a body in two parts, well
    inside it, is answered normally."""
    port = int(daemon.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        token = csrf_cookie(get(s, "/login"))
        body = b"name=nobody&password=wrong-wrong&_csrf_token=" + token.encode()
        s.sendall(("POST /login HTTP/1.1\r\nHost: x\r\n"
                   f"Cookie: csrftoken={token}\r\n"
                   "Content-Type: application/x-www-form-urlencoded\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n").encode() + body[:5])
        time.sleep(0.5)  # a pause inside the deadline, not a proof of absence
        s.sendall(body[5:])
        answer = read_response(s, 30)
        assert answer.startswith(b"HTTP/1.1 401"), answer[:300]
