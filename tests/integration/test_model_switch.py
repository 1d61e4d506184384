"""Changing the served model while the daemon runs (issue 54, item 3): what runs is drained
(and handed back when the drain times out), requests that arrive meanwhile are asked to
retry, every client then sees the new model; the choice is kept for the next start, and
``appliance model use`` records one for it."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from appliance import cli_admin
from appliance.daemon import build_daemon
from appliance.engine.model import DEMO_MODEL_DIR
from appliance.engine.request import Event, FinishEvent, GenerationRequest, SamplingParams
from appliance.service import model_choice
from appliance.vocab import FinishReason
from tests.browser.support import SLOW_MAX_TOKENS, slow_fault
from tests.helpers import live_server, make_settings, wait_until


def test_a_switch_drains_then_serves_the_new_model_and_is_kept(tiny_model: Path) -> None:
    settings = make_settings(tiny_model, default_max_tokens=4)
    with live_server(settings, fault=slow_fault) as s:
        s.services.drain_s = 0.5  # the slow request outlives it: handed back
        events: list[Event] = []
        eos = tuple((int(t), -100.0) for t in s.engine.loaded.eos_token_ids)
        s.engine.submit(GenerationRequest(
            prompt=tuple(range(5, 40)), max_tokens=SLOW_MAX_TOKENS, user="bob",
            user_id=s.user_ids["bob"], sampling=SamplingParams(logit_bias=eos)), events.append)
        wait_until(lambda: s.engine.snapshot.active == 1, what="the slow request to run")
        answer: list[Any] = []
        switch = threading.Thread(target=lambda: answer.append(s.client("alice").post(
            "/admin/model", json={"model": str(DEMO_MODEL_DIR)})))
        switch.start()
        wait_until(lambda: s.engine.switching_to is not None, what="the switch to start")
        meanwhile = s.client("carol").post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        switch.join(120)
        assert meanwhile.status_code == 503
        assert "being changed to demo_model" in meanwhile.json()["error"]["message"]
        assert answer[0].status_code == 200, answer[0].text
        assert answer[0].json()["model"] == "demo_model"
        finish = [e for e in events if isinstance(e, FinishEvent)]
        assert [e.reason for e in finish] == [FinishReason.CANCELLED]
        with s.client("bob") as bob:
            assert bob.get("/v1/models").json()["data"][0]["id"] == "demo_model"
            assert bob.post("/v1/chat/completions", json={
                "model": "demo_model", "max_tokens": 3,
                "messages": [{"role": "user", "content": "hi"}]}).status_code == 200
    # `appliance model use`: refused in words for a name that is no model; recorded else
    assert cli_admin.model_use(settings, "nothing-here") == 1
    assert cli_admin.model_use(settings, "demo") == 0
    daemon = build_daemon(settings, secret="x" * 32, drain_timeout=1)
    try:  # the next start serves the choice, while the configuration says what it said
        assert daemon.services.model.name == "demo_model"
        with daemon.store.read_sessions() as db:
            choice = model_choice.recorded(db)
        assert choice == model_choice.Choice(str(DEMO_MODEL_DIR.resolve()), str(tiny_model))
        # once the configuration names another model, it wins
        assert model_choice.at_start(daemon.store, "another-model") is None
    finally:
        daemon.close()
