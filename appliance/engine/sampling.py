"""Per-row sampling for a decode batch.

Greedy rows without logits processors share one batched argmax. Other rows are sampled
one by one with mlx-lm's filters (top-p, top-k, min-p) and logits processors (logit bias,
repetition/presence/frequency penalties, and a grammar mask for constrained decoding). No
full-vocabulary log-softmax is computed for greedy rows: nobody asked for log-probabilities.

A seeded row is reproducible (docs/decisions/seeded-sampling.md): the draw at each
position uses a key made of the seed and the position alone (not a key split once per draw,
so neither the batch nor a retried or re-read step moves it), as a Gumbel-max over float32
noise. Logits of the same context read another way (a cached prefix, a dense prompt
product) differ by ~1e-3; this draw then changes in ~0.1 % of positions, where
``mx.random.categorical`` changed in ~6 %, and an inverse-CDF draw in token-id order in
most (every interval's edge moves by the cumulative sums' rounding).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from appliance.engine.grammar import GrammarRow
from appliance.engine.request import SEED_LIMIT, SamplingParams


class RowSampler:
    """Sampling state of one sequence."""

    def __init__(self, params: SamplingParams, vocab_size: int,
                 grammar: GrammarRow | None = None) -> None:
        for token, _ in params.logit_bias:
            if not 0 <= token < vocab_size:
                raise ValueError(f"logit_bias token {token} is outside the vocabulary "
                                 f"(0..{vocab_size - 1})")
        if params.seed is not None and not 0 <= params.seed < SEED_LIMIT:
            raise ValueError(f"seed must be between 0 and 2**64 - 1, got {params.seed}")
        if params.top_k >= vocab_size:
            params = _replace_top_k(params)
        self.params = params
        self._bias: mx.array | None = None
        self.processors = make_logits_processors(  # penalties; the bias is added separately
            repetition_penalty=params.repetition_penalty,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
        )
        self.grammar = grammar

    @property
    def plain_greedy(self) -> bool:
        """Greedy with no penalties and no grammar: sampled with the batch's one argmax
        (after its bias)."""
        return self.params.greedy and not self.processors and self.grammar is None

    def bias(self, vocab: int) -> mx.array | None:
        """The logit bias as a dense [vocab] row (made once), or None."""
        if self._bias is None and self.params.logit_bias:
            tokens = mx.array([t for t, _ in self.params.logit_bias])
            values = mx.array([v for _, v in self.params.logit_bias], dtype=mx.float32)
            self._bias = mx.zeros((vocab,), dtype=mx.float32).at[tokens].add(values)
        return self._bias

    def sample(self, logits: mx.array, context: Sequence[int]) -> mx.array:
        """logits: [1, V] for this row; returns a [1] token array (not yet evaluated)."""
        bias = self.bias(logits.shape[-1])
        if bias is not None:
            logits = logits + bias
        if self.processors:
            ctx = mx.array(list(context[-64:]) or [0])
            for proc in self.processors:
                logits = proc(ctx, logits)
        if self.grammar is not None:
            logits = self.grammar.mask(logits, context)
        p = self.params
        if p.greedy:
            return mx.argmax(logits, axis=-1)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if 0.0 < p.top_p < 1.0:
            logprobs = apply_top_p(logprobs, p.top_p)
        if p.min_p > 0.0:
            logprobs = apply_min_p(logprobs, p.min_p)
        if p.top_k > 0:
            logprobs = apply_top_k(logprobs, p.top_k)
        scaled = logprobs * (1.0 / p.temperature)
        if p.seed is None:
            return mx.random.categorical(scaled)
        noise = mx.random.gumbel(shape=scaled.shape, key=position_key(p.seed, len(context)))
        return mx.argmax(scaled.astype(mx.float32) + noise, axis=-1)


_MASK64 = (1 << 64) - 1


def position_key(seed: int, position: int) -> mx.array:
    """The PRNG key of the draw at ``position`` (tokens before it) for ``seed``: a function
    of those two only (splitmix64's finaliser over both), whatever drew before it."""
    z = (seed + 0x9E3779B97F4A7C15 * (position + 1)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return mx.random.key(z ^ (z >> 31))


def _replace_top_k(params: SamplingParams) -> SamplingParams:
    from dataclasses import replace
    return replace(params, top_k=0)


def _greedy(logits: mx.array, samplers: Sequence[RowSampler]) -> mx.array:
    """One batched argmax over plain greedy rows (each after its logit bias)."""
    biases = [s.bias(logits.shape[-1]) for s in samplers]
    if any(b is not None for b in biases):
        zeros = mx.zeros((logits.shape[-1],), dtype=mx.float32)
        logits = logits + mx.stack([zeros if b is None else b for b in biases])
    return mx.argmax(logits, axis=-1)


def sample_batch(logits: mx.array, samplers: Sequence[RowSampler],
                 contexts: Sequence[Sequence[int]],
                 on_row_error: Any = None) -> list[int | None]:
    """Sample one token per row of ``logits`` [B, V] (:func:`sample_lazy`, then read)."""
    return read_tokens(*sample_lazy(logits, samplers, contexts, on_row_error), len(samplers))


def sample_lazy(logits: mx.array, samplers: Sequence[RowSampler],
                contexts: Sequence[Sequence[int]],
                on_row_error: Any = None) -> tuple[mx.array | None, list[int]]:
    """The sampled tokens of the rows of ``logits`` [B, V] whose sampling could be built, as
    one lazy array, and those rows' indices (the array is None when there are none).

    Plain greedy rows share one argmax even when other rows of the batch need their own
    sampling (penalties, temperature, a grammar). A row whose sampling raises is left out
    and ``on_row_error(i, exc)`` is called; the other rows are unaffected.
    """
    if all(s.plain_greedy for s in samplers):
        return _greedy(logits, samplers), list(range(len(samplers)))
    out: list[mx.array | None] = [None] * len(samplers)
    plain = [i for i, s in enumerate(samplers) if s.plain_greedy]
    if plain:
        picked = _greedy(logits[mx.array(plain)], [samplers[i] for i in plain])
        for k, i in enumerate(plain):
            out[i] = picked[k]
    for i, s in enumerate(samplers):
        if s.plain_greedy:
            continue
        try:
            out[i] = s.sample(logits[i:i + 1], contexts[i]).reshape(())
        except Exception as exc:  # one request's failure ends only that request
            if on_row_error is None:
                raise
            on_row_error(i, exc)
    live = [(i, t) for i, t in enumerate(out) if t is not None]
    if not live:
        return None, []
    return mx.stack([t for _, t in live]), [i for i, _ in live]


def sample_positions(logits: mx.array, sampler: RowSampler, context: Sequence[int],
                     drafts: Sequence[int]) -> mx.array:
    """The tokens one stream samples at each position of a verify (appliance/engine/lookup.py):
    ``logits`` [n, V] for its next token and the ``n - 1`` drafts after it, position ``i``
    sampled as a plain step after ``context`` and the first ``i`` drafts would sample it
    (the same seeded key, penalties over the same tokens). Lazy, [n]."""
    if sampler.plain_greedy:
        return _greedy(logits, [sampler] * logits.shape[0])
    seen = list(context)
    out = []
    for i in range(logits.shape[0]):
        out.append(sampler.sample(logits[i:i + 1], seen).reshape(()))
        if i < len(drafts):
            seen.append(drafts[i])
    return mx.stack(out)


def read_tokens(tokens: mx.array | None, live: list[int], rows: int) -> list[int | None]:
    """:func:`sample_lazy`'s tokens as one entry per row (None for a row left out)."""
    result: list[int | None] = [None] * rows
    if tokens is not None:
        values: list[int] = tokens.tolist()  # type: ignore[assignment]
        for i, v in zip(live, values, strict=True):
            result[i] = int(v)
    return result
