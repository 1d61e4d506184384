"""Home Assistant's Ollama integration against our ``/api``: its exact request bodies
replayed from fixtures, and its stream consumer (a re-implementation of
``homeassistant.components.ollama.entity._transform_stream``) run on our stream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import ollama
import pytest

from tests.helpers import LiveServer, live_server, make_settings

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "home_assistant_requests.json"
CASES: list[dict[str, Any]] = json.loads(FIXTURES.read_text())


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[LiveServer]:
    with live_server(make_settings(tiny_model, ctx_size=8192, default_max_tokens=6)) as s:
        yield s


def _body(case: dict[str, Any]) -> bytes:
    return json.dumps(case["body"]).replace('"{model}"', '"tiny:latest"').encode()


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_home_assistants_request_gets_the_expected_answer(server: LiveServer,
                                                          case: dict[str, Any]) -> None:
    with server.client("bob") as c, c.stream(
            "POST", "/api/chat", content=_body(case),
            headers={"content-type": "application/json"}) as r:
        raw = r.read().decode()
    assert r.status_code == case["status"], raw
    if r.status_code != 200:
        assert case["error"] in json.loads(raw)["error"]
        return
    chunks = [json.loads(line) for line in raw.splitlines()]
    assert chunks[-1]["done"] is True
    for chunk in chunks:  # what HA reads from every chunk
        message = chunk["message"]
        assert message["role"] == "assistant" and isinstance(message["content"], str)
        for call in message.get("tool_calls") or []:
            assert isinstance(call["function"]["arguments"], dict)


def _parse_tool_args(arguments: dict[str, Any]) -> dict[str, Any]:
    """HA drops empty arguments (``arguments.items()``: a string here would crash it)."""
    return {k: v for k, v in arguments.items() if v is not None and v != ""}


async def transform_stream(result: AsyncIterator[ollama.ChatResponse]
                           ) -> AsyncIterator[dict[str, Any]]:
    """HA's consumer: the role once, then per chunk the tool calls, content and thinking."""
    new_msg = True
    async for response in result:
        message = response["message"]
        chunk: dict[str, Any] = {}
        if new_msg:
            new_msg = False
            chunk["role"] = "assistant"
        if (tool_calls := message.get("tool_calls")) is not None:
            chunk["tool_calls"] = [(c["function"]["name"],
                                    _parse_tool_args(c["function"]["arguments"]))
                                   for c in tool_calls]
        if (content := message.get("content")) is not None:
            chunk["content"] = content
        if (thinking := message.get("thinking")) is not None:
            chunk["thinking_content"] = thinking
        yield chunk


async def _ha_round(server: LiveServer, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    client = ollama.AsyncClient(host=server.url, headers={
        "Authorization": f"Bearer {server.keys['bob']}"})
    stream = await client.chat(model="tiny:latest", messages=messages, tools=tools,
                               stream=True, keep_alive=-1, options={"num_ctx": 8192},
                               think=False)
    return [delta async for delta in transform_stream(stream)]


def test_home_assistants_stream_consumer_reads_our_stream(server: LiveServer) -> None:
    case = CASES[7]  # the second round: tool call and result in the history
    body = case["body"]
    deltas = asyncio.run(_ha_round(server, body["messages"], body["tools"]))
    assert deltas[0]["role"] == "assistant"
    assert all("role" not in d for d in deltas[1:])
    assert all(isinstance(d.get("content", ""), str) for d in deltas)
    text = "".join(d.get("content", "") for d in deltas)
    whole = ollama.Client(host=server.url, headers={
        "Authorization": f"Bearer {server.keys['bob']}"}).chat(
        model="tiny:latest", messages=body["messages"], tools=body["tools"], think=False)
    assert text == whole.message.content


@pytest.fixture(scope="module")
def demo_server(demo_model: Path) -> Iterator[LiveServer]:
    with live_server(make_settings(demo_model)) as s:
        yield s


def test_a_full_tool_round_with_the_demo_model(demo_server: LiveServer) -> None:
    """HA's own bodies, HA's consumer: "turn on the kitchen light" → a HassTurnOn call with
    object arguments → HA's tool result (content-less assistant turn, tool turn without
    tool_name) → a sentence."""
    model = ollama.Client(host=demo_server.url, headers={
        "Authorization": f"Bearer {demo_server.keys['bob']}"}).list().models[0].model
    assert model is not None
    first, second = CASES[0]["body"], CASES[7]["body"]

    async def round_(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        client = ollama.AsyncClient(host=demo_server.url, headers={
            "Authorization": f"Bearer {demo_server.keys['bob']}"})
        stream = await client.chat(model=model, messages=messages, tools=first["tools"],
                                   stream=True, keep_alive=-1, options={"num_ctx": 8192},
                                   think=False)
        return [delta async for delta in transform_stream(stream)]

    deltas = asyncio.run(round_(first["messages"]))
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert calls == [("HassTurnOn", {"name": "kitchen light"})], deltas
    assert "".join(d.get("content", "") for d in deltas).strip() == ""

    history = [*first["messages"], {"role": "assistant", "tool_calls": [
        {"function": {"name": name, "arguments": args}} for name, args in calls]},
        second["messages"][-1]]
    deltas = asyncio.run(round_(history))
    assert not [c for d in deltas for c in d.get("tool_calls", [])], deltas
    sentence = "".join(d.get("content", "") for d in deltas).strip()
    assert 2 <= len(sentence.split()) <= 15 and sentence.endswith((".", "!")), sentence


def test_a_tool_call_cut_by_the_token_limit_puts_no_tag_text_in_content(
        demo_server: LiveServer) -> None:
    """Issue 52, item 4: HA's first turn cut at 6 tokens, inside the demo model's call."""
    first = CASES[0]["body"]
    with demo_server.client("bob") as c:
        for path, limit in (("/api/chat", {"options": {"num_predict": 6}}),
                            ("/v1/chat/completions", {"max_tokens": 6})):
            r = c.post(path, json={"model": demo_server.engine.loaded.name,  # type: ignore[attr-defined]
                                   "messages": first["messages"], "tools": first["tools"],
                                   "stream": False, **limit})
            assert r.status_code == 200, r.text
            body = r.json()
            msg = body["message"] if path == "/api/chat" else body["choices"][0]["message"]
            assert "<tool_call>" not in (msg.get("content") or ""), body
            reason = body.get("done_reason") or body["choices"][0]["finish_reason"]
            assert reason == "length", body
