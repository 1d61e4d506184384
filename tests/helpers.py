"""Test helpers: an in-process daemon on a real loopback port."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from argon2 import PasswordHasher

from appliance import settings as settings_mod
from appliance.daemon import Daemon, build_daemon, serve_in_thread
from appliance.engine.core import Engine
from appliance.engine.request import FaultHook
from appliance.settings import Settings
from appliance.store import keys, users
from appliance.store.db import Store
from appliance.store.writer import StoreWriter

FAST_HASHER = PasswordHasher(time_cost=1, memory_cost=1024, parallelism=1)
PEOPLE = {"alice": "admin", "bob": "member", "carol": "member"}
PASSWORD = "correct horse battery"
_DATA_DIRS: list[str] = []

NATIVE: bool = settings_mod.load(
    env={k: v for k, v in os.environ.items() if k == "APPLIANCE_NATIVE"}).engine.native
"""The native-code switch for in-process engines, as ``appliance serve`` reads it from the
environment: CI runs the engine and API tests once more with APPLIANCE_NATIVE=off."""


@atexit.register
def _remove_data_dirs() -> None:
    """The data directories ``make_settings`` made go when the test process ends (a suite
    run used to leave about 150 behind in the temp directory)."""
    for path in _DATA_DIRS:
        shutil.rmtree(path, ignore_errors=True)


def make_settings(model: Path, **overrides: Any) -> Settings:
    s = Settings()
    s.engine.model = str(model)
    s.store.data_dir = tempfile.mkdtemp(prefix="appliance-test-")
    _DATA_DIRS.append(s.store.data_dir)
    s.engine.debug_invariants = True  # the scheduler's invariants checked on every tick
    s.engine.native = NATIVE
    # no background title request after each first answer, unless a test asks for them:
    # it would take a slot and tokens that tests of queues and quotas do not expect
    s.server.chat_titles = False
    for key, value in overrides.items():
        for section in (s.server, s.engine, s.sched, s.store, s.jobs):
            if hasattr(section, key):
                setattr(section, key, value)
                break
        else:
            raise KeyError(key)
    return s


@dataclass
class LiveServer:
    url: str
    engine: Engine
    store: Store
    writer: StoreWriter
    keys: dict[str, str]
    """Plaintext API key of each persona (alice admin, bob and carol members)."""
    user_ids: dict[str, int]
    daemon: Daemon

    @property
    def services(self) -> Any:
        """The app's ``Services``."""
        return self.daemon.services

    @property
    def jobs(self) -> Any:
        """The job scheduler (``JobService``) the jobs tests reach into."""
        return self.daemon.jobs

    def client(self, who: str | None = None, **kw: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.keys[who]}"} if who else {}
        return httpx.Client(base_url=self.url, timeout=60, headers=headers, **kw)


def add_household(store: Store) -> tuple[dict[str, str], dict[str, int]]:
    plain: dict[str, str] = {}
    ids: dict[str, int] = {}
    with store.sessions.begin() as s:
        for name, role in PEOPLE.items():
            user = users.create_user(s, name, PASSWORD, role=role, hasher=FAST_HASHER,
                                     max_class="voice" if role == "admin" else "interactive")
            _, plain[name] = keys.create_api_key(s, user, f"{name}-key")
            ids[name] = user.id
    return plain, ids


def wait_until(pred: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@contextmanager
def live_server(settings: Settings, fault: FaultHook | None = None) -> Iterator[LiveServer]:
    """The daemon as ``appliance serve`` assembles it (``build_daemon``), on a thread."""
    daemon = build_daemon(settings, fault=fault, secret="x" * 32, drain_timeout=1,
                          flush_interval=0.05, supervise_interval_s=0.1)
    plain, ids = add_household(daemon.store)
    served = serve_in_thread(daemon)
    try:
        yield LiveServer(served.url, daemon.engine, daemon.store, daemon.writer, plain, ids,
                         daemon)
    finally:
        served.stop()
