"""Pure parts of the Ollama API and the voice hook: keep_alive, options, memory, sentences."""

from __future__ import annotations

import pytest

from appliance.api.errors import ApiError
from appliance.api.ollama_options import parse_keep_alive, parse_options
from appliance.service.voice_memory import SentenceSplitter, VoiceMemory


@pytest.mark.parametrize("value, seconds", [
    (None, 300.0), (-1, None), (-1.0, None), (0, 0.0), (300, 300.0), ("300s", 300.0),
    ("-1s", None), ("-1", None), ("5m", 300.0), ("1h30m", 5400.0), ("1.5h", 5400.0),
    ("250ms", 0.25), ("10", 10.0),
])
def test_keep_alive_takes_numbers_and_go_durations(value: object, seconds: float | None
                                                    ) -> None:
    assert parse_keep_alive(value) == seconds  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["banana", "5 m", "m", "", "1d", "5m3"])
def test_a_bad_keep_alive_is_a_400(value: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_keep_alive(value)
    assert err.value.status == 400 and "keep_alive" in err.value.message


def test_options_map_to_sampling_and_ignore_unknown_keys() -> None:
    opts = parse_options({"num_predict": 7, "temperature": 0.2, "top_p": 0.9, "top_k": 40,
                          "seed": 1, "stop": ["\n"], "num_ctx": 8192, "mirostat": 2,
                          "num_gpu": 99, "repeat_penalty": 1.1})
    assert (opts.num_predict, opts.num_ctx) == (7, 8192)
    s = opts.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.stop) == (0.2, 0.9, 40, 1, ["\n"])
    assert s.repetition_penalty == 1.1
    assert parse_options({"num_predict": -1}).num_predict is None
    assert parse_options({"num_predict": 5.0}).num_predict == 5


@pytest.mark.parametrize("options, fragment", [
    ({"temperature": "hot"}, "options.temperature"), ({"num_ctx": 0}, "num_ctx"),
    ({"top_k": 1.5}, "options.top_k"), ({"stop": [1]}, "options.stop"),
    ({"seed": True}, "options.seed"),
])
def test_wrong_option_types_are_a_400(options: dict[str, object], fragment: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_options(options)
    assert fragment in err.value.message


def test_voice_memory_is_per_user_and_forgets_after_its_ttl() -> None:
    mem = VoiceMemory(ttl_s=300, max_turns=4, max_conversations=2)
    cid, turns = mem.history(1, None, now=0)
    assert turns == []
    mem.remember(1, cid, "q1", "a1", now=0)
    assert mem.history(1, cid, now=10) == (cid, [{"role": "user", "content": "q1"},
                                                 {"role": "assistant", "content": "a1"}])
    other, turns = mem.history(2, cid, now=10)
    assert other != cid and turns == []
    for i in range(3):
        mem.remember(1, cid, f"q{i}", f"a{i}", now=20)
    assert len(mem.history(1, cid, now=30)[1]) == 4
    assert mem.history(1, cid, now=400)[1] == []
    for n in range(3):
        mem.remember(1, f"c{n}", "q", "a", now=500)
    assert len(mem) == 2


def test_sentences_come_out_as_soon_as_they_end() -> None:
    split = SentenceSplitter()
    assert split.feed("Turning on") == []
    assert split.feed(" the light. It is") == ["Turning on the light."]
    assert split.feed(" 21.5 degrees! Anything") == ["It is 21.5 degrees!"]
    assert split.feed(" else?\nYes") == ["Anything else?"]
    assert split.finish() == ["Yes"]
