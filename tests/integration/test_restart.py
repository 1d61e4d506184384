"""The fairness state survives a restart of the real daemon (`appliance serve` as a
process): the virtual token counters, the weights and the day's usage come back, whether
the daemon was stopped with SIGTERM or killed with -9 (then within one counter flush)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.daemon import Daemon, make_household, start_daemon
from tests.helpers import wait_until

FLAGS = ("--prompt-cache-entries", "0")  # the same prompt costs the same after a restart


def counters(admin: httpx.Client) -> dict[str, float]:
    """Every user's fairness counter, as `/metrics` publishes it."""
    text = admin.get("/metrics").text
    return {s.labels["user_id"]: s.value for family in text_string_to_metric_families(text)
            if family.name == "appliance_user_virtual_tokens" for s in family.samples}


def saved_counters(data_dir: Path) -> dict[str, float]:
    con = sqlite3.connect(f"file:{data_dir / 'appliance.db'}?mode=ro", uri=True)
    try:
        return {str(uid): vtc for uid, vtc in con.execute(
            "SELECT user_id, vtc FROM usage_counters")}
    finally:
        con.close()


def chat(client: httpx.Client, body: dict[str, object]) -> httpx.Response:
    return client.post("/v1/chat/completions", json=body)


def charge(d: Daemon, admin: httpx.Client, who: httpx.Client, uid: str,
           body: dict[str, object]) -> float:
    """What one request adds to the user's counter (the daemon is otherwise idle)."""
    before = counters(admin).get(uid, 0.0)
    assert chat(who, body).status_code == 200
    wait_until(lambda: counters(admin).get(uid, 0.0) > before, 10, "the charge")
    return counters(admin)[uid] - before


@pytest.mark.parametrize("stop", ["sigterm", "kill -9"])
def test_counters_weights_and_the_days_usage_survive_a_restart(
        tiny_model: Path, tmp_path: Path, stop: str) -> None:
    keys = make_household(tmp_path)
    eos = json.loads((tiny_model / "config.json").read_text())["eos_token_id"]
    ban = {str(t): -100.0 for t in (eos if isinstance(eos, list) else [eos])}
    body = {"messages": [{"role": "user", "content": "Count to ten"}], "max_tokens": 6,
            "temperature": 0, "logit_bias": ban}
    d = start_daemon(tiny_model, tmp_path, *FLAGS)
    with d.client(keys["alice"]) as alice, d.client(keys["bob"]) as bob:
        ids = {u["name"]: str(u["id"]) for u in alice.get("/admin/users").json()}
        # two users served one after the other; bob first, so that his charge is the cost
        # alone (a user arriving after another is lifted to that user's counter)
        bob_at_weight_1 = charge(d, alice, bob, ids["bob"], body)
        assert chat(alice, body).status_code == 200
        # an admin quadruples bob's weight and caps alice at what she used today
        r = alice.patch(f"/admin/users/{ids['bob']}", json={"weight": 4.0})
        assert r.status_code == 200, r.text
        wait_until(lambda: alice.get("/admin/usage").json()[ids["alice"]]["last_day"]
                   ["requests"] == 1, 10, "alice's ledger row")
        used = alice.get("/admin/usage").json()[ids["alice"]]["last_day"]["total_tokens"]
        quota = {"tokens_per_day": used, "max_concurrent": 3, "max_prompt_tokens": None,
                 "max_output_tokens": None}
        r = alice.put(f"/admin/users/{ids['alice']}/quota", json=quota)
        assert r.status_code == 200, r.text
        refused = chat(alice, body)
        assert refused.status_code == 429, refused.text
        before = counters(alice)
        assert before[ids["alice"]] > 0 and before[ids["bob"]] > 0
    if stop == "sigterm":
        assert d.terminate() == 0
    else:
        # an idle daemon has handed its latest counters to the writer within one flush
        wait_until(lambda: saved_counters(tmp_path) == pytest.approx(before), 30,
                   "the counters on disk")
        d.kill()

    d2 = start_daemon(tiny_model, tmp_path, *FLAGS, log_name="restart.log")
    with d2.client(keys["alice"]) as alice, d2.client(keys["bob"]) as bob:
        wait_until(lambda: counters(alice) != {}, 10, "the restored counters on /metrics")
        assert counters(alice) == pytest.approx(before)
        users = {u["name"]: u for u in alice.get("/admin/users").json()}
        assert users["bob"]["weight"] == 4.0
        assert alice.get(f"/admin/users/{ids['alice']}/quota").json() == quota
        # the day's usage is back: alice is still over her daily quota
        refused = chat(alice, body)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "tokens_per_day"
        # the weight is back in the scheduler: the same request costs bob a quarter
        assert charge(d2, alice, bob, ids["bob"], body) == pytest.approx(bob_at_weight_1 / 4)
    assert d2.terminate() == 0
