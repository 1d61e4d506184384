"""Liveness and batch figures: ``/health`` and ``/slots`` (read the engine's snapshot only)."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from litestar import Response, get
from litestar.datastructures import State

from appliance.api.auth import admin_only
from appliance.api.service import Services


@get("/health", sync_to_thread=False)
def health(state: State) -> Response[dict[str, Any]]:
    """Liveness: never fails because the server is busy; 503 with the reason when the engine
    is not serving (its thread died, or it stalled while requests wait)."""
    services: Services = state.services
    snap = services.engine.snapshot
    reason = services.engine.check()
    body: dict[str, Any] = {
        "status": "ok" if reason is None else "unavailable", "model": services.model.name,
        "demo_model": services.model.is_demo, "active": snap.active, "queued": snap.queued,
        "completed": snap.completed, "max_batch_size": services.max_batch_size,
        "uptime_s": round(time.time() - services.started_at, 1)}
    loaded = services.engine.loaded
    if loaded is not None:  # what computes: appliance/backend
        body["backend"] = loaded.backend.describe()
    if reason is not None:
        body["reason"] = reason
        return Response(body, status_code=503, headers={"Retry-After": "10"})
    return Response(body)


@get("/slots", sync_to_thread=False, guards=[admin_only])
def slots(state: State) -> dict[str, Any]:
    services: Services = state.services
    snap = services.engine.snapshot
    return {"max_batch_size": services.max_batch_size, "active": snap.active,
            "queued": snap.queued, "kv_bytes": snap.kv_bytes,
            "slots": [asdict(s) for s in snap.slots], "queue": [asdict(s) for s in snap.queue]}


@get("/v1/cache/stats", sync_to_thread=False)
def cache_stats(state: State) -> dict[str, Any]:
    """The prompt cache: entries, bytes, lookups, hits, tokens reused, evictions."""
    stats = state.services.engine.snapshot.prompt_cache
    return {"enabled": stats is not None, **(stats or {})}


ROUTES = [health, slots, cache_stats]
