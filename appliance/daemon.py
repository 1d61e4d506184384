"""The one assembly of the running daemon, used by ``appliance serve``, the tests and the
benchmarks alike, so what is tested is what ships.

``build_daemon(settings)`` migrates the database, opens the store, starts the store writer,
starts the engine with the persisted fairness state (counters, weights and the last day's
usage) and its supervisor, and builds the services and the HTTP app. ``Daemon.close()``
tears it down in the reverse order: stop the supervisor, drain the engine (its counters go to
the writer), flush and stop the writer, close the store. The app calls ``close`` in its
shutdown hook; calling it again is harmless. When the supervisor finds the engine down it
calls each of ``Daemon.on_engine_down`` (``appliance serve`` stops serving and exits 70).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from litestar import Litestar

from appliance.app import (
    app_secret,
    build_jobs,
    build_services,
    create_app,
    shutdown_engine,
    start_engine,
    supervise,
)
from appliance.engine.core import Engine
from appliance.engine.request import FaultHook
from appliance.engine.supervisor import Supervisor
from appliance.jobs.netguard import parse_allow_list
from appliance.jobs.runner import JobService
from appliance.jobs.schedule import household_zone
from appliance.service.services import Services
from appliance.settings import Settings
from appliance.store import migrate
from appliance.store.datadir import DatabaseWatch, take_backup
from appliance.store.db import Store, db_file, open_store
from appliance.store.writer import DEFAULT_FLUSH_INTERVAL_S, StoreWriter

log = logging.getLogger(__name__)


@dataclass
class Daemon:
    settings: Settings
    store: Store
    writer: StoreWriter
    engine: Engine
    services: Services
    jobs: JobService
    """The background job scheduler (started and stopped by the app's lifespan)."""
    drain_timeout: float
    """Seconds the engine's drain waits for running requests before cancelling them."""
    app: Litestar = field(init=False)
    supervisor: Supervisor | None = None
    on_engine_down: list[Callable[[str], None]] = field(default_factory=list)
    """Called (from the supervisor's thread) with the reason when the engine stops serving."""
    watch: DatabaseWatch | None = None
    """The database file's watch and periodic backup (``appliance.store.datadir``)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _closed: bool = False

    def drain(self) -> None:
        """Stop admitting, let running requests finish for up to ``drain_timeout``, then
        cancel the rest: before the HTTP server cancels its tasks, so every handler ends
        its answer itself (and each request's ledger row is written)."""
        shutdown_engine(self.engine, self.drain_timeout, stop=False)

    def close(self) -> None:
        """Drain the engine, flush and stop the writer, close the store (once)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.supervisor is not None:
                self.supervisor.stop()
            shutdown_engine(self.engine, self.drain_timeout)
            if self.watch is not None:
                self.watch.stop()
            self.writer.close()
            self.store.close()
            log.info("shut down cleanly")


def check_jobs(settings: Settings) -> None:
    """The jobs' time zone and allow-list, parsed once before anything starts."""
    household_zone(settings.jobs.timezone)
    parse_allow_list(settings.jobs.url_allow)


def build_daemon(settings: Settings, *, fault: FaultHook | None = None,
                 secret: str | None = None, drain_timeout: float | None = None,
                 flush_interval: float = DEFAULT_FLUSH_INTERVAL_S,
                 supervise_interval_s: float = 1.0, store_fault: Path | None = None) -> Daemon:
    """The running daemon from its settings (the model is loaded when this returns).
    ``store_fault``: the tests' storage fault control file (``appliance.store.faults``).
    A damaged database file raises ``migrate.DatabaseDamaged``, a missing one with a backup
    beside it ``datadir.DatabaseLost``, before anything starts."""
    check_jobs(settings)  # a typo in the time zone or allow-list stops the start
    path = db_file(settings.store.data_dir)
    migrate.check_database(path)  # raises migrate.DatabaseDamaged or datadir.DatabaseLost
    log.info("store: database backed up to %s", take_backup(path))  # known good: checked
    store = open_store(path, test_fault=store_fault)
    watch = DatabaseWatch(path, store.health,
                          backup_interval_s=settings.store.backup_interval_minutes * 60.0)
    writer = StoreWriter(store.sessions, flush_interval=flush_interval, health=store.health,
                         backlog_limit=settings.store.ledger_backlog)
    try:
        engine = start_engine(settings, fault=fault, writer=writer, store=store)
    except BaseException:
        writer.close()
        store.close()
        raise
    watch.start()
    services = build_services(settings, engine, store, writer)
    jobs = build_jobs(services, settings, writer)
    daemon = Daemon(settings, store, writer, engine, services, jobs,
                    settings.server.shutdown_timeout if drain_timeout is None else drain_timeout,
                    watch=watch)
    if secret is None:
        secret = app_secret(Path(settings.store.data_dir).expanduser())
    daemon.app = create_app(services, secret, on_shutdown=[daemon.close], jobs=jobs)

    def engine_down(reason: str) -> None:
        for hook in list(daemon.on_engine_down):
            hook(reason)

    daemon.supervisor = supervise(engine, engine_down, supervise_interval_s)
    supervisor = daemon.supervisor

    def group_lost(_reason: str) -> None:
        supervisor.step()  # at once, not at its next round

    engine.on_group_lost = group_lost
    return daemon


def settle_heap() -> int:
    """Collect once, then move every object alive now out of the cyclic collector's scans
    (``gc.freeze``): the loaded libraries, the model's wrappers and the app, about 176,000
    objects with the SmolLM-135M shape. A full collection over them took 83-91 ms on a
    2-core x86, taken on whichever thread allocated past the threshold, the engine's too,
    holding the GIL: serving the demo model's fairness phases, the engine thread ran two of
    124 and 127 ms (its ticks are about 5 ms); with the heap frozen, 9 and 11 ms. Objects
    made later are collected as before. Returns the objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def uvicorn_config(daemon: Daemon, host: str, port: int, nofile: int | None = None) -> Any:
    """How the daemon's app is served (the CLI in the foreground, tests in a thread);
    ``nofile``: the open-file limit (``raise_open_file_limit()`` in the CLI)."""
    import uvicorn

    from appliance.httpserver import server_options

    return uvicorn.Config(quiet_cancellation(daemon.app), host=host, port=port,
                          log_config=None, access_log=False,
                          lifespan="on",
                          timeout_graceful_shutdown=int(daemon.drain_timeout) or None,
                          **server_options(daemon.settings.server, nofile))


def draining_server(daemon: Daemon, config: Any) -> Any:
    """A uvicorn server that drains the engine first when told to exit (SIGTERM, SIGHUP):
    meanwhile it still answers, new model requests with 503 ``shutting_down``. Plain
    uvicorn waited for the connections while the engine went on admitting, then cancelled
    the handlers still running, each with a traceback."""
    import asyncio

    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            await asyncio.to_thread(daemon.drain)
            await super().shutdown(sockets)

    return DrainingServer(config)


def quiet_cancellation(app: Any) -> Any:
    """The ASGI app, where a request the server cancels at shutdown (still running after
    the drain: a body still arriving, a client not reading) ends with one log line rather
    than uvicorn's traceback."""
    import asyncio

    async def asgi(scope: Any, receive: Any, send: Any) -> None:
        try:
            await app(scope, receive, send)
        except asyncio.CancelledError:
            if scope.get("type") != "http":
                raise
            log.warning("shutdown: %s %s cancelled, still running after the drain",
                        scope.get("method"), scope.get("path"))

    return asgi


@dataclass
class ServerThread:
    """The daemon served by uvicorn on a thread of this process (tests, benchmarks)."""

    daemon: Daemon
    url: str
    port: int
    thread: threading.Thread
    server: Any

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10 + self.daemon.drain_timeout)
        self.daemon.close()


def serve_in_thread(daemon: Daemon, host: str = "127.0.0.1", port: int = 0,
                    timeout: float = 30.0) -> ServerThread:
    """Start serving on a loopback port (0: any free one) and wait until it listens."""

    server = draining_server(daemon, uvicorn_config(daemon, host, port))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            daemon.close()
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    return ServerThread(daemon, f"http://{host}:{bound}", bound, thread, server)
