"""Issue 52, item 15: revoking a key, disabling a user or lowering a quota below what is used
ends that user's running streams within a tick, each with its ledger row."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from appliance.store.models import LedgerEntry
from tests.helpers import LiveServer, live_server, make_settings, wait_until

MAX_TOKENS = 1500


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[LiveServer]:
    with live_server(make_settings(tiny_model)) as s:
        yield s


class Stream:
    """One long streamed answer on its own thread: its text chunks and its last object."""

    def __init__(self, server: LiveServer, who: str) -> None:
        eos = sorted(server.engine.loaded.eos_token_ids)  # type: ignore[attr-defined]
        self.chunks = 0
        self.last = ""
        self.ended = threading.Event()
        body = {"model": server.engine.loaded.name,  # type: ignore[attr-defined]
                "messages": [{"role": "user", "content": "Tell me a long story."}],
                "stream": True, "max_tokens": MAX_TOKENS,
                "logit_bias": {str(t): -100 for t in eos}}
        threading.Thread(target=self._run, args=(server, who, body), daemon=True).start()

    def _run(self, server: LiveServer, who: str, body: dict[str, object]) -> None:
        with server.client(who) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.last = line
                    self.chunks += '"content"' in line
        self.ended.set()


def _ledger(server: LiveServer, user_id: int) -> list[LedgerEntry]:
    with server.store.read_sessions() as s:
        return list(s.scalars(select(LedgerEntry).where(LedgerEntry.user_id == user_id)))


def _ends_promptly(server: LiveServer, who: str, act: Callable[[], None], reason: str) -> str:
    stream = Stream(server, who)
    wait_until(lambda: stream.chunks >= 3, 60, "the stream's first tokens")
    act()
    acted = time.monotonic()
    assert stream.ended.wait(30), "the stream ran on after the change"
    took = time.monotonic() - acted
    assert stream.chunks < MAX_TOKENS // 2
    uid = server.user_ids[who]
    wait_until(lambda: any(e.finish_reason == reason for e in _ledger(server, uid)), 10,
               f"a ledger row finished {reason}")
    assert took < 10, took
    return stream.last


def test_revoking_a_key_ends_its_stream_with_a_ledger_row(server: LiveServer) -> None:
    with server.client("alice") as admin:
        prefix = next(k["prefix"] for k in admin.get("/admin/keys").json()
                      if k["user_id"] == server.user_ids["bob"])

        def revoke() -> None:
            assert admin.delete(f"/admin/keys/{prefix}").status_code == 204

        last = _ends_promptly(server, "bob", revoke, "cancelled")
    assert "access_revoked" in last and "revoked" in last


def test_disabling_a_user_ends_their_stream_with_a_ledger_row(server: LiveServer) -> None:
    with server.client("alice") as admin:
        def disable() -> None:
            r = admin.patch(f"/admin/users/{server.user_ids['carol']}", json={"disabled": True})
            assert r.status_code == 200, r.text

        last = _ends_promptly(server, "carol", disable, "cancelled")
    assert "disabled" in last


def test_a_quota_lowered_below_what_is_used_ends_the_stream_with_quota(
        server: LiveServer) -> None:
    with server.client("alice") as admin:
        def lower() -> None:
            r = admin.put(f"/admin/users/{server.user_ids['alice']}/quota",
                          json={"tokens_per_day": 1})
            assert r.status_code == 200, r.text

        _ends_promptly(server, "alice", lower, "quota")
