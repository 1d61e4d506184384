"""The control channel between the machines of a group (no MLX): a TCP connection from each
follower to rank 0 carrying one JSON object per line.

At start a follower says who it is (``hello``: rank, version, the model's fingerprint, its
memory budget) and rank 0 answers with its part (``welcome``: its layers and the shapes it
needs) or why not (``refuse``). Then the follower sends a ``beat`` every
:data:`BEAT_S` (its steps, step time, memory) and answers rank 0's ``ping`` with a ``pong``
(the link's round trip, for the dashboard). The channel is how each side learns the other
is gone: a process that dies closes its socket at once, and one that stops answering
(stopped, or a pulled cable) misses its beats. Rank 0's plans come this way too
(appliance/distributed/plan.py); the tensors go over MLX's own distributed layer
(appliance/distributed/stage.py), never here.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from typing import Any

BEAT_S = 0.25
"""How often a follower reports; rank 0 declares it lost after ``heartbeat_timeout``."""

IDLE, COMPUTE, RING = "idle", "compute", "ring"
"""What a machine's main thread does, as its beats say: waits for a plan, computes its
layers, or waits in a ring operation on the other machines (only that can hang)."""


class ChannelClosed(ConnectionError):
    """The other side closed the connection or stopped answering in time."""


class Channel:
    """One connection, one JSON object per line (sent from any thread; received by one)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = b""
        self._send_lock = threading.Lock()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, message: dict[str, Any]) -> None:
        data = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        try:
            with self._send_lock:
                self.sock.sendall(data)
        except OSError as exc:
            raise ChannelClosed(f"send failed: {exc}") from exc

    def receive(self, timeout: float) -> dict[str, Any]:
        """The next message; raises :class:`ChannelClosed` at EOF or after ``timeout``
        seconds with nothing received. What arrived is always read before the time is
        judged: a thread that did not run for a while (a busy core) must not take its own
        delay for the other side's silence."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            self.sock.settimeout(max(deadline - time.monotonic(), 0.0))
            try:
                data = self.sock.recv(65536)
            except (TimeoutError, BlockingIOError):
                if time.monotonic() >= deadline:
                    raise ChannelClosed(f"no word for {timeout:.1f} s") from None
                continue
            except OSError as exc:
                raise ChannelClosed(f"connection lost: {exc}") from exc
            if not data:
                raise ChannelClosed("connection closed")
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            message = json.loads(line)
        except ValueError as exc:
            raise ChannelClosed("a message that is not JSON") from exc
        if not isinstance(message, dict):
            raise ChannelClosed("a message that is not an object")
        return message

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(8)
    return sock


def accept(server: socket.socket, timeout: float) -> Channel | None:
    """The next follower's connection, or None after ``timeout``."""
    server.settimeout(max(timeout, 0.01))
    try:
        sock, _ = server.accept()
    except TimeoutError:
        return None
    sock.settimeout(None)
    return Channel(sock)


def connect(host: str, port: int, timeout: float = 2.0) -> Channel:
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.settimeout(None)
    return Channel(sock)
