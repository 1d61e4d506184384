"""Issue 13, engine side, over HTTP: a bad seed is a 400 and the engine lives on; request
ids are UUIDv7s shared by the OpenAI ``id`` and the ledger; a client that leaves a
non-streaming request frees its slot; ``max_tokens: 0`` is a 400 on both endpoints; admin
weights reach the scheduler and stay in bounds; a dead engine makes ``/health`` say 503."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from appliance.engine.request import GenerationRequest
from appliance.store.models import LedgerEntry
from tests.helpers import LiveServer, live_server, make_settings, wait_until

SLOW = 99_999
"""max_tokens that the fault hook slows to 50 ms a token: the request stays running."""
DIE = 17
"""max_tokens at which the fault hook kills the engine thread (an uncaught BaseException)."""


class _Death(BaseException):
    pass


def _fault(request: GenerationRequest, phase: str) -> None:
    if request.max_tokens == SLOW:
        time.sleep(0.05)
    if request.max_tokens == DIE and phase == "decode":
        raise _Death()


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[LiveServer]:
    with live_server(make_settings(tiny_model), fault=_fault) as s:
        yield s


def _chat(**extra: object) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}


@pytest.mark.parametrize("seed", [-1, -(2 ** 63), 2 ** 64, 2 ** 70])
def test_a_seed_outside_0_to_2_64_gets_a_clear_400_and_the_engine_lives_on(
        server: LiveServer, seed: int) -> None:
    with server.client("bob") as bob:
        r = bob.post("/v1/chat/completions", json=_chat(seed=seed))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error"
        assert "seed" in err["message"]
        ok = bob.post("/v1/chat/completions", json=_chat(seed=2 ** 64 - 1, temperature=1.0))
        assert ok.status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200


def test_completions_with_max_tokens_0_get_a_clear_400(server: LiveServer) -> None:
    with server.client("bob") as bob:
        for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 0}),
                           ("/v1/chat/completions", _chat(max_tokens=0))):
            r = bob.post(path, json=body)
            assert r.status_code == 400, (path, r.text)
            assert r.json()["error"]["param"] == "max_tokens"


def test_the_openai_id_is_a_uuid7_and_names_the_ledger_row(server: LiveServer) -> None:
    with server.client("bob") as bob:
        ids = [bob.post(path, json=body).json()["id"] for path, body in (
            ("/v1/chat/completions", _chat()),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 3}))]
    assert ids[0].startswith("chatcmpl-") and ids[1].startswith("cmpl-")
    hexes = [i.split("-", 1)[1] for i in ids]
    assert all(uuid.UUID(h).version == 7 for h in hexes)
    server.writer.flush()
    with server.store.read_sessions() as s:
        stored = set(s.scalars(select(LedgerEntry.request_id)))
    assert set(hexes) <= stored


def test_a_client_that_leaves_a_non_streaming_request_frees_its_slot(
        server: LiveServer) -> None:
    before = server.engine.snapshot.cancelled_total
    with server.client("alice") as alice:
        with pytest.raises(httpx.ReadTimeout):
            alice.post("/v1/chat/completions", json=_chat(max_tokens=SLOW), timeout=1.5)
        # the client hung up; the handler sees the disconnect and cancels the request
        wait_until(lambda: alice.get("/slots").json()["active"] == 0, 30, "slot freed")
        assert alice.get("/slots").json()["kv_bytes"] == 0
    assert server.engine.snapshot.cancelled_total == before + 1


def _weight(server: LiveServer, who: str) -> float | None:
    return server.engine.snapshot.weights.get(str(server.user_ids[who]))


def test_a_weight_set_through_the_admin_api_reaches_the_running_scheduler(
        server: LiveServer) -> None:
    with server.client("alice") as alice:
        r = alice.patch(f"/admin/users/{server.user_ids['carol']}", json={"weight": 4.0})
        assert r.status_code == 200, r.text
        alice.post("/v1/chat/completions", json=_chat())  # a tick publishes the snapshot
        wait_until(lambda: _weight(server, "carol") == 4.0, 10, "weight in the scheduler")
        r = alice.post("/admin/users", json={"name": "dave", "password": "correct horse 12",
                                             "weight": 3.0})
        assert r.status_code == 201, r.text
        alice.post("/v1/chat/completions", json=_chat())
        dave = str(r.json()["id"])
        wait_until(lambda: server.engine.snapshot.weights.get(dave) == 3.0, 10, "new user")


@pytest.mark.parametrize("weight", [1e-320, 0.0, -1.0, 0.001, 100.5, 1e300])
def test_a_weight_outside_0_01_to_100_gets_a_clear_400(server: LiveServer,
                                                       weight: float) -> None:
    with server.client("alice") as alice:
        r = alice.patch(f"/admin/users/{server.user_ids['bob']}", json={"weight": weight})
        assert r.status_code == 400, r.text
        assert "weight must be a number from 0.01 to 100" in r.json()["error"]["message"]
        r = alice.post("/admin/users", json={"name": "eve", "password": "correct horse 12",
                                             "weight": weight})
        assert r.status_code == 400, r.text
        users = alice.get("/admin/users").json()
    assert "eve" not in {u["name"] for u in users}
    assert all(u["weight"] >= 0.01 for u in users)


def test_a_dead_engine_makes_health_say_503_with_the_reason(tiny_model: Path) -> None:
    with live_server(make_settings(tiny_model), fault=_fault) as s, s.client("bob") as bob:
        assert httpx.get(s.url + "/health").json()["status"] == "ok"
        r = bob.post("/v1/chat/completions", json=_chat(max_tokens=DIE))
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "engine_unavailable"
        assert r.headers["retry-after"].isdigit()
        health = httpx.get(s.url + "/health")
        assert health.status_code == 503
        assert health.json()["status"] == "unavailable"
        assert "engine thread died" in health.json()["reason"]
        later = bob.post("/v1/chat/completions", json=_chat())
        assert later.status_code == 503
        assert later.json()["error"]["code"] == "engine_unavailable"


@pytest.mark.parametrize("weight", ["1e-320", "0", "1000"])
def test_the_web_admin_page_refuses_a_weight_outside_0_01_to_100(
        server: LiveServer, weight: str) -> None:
    from tests.browser.support import browser

    with browser(server.url, "alice") as alice:
        r = alice.post("/manage/users", data={"name": "fay", "password": "correct horse 12",
                                              "weight": weight})
        assert r.status_code == 400 and "weight must be a number from 0.01 to 100" in r.text
        r = alice.post(f"/manage/users/{server.user_ids['carol']}", data={"weight": weight})
        assert r.status_code == 400 and "weight must be a number from 0.01 to 100" in r.text


def test_the_cli_refuses_a_weight_outside_0_01_to_100(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "APPLIANCE_DATA_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "appliance", "user", "add", "gus",
                          "--weight", "1e-320"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1
    assert "weight must be a number from 0.01 to 100" in out.stderr
    listed = subprocess.run([sys.executable, "-m", "appliance", "user", "list"], env=env,
                            capture_output=True, text=True, timeout=120, check=True)
    assert "gus" not in listed.stdout


def test_a_ledger_id_conflict_is_logged_and_counted_never_silent(
        server: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    from appliance.store.ledger import LedgerRecord

    now = time.time()
    row = LedgerRecord(request_id="0" * 32, user_id=server.user_ids["bob"], api_key_id=None,
                       klass="interactive", endpoint="/v1/chat/completions", model="",
                       prompt_tokens=1, cached_tokens=0, output_tokens=1, queued_at=now,
                       admitted_at=now, first_token_at=now, finished_at=now,
                       finish_reason="stop")
    before = server.writer.stats.conflicts
    with caplog.at_level("ERROR", logger="appliance.store.writer"):
        for _ in range(2):
            server.writer.submit_ledger(row)
            server.writer.flush()
    assert server.writer.stats.conflicts == before + 1
    assert any("NOT written" in r.getMessage() and "0" * 32 in r.getMessage()
               for r in caplog.records)
