"""When one of two machines dies, stops answering, never comes, or the model does not fit:
what the household sees (docs/distributed.md, "When a machine fails")."""

from __future__ import annotations

import json
import re
import signal
import sqlite3
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port
from tests.daemon import make_household, start_daemon
from tests.distributed.group import Group, start_follower, start_group
from tests.distributed.test_two_machines import ask, served
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(300)

ENGINE_DOWN_EXIT = 70
GROUP_LOST_EXIT = 75


@pytest.fixture(scope="module")
def household(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("household")
    return root, make_household(root)["bob"]


def lost_at(log: Path) -> float:
    """When rank 0 logged the group lost (epoch seconds, from the log line's time)."""
    m = re.search(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d+) CRITICAL "
                  r"appliance\.distributed\.link: distributed group lost", log.read_text())
    assert m, "rank 0 never said the group was lost"
    return time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000


def stream_until(group: Group, key: str, fault: threading.Event, after: int = 3
                 ) -> tuple[int, str, str]:
    """A long answer; ``fault`` is set after ``after`` chunks. The chunks that came, the
    stream's last event (the error, if it ended with one) and the request's id."""
    seen, last, rid = 0, "", ""
    with httpx.stream("POST", group.rank0.url + "/v1/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": served(group.rank0.url), "max_tokens": 2000,
                            "temperature": 0, "stream": True,
                            "messages": [{"role": "user", "content": "a long story"}]}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                last = line
                seen += 1
                rid = rid or str(json.loads(line[6:]).get("id", "")).removeprefix("chatcmpl-")
                if seen == after:
                    fault.set()
    return seen, last, rid


def ledger_ids(data: Path) -> set[str]:
    with sqlite3.connect(data / "appliance.db") as db:
        return {row[0] for row in db.execute("select request_id from ledger")}


def ledger_row(data: Path, request_id: str) -> tuple[str, int] | None:
    """The ledger's finish reason and output tokens of one request (None: no row)."""
    with sqlite3.connect(data / "appliance.db") as db:
        row = db.execute("select finish_reason, output_tokens from ledger where request_id = ?",
                         (request_id,)).fetchone()
    return None if row is None else (str(row[0]), int(row[1]))


def settled_answer(group: Group, key: str) -> str:
    r = httpx.post(group.rank0.url + "/v1/chat/completions", timeout=60,
                   headers={"Authorization": f"Bearer {key}"},
                   json={"model": served(group.rank0.url), "max_tokens": 8, "temperature": 0,
                         "messages": [{"role": "user", "content": "good morning"}]})
    assert r.status_code == 200
    return str(r.json()["id"]).removeprefix("chatcmpl-")


def lose_mid_stream(group: Group, key: str, sig: signal.Signals, within: float
                    ) -> tuple[float, str, int]:
    """A long answer streaming, then ``sig`` to the follower: the answer ends with a clear
    error, rank 0 logs the loss ``within`` seconds and exits 70. When the signal went, the
    answer's request id and the chunks it got."""
    fault = threading.Event()
    done: list[tuple[int, str, str]] = []
    streaming = threading.Thread(target=lambda: done.append(stream_until(group, key, fault)))
    streaming.start()
    assert fault.wait(60)
    at = time.time()
    group.rank1.proc.send_signal(sig)
    streaming.join(60)
    assert group.rank0.proc.wait(60) == ENGINE_DOWN_EXIT
    seen, last, rid = done[0]
    assert seen < 200 and "error" in last and "machine" in last, last
    assert lost_at(group.rank0.log) - at <= within
    return at, rid, seen


def test_a_lost_machine_ends_the_answers_clearly_and_the_group_comes_back(
        household: tuple[Path, str], demo_model: Path) -> None:
    data, key = household
    group = start_group(demo_model, data, log_name="killed.log")
    try:
        settled = settled_answer(group, key)
        at, cut, _ = lose_mid_stream(group, key, signal.SIGKILL, 2.0)  # socket closes at once
    finally:
        group.rank1.stop()
        if group.rank0.proc.poll() is None:
            group.rank0.kill()
    assert settled in ledger_ids(data)  # every settled answer is in the ledger
    assert ledger_row(data, cut) is not None, "the cut answer's usage was not recorded"
    # nothing to drain: the log says why rather than a drain that never waited
    assert "no drain: the engine stopped serving" in group.rank0.log.read_text()
    assert "drain timeout" not in group.rank0.log.read_text()
    # the service managers start both again: serving within 30 s of the fault
    again = start_group(demo_model, data, log_name="stopped.log")
    try:
        assert ask(again.rank0.url, key, "good morning", 4)[1] == 4
        assert time.time() - at < 30
        health = again.health()  # serving together again: the kept reason is gone
        assert health["status"] == "ok" and "reason" not in health
        assert health["distributed"]["lost"] is None
        # a follower that stops answering (SIGSTOP) is caught by its missed beats
        settled = settled_answer(again, key)
        _, cut, chunks = lose_mid_stream(again, key, signal.SIGSTOP, 3.0 + 1.5)  # beats
        # woken, it finds rank 0 gone and leaves for its service manager to restart it
        again.rank1.proc.send_signal(signal.SIGCONT)
        assert again.rank1.proc.wait(30) == GROUP_LOST_EXIT
        assert "rank 0 lost" in again.rank1.log.read_text()
    finally:
        again.rank1.stop()
        if again.rank0.proc.poll() is None:
            again.rank0.kill()
    assert settled in ledger_ids(data)
    # the hung group's answer, ended by the supervisor, is counted with what it sent
    row = ledger_row(data, cut)
    assert row is not None and row[0] == "error" and row[1] >= max(1, chunks - 2), row
    # the other machine does not come back: rank 0, restarted, serves alone and says why
    # the machines were parted (the 503 saying it lived 0.1 s, the restart forgot it)
    alone = start_daemon(demo_model, data, "--distributed", str(again.hostfile),
                         "--control-port", str(free_port()), "--join-timeout", "1",
                         log_name="after-stop.log")
    try:
        health = httpx.get(alone.url + "/health", timeout=10).json()
    finally:
        assert alone.terminate() == 0
    assert health["status"] == "degraded", health
    assert "serving on this machine alone (the machines were parted at " in health["reason"]
    assert "machine 1 (127.0.0.1) lost" in health["reason"]
    assert "machine 1 (127.0.0.1) lost" in health["distributed"]["lost"]


def test_rank_0_serves_alone_until_the_other_machine_comes_back(
        household: tuple[Path, str], demo_model: Path, tmp_path: Path) -> None:
    from tests.daemon import wait_up
    from tests.distributed.group import hostfile, pin

    data, key = household
    hosts = hostfile(tmp_path / "hosts.json")
    port = str(free_port())
    flags = ("--distributed", str(hosts), "--control-port", port, "--join-timeout", "1")
    alone = start_daemon(demo_model, data, *flags, prefix=pin(0), log_name="alone.log")
    follower = None
    try:
        health = httpx.get(alone.url + "/health", timeout=10).json()
        assert health["status"] == "degraded"
        assert "did not join within 1 s: serving on this machine alone" in health["reason"]
        assert ask(alone.url, key, "good morning", 4)[1] == 4
        # the machine comes back: rank 0, idle, restarts to serve with it
        follower = start_follower(hosts, demo_model, tmp_path / "r1", int(port))
        assert alone.proc.wait(60) == ENGINE_DOWN_EXIT
        assert "is back: restarting to serve the model on both machines" in \
            alone.log.read_text()
        again = start_daemon(demo_model, data, *flags[:-2], "--join-timeout", "30",
                             prefix=pin(0), wait=False, log_name="again.log")
        wait_up(again)
        health = httpx.get(again.url + "/health", timeout=10).json()
        assert health["status"] == "ok" and len(health["distributed"]["ranks"]) == 2
        assert ask(again.url, key, "good morning", 4)[1] == 4
        assert again.terminate() == 0
        assert follower.proc.wait(30) == 0
    finally:
        if follower is not None:
            follower.stop()
        if alone.proc.poll() is None:
            alone.kill()


def test_rank_0_gives_up_when_the_model_does_not_fit_alone(
        household: tuple[Path, str], demo_model: Path, tmp_path: Path) -> None:
    from tests.distributed.group import hostfile

    data, _ = household
    hosts = hostfile(tmp_path / "hosts.json")
    small = start_daemon(demo_model, data, "--distributed", str(hosts), "--join-timeout", "1",
                         "--memory-budget", "100000", wait=False, log_name="small.log")
    assert small.proc.wait(120) != 0
    assert "does not fit this machine's budget" in small.log.read_text()


def test_a_machine_with_another_model_is_refused(household: tuple[Path, str],
                                                 demo_model: Path, tmp_path: Path) -> None:
    from tests.engine.arch_models import build

    data, _ = household
    other = build(tmp_path / "other", demo_model, "qwen2")
    group_hosts = tmp_path / "hosts.json"
    from tests.distributed.group import hostfile

    hostfile(group_hosts)
    port = free_port()
    rank0 = start_daemon(demo_model, data, "--distributed", str(group_hosts), "--control-port",
                         str(port), "--join-timeout", "3", wait=False, log_name="refuse0.log")
    rank1 = start_follower(group_hosts, other, tmp_path / "r1", port)
    try:
        assert rank1.proc.wait(60) == 78
        assert "fingerprints differ" in rank1.log.read_text()
        wait_until(lambda: "serving on this machine alone" in rank0.log.read_text(), 60,
                   "rank 0 alone")
    finally:
        rank1.stop()
        rank0.kill()


def test_a_model_that_does_not_ride_is_refused_at_start(demo_model: Path,
                                                         tmp_path: Path) -> None:
    """Checked before anyone is waited for (in this process: the daemon's start reports
    the same message, as the not-fitting model above shows for its own)."""
    from mlx_lm import load

    from appliance.distributed.group import Coordinator
    from appliance.distributed.hostfile import read
    from appliance.settings import DistributedSettings
    from tests.conftest import free_port
    from tests.distributed.group import hostfile
    from tests.engine.arch_models import build

    gemma = build(tmp_path / "gemma", demo_model, "gemma3_text")
    group = Coordinator(read(hostfile(tmp_path / "hosts.json")),
                        DistributedSettings(control_port=free_port(), join_timeout=1.0),
                        gemma, {})
    try:
        with pytest.raises(RuntimeError, match="gemma3_text models cannot be served across "
                                               "machines"):
            group.split(load(str(gemma), lazy=True)[0])
    finally:
        group.close()
