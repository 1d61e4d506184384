"""Ollama's truncation of long histories: the oldest messages go, the system prompt and the
current turn stay (a fake template: one token per word)."""

from __future__ import annotations

from typing import Any

import pytest

from appliance.api.ollama_fit import answer_reserve, cut_points, fit_context, fit_turns
from appliance.service.errors import InvalidRequest


def _render(turns: list[dict[str, Any]]) -> list[int]:
    return [0] * sum(1 + len(str(t["content"]).split()) for t in turns)


def _turn(role: str, words: int, tag: str = "") -> dict[str, Any]:
    return {"role": role, "content": " ".join([tag or role] * words)}


HISTORY = [_turn("system", 9, "sys"),
           _turn("user", 9, "u1"), _turn("assistant", 9, "a1"),
           _turn("user", 9, "u2"), _turn("assistant", 0, "call"), _turn("tool", 9, "t2"),
           _turn("assistant", 9, "a2"),
           _turn("user", 9, "u3"), _turn("assistant", 0, "call3"), _turn("tool", 4, "t3")]


def _tags(prompt_turns: list[dict[str, Any]]) -> list[str]:
    return [str(t["content"]).split()[0] if t["content"] else t["role"] for t in prompt_turns]


def test_a_prompt_that_fits_is_left_alone() -> None:
    prompt, dropped = fit_turns(_render, HISTORY, 1000, 10)
    assert (len(prompt), dropped) == (len(_render(HISTORY)), 0)


def test_it_cuts_only_where_the_rest_starts_with_a_user_message() -> None:
    # droppable: u1 a1 u2 call t2 a2 (before u3); the rest may start at u2 (2) or u3 (6)
    assert cut_points(HISTORY) == [0, 2, 6]


def test_the_oldest_exchanges_go_first_keeping_system_and_the_current_turn() -> None:
    full = len(_render(HISTORY))
    seen: list[list[dict[str, Any]]] = []

    def render(turns: list[dict[str, Any]]) -> list[int]:
        seen.append(turns)
        return _render(turns)

    prompt, dropped = fit_turns(render, HISTORY, full - 5 + 4, 4)  # 5 tokens too long
    assert dropped == 2 and len(prompt) == full - 20
    assert _tags(seen[-1])[:2] == ["sys", "u2"]  # the last render tried is the one kept
    assert _tags(seen[-1])[-3:] == ["u3", "assistant", "t3"]
    prompt, dropped = fit_turns(_render, HISTORY, 40, 4)  # only system + current turn fit
    assert dropped == 6 and len(prompt) == 10 + 10 + 1 + 5


def test_when_even_the_kept_part_leaves_no_room_it_is_the_context_400() -> None:
    with pytest.raises(InvalidRequest) as err:
        fit_turns(_render, HISTORY, 26, 4)
    assert err.value.code == "context_length_exceeded"
    kept, dropped = fit_turns(_render, HISTORY, 27, 4)  # fits, with less room than asked
    assert (len(kept), dropped) == (26, 6)


def test_generate_drops_the_oldest_context_tokens() -> None:
    assert fit_context([1, 2, 3, 4], [7, 8], 10, 2) == [1, 2, 3, 4, 7, 8]
    assert fit_context([1, 2, 3, 4], [7, 8], 6, 2) == [3, 4, 7, 8]
    with pytest.raises(InvalidRequest):
        fit_context([1, 2], [7, 8, 9], 3, 1)


def test_the_answer_keeps_its_length_but_at_most_a_quarter() -> None:
    assert answer_reserve(None, 512, 8192) == 512
    assert answer_reserve(100, 512, 200) == 50
    assert answer_reserve(1, 512, 2) == 1
