"""``/api/tags`` and ``/api/version`` never wait behind the engine: they answer while 16
streams saturate it; the request after a full queue gets Ollama's 503."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import ollama
import pytest

from appliance.engine.request import GenerationRequest
from tests.helpers import LiveServer, live_server, make_settings, wait_until

SLOW = 4321
"""num_predict the test hook slows to 50 ms a decode step (the streams stay running)."""


def _fault(request: GenerationRequest, phase: str) -> None:
    if request.max_tokens == SLOW:
        time.sleep(0.05)


@pytest.fixture()
def server(tiny_model: Path) -> Iterator[LiveServer]:
    with live_server(make_settings(tiny_model, ctx_size=8192, max_batch_size=4,
                                   max_queue_depth=12), fault=_fault) as s:
        yield s


def test_tags_and_version_answer_while_16_streams_saturate_the_engine(
        server: LiveServer) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go on"}],
            "options": {"num_predict": SLOW}}
    snap = lambda: server.engine.snapshot  # noqa: E731
    with ExitStack() as stack:
        def open_streams(n: int) -> None:
            for _ in range(n):
                client = stack.enter_context(server.client("bob"))
                r = stack.enter_context(client.stream("POST", "/api/chat", json=body))
                assert r.status_code == 200
        # the batch first, then the queue: 16 at once could find 12 still waiting for
        # admission and the 13th would (rightly) be told the queue is full
        open_streams(4)
        wait_until(lambda: snap().active == 4, 60, "a full batch")
        open_streams(12)
        wait_until(lambda: snap().active == 4 and snap().queued == 12, 60, "saturation")
        ha = ollama.Client(host=server.url, timeout=5,
                           headers={"Authorization": f"Bearer {server.keys['alice']}"})
        started = time.monotonic()
        assert [m.model for m in ha.list().models] == ["tiny:latest"]
        assert ha.ps().models
        with server.client("alice") as c:
            assert c.get("/api/version").status_code == 200
        assert time.monotonic() - started < 5.0
        with pytest.raises(ollama.ResponseError) as err:
            ha.chat(model="tiny", messages=[{"role": "user", "content": "x"}])
        assert err.value.status_code == 503 and "busy" in err.value.error
    # the streams were closed: their requests are cancelled and the engine drains
    wait_until(lambda: server.engine.snapshot.active == 0, 60, "cancelled streams")
