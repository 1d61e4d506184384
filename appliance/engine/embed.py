"""Embeddings from the served model: mean-pooled final hidden states, L2-normalised.

The engine thread owns MLX, so embedding requests reach it as :class:`EmbedJob` s in a
queue of their own, and :class:`Embedder` reads them between ticks: at most one batch of
about ``BATCH_TOKENS`` padded tokens per tick, in the background of the generation work, so
a long list of documents never stalls the streams beside it by more than one such batch.
Rows are right-padded: with causal attention a real position never reads a pad, and the
mean is taken over the real positions only.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

BATCH_TOKENS = 1024
"""Padded tokens (rows x longest row) of one batch: one tick's embedding work."""

Vectors = list[list[float]]


@dataclass(slots=True)
class EmbedJob:
    """One request's rows (token ids); ``done`` gets the vectors or an error, once."""

    rows: Sequence[Sequence[int]]
    done: Callable[[Vectors | None, str | None], None]
    vectors: Vectors = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)


def pooled(model: Any, rows: Sequence[Sequence[int]], pad: int) -> Vectors:
    """One forward of ``rows`` through the model's body (no LM head): each row's mean final
    hidden state over its own tokens, with unit L2 norm."""
    import mlx.core as mx  # on the engine thread only, like every MLX call

    width = max(len(r) for r in rows)
    tokens = mx.array([list(r) + [pad] * (width - len(r)) for r in rows])
    lengths = mx.array([len(r) for r in rows])
    body = getattr(model, "model", None) or model.language_model.model
    hidden = body(tokens).astype(mx.float32)  # (rows, width, hidden): after the final norm
    keep = (mx.arange(width)[None, :] < lengths[:, None]).astype(mx.float32)[..., None]
    mean = (hidden * keep).sum(axis=1) / lengths[:, None].astype(mx.float32)
    norm = mx.sqrt((mean * mean).sum(axis=-1, keepdims=True))
    out = mean / mx.maximum(norm, 1e-12)
    mx.eval(out)
    return [[float(v) for v in row] for row in out.tolist()]


class Embedder:
    """The engine thread's queue of embedding jobs (``submit`` from any thread)."""

    def __init__(self, model: Any, pad: int, batch_tokens: int = BATCH_TOKENS) -> None:
        self.model = model
        self.pad = pad
        self.batch_tokens = batch_tokens
        self._jobs: deque[EmbedJob] = deque()
        self._lock = threading.Lock()

    def submit(self, job: EmbedJob) -> None:
        with self._lock:
            self._jobs.append(job)

    @property
    def pending(self) -> bool:
        return bool(self._jobs)

    def step(self) -> bool:
        """Embed one batch of the oldest job's rows; returns whether there was work."""
        with self._lock:
            while self._jobs and self._jobs[0].cancelled.is_set():
                self._jobs.popleft()
            if not self._jobs:
                return False
            job = self._jobs[0]
        start = len(job.vectors)
        take = 1
        while (start + take < len(job.rows)
               and (take + 1) * max(len(r) for r in job.rows[start:start + take + 1])
               <= self.batch_tokens):
            take += 1
        try:
            job.vectors.extend(pooled(self.model, job.rows[start:start + take], self.pad))
        except Exception as exc:
            log.error("embedding failed rows=%d: %s", take, type(exc).__name__)
            self._finish(job, None, "inference backend error")
            return True
        if len(job.vectors) == len(job.rows):
            self._finish(job, job.vectors, None)
        return True

    def fail_all(self, reason: str) -> None:
        with self._lock:
            jobs, self._jobs = list(self._jobs), deque()
        for job in jobs:
            job.done(None, reason)

    def _finish(self, job: EmbedJob, vectors: Vectors | None, error: str | None) -> None:
        with self._lock:
            if self._jobs and self._jobs[0] is job:
                self._jobs.popleft()
        try:
            job.done(vectors, error)
        except Exception as exc:  # the caller's hand-off; nobody else's job
            log.error("embedding hand-off failed: %s", type(exc).__name__)
