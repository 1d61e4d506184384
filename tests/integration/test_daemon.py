"""The daemon as a process: SIGTERM drains, logs carry no secrets or text, and
`appliance run` gives the server's greedy answer. (kill -9 and restarts:
tests/adversarial/test_kill_restart.py.)"""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from appliance.backend import installed_kind
from tests.daemon import PASSWORD, cli, make_household, start_daemon
from tests.helpers import NATIVE

CHAT = {"messages": [{"role": "user", "content": "Tell me a story"}]}


def test_sigterm_lets_running_and_queued_requests_finish_then_exits_0(
        tiny_model: Path, tmp_path: Path) -> None:
    keys = make_household(tmp_path)
    # a drain timeout no loaded machine reaches: the test is about finishing, not speed
    d = start_daemon(tiny_model, tmp_path, "--max-batch-size", "1", "--shutdown-timeout", "600")
    eos = json.loads((tiny_model / "config.json").read_text())["eos_token_id"]
    ban = {str(t): -100.0 for t in (eos if isinstance(eos, list) else [eos])}
    body = {**CHAT, "max_tokens": 1500, "logit_bias": ban}
    with cf.ThreadPoolExecutor(4) as pool, d.client(keys["bob"]) as c:
        futures = [pool.submit(c.post, "/v1/chat/completions", json=body) for _ in range(4)]
        deadline = time.monotonic() + 30
        while c.get("/health").json()["active"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert d.terminate() == 0
        replies = [f.result() for f in futures]
    assert [r.status_code for r in replies] == [200] * 4
    for r in replies:
        assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
    log = d.log.read_text()
    assert "shut down cleanly" in log
    frozen = re.search(r"startup heap settled: (\d+) objects", log)
    assert frozen is not None and int(frozen.group(1)) > 10_000, log[-2000:]
    # the real entry point keeps big buffers in malloc's heap (appliance/backend/heap.py),
    # unless the native code is off (CI's second leg)
    tuned = NATIVE and installed_kind() == "cpu"
    assert (" heap=kept " if tuned else " heap=not tuned ") in log, log[-2000:]


def test_logs_carry_no_password_key_or_text(tiny_model: Path, tmp_path: Path) -> None:
    keys = make_household(tmp_path)
    # no drafts: every one of the answer's 24 tokens is a tick of its own
    d = start_daemon(tiny_model, tmp_path, "--log-level", "debug", "--draft-tokens", "0")
    secret_prompt = "PINEAPPLE-ZEPPELIN-4471"
    with d.client(keys["bob"]) as c:
        reply = c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": secret_prompt}], "max_tokens": 24})
        answer = reply.json()["choices"][0]["message"]["content"]
        c.post("/v1/chat/completions", json={"messages": "not a list"})
    with httpx.Client(base_url=d.url) as browser:
        browser.get("/login")
        browser.post("/login", data={"name": "alice", "password": PASSWORD,
                                     "_csrf_token": browser.cookies.get("csrftoken") or ""})
        browser.post("/login", data={"name": "alice", "password": "wrong-" + PASSWORD,
                                     "_csrf_token": browser.cookies.get("csrftoken") or ""})
    assert d.terminate() == 0
    log = d.log.read_text()
    assert "request finished" in log  # the log is not simply empty
    # the longest gap between the answer's tokens as the engine made them: 23 gaps
    assert re.search(r"request finished .* itl_max_ms=\d+\.\d ", log), log[-2000:]
    # debug shows every tick, not the repeat filter's ten a minute
    assert len(re.findall(r"DEBUG appliance\.engine\.runner: tick=\d+ ", log)) > 10, log[-2000:]
    for secret in (PASSWORD, keys["alice"], keys["bob"], secret_prompt, "PINEAPPLE"):
        assert secret not in log
    if len(answer.strip()) >= 12:
        assert answer.strip() not in log


def test_appliance_run_gives_the_servers_greedy_answer(demo_model: Path,
                                                      tmp_path: Path) -> None:
    prompt = "What is a list?"
    out = subprocess.run([sys.executable, "-m", "appliance", "run", "--model", str(demo_model),
                          "-p", prompt, "--max-tokens", "20"], capture_output=True, text=True,
                         timeout=300, check=True,
                         env={"APPLIANCE_DATA_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"})
    keys = make_household(tmp_path)
    d = start_daemon(demo_model, tmp_path)
    with d.client(keys["bob"]) as c:
        served = c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": prompt}], "max_tokens": 20,
            "temperature": 0}).json()["choices"][0]["message"]["content"]
    d.terminate()
    assert out.stdout.rstrip("\n") == served


def test_model_pull_without_network_fails_clearly(tmp_path: Path) -> None:
    with pytest.raises(subprocess.CalledProcessError) as err:
        cli(tmp_path, "model", "pull", "mlx-community/SmolLM-135M-Instruct-4bit")
    assert "could not pull" in err.value.stdout
