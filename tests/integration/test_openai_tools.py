"""Tools, tool_choice, response_format and thinking on /v1, through the real `openai` client,
including the calls Home Assistant's llama.cpp integration makes (HA 2026.8+)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.helpers import LiveServer, live_server, make_settings

LIGHT_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "HassTurnOn", "description": "Turns on a device or entity.",
    "parameters": {"type": "object", "properties": {
        "name": {"type": "string", "enum": ["kitchen light", "hall lamp"]},
        "domain": {"type": "array", "items": {"type": "string", "enum": ["light"]},
                   "maxItems": 1}},
        "required": ["name", "domain"], "additionalProperties": False}}}
OFF_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "HassTurnOff", "description": "Turns off a device or entity.",
    "parameters": {"type": "object", "properties": {
        "name": {"type": "string", "enum": ["kitchen light"]}}, "required": ["name"],
        "additionalProperties": False}}}
DUMMY_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "test_tool", "description": "A test tool",
    "parameters": {"type": "object", "properties": {}}}}
FORCE_LIGHT = {"type": "function", "function": {"name": "HassTurnOn"}}


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[LiveServer]:
    with live_server(make_settings(tiny_model, ctx_size=2048)) as s:
        yield s


@pytest.fixture()
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.keys["bob"], max_retries=0)


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def test_the_llama_cpp_integration_probe_answers_streamed_and_not(
        client: openai.OpenAI) -> None:
    models = client.models.list()
    model = models.data[0].id
    reply = client.chat.completions.create(model=model, messages=_user("Test"),  # type: ignore[arg-type]
                                           tools=[DUMMY_TOOL], max_tokens=3)  # type: ignore[list-item]
    assert reply.choices[0].finish_reason in ("length", "stop", "tool_calls")
    chunks = list(client.chat.completions.create(
        model=model, messages=_user("Test"), tools=[DUMMY_TOOL], max_tokens=3,  # type: ignore[arg-type, list-item]
        stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("length", "stop", "tool_calls")


def _reassemble(chunks: list[Any]) -> tuple[dict[int, dict[str, str]], str | None]:
    """What HA's llama.cpp integration does: tool-call fragments joined by ``index``."""
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for c in chunks:
        if not c.choices:
            continue
        finish = c.choices[0].finish_reason or finish
        for tc in c.choices[0].delta.tool_calls or ():
            slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            slot["id"] += tc.id or ""
            slot["name"] += (tc.function.name or "") if tc.function else ""
            slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
    return calls, finish


def test_a_forced_tool_call_streams_by_index_with_string_arguments(
        client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model="default", messages=_user("turn on the kitchen light"), tools=[LIGHT_TOOL, OFF_TOOL],  # type: ignore[arg-type, list-item]
        tool_choice=FORCE_LIGHT, max_tokens=60, stream=True))  # type: ignore[arg-type]
    calls, finish = _reassemble(chunks)
    assert finish == "tool_calls"
    assert list(calls) == [0]
    assert calls[0]["name"] == "HassTurnOn" and calls[0]["id"].startswith("call_")
    args = json.loads(calls[0]["arguments"])
    jsonschema.validate(args, LIGHT_TOOL["function"]["parameters"])
    for c in chunks:  # no tag text anywhere in the content
        assert "<tool_call>" not in (c.choices[0].delta.content or "") if c.choices else True


def test_a_forced_call_not_streamed_and_the_tool_result_round(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="default", messages=_user("lights"), tools=[LIGHT_TOOL, OFF_TOOL],  # type: ignore[arg-type, list-item]
        tool_choice="required", max_tokens=60)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    call = choice.message.tool_calls[0]  # type: ignore[index]
    assert call.function.name in ("HassTurnOn", "HassTurnOff")  # type: ignore[union-attr]
    assert isinstance(json.loads(call.function.arguments), dict)  # type: ignore[union-attr]
    # HA sends the call back with string arguments and the result as a tool message
    follow = client.chat.completions.create(
        model="default", max_tokens=8, tools=[LIGHT_TOOL, OFF_TOOL],  # type: ignore[list-item]
        messages=[*_user("lights"),  # type: ignore[list-item]
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": call.id, "type": "function", "function": {
                          "name": call.function.name,  # type: ignore[union-attr]
                          "arguments": call.function.arguments}}]},  # type: ignore[union-attr]
                  {"role": "tool", "tool_call_id": call.id,
                   "content": json.dumps({"success": True})}])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_choice_none_sends_no_tools_and_parses_none(client: openai.OpenAI,
                                                         server: LiveServer) -> None:
    ban = {str(t): -100.0 for t in server.engine.loaded.eos_token_ids}  # type: ignore[attr-defined]
    reply = client.chat.completions.create(
        model="default", messages=_user("hi"), tools=[LIGHT_TOOL], tool_choice="none",  # type: ignore[arg-type, list-item]
        max_tokens=5, logit_bias=ban)
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.tool_calls is None


def test_response_format_json_schema_is_enforced(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {
        "room": {"type": "string", "enum": ["kitchen", "hall"]},
        "on": {"type": "boolean"}, "level": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["room", "on", "level"], "additionalProperties": False}
    for stream in (False, True):
        args: dict[str, Any] = dict(
            model="default", messages=_user("state as JSON"), max_tokens=60,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "state", "schema": schema}})
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(stream=True, **args) if c.choices)
        else:
            text = client.chat.completions.create(**args).choices[0].message.content or ""
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize(("extra", "param"), [
    ({"tool_choice": {"type": "function", "function": {"name": "Nope"}},
      "tools": [LIGHT_TOOL]}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "sometimes", "tools": [LIGHT_TOOL]}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"enable_thinking": True}, "enable_thinking"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "x"},
                   {"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                                         "function": {"name": "f",
                                                                      "arguments": "{oops"}}]}]},
     "messages"),
])
def test_bad_tool_and_format_requests_are_clear_400s(server: LiveServer, extra: dict[str, Any],
                                                     param: str) -> None:
    body = {"model": "default", "messages": _user("x"), "max_tokens": 2, **extra}
    with server.client("bob") as http:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
        assert http.get("/v1/models").status_code == 200  # still serving
