"""The parts the daemon is assembled from: the engine thread (``start_engine``), what the
handlers share (``build_services``), the job scheduler (``build_jobs``) and the Litestar app
over them (``create_app``: routes, middleware, error mapping).

``appliance.daemon.build_daemon`` is the one assembly: it calls these in order, with the
store and its writer, and nothing else wires a running daemon. Engine tests call
``start_engine`` alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from litestar import Litestar
from litestar.config.csrf import CSRFConfig
from litestar.datastructures import State
from litestar.exceptions import HTTPException
from litestar.middleware import DefineMiddleware
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin
from litestar.plugins.jinja import JinjaTemplateEngine
from litestar.template.config import TemplateConfig
from sqlalchemy.exc import DatabaseError

from appliance import __version__
from appliance.api import (
    account,
    admin,
    embeddings,
    hooks,
    metrics,
    monitoring,
    ollama,
    openai,
)
from appliance.api import jobs as job_routes
from appliance.api.auth import PUBLIC_PATHS, AuthMiddleware, CsrfUnlessBearer
from appliance.api.errors import (
    LIMIT_ERROR_HANDLERS,
    ApiError,
    api_error_handler,
    database_error_handler,
    http_error_handler,
    internal_error_handler,
    service_error_handler,
    store_error_handler,
)
from appliance.api.headers import HtmlSecurityHeaders
from appliance.api.root import ollama_root
from appliance.engine.core import Engine, EngineConfig
from appliance.engine.model import resolve_model_path
from appliance.engine.request import FaultHook
from appliance.engine.supervisor import Supervisor
from appliance.jobs.runner import JobService
from appliance.sched.budget import TickObjectives
from appliance.sched.types import SchedulerConfig
from appliance.service import model_choice
from appliance.service.errors import ServiceError
from appliance.service.model_choice import model_info
from appliance.service.services import Services
from appliance.settings import Settings, parse_bytes
from appliance.store import fairness
from appliance.store.db import Store
from appliance.store.errors import AlreadyExists, LastAdmin, NotFound
from appliance.store.writer import StoreWriter
from appliance.vocab import Refused
from web.routes import ROUTES as WEB_ROUTES
from web.routes import setup as web_setup

TEMPLATES = Path(__file__).resolve().parent.parent / "web" / "templates"
CSRF_EXEMPT = ["^/v1", "^/api/", "^/hooks/", "^/health$"]

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 1024 * 1024


def engine_config(settings: Settings) -> EngineConfig:
    e = settings.engine
    return EngineConfig(
        model_path=resolve_model_path(e.model, settings.models_dir),
        ctx_size=e.ctx_size,
        fast_cpu_ops=e.fast_cpu_ops, native=e.native,
        max_queue_depth=settings.server.max_queue_depth,
        kv_cache_budget=parse_bytes(e.kv_cache_budget),
        prompt_cache_entries=e.prompt_cache_entries,
        stall_timeout_s=e.engine_stall_timeout,
        gather_s=e.gather_ms / 1000.0,
        draft_tokens=e.draft_tokens,
        scheduler=SchedulerConfig(
            max_batch_size=1 if e.no_batch else e.max_batch_size,
            prefill_chunk_size=e.prefill_chunk_size,
            prefill_grant_interval=e.prefill_grant_interval,
            policy=settings.sched.policy, w_in=settings.sched.w_in, w_out=settings.sched.w_out,
            aging_seconds=settings.sched.aging_seconds,
            background_reserve=settings.sched.background_reserve,
            kv_admission_watermark=e.kv_admission_watermark,
            enable_preemption=e.enable_preemption, preemption_policy=e.preemption_policy,
            class_preemption=e.class_preemption, share_preemption=e.share_preemption,
            check_invariants=e.debug_invariants,
            objectives=tick_objectives(settings)))


def tick_objectives(settings: Settings) -> TickObjectives:
    e = settings.engine
    return TickObjectives(itl_target_s=e.itl_target_ms / 1000.0, itl_factor=e.itl_factor,
                          ttft_target_s=e.ttft_target_ms / 1000.0, presence_s=e.presence_s,
                          arrival_tokens=e.arrival_tokens)


def start_engine(settings: Settings, fault: FaultHook | None = None,
                 writer: StoreWriter | None = None, store: Store | None = None) -> Engine:
    """Start the engine thread, wait until it has loaded the model, and give it the
    persisted fairness state (counters, weights, the last day's usage) when there is a
    store."""
    on_counters = None
    if writer is not None:
        def on_counters(values: dict[str, float]) -> None:
            writer.submit_counters({int(k): v for k, v in values.items() if k.isdigit()})
    config = engine_config(settings)
    chosen = None if store is None else model_choice.at_start(store, settings.engine.model)
    if chosen is not None:  # chosen on the Models page or by `appliance model use`
        log.info("serving the chosen model: path=%s", chosen)
        config = replace(config, model_path=chosen)
    if settings.distributed.hostfile:
        from appliance.distributed.group import Coordinator
        from appliance.distributed.hostfile import read as read_hostfile

        e = settings.engine
        config = replace(config, group=Coordinator(
            read_hostfile(settings.distributed.hostfile), settings.distributed,
            config.model_path, {"native": e.native, "fast_cpu_ops": e.fast_cpu_ops,
                                "max_rows": config.scheduler.max_batch_size},
            state_dir=Path(settings.store.data_dir).expanduser()))
    # the engine's record of each finished request is the ledger's row, as it is
    engine = Engine(config, fault=fault,
                    on_finish=writer.submit_ledger if writer is not None else None,
                    on_counters=on_counters)
    if store is not None:
        with store.read_sessions() as s:
            state = fairness.load_state(s, time.time())
        engine.usage.load(state.usage)
        # queued before the thread starts: applied before its first tick
        engine.restore_counters(state.counters)
        engine.set_weights(state.weights)
    engine.start()
    return engine


def supervise(engine: Engine, on_down: Callable[[str], None] | None = None,
              interval_s: float = 1.0) -> Supervisor:
    """Watch the engine thread (see :mod:`appliance.engine.supervisor`)."""
    return Supervisor(engine, on_down, interval_s).start()


def build_services(settings: Settings, engine: Engine, store: Store,
                   writer: StoreWriter | None = None) -> Services:
    loaded = engine.loaded
    assert loaded is not None, "start_engine returns once the model is loaded"
    info = model_info(loaded)

    def reload_weights() -> None:
        with store.read_sessions() as s:
            engine.set_weights(fairness.load_weights(s))

    services = Services(engine=engine, model=info, store=store, on_policy_change=reload_weights,
                        default_max_tokens=settings.engine.default_max_tokens,
                        max_batch_size=engine.config.scheduler.max_batch_size,
                        models_dir=settings.models_dir,
                        shared_idle_s=settings.server.shared_device_idle_minutes * 60.0,
                        pdf_read_seconds=settings.server.pdf_read_seconds,
                        pdf_read_memory_mb=settings.server.pdf_read_memory_mb,
                        chat_titles=settings.server.chat_titles,
                        note_key_used=writer.submit_key_used if writer is not None else None,
                        writer=writer, drain_s=settings.server.shutdown_timeout,
                        configured_model=settings.engine.model)
    return services


def build_jobs(services: Services, settings: Settings, writer: StoreWriter | None
               ) -> JobService:
    """The background job scheduler; ``create_app`` starts it in the lifespan."""
    flush = None if writer is None else (lambda: writer.flush(10))
    return JobService(services, settings.jobs, flush_ledger=flush)


def create_app(services: Services, secret: str,
               on_shutdown: Sequence[Callable[[], Any]] = (),
               jobs: JobService | None = None) -> Litestar:
    csrf = CSRFConfig(secret=secret, exclude=CSRF_EXEMPT, cookie_samesite="strict")
    app = Litestar(
        route_handlers=[*openai.ROUTES, *ollama.ROUTES, *embeddings.ROUTES, *hooks.ROUTES,
                        *monitoring.ROUTES,
                        *metrics.ROUTES, *account.ROUTES, admin.router, *job_routes.ROUTES,
                        *WEB_ROUTES],
        state=State({"services": services, "jobs": jobs}),
        # Outermost first: who is asking (401) before whether the form is genuine (403).
        middleware=[HtmlSecurityHeaders,
                    # OPTIONS too: an unauthenticated OPTIONS reached the admin guard (500)
                    DefineMiddleware(AuthMiddleware,
                                     exclude=[*PUBLIC_PATHS, *ollama.PUBLIC_PATHS],
                                     exclude_http_methods=()),
                    DefineMiddleware(CsrfUnlessBearer, config=csrf)],
        template_config=TemplateConfig(directory=TEMPLATES, engine=JinjaTemplateEngine),
        exception_handlers={
            ApiError: api_error_handler,
            ServiceError: service_error_handler,
            HTTPException: http_error_handler,
            NotFound: store_error_handler(404),
            AlreadyExists: store_error_handler(409),
            LastAdmin: store_error_handler(409),
            # input refused in words (a 400: store.errors.Invalid is one); any other
            # ValueError is a bug: a 500
            Refused: store_error_handler(400),
            **LIMIT_ERROR_HANDLERS,
            DatabaseError: database_error_handler,  # locked or storage fault: 503
            Exception: internal_error_handler,
        },
        # APScheduler's AsyncIOScheduler needs the running loop: started here; stopped
        # before anything else shuts down (before the engine drains). Litestar runs the
        # shutdown hooks last to first, so the jobs' hook goes at the end of the list.
        on_startup=[jobs.start] if jobs is not None else [],
        on_shutdown=[*on_shutdown, *([jobs.stop] if jobs is not None else [])],
        request_max_body_size=MAX_BODY_BYTES,
        logging_config=None,
        # JSON only: Litestar's Swagger/ReDoc pages load scripts from CDNs (offline here)
        openapi_config=OpenAPIConfig(title="The appliance", version=__version__,
                                     path="/schema", render_plugins=[JsonRenderPlugin()]),
    )
    web_setup(app)  # the pages' state, built once with the app
    # `GET|HEAD /` answers "Ollama is running" to API clients before routing and auth
    app.asgi_handler = ollama_root(app.asgi_handler)
    return app


def shutdown_engine(engine: Engine, timeout: float, *, stop: bool = True) -> None:
    """SIGTERM drain: stop admitting, let running requests finish, then cancel the rest
    (and stop the engine thread unless ``stop`` is False)."""
    engine.stop_admitting()
    if not engine.wait_idle(timeout):
        if engine.failure is not None:  # nothing left to drain: its requests were ended
            log.warning("no drain: the engine stopped serving (%s)", engine.failure)
        else:
            log.warning("drain timeout after %.0f s; cancelling what is left", timeout)
        engine.cancel_all()
        engine.wait_idle(5.0)  # the cancelled requests' last events reach their handlers
    if stop:
        engine.stop()


def app_secret(data_dir: Path) -> str:
    """A per-installation secret (CSRF tokens), made once and kept in the data folder.
    Created 0600 from its first byte (never readable by others between a write and a
    chmod) and whole: written beside, then linked into place, which fails if another
    process made it first (then theirs is read)."""
    import os
    import secrets

    path = data_dir / "secret.key"
    if not path.exists():
        data_dir.mkdir(parents=True, exist_ok=True)
        tmp = data_dir / f".secret.key.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(secrets.token_urlsafe(32))
                fh.flush()
                os.fsync(fh.fileno())
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    return path.read_text().strip()
