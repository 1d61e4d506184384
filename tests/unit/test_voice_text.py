"""What the voice hook may say aloud: markup stripped as the text streams in."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from appliance.api.voice_text import SpokenText

QWEN = SimpleNamespace(has_tool_calling=True, tool_call_start="<tool_call>",
                       tool_call_end="</tool_call>", has_thinking=True, think_start="<think>",
                       think_end="</think>")
PLAIN = SimpleNamespace()


def _say(tokenizer: object, pieces: list[str]) -> tuple[str, bool]:
    spoken = SpokenText(tokenizer)
    out = "".join(spoken.feed(p) for p in pieces) + spoken.finish()
    return out, spoken.asked_tool


CALL = '<tool_call>{"name": "HassTurnOn", "arguments": {"name": "kitchen light"}}</tool_call>'


@pytest.mark.parametrize("tokenizer", [QWEN, PLAIN])
@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_it_drops_a_tool_call_split_anywhere_and_notes_it(tokenizer: object,
                                                         size: int) -> None:
    text = "Sure. " + CALL
    out, asked = _say(tokenizer, [text[i:i + size] for i in range(0, len(text), size)])
    assert out.strip() == "Sure." and asked


def test_thinking_and_stray_tags_are_not_spoken() -> None:
    out, asked = _say(QWEN, ["<think>hmm, lights", "</think>", "The light is on.<|im_end|>"])
    assert out == "The light is on." and not asked


def test_an_unclosed_call_is_dropped_whole_and_still_counts() -> None:
    out, asked = _say(QWEN, ["Ok ", '<tool_call>{"name": "Hass'])
    assert out == "Ok " and asked


def test_plain_text_with_a_less_than_sign_is_kept() -> None:
    out, asked = _say(QWEN, ["It is < 3 degrees", " outside."])
    assert out == "It is < 3 degrees outside." and not asked
