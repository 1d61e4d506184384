"""The prompt (prefix) cache: KV of earlier requests reused by later ones of the same user.

Multi-turn chat re-sends its whole history; the KV of the previous turn's prompt and answer
is kept after it finishes and the next turn only computes what is new. Entries are scoped
per user: a shared cache would let one member learn what another asked through timing.
Built on mlx-lm's ``LRUPromptCache`` (a token trie with LRU eviction); cached tokens are
not computed, so they cost nothing on the user's fairness counter.

A prefix shorter than ``MIN_REUSE_TOKENS`` is not reused: it is typically only the chat
template's opening (``<|im_start|>user``, 6-7 tokens), and a prompt that starts from it is
read in a forward of its own, while prompts read whole go through the model together. On
a CPU a forward's fixed cost is worth tens of tokens, so several arrivals in one forward
save far more than a few cached tokens do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

MIN_REUSE_TOKENS = 32
"""Cached prefixes shorter than this are not reused (the prompt is read whole)."""


@dataclass(slots=True)
class CacheStats:
    entries: int = 0
    bytes: int = 0
    lookups: int = 0
    hits: int = 0
    tokens_reused: int = 0
    evictions: int = 0


class PromptCache:
    def __init__(self, max_entries: int) -> None:
        self._lru = LRUPromptCache(max_size=max_entries)
        self.stats = CacheStats()

    @property
    def nbytes(self) -> int:
        return int(self._lru.nbytes)

    def fetch(self, user: str, tokens: list[int]) -> tuple[list[Any] | None, int]:
        """A private copy of the longest cached prefix of ``tokens`` for ``user`` and its
        length; at least one token is always left to compute (its logits start the answer).
        None and 0 when no prefix of at least ``MIN_REUSE_TOKENS`` is cached."""
        self.stats.lookups += 1
        cache, rest = self._lru.fetch_nearest_cache(user, tokens)
        if cache is None:
            return None, 0
        reused = len(tokens) - len(rest)
        if reused >= len(tokens):
            if not can_trim_prompt_cache(cache):
                return None, 0
            trim_prompt_cache(cache, reused - len(tokens) + 1)
            reused = len(tokens) - 1
        if reused < MIN_REUSE_TOKENS:
            return None, 0
        self.stats.hits += 1
        self.stats.tokens_reused += reused
        return cache, reused

    def store(self, user: str, tokens: list[int], cache: list[Any]) -> None:
        """Keep ``cache`` (the KV of exactly ``tokens``) for ``user``'s next turn."""
        if tokens:
            self._lru.insert_cache(user, list(tokens), cache)
        self._refresh()

    def evict_bytes(self, nbytes: int) -> None:
        """Free at least ``nbytes`` (coldest entries first)."""
        before = len(self._lru)
        self._lru.trim_to(n_bytes=max(self.nbytes - nbytes, 0))
        self.stats.evictions += before - len(self._lru)
        self._refresh()

    def drop_user(self, user: str) -> int:
        """Forget every entry of ``user``; returns how many. mlx-lm's LRUPromptCache has no
        per-key removal, so this walks its order lists and trie as its own trim does."""
        lru: Any = self._lru
        order = lru._lru
        victims = [(m, t) for q in order._lrus.values() for m, t in q if m == user]
        for model, tokens in victims:
            entry = lru._trie.pop(model, tokens)
            order.remove(model, tokens)
            lru._n_bytes -= entry.nbytes
            lru._n_bytes_by_type[entry.cache_type] -= entry.nbytes
        self.stats.evictions += len(victims)
        self._refresh()
        return len(victims)

    def clear(self) -> None:
        self.evict_bytes(self.nbytes)

    def _refresh(self) -> None:
        self.stats.entries = len(self._lru)
        self.stats.bytes = self.nbytes
