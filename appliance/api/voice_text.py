"""What the voice hook may say aloud: the model's text without its markup (pure, streaming).

A model trained for Home Assistant answers a command with a tool call
(``<tool_call>{"name": "HassTurnOn", ...}</tool_call>``) even when the hook offers no tools;
a TTS engine would read that markup aloud. :class:`SpokenText` drops tool-call and thinking
blocks (the tokenizer's own markers, or the common ``<tool_call>``/``<think>`` tags) and any
stray ``<tag>`` such as ``<|im_end|>``, and remembers that a tool was asked for, so the hook
can say in a plain sentence that it cannot act from here.
"""

from __future__ import annotations

import re
from typing import Any

CANNOT_ACT = "I can't do that from here."
"""Said instead of a tool call: the hook has no tools to run."""

_TAG = re.compile(r"<\|?/?[A-Za-z_][\w.:-]*\|?>")
_OPEN_TAG = re.compile(r"<\|?/?[A-Za-z_]?[\w.:-]*\|?$")


def _markers(tokenizer: Any) -> list[tuple[str, str, bool]]:
    """(start, end, is a tool call) blocks to drop, the model's own first."""
    blocks: list[tuple[str, str, bool]] = []
    start = getattr(tokenizer, "tool_call_start", None)
    end = getattr(tokenizer, "tool_call_end", None)
    if getattr(tokenizer, "has_tool_calling", False) and start:
        blocks.append((start, end or "", True))
    think_start = getattr(tokenizer, "think_start", None)
    think_end = getattr(tokenizer, "think_end", None)
    if getattr(tokenizer, "has_thinking", False) and think_start and think_end:
        blocks.append((think_start, think_end, False))
    for default in (("<tool_call>", "</tool_call>", True), ("<think>", "</think>", False)):
        if all(default[0] != b[0] for b in blocks):
            blocks.append(default)
    return blocks


class SpokenText:
    """Feed the model's text deltas; get back only what may be spoken."""

    def __init__(self, tokenizer: Any) -> None:
        self._blocks = _markers(tokenizer)
        self._buf = ""
        self._inside: tuple[str, str, bool] | None = None
        self.asked_tool = False

    def feed(self, text: str) -> str:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> str:
        """The rest of the text; an unclosed block is dropped whole."""
        out = self._run(final=True)
        if self._inside is not None and self._inside[2]:
            self.asked_tool = True
        self._inside, self._buf = None, ""
        return out

    def _run(self, final: bool) -> str:
        out: list[str] = []
        while True:
            if self._inside is not None:
                start, end, is_call = self._inside
                i = self._buf.find(end) if end else -1
                if i < 0:
                    # keep a possible start of the end marker; drop the rest of the block
                    keep = _held(self._buf, [end]) if end else 0
                    self._buf = self._buf[len(self._buf) - keep:] if keep else ""
                    return "".join(out)
                self._buf = self._buf[i + len(end):]
                self.asked_tool |= is_call
                self._inside = None
                continue
            hits = [(self._buf.find(b[0]), b) for b in self._blocks]
            found = [(i, b) for i, b in hits if i >= 0]
            if found:
                i, block = min(found, key=lambda h: h[0])
                out.append(_untagged(self._buf[:i]))
                self._buf = self._buf[i + len(block[0]):]
                self._inside = block
                continue
            keep = 0 if final else max(_held(self._buf, [b[0] for b in self._blocks]),
                                       _open_tag(self._buf))
            cut = len(self._buf) - keep
            out.append(_untagged(self._buf[:cut]))
            self._buf = self._buf[cut:]
            return "".join(out)


def _untagged(text: str) -> str:
    return _TAG.sub("", text)


def _held(buf: str, markers: list[str]) -> int:
    """How many trailing characters could begin one of ``markers``."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(buf)), 0, -1):
            if buf.endswith(m[:n]):
                best = max(best, n)
                break
    return best


def _open_tag(buf: str) -> int:
    """Trailing characters that may be the start of a ``<tag>`` still arriving."""
    i = buf.rfind("<")
    if i < 0 or len(buf) - i > 40:
        return 0
    return len(buf) - i if _OPEN_TAG.fullmatch(buf[i:]) else 0
