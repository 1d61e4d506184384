"""Constrained decoding on the real engine: answers follow their JSON schema, batched rows
stay what they are alone, and a broken matcher ends only its own request."""

from __future__ import annotations

import json
import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import llguidance.hf
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.app import start_engine
from appliance.engine.core import Engine
from appliance.engine.request import (
    FinishEvent,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
    blocking_sink,
)
from appliance.service.structured import JSON_OBJECT, grammar_for, tool_call_grammar
from tests.helpers import make_settings

MAX_TOKENS = 800
"""Room for the largest answer the schemas below allow (nested arrays of objects run to a
few hundred tokens): an answer cut at max_tokens cannot be whole JSON."""


@pytest.fixture(scope="module")
def engine(demo_model: Path) -> Iterator[Engine]:
    eng = start_engine(make_settings(demo_model, max_batch_size=8, max_queue_depth=64,
                                     prompt_cache_entries=0))
    yield eng
    eng.stop()


def _prompt(engine: Engine, text: str) -> tuple[int, ...]:
    tok = engine.loaded.tokenizer  # type: ignore[attr-defined]
    return tuple(tok.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True))


def _run(engine: Engine, reqs: list[GenerationRequest]) -> list[tuple[str, FinishEvent]]:
    queues = []
    for r in reqs:
        q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        engine.submit(r, blocking_sink(q))
        queues.append(q)
    out = []
    for q in queues:
        parts: list[str] = []
        while True:
            ev = q.get(timeout=300)
            if isinstance(ev, FinishEvent):
                parts.append(ev.text)
                out.append(("".join(parts), ev))
                break
            assert isinstance(ev, TokenEvent)
            parts.append(ev.text)
    return out


# Small schemas of the kinds HA's AI Task and scripts send: objects of scalars, enums,
# arrays and nested objects. Every value has a bounded length (maxLength, integer ranges,
# maxItems): the tiny demo model, greedy, happily repeats a digit forever, and an answer cut
# at max_tokens cannot be whole JSON whatever enforces the grammar.
_scalar = st.one_of(
    st.just({"type": "string", "maxLength": 12}),
    st.just({"type": "boolean"}),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.just({"type": "number", "enum": [0.5, 1.5, 20.25]}),
    st.lists(st.sampled_from(["red", "green", "blue", "on", "off", "kitchen"]), min_size=1,
             max_size=4, unique=True).map(lambda e: {"type": "string", "enum": e}),
    st.just({"type": "null"}),
)
_value = st.recursive(
    _scalar,
    lambda inner: st.one_of(
        st.builds(lambda items, n: {"type": "array", "items": items, "minItems": n,
                                    "maxItems": n + 2}, inner, st.integers(0, 2)),
        st.dictionaries(st.from_regex(r"[a-z]{1,6}", fullmatch=True), inner, min_size=1,
                        max_size=3).map(lambda props: {
                            "type": "object", "properties": props,
                            "required": sorted(props), "additionalProperties": False}),
    ),
    max_leaves=5,
)
schemas = st.dictionaries(st.from_regex(r"[a-z]{1,8}", fullmatch=True), _value, min_size=1,
                          max_size=4).map(lambda props: {
                              "type": "object", "properties": props, "required": sorted(props),
                              "additionalProperties": False})


@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=schemas, temperature=st.sampled_from([0.0, 0.8]))
def test_every_answer_parses_and_validates(engine: Engine, schema: dict[str, Any],
                                           temperature: float) -> None:
    req = GenerationRequest(prompt=_prompt(engine, "Describe the kitchen as JSON."),
                            max_tokens=MAX_TOKENS, grammar=grammar_for(schema),
                            sampling=SamplingParams(temperature=temperature, seed=7))
    text, fin = _run(engine, [req])[0]
    assert fin.reason == "stop", (fin, text)
    jsonschema.validate(json.loads(text), schema)


def test_json_object_mode_keeps_to_json_even_when_cut_short(engine: Engine) -> None:
    """Free-form JSON has no length bound: the tiny model may still be inside a string at
    max_tokens. Whole or cut, every token it produced was valid JSON-object text."""
    grammar = grammar_for(JSON_OBJECT)
    req = GenerationRequest(prompt=_prompt(engine, "Anything."), max_tokens=40,
                            grammar=grammar)
    text, fin = _run(engine, [req])[0]
    assert text.startswith("{")
    tok = engine.loaded.tokenizer  # type: ignore[attr-defined]
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok._tokenizer), grammar)
    assert matcher.consume_tokens(tok.encode(text, add_special_tokens=False))
    if fin.reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert fin.reason == "length"


def test_a_constrained_row_leaves_its_greedy_neighbours_unchanged(engine: Engine) -> None:
    plain = [GenerationRequest(prompt=_prompt(engine, q), max_tokens=20)
             for q in ("What is a list?", "Tell me about files.")]
    alone = [_run(engine, [r])[0][0] for r in plain]
    schema = {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"],
              "additionalProperties": False}
    mixed = _run(engine, [
        GenerationRequest(prompt=plain[0].prompt, max_tokens=20),
        GenerationRequest(prompt=_prompt(engine, "State?"), max_tokens=40,
                          grammar=grammar_for(schema)),
        GenerationRequest(prompt=plain[1].prompt, max_tokens=20)])
    assert [mixed[0][0], mixed[2][0]] == alone
    assert json.loads(mixed[1][0])["on"] in (True, False)


def test_a_grammar_that_cannot_match_ends_only_its_own_request(engine: Engine) -> None:
    # A grammar made for another vocabulary's text cannot break the engine: here a grammar
    # whose matcher is fine but a neighbour is plain; then a bad grammar string.
    good = GenerationRequest(prompt=_prompt(engine, "What is a list?"), max_tokens=12)
    bad = GenerationRequest(prompt=_prompt(engine, "x"), max_tokens=12, grammar="start: (")
    out = _run(engine, [good, bad])
    assert out[0][1].reason in ("stop", "length")
    assert out[1][1].reason == "error"


def test_a_grammar_that_fails_mid_answer_logs_its_error_class_not_its_schema(
        engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    """Admission refuses such schemas (``Engine.check_grammar``); should one reach the
    engine anyway, its request ends alone and the log names the error, not the schema."""
    marker = "zeppelin_field_4471"
    grammar = tool_call_grammar([{"type": "function", "function": {
        "name": marker, "parameters": {"$ref": "#"}}}], arguments_key="parameters")
    assert engine.check_grammar(grammar) == "ParserTooComplex"
    assert engine.check_grammar(grammar_for({"$ref": "#", "title": marker})) \
        == "NoExtensionBias"
    assert engine.check_grammar(grammar_for({"type": "object"})) is None
    with caplog.at_level("INFO"):
        out = _run(engine, [GenerationRequest(prompt=_prompt(engine, "x"), max_tokens=12,
                                              grammar=grammar)])
    assert out[0][1].reason == "error"
    assert "ParserTooComplex" in caplog.text
    assert marker not in caplog.text and marker not in (out[0][1].error or "")
