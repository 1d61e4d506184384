"""The cheap prompt-size bound (issue 37, item 7): no token stands for more characters than
the vocabulary's longest entry, so a text's characters bound its tokens from below (on a
real tokenizer: tests/engine/test_token_bound.py)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from appliance.service.chat_format import longest_token_chars, text_chars
from appliance.service.checks import check_prompt_size
from appliance.service.errors import InvalidRequest
from appliance.service.services import ModelInfo


class Vocab:
    def __init__(self, entries: list[str]) -> None:
        self.entries = entries

    def get_vocab(self) -> dict[str, int]:
        return {e: i for i, e in enumerate(self.entries)}


def model(longest: int, ctx: int = 100) -> ModelInfo:
    return ModelInfo(name="m", path="m", is_demo=False, ctx_limit=ctx, vocab_size=10,
                     tokenizer=None, max_token_chars=longest)


def test_the_bound_refuses_only_what_cannot_fit() -> None:
    assert longest_token_chars(Vocab(["a", "abcd", "<0x41>"])) == 6
    check_prompt_size(model(6), 6 * 100 - 1)  # at least 99 tokens: it may fit
    with pytest.raises(InvalidRequest) as err:
        check_prompt_size(model(6), 6 * 100, "prompt")  # at least 100: it cannot
    assert err.value.code == "context_length_exceeded" and err.value.param == "prompt"
    check_prompt_size(model(0), 10**9)  # no vocabulary: no bound


def test_every_text_field_counts() -> None:
    """System and assistant turns, names, tools' descriptions and schemas (keys too), and
    request structs' fields: a template may print any of them (issue 52, D16)."""
    class Part(msgspec.Struct):
        type: str
        text: str
    turns: list[Any] = [{"role": "system", "content": "abc"},
                        {"role": "user", "name": "bo", "content": [Part("t", "def")]}]
    tools = [{"function": {"description": "xyz", "parameters": {"a": 1}}}]
    assert text_chars(turns) == (4 + 7 + 6 + 3) + (4 + 4 + 7 + 4 + 2 + 1 + 3)
    assert text_chars(tools) == 8 + 11 + 3 + 10 + 1
    assert text_chars(None, 7, "hi") == 2
