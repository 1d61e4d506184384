"""``create_app``: the one place where everything is wired together."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from litestar import Litestar
from litestar.datastructures import State
from litestar.exceptions import HTTPException

from appliance.api import monitoring, openai
from appliance.api.errors import (
    ApiError,
    api_error_handler,
    http_error_handler,
    internal_error_handler,
)
from appliance.api.service import ModelInfo, Services
from appliance.engine.core import Engine, EngineConfig, FaultHook
from appliance.engine.model import resolve_model_path
from appliance.sched.scheduler import SchedulerConfig
from appliance.settings import Settings

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 1024 * 1024


def engine_config(settings: Settings) -> EngineConfig:
    e = settings.engine
    return EngineConfig(
        model_path=resolve_model_path(e.model, settings.models_dir),
        ctx_size=e.ctx_size,
        max_queue_depth=settings.server.max_queue_depth,
        scheduler=SchedulerConfig(
            max_batch_size=1 if e.no_batch else e.max_batch_size,
            prefill_chunk_size=e.prefill_chunk_size,
            prefill_grant_interval=e.prefill_grant_interval,
            policy=settings.sched.policy))


def start_engine(settings: Settings, fault: FaultHook | None = None) -> Engine:
    """Start the engine thread and wait until it has loaded the model."""
    engine = Engine(engine_config(settings), fault=fault)
    engine.start()
    return engine


def build_services(settings: Settings, engine: Engine) -> Services:
    loaded: Any = engine.loaded
    info = ModelInfo(name=loaded.name, path=str(loaded.path), is_demo=loaded.is_demo,
                     ctx_limit=loaded.ctx_limit,
                     vocab_size=int(loaded.config.get("vocab_size") or 0) or 1 << 30,
                     tokenizer=loaded.tokenizer)
    return Services(engine=engine, model=info,
                    default_max_tokens=settings.engine.default_max_tokens,
                    max_batch_size=engine.config.scheduler.max_batch_size)


def create_app(services: Services,
               on_shutdown: Sequence[Callable[[], Any]] = ()) -> Litestar:
    return Litestar(
        route_handlers=[*openai.ROUTES, *monitoring.ROUTES],
        state=State({"services": services}),
        exception_handlers={
            ApiError: api_error_handler,
            HTTPException: http_error_handler,
            Exception: internal_error_handler,
        },
        on_shutdown=list(on_shutdown),
        request_max_body_size=MAX_BODY_BYTES,
        logging_config=None,
        openapi_config=None,
    )


def shutdown_engine(engine: Engine, timeout: float) -> None:
    """SIGTERM drain: stop admitting, let running requests finish, then cancel the rest."""
    engine.stop_admitting()
    if not engine.wait_idle(timeout):
        log.warning("drain timeout after %.0f s; cancelling what is left", timeout)
        engine.cancel_all()
    engine.stop()
