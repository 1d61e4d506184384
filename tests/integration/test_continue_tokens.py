"""Continue: the space a detokenizer drops at a text's start is read from the tokenizer."""

from __future__ import annotations

from pathlib import Path

from appliance.service.continuation import starts_with_space


def test_whether_a_token_begins_with_a_space_comes_from_the_tokenizer(
        tiny_model: Path) -> None:
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    before = tokenizer.encode("measure", add_special_tokens=False)[-1]
    spaced = tokenizer.encode(" out", add_special_tokens=False)[0]
    glued = tokenizer.encode("out", add_special_tokens=False)[0]
    assert starts_with_space(tokenizer, before, spaced)
    assert not starts_with_space(tokenizer, before, glued)
