"""Structured output: what a request asks its answer to look like, as an llguidance grammar.

A *constraint* is what the APIs accept: a JSON schema (OpenAI ``response_format`` of type
``json_schema``, Ollama ``format`` as a schema) or ``{"type": "json_object"}`` for any JSON
object (OpenAI ``json_object``, Ollama ``format: "json"``). :func:`grammar_for` turns it into
the grammar the engine enforces token by token (``GenerationRequest.grammar``), and refuses
with a 400 what llguidance cannot compile. No MLX here: the engine builds the matcher.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

from appliance.api.errors import bad_request

Constraint = dict[str, Any]
"""A JSON schema, or ``{"type": "json_object"}`` for any JSON object."""

JSON_OBJECT: Constraint = {"type": "json_object"}
_ANY_OBJECT: dict[str, Any] = {"type": "object"}
_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ",
                            "key_separator": ": "}
"""Answers are laid out as ``{"a": 1, "b": [2, 3]}``: one space after ``,`` and ``:``, no
newlines (a model cannot wander off into endless whitespace)."""


def schema_of(constraint: Constraint) -> dict[str, Any]:
    return _ANY_OBJECT if constraint == JSON_OBJECT else constraint


def grammar_for(constraint: Constraint, param: str = "response_format") -> str:
    """The llguidance grammar for a constraint; a 400 when it cannot be compiled."""
    if not isinstance(constraint, dict):
        raise bad_request("A JSON schema must be a JSON object.", param=param)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema_of(constraint)), defaults=_OPTIONS)  # type: ignore[arg-type]
    except (ValueError, TypeError) as exc:
        raise bad_request(f"Invalid JSON schema: {exc}", param=param) from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise bad_request(f"This JSON schema is not supported: {error}", param=param)
    return grammar


def tool_call_grammar(start: str, end: str, tools: list[dict[str, Any]],
                      names: list[str] | None = None, arguments_key: str = "arguments") -> str:
    """A grammar for an answer that is exactly one tool call in the model's syntax:
    ``start`` + ``{"name": ..., "<arguments_key>": {...}}`` + ``end`` (both tags empty for
    Llama's bare JSON), naming one of ``names`` (any tool when None), with arguments that
    follow that tool's parameter schema."""
    options = []
    for tool in tools:
        fn = tool.get("function") or {}
        name = fn.get("name")
        if not isinstance(name, str) or (names is not None and name not in names):
            continue
        params = fn.get("parameters") or {"type": "object"}
        options.append({"type": "object", "properties": {
            "name": {"const": name}, arguments_key: params},
            "required": ["name", arguments_key], "additionalProperties": False})
    if not options:
        raise bad_request("tool_choice names a function that is not in 'tools'.",
                          param="tool_choice")
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    body = json.dumps({**schema, "x-guidance": _OPTIONS})
    parts = [json.dumps(t) for t in (start,) if t] + ["call"] + [
        json.dumps(t) for t in (end,) if t]
    lark = f"start: {' '.join(parts)}\ncall: %json {body}\n"
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise bad_request(f"These tools cannot be forced: {error}", param="tool_choice")
    return grammar
