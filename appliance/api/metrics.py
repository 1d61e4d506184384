"""``GET /metrics``: Prometheus text format, read from the engine's snapshot (admins only;
a Prometheus scraper uses an admin's API key as a bearer token)."""

from __future__ import annotations

from collections.abc import Iterator

from litestar import Response, get
from litestar.datastructures import State
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from appliance.api.auth import admin_only
from appliance.service.services import Services

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class SnapshotCollector(Collector):
    def __init__(self, services: Services) -> None:
        self.services = services

    def collect(self) -> Iterator[Metric]:
        snap = self.services.engine.snapshot
        gauges: dict[str, tuple[str, float]] = {
            "appliance_active_sequences": ("Sequences prefilling or decoding.", snap.active),
            "appliance_queued_requests": ("Requests waiting for a slot.", snap.queued),
            "appliance_kv_bytes": ("Bytes held by live KV caches.", snap.kv_bytes),
            "appliance_max_batch_size": ("Most sequences at once.",
                                         self.services.max_batch_size),
        }
        writer, health = self.services.writer, self.services.store.health
        gauges["appliance_store_writable"] = (
            "1 while the database takes writes; 0 during a storage fault (disk full, "
            "read-only file, I/O error).", 0.0 if health.faulted else 1.0)
        if writer is not None:
            gauges["appliance_store_ledger_backlog"] = (
                "Ledger rows kept in memory until the database takes them.",
                writer.stats.backlog)
        budget = self.services.engine.kv_budget_bytes
        if budget is not None:
            gauges["appliance_kv_budget_bytes"] = ("KV cache budget.", budget)
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters: dict[str, tuple[str, float]] = {
            "appliance_requests_finished": ("Requests finished (any reason).", snap.completed),
            "appliance_prompt_tokens": ("Prompt tokens computed.", snap.prompt_tokens_total),
            "appliance_generated_tokens": ("Output tokens generated.",
                                           snap.generated_tokens_total),
            "appliance_preemptions": ("Sequences preempted.", snap.preemptions_total),
            "appliance_request_errors": ("Requests ended by an error.", snap.errors_total),
            "appliance_requests_cancelled": ("Requests cancelled.", snap.cancelled_total),
            "appliance_store_faults": ("Database errors that were storage faults.",
                                       self.services.store.health.faults_total),
            "appliance_engine_ticks": ("Engine ticks run.", snap.ticks),
            "appliance_engine_ticks_over_target": (
                "Engine ticks that took more than twice their time target.",
                snap.ticks_over_target),
            "appliance_engine_mixed_forwards": (
                "Decode steps that read prompt chunks in their own forward.",
                snap.mixed_forwards),
            "appliance_engine_draft_tokens": (
                "Draft tokens (prompt lookup) lone streams verified.", snap.draft_tokens),
            "appliance_engine_draft_tokens_kept": (
                "Draft tokens that came true and were kept.", snap.draft_tokens_kept),
            "appliance_embedding_tokens": ("Embedding input tokens read.",
                                           self.services.engine.embedding_tokens),
            "appliance_embeddings_cancelled": (
                "Embeddings whose client left before they were read.",
                self.services.engine.embeddings_cancelled),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
        vtc = GaugeMetricFamily("appliance_user_virtual_tokens",
                                "Fairness counter of each user.", labels=["user_id"])
        for user, value in sorted(snap.counters.items()):
            vtc.add_metric([user], value)
        yield vtc


@get("/metrics", guards=[admin_only], sync_to_thread=False)
def metrics(state: State) -> Response[bytes]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(state.services))
    registry.register(state.services.latency)
    return Response(generate_latest(registry), media_type=CONTENT_TYPE)


ROUTES = [metrics]
