"""A token that is one space is streamed when it is made, not with the next token (mlx-lm's
byte-level detokenizer holds it back to drop a leading space), and the text is the same."""

from __future__ import annotations

from pathlib import Path

from mlx_lm.tokenizer_utils import load as load_tokenizer

from appliance.engine.textstream import TextStream


def test_a_lone_space_is_streamed_with_its_own_token(demo_model: Path) -> None:
    tokenizer = load_tokenizer(demo_model)
    a, space, b = tokenizer._tokenizer.convert_tokens_to_ids(["a", "\u0120", "b"])
    stream = TextStream(tokenizer.detokenizer)
    assert [stream.push(t) for t in (a, space, b, space, space)] == ["a", " ", "b", " ", " "]
    assert stream.finish() == ""
    # at the very beginning it is still held, and dropped as mlx-lm drops it
    first = TextStream(tokenizer.detokenizer)
    assert [first.push(t) for t in (space, a, space, b)] == ["", "a", " ", "b"]
    assert first.finish() == ""
    # the same text as mlx-lm's own detokenizer gives for the whole answer
    ids = tokenizer._tokenizer.encode(" one two  three   four", add_special_tokens=False)
    own = tokenizer.detokenizer
    for t in ids:
        own.add_token(t)
    own.finalize()
    ours = TextStream(tokenizer.detokenizer)
    assert "".join(ours.push(t) for t in ids) + ours.finish() == own.text
