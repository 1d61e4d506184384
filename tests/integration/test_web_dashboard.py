"""The dashboard: live parts over SSE, what admins and members see, and what it costs."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from jinja2 import Environment, FileSystemLoader

from appliance.engine.request import RequestHandle
from appliance.engine.snapshot import EngineSnapshot, SlotInfo
from appliance.store import keys, ledger, limits, users
from appliance.store.ledger import LedgerRecord
from appliance.store.models import User
from tests.browser.support import HOSTILE, browser, slow_fault, slow_request, sse_events
from tests.helpers import (
    FAST_HASHER,
    PASSWORD,
    LiveServer,
    live_server,
    make_settings,
    wait_until,
)
from web import live, stats
from web.assets import WEB
from web.format import HELPERS


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[LiveServer]:
    with live_server(make_settings(tiny_model, max_batch_size=2), fault=slow_fault) as s:
        yield s


@pytest.fixture()
def load(server: LiveServer) -> Iterator[list[RequestHandle]]:
    """Slow requests submitted straight to the engine; cancelled after the test."""
    handles: list[RequestHandle] = []
    yield handles
    for h in handles:
        server.engine.cancel(h)
    wait_until(lambda: server.engine.snapshot.active + server.engine.snapshot.queued == 0,
               10, "idle")


def _submit(server: LiveServer, handles: list[RequestHandle], user: str, uid: int) -> None:
    handles.append(slow_request(server.engine, user, uid))


def _frames(server: LiveServer, who: str, frames: int) -> list[tuple[str, str]]:
    with browser(server.url, who) as c:
        r = c.get("/dashboard/stream", params={"frames": frames})
        assert r.status_code == 200
        return sse_events(r.text)


def _parts_when(server: LiveServer, who: str, ready: Any) -> dict[str, str]:
    """The first one-frame stream whose parts satisfy ``ready`` (frames are shared per
    interval, so one may predate what the test just did)."""
    found: list[dict[str, str]] = []

    def check() -> bool:
        found[:] = [dict(_frames(server, who, 1))]
        return bool(ready(found[0]))
    wait_until(check, 10, "a dashboard frame showing it")
    return found[0]


def test_the_stream_sends_every_part_then_updates_faster_than_once_a_second(
        server: LiveServer, load: list[RequestHandle]) -> None:
    _submit(server, load, "carol", server.user_ids["carol"])
    wait_until(lambda: server.engine.snapshot.active == 1, 10, "a running request")
    events = _frames(server, "alice", 5)
    names = [n for n, _ in events]
    assert names[:6] == ["summary", "slots", "queue", "kv", "throughput", "users"]
    assert names.count("slots") >= 4  # the running request's tokens grow every frame
    # the hub's own period (no wall-clock measurement: the machine may be shared and slow)
    assert live.INTERVAL_S < 1.0
    assert all(names.count(n) <= 5 for n in set(names))  # unchanged parts are not resent


def test_admins_see_running_slots_and_the_queue_by_class(
        server: LiveServer, load: list[RequestHandle]) -> None:
    for who in ("bob", "carol", "carol"):
        _submit(server, load, who, server.user_ids[who])
    wait_until(lambda: server.engine.snapshot.queued == 1 and server.engine.snapshot.active == 2,
               10, "two running, one queued")
    parts = _parts_when(server, "alice", lambda p: p["slots"].count('class="slot"') == 2)
    assert ">bob<" in parts["slots"] and ">carol<" in parts["slots"]
    assert 'data-class="interactive" data-count="1"' in parts["queue"]
    assert "carol" in parts["queue"] and "waiting" in parts["queue"]
    assert 'id="queued-count" data-value="1"' in parts["summary"]
    with browser(server.url, "alice", htmx=False) as page:
        html = page.get("/dashboard").text
        assert 'data-stream="/dashboard/stream"' in html and 'data-value="1"' in html


def test_members_see_their_own_requests_and_usage_but_no_other_names(
        server: LiveServer, load: list[RequestHandle]) -> None:
    _submit(server, load, "bob", server.user_ids["bob"])
    _submit(server, load, "carol", server.user_ids["carol"])
    wait_until(lambda: server.engine.snapshot.active == 2, 10, "two running")
    parts = _parts_when(server, "bob", lambda p: "1 other request running" in p["slots"])
    assert parts["slots"].count('class="slot"') == 1 and ">bob<" in parts["slots"]
    assert "1 other request running" in parts["slots"]
    assert all("carol" not in html and "alice" not in html for html in parts.values())
    assert f'data-user-id="{server.user_ids["bob"]}"' in parts["users"]
    assert parts["users"].count('class="service-row') == 1


def test_a_hostile_user_name_is_inert_on_the_dashboard_and_admin_pages(
        server: LiveServer, load: list[RequestHandle]) -> None:
    with server.store.sessions.begin() as s:  # a name the store would refuse today
        user = User(name=HOSTILE, password_hash="x", role="member", max_class="interactive",
                    weight=1.0, disabled=False, created_at=time.time())
        s.add(user)
        s.flush()
        keys.create_api_key(s, user, HOSTILE)
        uid = user.id
    _submit(server, load, HOSTILE, uid)
    wait_until(lambda: server.engine.snapshot.active == 1, 10, "hostile request running")
    parts = _parts_when(server, "alice", lambda p: "&lt;script&gt;" in p["slots"])
    with browser(server.url, "alice", htmx=False) as alice:
        pages = [alice.get("/manage/users").text, alice.get("/keys").text,
                 alice.get("/dashboard").text]
    for html in [*parts.values(), *pages]:
        assert "<script>window" not in html and "<img src=x" not in html
    assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in parts["slots"]
    assert all("&lt;img src=x onerror=" in html for html in pages)


def test_per_user_service_figures_come_from_the_ledger(server: LiveServer) -> None:
    now = time.time()
    with server.store.sessions.begin() as s:  # someone with no other usage
        uid = users.create_user(s, "dora", PASSWORD, hasher=FAST_HASHER).id
    rows = [LedgerRecord(
        request_id=f"figures-{i}", user_id=uid, api_key_id=None, klass="interactive",
        endpoint="/v1/chat/completions", model="m", prompt_tokens=10, cached_tokens=0,
        output_tokens=20, queued_at=now - age - 1, admitted_at=now - age - 1,
        first_token_at=now - age, finished_at=now - age, finish_reason="stop",
        preemptions=i % 2, ttft_ms=100.0 * (i + 1), itl_mean_ms=10.0 + i, itl_p95_ms=20.0 + i)
        for i, age in enumerate([30, 90, 7200, 7300])]
    with server.store.sessions.begin() as s:
        ledger.insert_records(s, rows)
        limits.set_quota(s, uid, limits.QuotaLimits(tokens_per_day=1000))
    with server.store.read_sessions() as s:
        table = {u.user_id: u for u in stats.service_table(s, now)}
    dora = table[uid]
    assert (dora.tokens_hour, dora.tokens_day, dora.requests_day) == (60, 120, 4)
    assert dora.preemptions_day == 2 and dora.tokens_per_day == 1000
    assert (dora.ttft_p50_ms, dora.ttft_p95_ms) == (200.0, 400.0)
    assert (dora.itl_p50_ms, dora.itl_p95_ms) == (11.0, 23.0)
    assert dora.series[-1] == 30 and dora.series[-2] == 30 and sum(dora.series) == 60
    with server.store.sessions.begin() as s:
        limits.set_quota(s, uid, limits.UNLIMITED)
    _parts_when(server, "alice", lambda p: f'data-user-id="{uid}" data-day="120"' in p["users"])


def _templates() -> Environment:
    return Environment(loader=FileSystemLoader(WEB / "templates"), autoescape=True)


def test_viewers_share_one_frame_and_one_ledger_read(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[float] = []

    def table(session: Any, now: float) -> stats.Service:
        reads.append(now)
        return [], []

    class Sessions:
        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: object) -> None:
            return None

    monkeypatch.setattr(stats, "service", table)
    services = SimpleNamespace(engine=SimpleNamespace(snapshot=EngineSnapshot.empty(),
                                                      kv_budget_bytes=None,
                                                      group_status=lambda: None),
                               store=SimpleNamespace(read_sessions=Sessions),
                               max_batch_size=4)
    hub = live.Hub(services, _templates())  # type: ignore[arg-type]
    admin = live.Audience(True, 1, "alice")

    async def five_viewers() -> list[dict[str, str]]:
        return list(await asyncio.gather(*(hub.frame(admin) for _ in range(5))))

    frames = asyncio.run(five_viewers())
    assert len(reads) == 1
    assert all(f == frames[0] for f in frames)


def test_the_kv_gauge_shows_budget_reserved_and_prompt_cache() -> None:
    snap = dataclasses.replace(EngineSnapshot.empty(), kv_bytes=3 << 20,
                               kv_reserved_bytes=5 << 20, prompt_cache={"bytes": 1 << 20})
    view = live.kv_view(snap, 8 << 20)
    html = _templates().get_template("_dash_kv.html").render(kv=view, h=HELPERS)
    assert 'class="kv-used" width="37.5"' in html and 'class="kv-res" x="37.5"' in html
    assert "100 %</strong> of the 8.0 MiB budget taken" in html
    assert "5.0 MiB" in html and "1.0 MiB" in html and "8.0 MiB" in html
    small = dataclasses.replace(EngineSnapshot.empty(), kv_bytes=34 << 20)
    html = _templates().get_template("_dash_kv.html").render(
        kv=live.kv_view(small, int(10.4 * (1 << 30))), h=HELPERS)
    assert "0.3 %</strong>" in html and 'class="kv-used" width="0.6"' in html  # seen, not 0 %
    plain = live.kv_view(EngineSnapshot.empty())
    assert plain.budget is None and plain.reserved == 0  # the engine now publishes it


def test_queue_groups_by_class_with_the_longest_wait_first() -> None:
    ids = {"bob": 2, "carol": 3}

    def slot(rid: int, user: str, klass: str, waited: float) -> SlotInfo:
        return SlotInfo(rid, ids[user], user, klass, "queued", 10, 0, 0, 16, waited)
    queue = (slot(1, "bob", "background", 9.0), slot(2, "carol", "interactive", 2.0),
             slot(3, "bob", "interactive", 5.0))
    groups = {g.klass: g for g in live.queue_by_class(queue, None)}
    assert groups["interactive"].count == 2 and groups["interactive"].longest_wait_s == 5.0
    assert [r.rid for r in groups["interactive"].requests] == [3, 2]
    assert groups["voice"].count == 0
    mine = {g.klass: g for g in live.queue_by_class(queue, ids["carol"])}
    assert mine["interactive"].count == 2 and [r.rid for r in mine["interactive"].requests] == [2]
