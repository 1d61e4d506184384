"""Liveness and batch figures: ``/health`` and ``/slots`` (read the engine's snapshot only)."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from litestar import Response, get
from litestar.datastructures import State

from appliance.api.auth import admin_only
from appliance.service.services import Services


@get("/health", sync_to_thread=False)
def health(state: State) -> Response[dict[str, Any]]:
    """Liveness: never fails because the server is busy; 503 with the reason when model
    requests are refused: the engine is not serving (its thread died, or it stalled while
    requests wait) or the ledger backlog is full. ``degraded`` (200) while the database
    takes no writes but answers can still be recorded later."""
    services: Services = state.services
    snap = services.engine.snapshot
    storage, refusal = storage_state(services)
    status, reason = "ok", services.engine.check()
    if reason is not None:
        status = "unavailable"
    elif refusal is not None:
        status, reason = "unavailable", f"storage unavailable: {refusal}"
    elif storage["error"] is not None:
        status = "degraded"
        reason = (f"storage: the database takes no writes ({storage['error']}: "
                  f"{storage['detail']}); {storage['ledger_backlog']} ledger rows kept")
    group = services.engine.group_status()
    if status == "ok" and group is not None and group["alone"] is not None:
        status, reason = "degraded", f"distributed: {group['alone']}"
    body: dict[str, Any] = {
        "status": status, "model": services.model.name, "demo_model": services.model.is_demo,
        "active": snap.active, "queued": snap.queued, "completed": snap.completed,
        "max_batch_size": services.max_batch_size,
        "uptime_s": round(time.time() - services.started_at, 1), "storage": storage}
    loaded = services.engine.loaded
    if loaded is not None:  # what computes: appliance/backend
        body["backend"] = loaded.backend.describe()
        body["kv_cache"] = {"dtype": loaded.kv_dtype,
                            "bytes_per_token": loaded.kv_bytes_per_token}
        # the model's resident weights (held once: appliance/backend/quant.py's adopt)
        # and the KV budget counted from what was free once they were
        body["memory"] = {"weights_bytes": loaded.weight_bytes,
                          "kv_budget_bytes": services.engine.kv_budget_bytes}
    if group is not None:  # the machines serving the model together
        body["distributed"] = group
    if reason is not None:
        body["reason"] = reason
    if status == "unavailable":
        return Response(body, status_code=503, headers={"Retry-After": "10"})
    return Response(body)


def storage_state(services: Services) -> tuple[dict[str, Any], str | None]:
    """The store's health for ``/health``, and why model requests are refused (or None)."""
    health = services.store.health
    writer = services.writer
    since = health.since
    state = {"error": health.fault, "detail": health.detail or None,
             "since_s": None if since is None else round(time.time() - since, 1),
             "ledger_backlog": writer.stats.backlog if writer is not None else 0,
             "ledger_backlog_limit": writer.backlog_limit if writer is not None else None}
    return state, writer.refusal() if writer is not None else None


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
