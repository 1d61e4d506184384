"""Test helpers: an in-process daemon on a real loopback port."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from appliance.app import build_services, create_app, shutdown_engine, start_engine
from appliance.engine.core import Engine, FaultHook
from appliance.settings import Settings


def make_settings(model: Path, **overrides: Any) -> Settings:
    s = Settings()
    s.engine.model = str(model)
    for key, value in overrides.items():
        for section in (s.server, s.engine, s.sched, s.store):
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

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kw)


def wait_until(pred: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@contextmanager
def live_server(settings: Settings, fault: FaultHook | None = None) -> Iterator[LiveServer]:
    from tests.conftest import free_port

    engine = start_engine(settings, fault=fault)
    services = build_services(settings, engine)
    app = create_app(services)
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None,
                            access_log=False, timeout_graceful_shutdown=1, lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 30, "server start")
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", engine)
    finally:
        server.should_exit = True
        thread.join(10)
        shutdown_engine(engine, 1)
