"""A real daemon process (`python -m appliance serve`) for end-to-end tests."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.conftest import free_port
from tests.helpers import wait_until

PASSWORD = "correct horse battery"


def cli(data_dir: Path, *args: str, stdin: str | None = None) -> str:
    env = {**os.environ, "APPLIANCE_DATA_DIR": str(data_dir)}
    out = subprocess.run([sys.executable, "-m", "appliance", *args], env=env, input=stdin,
                         capture_output=True, text=True, timeout=120, check=True)
    return out.stdout


def make_household(data_dir: Path) -> dict[str, str]:
    """alice (admin) and bob (member) through the CLI; returns their API keys."""
    cli(data_dir, "migrate")
    cli(data_dir, "user", "add", "alice", "--role", "admin", "--password-stdin",
        stdin=PASSWORD + "\n")
    cli(data_dir, "user", "add", "bob", "--password-stdin", stdin=PASSWORD + "\n")
    return {name: cli(data_dir, "key", "create", name).strip().splitlines()[-1]
            for name in ("alice", "bob")}


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    data_dir: Path

    def client(self, key: str) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60,
                            headers={"Authorization": f"Bearer {key}"})

    def terminate(self, timeout: float = 60) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(30)


def start_daemon(model: Path, data_dir: Path, *flags: str, log_name: str = "daemon.log",
                 env: dict[str, str] | None = None, prefix: tuple[str, ...] = (),
                 wait: bool = True, python: str = sys.executable, cwd: Path | None = None,
                 unset: tuple[str, ...] = ()) -> Daemon:
    """``prefix``: what runs the interpreter (``taskset -c 0``); without ``wait`` the
    daemon is returned as soon as it is started (a group waits for its other machines).
    ``python``, ``cwd``: another interpreter (a wheel's venv) or directory (``-m`` imports
    from it); ``unset``: variables of this environment the daemon must not see."""
    port = free_port()
    log = data_dir / log_name
    env = {**{k: v for k, v in os.environ.items() if k not in unset},
           "APPLIANCE_DATA_DIR": str(data_dir), "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log, "ab") as fh:
        proc = subprocess.Popen(
            [*prefix, python, "-m", "appliance", "serve", "--model", str(model),
             "--port", str(port), *flags], env=env, cwd=cwd, stdout=fh,
            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    daemon = Daemon(proc, url, log, data_dir)
    if wait:
        wait_up(daemon)
    return daemon


def wait_up(daemon: Daemon, timeout: float = 120) -> None:
    """Until ``/health`` answers 200 (the daemon's exit or the time out raise)."""
    proc, url, log = daemon.proc, daemon.url, daemon.log

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"daemon exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            return httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(up, timeout, "daemon /health")
    except BaseException:
        proc.kill()  # never leave a half-started daemon behind
        proc.wait(30)
        raise


def ledger_ids(data_dir: Path) -> set[str]:
    """The request ids of the ledger rows a daemon wrote into ``data_dir``'s database."""
    con = sqlite3.connect(f"file:{data_dir / 'appliance.db'}?mode=ro", uri=True)
    try:
        return {r[0] for r in con.execute("SELECT request_id FROM ledger")}
    finally:
        con.close()
