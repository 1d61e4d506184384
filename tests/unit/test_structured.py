"""Schemas made bounded before they become grammars: numbers get digit limits and listed
objects get no extra keys, so a small model's answer ends as JSON (pure: no tokenizer)."""

from __future__ import annotations

from typing import Any

import pytest

from appliance.service.errors import InvalidRequest
from appliance.service.structured import (
    FRACTION_DIGITS,
    INT_DIGITS,
    bounded,
    grammar_for,
    tag_term,
    tool_call_grammar,
)

BOUND = 10 ** INT_DIGITS - 1
HA_AI_TASK = {"type": "object", "properties": {
    "summary": {"type": "string", "description": "One sentence"},
    "lights_on": {"type": "integer"}}, "required": ["summary", "lights_on"]}


def test_it_bounds_home_assistants_integer_and_closes_the_object() -> None:
    out = bounded(HA_AI_TASK)
    assert out["properties"]["lights_on"] == {"type": "integer", "minimum": -BOUND,
                                              "maximum": BOUND}
    assert out["additionalProperties"] is False
    assert "additionalProperties" not in HA_AI_TASK  # the request's schema is not changed
    grammar_for(HA_AI_TASK)  # and it still compiles


def test_it_keeps_the_clients_own_bounds_and_steps() -> None:
    out = bounded({"type": "number", "minimum": 0, "multipleOf": 0.5})
    assert out == {"type": "number", "minimum": 0, "maximum": BOUND, "multipleOf": 0.5}
    far = bounded({"type": "integer", "exclusiveMinimum": 10 ** 18})
    assert far["maximum"] == 10 ** 18 + BOUND  # still satisfiable
    assert bounded({"type": "integer", "maximum": -(10 ** 18)})["minimum"] < -(10 ** 18)


def test_it_bounds_number_decimals_and_nullable_numbers() -> None:
    out = bounded({"type": ["number", "null"]})
    assert out["multipleOf"] == 10.0 ** -FRACTION_DIGITS
    assert out["minimum"] == -BOUND and out["maximum"] == BOUND
    assert bounded({"type": "integer", "enum": [1, 2]}) == {"type": "integer", "enum": [1, 2]}


def test_it_reaches_nested_arrays_definitions_and_alternatives() -> None:
    schema: dict[str, Any] = {
        "$defs": {"n": {"type": "integer"}},
        "type": "object", "additionalProperties": True, "properties": {
            "xs": {"type": "array", "items": {"type": "number"}},
            "pick": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "string"}]}}}
    out = bounded(schema)
    assert out["$defs"]["n"]["maximum"] == BOUND
    assert out["properties"]["xs"]["items"]["maximum"] == BOUND
    assert out["additionalProperties"] is True  # what the client said is kept


def test_parts_of_all_of_keep_their_extra_keys() -> None:
    schema = {"allOf": [{"type": "object", "properties": {"a": {"type": "string"}}},
                        {"type": "object", "properties": {"b": {"type": "string"}}}]}
    assert all("additionalProperties" not in part for part in bounded(schema)["allOf"])


class _Tokenizer:
    """What tag_term reads of an mlx-lm wrapper: the HF tokenizer's added tokens."""

    def __init__(self, added: dict[str, int]) -> None:
        self._tokenizer = self
        self._added = added

    def get_added_vocab(self) -> dict[str, int]:
        return self._added


def test_a_tag_that_is_one_added_token_is_named_by_its_id() -> None:
    demo = _Tokenizer({"<tool_call>": 4094, "</tool_call>": 4095})
    assert tag_term(demo, "<tool_call>") == "<[4094]>"
    assert tag_term(_Tokenizer({}), "<tool_call>") == '"<tool_call>"'
    grammar = tool_call_grammar(
        [{"type": "function", "function": {"name": "f", "parameters": HA_AI_TASK}}],
        start=(tag_term(demo, "<tool_call>"), '"\\n"'),
        end=('"\\n"', tag_term(demo, "</tool_call>")))
    assert "<[4094]>" in grammar and "<[4095]>" in grammar


def test_a_schema_nested_too_deeply_is_a_400_not_a_crash() -> None:
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(3000):
        deep = {"type": "object", "properties": {"a": deep}}
    for make, param in ((lambda: grammar_for(deep), "response_format"),
                        (lambda: tool_call_grammar([{"type": "function", "function": {
                            "name": "f", "parameters": deep}}]), "tools")):
        with pytest.raises(InvalidRequest) as err:
            make()
        assert err.value.param == param
