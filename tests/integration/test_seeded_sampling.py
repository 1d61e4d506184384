"""A seeded sample is the same text cold, warm, for another user and batched (issue 52,
item 2), on the real SmolLM2: its cached and uncached prefills give logits ~1e-3 apart."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers import LiveServer, live_server, make_settings

STORY = "Tell me a long story about the kitchen lights and the garden please, with many words in it"
OTHER = "Write a poem about a rainy Tuesday and a lost umbrella"


@pytest.fixture(scope="module")
def server(smollm2: Path) -> Iterator[LiveServer]:
    with live_server(make_settings(smollm2)) as s:
        yield s


def _ask(server: LiveServer, who: str, text: str) -> tuple[str, int]:
    with server.client(who) as c:
        r = c.post("/v1/chat/completions", json={
            "model": server.engine.loaded.name,  # type: ignore[attr-defined]
            "messages": [{"role": "user", "content": text}],
            "seed": 7, "temperature": 1.2, "max_tokens": 32})
        assert r.status_code == 200, r.text
        body = r.json()
        return (body["choices"][0]["message"]["content"],
                body["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_a_seeded_sample_is_the_same_cold_warm_for_another_user_and_batched(
        server: LiveServer) -> None:
    cold, cached = _ask(server, "bob", STORY)
    assert cached == 0
    warm, cached = _ask(server, "bob", STORY)
    assert cached > 0, "the second call should read its prompt from the cache"
    with ThreadPoolExecutor(2) as pool:  # carol's first call shares the batch with bob's
        carol = pool.submit(_ask, server, "carol", STORY)
        pool.submit(_ask, server, "bob", OTHER).result()
        batched, cached = carol.result()
    assert cached == 0
    assert len(cold) > 20
    assert warm == cold
    assert batched == cold
