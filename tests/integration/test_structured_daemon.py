"""Structured output on the bundled demo model through a started `appliance serve`: forced
tool calls (its `<tool_call>` is one token), Home Assistant's AI Task schema with an
integer (bounded, so the answer ends as JSON), and schemas the engine cannot run refused at
admission with a 400 naming the field, with no schema text in the log."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.daemon import Daemon, make_household, start_daemon

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "home_assistant_requests.json"
AI_TASK = next(c for c in json.loads(FIXTURES.read_text()) if c["name"].startswith("AI Task"))
MARKER = "zeppelin_field_4471"
"""A property name in the refused schemas: it must never reach the log."""
TOOL = {"type": "function", "function": {
    "name": "HassTurnOn", "description": "Turns on a device or entity.",
    "parameters": {"type": "object", "properties": {"name": {"type": "string"}},
                   "required": ["name"]}}}
RECURSIVE = {"type": "object", "properties": {MARKER: {"$ref": "#"}}, "required": [MARKER]}


@pytest.fixture(scope="module")
def served(demo_model: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[Daemon, dict[str, str]]]:
    data = tmp_path_factory.mktemp("structured")
    keys = make_household(data)
    d = start_daemon(demo_model, data)
    try:
        yield d, keys
    finally:
        d.terminate()


def _chat(served: tuple[Daemon, dict[str, str]], path: str, body: dict[str, Any]) -> Any:
    d, keys = served
    with d.client(keys["bob"]) as c:
        return c.post(path, json=body)


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "HassTurnOn"}}])
def test_a_forced_tool_call_on_the_demo_model_answers_with_a_call(
        served: tuple[Daemon, dict[str, str]], choice: Any) -> None:
    r = _chat(served, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hello"}], "tools": [TOOL],
        "tool_choice": choice, "max_tokens": 100})
    assert r.status_code == 200, r.text
    choice0 = r.json()["choices"][0]
    assert choice0["finish_reason"] == "tool_calls"
    call = choice0["message"]["tool_calls"][0]["function"]
    assert call["name"] == "HassTurnOn"
    jsonschema.validate(json.loads(call["arguments"]), TOOL["function"]["parameters"])


def test_home_assistants_ai_task_with_an_integer_gets_parseable_json(
        served: tuple[Daemon, dict[str, str]]) -> None:
    body = json.loads(json.dumps(AI_TASK["body"]).replace('"{model}"', '"demo_model:latest"'))
    r = _chat(served, "/api/chat", body)
    assert r.status_code == 200, r.text
    chunks = [json.loads(line) for line in r.text.splitlines()]
    assert chunks[-1]["done_reason"] == "stop"
    answer = json.loads("".join(c["message"]["content"] for c in chunks))
    jsonschema.validate(answer, body["format"])
    assert isinstance(answer["lights_on"], int)


def test_a_strict_json_schema_with_numbers_ends_as_json(
        served: tuple[Daemon, dict[str, str]]) -> None:
    schema = {"type": "object", "properties": {"lights_on": {"type": "integer"},
                                               "temperature": {"type": "number"}},
              "required": ["lights_on", "temperature"], "additionalProperties": False}
    r = _chat(served, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "How many lights are on?"}],
        "max_tokens": 120, "response_format": {"type": "json_schema", "json_schema": {
            "name": "state", "strict": True, "schema": schema}}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)


@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": RECURSIVE}}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#", "title": MARKER}}}}, "response_format"),
    ("/api/chat", {"format": {"$ref": "#", "title": MARKER}, "stream": False}, "format"),
    ("/v1/chat/completions", {"tool_choice": "required", "tools": [{
        "type": "function", "function": {"name": MARKER, "parameters": {"$ref": "#"}}}]},
     "tools"),
])
def test_a_schema_the_engine_cannot_run_is_a_400_naming_its_field(
        served: tuple[Daemon, dict[str, str]], path: str, extra: dict[str, Any],
        param: str) -> None:
    model = "default" if path.startswith("/v1") else "demo_model:latest"
    body = {"model": model, "max_tokens": 8,
            "messages": [{"role": "user", "content": "hello"}], **extra}
    r = _chat(served, path, body)
    assert r.status_code == 400, r.text
    if path.startswith("/v1"):
        assert r.json()["error"]["param"] == param
    else:
        assert "format" in r.json()["error"]
    plain = {k: v for k, v in body.items() if k not in extra or k == "stream"}
    ok = _chat(served, path, plain)
    assert ok.status_code == 200, ok.text  # still serving
    log = served[0].log.read_text()
    assert "grammar refused at admission user_id=" in log and f"param={param}" in log
    assert MARKER not in log and "$ref" not in log
