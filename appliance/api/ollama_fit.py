"""Ollama's answer to a prompt longer than the context: drop the oldest history, not 400.

Home Assistant keeps whole conversations and re-sends them with ``num_ctx``; Ollama then
truncates from the front, keeping the system prompt, and answers. So do we on ``/api/chat``
and ``/api/generate`` (``/v1`` keeps OpenAI's 400):

- chat: the system messages and the current turn (the last user message and what follows
  it: tool calls and their results) are always kept; the oldest other messages go first,
  and only at a point where what remains starts with a user message (a tool result without
  its call, or an answer without its question, would confuse the template and the model);
- generate: the oldest tokens of ``context`` (an earlier answer's ids) go first;
- the prompt is fitted to leave the answer room for its length, at most a quarter of the
  context; when even the kept part leaves no room for one token, it is the usual 400.

The final ``prompt_eval_count`` is what was read, so a client sees the truncation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from appliance.service.checks import check_context

log = logging.getLogger(__name__)

Turn = dict[str, Any]


def answer_reserve(wanted: int | None, default: int, limit: int) -> int:
    """Room kept for the answer while fitting: its length, at most a quarter of ``limit``."""
    return max(1, min(wanted or default, limit // 4))


def cut_points(turns: Sequence[Turn]) -> list[int]:
    """How many droppable messages may go, in increasing order (0 first). The droppable
    messages are the non-system ones before the last user message, oldest first."""
    last_user = max((i for i, t in enumerate(turns) if t.get("role") == "user"), default=-1)
    droppable = [i for i, t in enumerate(turns[:max(last_user, 0)])
                 if t.get("role") != "system"]
    cuts = [0]
    for k in range(1, len(droppable) + 1):
        nxt = droppable[k] if k < len(droppable) else last_user
        if turns[nxt].get("role") == "user":
            cuts.append(k)
    return cuts


def kept_turns(messages: Sequence[Any]) -> list[Any]:
    """The messages :func:`fit_turns` never drops (the system ones and the current turn),
    as they came (dicts or request structs)."""
    def role(m: Any) -> Any:
        return m.get("role") if isinstance(m, dict) else getattr(m, "role", None)

    last_user = max((i for i, m in enumerate(messages) if role(m) == "user"), default=0)
    return [m for i, m in enumerate(messages) if i >= last_user or role(m) == "system"]


def without(turns: Sequence[Turn], k: int) -> list[Turn]:
    """``turns`` less the ``k`` oldest droppable messages."""
    last_user = max((i for i, t in enumerate(turns) if t.get("role") == "user"), default=-1)
    gone = {i for i, t in enumerate(turns[:max(last_user, 0)])
            if t.get("role") != "system"}
    gone = set(sorted(gone)[:k])
    return [t for i, t in enumerate(turns) if i not in gone]


def fit_turns(render: Callable[[list[Turn]], list[int]], turns: list[Turn], limit: int,
              reserve: int) -> tuple[list[int], int]:
    """The prompt of ``turns`` with as few oldest messages dropped as make it leave
    ``reserve`` tokens of ``limit``, and how many were dropped. The fewest that fit are
    found by bisection (each try renders the template once). Raises the context 400 when
    even the kept messages leave no room."""
    prompt = render(turns)
    if len(prompt) + reserve <= limit:
        return prompt, 0
    cuts = cut_points(turns)
    lo, hi = 1, len(cuts) - 1  # search cuts[lo..hi] for the first that fits
    best: tuple[list[int], int] | None = None
    while lo <= hi:
        mid = (lo + hi) // 2
        tried = render(without(turns, cuts[mid]))
        if len(tried) + reserve <= limit:
            best, hi = (tried, cuts[mid]), mid - 1
        else:
            lo = mid + 1
    if best is None:  # nothing fits with the reserve: keep what must be kept, if it fits
        k = cuts[-1]
        best = (render(without(turns, k)) if k else prompt, k)
        check_context(len(best[0]), limit)
    if best[1]:
        log.info("prompt truncated messages_dropped=%d tokens=%d->%d limit=%d", best[1],
                 len(prompt), len(best[0]), limit)
    return best


def fit_context(context: list[int], prompt: list[int], limit: int, reserve: int
                ) -> list[int]:
    """``context + prompt`` with the oldest context tokens dropped until it leaves
    ``reserve`` tokens of ``limit`` (the 400 when the prompt alone leaves no room)."""
    if len(context) + len(prompt) + reserve <= limit:
        return context + prompt
    keep = max(0, limit - reserve - len(prompt))
    fitted = context[len(context) - keep:] if keep else []
    check_context(len(fitted) + len(prompt), limit)
    log.info("context truncated tokens=%d->%d limit=%d", len(context) + len(prompt),
             len(fitted) + len(prompt), limit)
    return fitted + prompt
