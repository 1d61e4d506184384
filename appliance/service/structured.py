"""Structured output: what a request asks its answer to look like, as an llguidance grammar.

A *constraint* is what the APIs accept: a JSON schema (OpenAI ``response_format`` of type
``json_schema``, Ollama ``format`` as a schema) or ``{"type": "json_object"}`` for any JSON
object (OpenAI ``json_object``, Ollama ``format: "json"``). :func:`grammar_for` turns it into
the grammar the engine enforces token by token (``GenerationRequest.grammar``), and refuses
with a 400 what llguidance cannot compile. No MLX here: the engine builds the matcher (and
checks at admission that it can run it, ``Engine.check_grammar``).

Numbers are bounded (:func:`bounded`): at most ``INT_DIGITS`` digits before the point and
``FRACTION_DIGITS`` after it, as llama.cpp's grammars (and so Ollama) bound them. A small
model asked for an integer otherwise writes ``7000...`` until max_tokens, and the answer is
not JSON.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

from appliance.service.errors import InvalidRequest

Constraint = dict[str, Any]
"""A JSON schema, or ``{"type": "json_object"}`` for any JSON object."""

JSON_OBJECT: Constraint = {"type": "json_object"}
_ANY_OBJECT: dict[str, Any] = {"type": "object"}
_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ",
                            "key_separator": ": "}
"""Answers are laid out as ``{"a": 1, "b": [2, 3]}``: one space after ``,`` and ``:``, no
newlines (a model cannot wander off into endless whitespace)."""

INT_DIGITS = 15
"""Digits before the point: every integer a float64 holds exactly."""
FRACTION_DIGITS = 6
_BOUND = 10 ** INT_DIGITS - 1
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_ONE = ("items", "additionalProperties", "then", "else", "if", "contains",
               "additionalItems", "unevaluatedProperties", "unevaluatedItems")


def schema_of(constraint: Constraint) -> dict[str, Any]:
    return _ANY_OBJECT if constraint == JSON_OBJECT else constraint


def bounded(schema: Any, merged: bool = False) -> Any:
    """``schema`` with every integer and number bounded to ``INT_DIGITS`` digits (and
    numbers to ``FRACTION_DIGITS`` decimals), where the schema leaves them open; a bound the
    schema sets is kept. An object that lists its ``properties`` and says nothing of
    ``additionalProperties`` gets no others, as llama.cpp's grammars (so Ollama) read it:
    else the model may append keys whose values nothing bounds. Not inside ``allOf``
    (``merged``), whose parts each list some of the properties. A copy: the request's own
    schema is not changed."""
    if isinstance(schema, list):
        return [bounded(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [bounded(s, merged or key == "allOf") for s in out[key]]
    if (isinstance(out.get("properties"), dict) and not merged and "allOf" not in out
            and not {"additionalProperties", "patternProperties",
                     "unevaluatedProperties"} & out.keys()):
        out["additionalProperties"] = False
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: bounded(s) for k, s in out[key].items()}
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), dict | list):
            out[key] = bounded(out[key])
    kinds = out.get("type")
    kinds = set(kinds) if isinstance(kinds, list) else {kinds}
    if kinds & {"integer", "number"} and "enum" not in out and "const" not in out:
        _bound_numbers(out, fraction="number" in kinds)
    return out


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        else None


def _bound_numbers(schema: dict[str, Any], fraction: bool) -> None:
    lo = _number(schema.get("minimum", schema.get("exclusiveMinimum")))
    hi = _number(schema.get("maximum", schema.get("exclusiveMaximum")))
    if lo is None:  # below the other bound, if that one is already far out
        schema["minimum"] = -_BOUND if hi is None or hi > -_BOUND else int(hi) - _BOUND
    if hi is None:
        schema["maximum"] = _BOUND if lo is None or lo < _BOUND else int(lo) + _BOUND
    if fraction and "multipleOf" not in schema:
        schema["multipleOf"] = 10.0 ** -FRACTION_DIGITS


def grammar_for(constraint: Constraint, param: str = "response_format") -> str:
    """The llguidance grammar for a constraint; a 400 when it cannot be compiled."""
    if not isinstance(constraint, dict):
        raise InvalidRequest("A JSON schema must be a JSON object.", param=param)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(bounded(schema_of(constraint))),
            defaults=_OPTIONS)  # type: ignore[arg-type]
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(f"Invalid JSON schema: {exc}", param=param) from None
    except RecursionError:
        raise InvalidRequest("The JSON schema is nested too deeply.", param=param) from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidRequest(f"This JSON schema is not supported: {error}", param=param)
    return grammar


def tag_term(tokenizer: Any, text: str) -> str:
    """``text`` as a Lark term: the token itself (``<[id]>``) where the tokenizer has
    ``text`` as one added token, as Qwen's and the demo model's ``<tool_call>`` are; a
    string otherwise. llguidance never lets text spell an added token: the string form made
    every forced call on such a model fail at its first token."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's wrapper holds the HF one
    added = getattr(hf, "get_added_vocab", None)
    token = added().get(text) if callable(added) else None
    return f"<[{int(token)}]>" if isinstance(token, int) else json.dumps(text)


def tool_call_grammar(tools: list[dict[str, Any]], names: list[str] | None = None,
                      arguments_key: str = "arguments", start: tuple[str, ...] = (),
                      end: tuple[str, ...] = ()) -> str:
    """A grammar for an answer that is exactly one tool call in the model's syntax:
    ``start`` + ``{"name": ..., "<arguments_key>": {...}}`` + ``end`` (Lark terms, see
    :func:`tag_term`; none for Llama's bare JSON), naming one of ``names`` (any tool when
    None), with arguments that follow that tool's parameter schema (numbers bounded)."""
    options = []
    for tool in tools:
        fn = tool.get("function") or {}
        name = fn.get("name")
        if not isinstance(name, str) or (names is not None and name not in names):
            continue
        try:
            params = bounded(fn.get("parameters") or {"type": "object"})
        except RecursionError:
            raise InvalidRequest("A tool's parameters are nested too deeply.",
                              param="tools") from None
        options.append({"type": "object", "properties": {
            "name": {"const": name}, arguments_key: params},
            "required": ["name", arguments_key], "additionalProperties": False})
    if not options:
        raise InvalidRequest("tool_choice names a function that is not in 'tools'.",
                          param="tool_choice")
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    try:
        body = json.dumps({**schema, "x-guidance": _OPTIONS})
    except (ValueError, TypeError, RecursionError):
        raise InvalidRequest("A tool's parameters are not a JSON schema.", param="tools") from None
    lark = f"start: {' '.join([*start, 'call', *end])}\ncall: %json {body}\n"
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidRequest(f"These tools cannot be forced: {error}", param="tools")
    return grammar
