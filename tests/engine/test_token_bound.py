"""The cheap prompt-size bound on a real tokenizer (the demo model's): no token decodes to
more characters than the vocabulary's longest entry."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.service.chat_format import longest_token_chars

DEMO = Path(__file__).resolve().parents[2] / "appliance" / "demo_model" / "tokenizer.json"


def test_no_demo_token_decodes_to_more_than_the_longest_entry() -> None:
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(DEMO))
    longest = longest_token_chars(tok)
    assert longest > 0
    assert all(len(tok.decode([i], skip_special_tokens=False)) <= longest
               for i in range(tok.get_vocab_size()))
