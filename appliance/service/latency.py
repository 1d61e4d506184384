"""Latency histograms for ``/metrics``: time to first token, inter-token latency, queue time
and end-to-end time, labelled by request ``class`` and ``api`` (``v1``, ``ollama``, ``hook``,
``jobs``, ``web``). The names are vLLM's (``vllm:time_to_first_token_seconds`` ...) with our
``appliance_`` prefix, in seconds.

Times are taken where the client's stream is written (the event loop), so they include the
hop from the engine thread: what a caller sees. Queue time is the engine's own (arrival to
first admission). Every submitted request is measured by :class:`Probe` through
``Generation.events()``; cancelled and failed requests count in TTFT and ITL (what they
streamed) but not in end-to-end time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import Histogram
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from appliance.engine.request import FinishEvent

BUCKETS = (0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5,
           5.0, 7.5, 10.0, 15.0, 20.0, 30.0)
LABELS = ("class", "api")
JOB_ENDPOINT = "job"
"""The ledger endpoint of a background job's requests (``appliance.jobs.runner``)."""


def api_label(endpoint: str) -> str:
    if endpoint.startswith("/v1/"):
        return "v1"
    if endpoint.startswith("/api/"):
        return "ollama"
    if endpoint.startswith("/hooks/"):
        return "hook"
    if endpoint == JOB_ENDPOINT:
        return "jobs"
    return "web"


class LatencyMetrics(Collector):
    """The four histograms of one daemon (not in prometheus_client's global registry)."""

    def __init__(self) -> None:
        def hist(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=BUCKETS, registry=None)

        self.ttft = hist("appliance_time_to_first_token_seconds",
                         "Time from request arrival to its first streamed token.")
        self.itl = hist("appliance_inter_token_latency_seconds",
                        "Time between two streamed tokens of one request.")
        self.queue = hist("appliance_request_queue_time_seconds",
                          "Time a request waited in the queue before its first admission.")
        self.e2e = hist("appliance_e2e_request_latency_seconds",
                        "Time from request arrival to its last token (finished requests).")

    def collect(self) -> Iterator[Metric]:
        for h in (self.ttft, self.itl, self.queue, self.e2e):
            yield from h.collect()

    def probe(self, klass: str, endpoint: str) -> Probe:
        return Probe(self, klass, api_label(endpoint))


class Probe:
    """Times one request as its events reach the event loop."""

    def __init__(self, metrics: LatencyMetrics, klass: str, api: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._m = metrics
        self._labels = (klass, api)
        self._clock = clock
        self.start = clock()
        self.first: float | None = None
        self._last: float | None = None

    def token(self) -> None:
        now = self._clock()
        if self.first is None:
            self.first = now
            self._m.ttft.labels(*self._labels).observe(now - self.start)
        elif self._last is not None:
            self._m.itl.labels(*self._labels).observe(now - self._last)
        self._last = now

    def finish(self, event: FinishEvent) -> None:
        if event.queue_s is not None:
            self._m.queue.labels(*self._labels).observe(event.queue_s)
        if event.reason.answered:
            self._m.e2e.labels(*self._labels).observe(self._clock() - self.start)
