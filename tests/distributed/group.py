"""Two machines on loopback for the tests: ``appliance serve --distributed`` (rank 0) and
``appliance join`` (rank 1), each pinned to a core of its own where there are two (a ring
operation polls: unpinned, the two ranks fight over a core)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.conftest import free_port
from tests.daemon import Daemon, start_daemon, wait_up


def pin(core: int) -> tuple[str, ...]:
    if shutil.which("taskset") and (os.cpu_count() or 1) >= 2:
        return ("taskset", "-c", str(core))
    return ()


@dataclass
class Follower:
    proc: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(30)


@dataclass
class Group:
    rank0: Daemon
    rank1: Follower
    hostfile: Path
    control_port: int

    def health(self) -> dict:
        return httpx.get(self.rank0.url + "/health", timeout=10).json()

    def stop(self) -> None:
        if self.rank0.proc.poll() is None:
            self.rank0.terminate()
        try:
            self.rank1.proc.wait(30)  # it leaves when rank 0 says stop
        except subprocess.TimeoutExpired:
            self.rank1.stop()


def hostfile(path: Path) -> Path:
    path.write_text(json.dumps([[f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{free_port()}"]]))
    return path


def start_follower(hosts: Path, model: Path, data_dir: Path, control_port: int,
                   *flags: str, log_name: str = "rank1.log") -> Follower:
    data_dir.mkdir(parents=True, exist_ok=True)
    log = data_dir / log_name
    env = {**os.environ, "APPLIANCE_DATA_DIR": str(data_dir), "PYTHONUNBUFFERED": "1"}
    with open(log, "ab") as fh:
        proc = subprocess.Popen(
            [*pin(1), sys.executable, "-m", "appliance", "join", str(hosts), "--rank", "1",
             "--model", str(model), "--control-port", str(control_port), *flags],
            env=env, stdout=fh, stderr=subprocess.STDOUT)
    return Follower(proc, log)


def start_group(model: Path, root: Path, *flags: str, follower_flags: tuple[str, ...] = (),
                hosts: Path | None = None, control_port: int | None = None,
                follower_model: Path | None = None, log_name: str = "rank0.log") -> Group:
    """Rank 0 in ``root`` (its database there) and rank 1 in ``root/rank1``, logging to
    ``log_name`` in each; returns once rank 0 serves."""
    hosts = hosts or hostfile(root / "hosts.json")
    port = control_port or free_port()
    rank0 = start_daemon(model, root, "--distributed", str(hosts), "--control-port",
                         str(port), *flags, prefix=pin(0), wait=False, log_name=log_name)
    rank1 = start_follower(hosts, follower_model or model, root / "rank1", port,
                           *follower_flags, log_name=log_name)
    try:
        wait_up(rank0)
    except BaseException:
        rank1.stop()
        raise
    return Group(rank0, rank1, hosts, port)
