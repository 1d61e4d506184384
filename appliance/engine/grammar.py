"""Constrained decoding: a per-request llguidance matcher used as a logits mask.

A request that carries a grammar (``GenerationRequest.grammar``, an llguidance grammar made
on the API side from a JSON schema or a Lark grammar) gets a :class:`GrammarRow`. Before its
row is sampled, the row feeds the matcher every token generated since the last time, asks for
the set of allowed next tokens and masks the rest to ``-inf``. When the grammar is complete
only end-of-sequence tokens stay allowed, so the answer ends there. A matcher in an error
state raises: the sampler's caller ends that request alone with a backend error. Errors name
llguidance's stop reason only: its own message quotes the whole grammar, which is the
client's schema, and must not reach a log.

:func:`probe_grammar` runs a grammar up to its first free choice at admission, so a schema
the matcher cannot run (``{"$ref": "#"}`` matches nothing; tool parameters that refer to
the whole call make it too complex at its first token) is a 400 before it is queued.

The llguidance tokenizer (a few hundred ms to build for a large vocabulary) is made once per
loaded tokenizer and shared; each request has its own matcher. Unconstrained rows never touch
any of this.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np

_tokenizers: dict[int, tuple[Any, Any]] = {}
_lock = threading.Lock()


def ll_tokenizer(tokenizer: Any, vocab_size: int, eos: Iterable[int]) -> Any:
    """The shared llguidance tokenizer for an mlx-lm tokenizer wrapper (built once)."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's wrapper holds the HF one
    key = id(hf)
    with _lock:
        hit = _tokenizers.get(key)
        if hit is not None and hit[0] is hf:
            return hit[1]
        eos_ids = sorted(set(eos)) or None
        n_vocab = max(vocab_size if 0 < vocab_size < 1 << 24 else 0, len(hf))
        made = llguidance.hf.from_tokenizer(hf, n_vocab=n_vocab, eos_token=eos_ids)
        _tokenizers[key] = (hf, made)
        return made


PROBE_TOKENS = 256
"""Forced tokens :func:`probe_grammar` follows at most (a forced call's tag and name)."""


def _failure(matcher: Any) -> str:
    """What went wrong, as llguidance's stop reason (one word), never its message."""
    message = matcher.get_error() or ""
    lines = message.splitlines()
    words = [line[len("Stop: "):] for line in lines if line.startswith("Stop: ")]
    words += [lines[0]] if lines else []
    words.append(matcher.stop_reason())
    return next((w for w in words if isinstance(w, str) and w.isidentifier()
                 and w not in ("NotStopped", "InternalError")), "GrammarError")


def probe_grammar(ll_tok: Any, grammar: str) -> str | None:
    """None when the engine can start decoding ``grammar``; else why not, as an error class
    (``ParserTooComplex``, ``NoExtensionBias``, ...). Builds the matcher the engine would,
    computes the first mask and follows the tokens the grammar forces, where a recursive
    schema first fails. Pure llguidance (no MLX): callable from any thread."""
    matcher = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
    seen = 0
    while not matcher.is_error():
        mask = matcher.compute_bitmask()
        if matcher.is_error():
            break
        if not any(mask):
            return "NoAllowedToken"
        forced = matcher.compute_ff_tokens()[:PROBE_TOKENS - seen]
        if not forced or matcher.is_stopped():
            break
        matcher.consume_tokens(forced)
        seen += len(forced)
    return _failure(matcher) if matcher.is_error() else None


class GrammarRow:
    """The matcher of one constrained request."""

    def __init__(self, ll_tok: Any, grammar: str, n_prompt: int) -> None:
        self._matcher = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
        if self._matcher.is_error():
            raise ValueError(f"invalid grammar: {_failure(self._matcher)}")
        self._seen = n_prompt
        self._vocab = int(ll_tok.vocab_size)

    def _catch_up(self, context: Sequence[int]) -> None:
        new = list(context[self._seen:])
        if new and not self._matcher.consume_tokens(new):
            raise RuntimeError(f"grammar matcher error: {_failure(self._matcher)}")
        self._seen = len(context)

    def mask(self, logits: mx.array, context: Sequence[int]) -> mx.array:
        """``logits`` [1, V] with every token the grammar forbids next set to -inf."""
        self._catch_up(context)
        if self._matcher.is_error():
            raise RuntimeError(f"grammar matcher error: {_failure(self._matcher)}")
        bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8),
                             bitorder="little")
        width = logits.shape[-1]
        allowed = np.zeros(width, dtype=bool)
        n = min(width, self._vocab, bits.shape[0])
        allowed[:n] = bits[:n].astype(bool)
        if not allowed.any():
            raise RuntimeError("grammar allows no next token")
        return mx.where(mx.array(allowed)[None, :], logits, mx.array(-float("inf"), logits.dtype))
