"""Conversation memory of the voice hook, and its sentence splitter (pure: no I/O, no clock
reads; the caller passes ``now``).

A conversation is the turns said so far under one ``conversation_id``, private to the user
who started it (another user's id starts a fresh conversation), forgotten ``ttl_s`` after
its last use, like Home Assistant's own conversations (5 minutes). At most ``max_turns``
turns are kept (the oldest go first) and at most ``max_conversations`` conversations (the
least recently used go first), so memory stays bounded however many devices talk.
"""

from __future__ import annotations

import re
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

CONVERSATION_TTL_S = 300.0
MAX_TURNS = 20
MAX_CONVERSATIONS = 1000

_SENTENCE_END = re.compile(r"[.!?。！？…]+[\"')\]]*\s+|\n+")


@dataclass(slots=True)
class Conversation:
    user_id: int
    turns: list[dict[str, str]] = field(default_factory=list)
    used_at: float = 0.0


class VoiceMemory:
    def __init__(self, ttl_s: float = CONVERSATION_TTL_S, max_turns: int = MAX_TURNS,
                 max_conversations: int = MAX_CONVERSATIONS) -> None:
        self.ttl_s = ttl_s
        self.max_turns = max_turns
        self.max_conversations = max_conversations
        self._convs: OrderedDict[str, Conversation] = OrderedDict()

    def __len__(self) -> int:
        return len(self._convs)

    def history(self, user_id: int, conversation_id: str | None, now: float
                ) -> tuple[str, list[dict[str, str]]]:
        """The id to answer under and the turns so far (a copy); unknown, expired or
        another user's ids start empty (a fresh id replaces another user's)."""
        self._expire(now)
        if conversation_id:
            conv = self._convs.get(conversation_id)
            if conv is not None and conv.user_id == user_id:
                return conversation_id, list(conv.turns)
            if conv is None:
                return conversation_id, []
        return uuid.uuid4().hex, []

    def remember(self, user_id: int, conversation_id: str, question: str, answer: str,
                 now: float) -> None:
        conv = self._convs.get(conversation_id)
        if conv is None or conv.user_id != user_id:
            conv = Conversation(user_id)
            self._convs[conversation_id] = conv
        conv.turns += [{"role": "user", "content": question},
                       {"role": "assistant", "content": answer}]
        del conv.turns[:-self.max_turns]
        conv.used_at = now
        self._convs.move_to_end(conversation_id)
        while len(self._convs) > self.max_conversations:
            self._convs.popitem(last=False)

    def _expire(self, now: float) -> None:
        while self._convs:
            cid, conv = next(iter(self._convs.items()))
            if now - conv.used_at <= self.ttl_s:
                return
            del self._convs[cid]


class SentenceSplitter:
    """Feed text deltas; get back whole sentences as soon as they end (for early TTS)."""

    def __init__(self) -> None:
        self._buf = ""

    def feed(self, text: str) -> list[str]:
        self._buf += text
        out: list[str] = []
        while True:
            m = _SENTENCE_END.search(self._buf)
            if m is None:
                return out
            sentence = self._buf[:m.end()].strip()
            self._buf = self._buf[m.end():]
            if sentence:
                out.append(sentence)

    def finish(self) -> list[str]:
        rest, self._buf = self._buf.strip(), ""
        return [rest] if rest else []
