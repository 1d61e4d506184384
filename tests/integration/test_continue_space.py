"""Continue: the text that carries on an answer keeps the space it begins with (issue 54:
"measureout", "theflavor"), where a fresh answer's first space is dropped as before."""

from __future__ import annotations

from appliance.engine.textstream import TextStream
from tests.conftest import DEMO


def _stream(text: str, keep: bool) -> str:
    from mlx_lm.utils import load_tokenizer
    tokenizer = load_tokenizer(DEMO)
    stream = TextStream(tokenizer.detokenizer, keep_leading_space=keep)
    out = [stream.push(t) for t in tokenizer.encode(text, add_special_tokens=False)]
    return "".join(out) + stream.finish()


def test_a_continuation_keeps_its_first_space_and_a_fresh_answer_does_not() -> None:
    assert _stream(" out the flour", keep=True) == " out the flour"
    assert _stream(" out the flour", keep=False) == "out the flour"
    assert _stream("ment of flour", keep=True) == "ment of flour"  # no space to keep
