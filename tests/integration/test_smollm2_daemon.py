"""Issue 52 on the real SmolLM2, one daemon: a seeded sample is the same text cold, warm, for
another user and batched (item 2: its cached and uncached prefills give logits ~1e-3
apart); its template drops tools, so a request with tools is a 400 in each API's words and
/api/show lists no tools (item 4)."""

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


LIGHT = {"type": "function", "function": {"name": "HassTurnOn", "parameters": {
    "type": "object", "properties": {"name": {"type": "string"}}}}}


def test_a_model_whose_template_drops_tools_refuses_them_in_both_apis(
        server: LiveServer) -> None:
    name = server.engine.loaded.name  # type: ignore[attr-defined]
    turns = [{"role": "user", "content": "Turn on the kitchen light."}]
    with server.client("bob") as c:
        r = c.post("/api/chat", json={"model": name, "messages": turns, "tools": [LIGHT],
                                      "stream": False})
        assert r.status_code == 400, r.text
        assert r.json() == {"error": f"{name}:latest does not support tools"}  # Ollama's
        r = c.post("/v1/chat/completions", json={"model": name, "messages": turns,
                                                 "tools": [LIGHT]})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "tools" and error["code"] == "unsupported_parameter"
        assert "'tools' is not supported with this model" in error["message"]
        shown = c.post("/api/show", json={"model": name}).json()
        assert "tools" not in shown["capabilities"]
        r = c.post("/v1/chat/completions", json={"model": name, "messages": turns,
                                                 "tools": [LIGHT], "tool_choice": "none",
                                                 "max_tokens": 1})
        assert r.status_code == 200, r.text  # tools left out of the prompt: nothing unseen
