"""Continue: where an answer cut at its length limit and the model's next words meet.

The engine streams a request's text from its own tokens only, and a detokenizer drops the
space that begins a text; the continued words of "...a measure" then start "out", and
appending gives "measureout". Whether the first new token carries a space is a fact of
the tokenizer: decoded after the answer's last token, does it begin with one?
"""

from __future__ import annotations

from typing import Any


def starts_with_space(tokenizer: Any, before: int, token: int) -> bool:
    """Whether ``token``, written right after ``before``, begins with white space."""
    alone = tokenizer.decode([before])
    both = tokenizer.decode([before, token])
    return both.startswith(alone) and both[len(alone):][:1].isspace()


def join(prefix: str, more: str, spaced: bool) -> str:
    """The answer so far and its continuation, with the one space the join needs."""
    if spaced and prefix and more and not prefix[-1].isspace() and not more[0].isspace():
        return f"{prefix} {more}"
    return prefix + more
