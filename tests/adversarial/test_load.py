"""A bounded flood, a disconnect storm and an externally locked database, against the live
daemon on loopback."""

from __future__ import annotations

import asyncio
import sqlite3
import threading

import httpx

from tests.adversarial.conftest import Live, assert_acceptable, normal_chat, scale
from tests.helpers import wait_until

CHAT = {"messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 24,
        "stream": True}


async def _one_streaming_chat(url: str, key: str) -> tuple[int, int]:
    """(status, data lines) of one streaming chat that reads to the end."""
    async with httpx.AsyncClient(base_url=url, timeout=300,
                                 headers={"Authorization": f"Bearer {key}"}) as c, \
            c.stream("POST", "/v1/chat/completions", json=CHAT) as r:
        if r.status_code != 200:
            await r.aread()
            assert_acceptable(r)
            return r.status_code, 0
        lines = [line async for line in r.aiter_lines() if line.startswith("data:")]
        assert lines[-1] == "data: [DONE]"
        return 200, len(lines)


async def _flood(url: str, key: str, n: int) -> list[tuple[int, int]]:
    return await asyncio.gather(*(_one_streaming_chat(url, key) for _ in range(n)))


def test_a_flood_gets_answers_or_a_clean_503(live: Live) -> None:
    key = live.fresh_key("flo")
    results = asyncio.run(_flood(live.url, key, scale().flood_clients))
    statuses = [s for s, _ in results]
    assert set(statuses) <= {200, 503}, statuses
    assert statuses.count(200) >= 1
    with live.client("alice") as alice:
        assert alice.get("/health").status_code == 200
    normal_chat(live, key)


async def _leave_mid_stream(url: str, key: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=300,
                                 headers={"Authorization": f"Bearer {key}"}) as c:
        body = {**CHAT, "max_tokens": 200}
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                assert_acceptable(r)
                return
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    return  # first token seen: hang up


async def _storm(url: str, key: str, n: int) -> None:
    await asyncio.gather(*(_leave_mid_stream(url, key) for _ in range(n)))


def test_clients_that_hang_up_free_their_slots(live: Live) -> None:
    key = live.fresh_key("stormy")
    asyncio.run(_storm(live.url, key, scale().storm_clients))
    with live.client("alice") as alice:
        def empty() -> bool:
            slots = alice.get("/slots").json()
            return slots["active"] == 0 and slots["queued"] == 0 and not slots["slots"]
        wait_until(empty, 120, "/slots empty after the storm")
    normal_chat(live, key)


def _ledger_rows(live: Live) -> int:
    db = sqlite3.connect(live.daemon.data_dir / "appliance.db", timeout=30)
    try:
        return int(db.execute("SELECT count(*) FROM ledger").fetchone()[0])
    finally:
        db.close()


def test_an_external_lock_on_the_database_loses_nothing(live: Live) -> None:
    """Another process holds the write lock for longer than the busy timeout: writes answer
    503 + Retry-After, key authentication and chats go on, every ledger row arrives once
    the lock is released, and the daemon recovers by itself."""
    key = live.fresh_key("lockie")
    with httpx.Client(base_url=live.url, timeout=120,
                      headers={"Authorization": f"Bearer {key}"}) as bob:
        settled = _ledger_rows(live)
        normal_chat(live, key)
        wait_until(lambda: _ledger_rows(live) == settled + 1, 30, "the first chat's row")
        before = settled + 1
        locker = sqlite3.connect(live.daemon.data_dir / "appliance.db", isolation_level=None,
                                 timeout=30)
        locker.execute("BEGIN EXCLUSIVE")
        held = threading.Timer(8.0, lambda: None)
        held.start()
        chats = 0
        try:
            r = bob.post("/conversations", json={"title": "during the lock"})
            assert_acceptable(r)
            assert r.status_code == 503 and r.json()["error"]["code"] == "database_busy"
            for _ in range(3):
                c = bob.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
                assert_acceptable(c)
                chats += c.status_code == 200
        finally:
            held.join()
            locker.execute("COMMIT")
            locker.close()
        assert chats == 3  # authentication and generation need no write lock
        assert bob.post("/conversations", json={"title": "after"}).status_code == 201
        wait_until(lambda: _ledger_rows(live) >= before + chats, 60, "every ledger row")
        # No row twice: one later chat's row is written by the same single writer after
        # anything it still had from the lock (a retried batch), so once that row is in,
        # a duplicate would be too.
        normal_chat(live, key)
        wait_until(lambda: _ledger_rows(live) >= before + chats + 1, 60, "the later row")
        assert _ledger_rows(live) == before + chats + 1
