"""Embeddings from the served model: mean-pooled final hidden states, L2-normalised.

The engine thread owns MLX, so embedding requests reach it as :class:`EmbedJob` s in a
queue of their own, and :class:`Embedder` reads them a bounded piece at a time, in a forward
after each tick, as prefill reads a prompt: ``step(tokens)`` reads at most ``tokens`` tokens
(the scheduler sizes them from the tick's time budget, appliance/sched/scheduler.py
``embed_tokens``). Short inputs are read whole, several in one right-padded forward (with
causal attention a real position never reads a pad; the mean is over the real positions
only); an input longer than the piece is read in chunks into a KV cache of its own, its
hidden states summed as they come, so its cost is the prefill's (linear in its tokens, up
to attention) and no forward is longer than the tick allows.
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
"""At most this many padded tokens (rows x longest row) in one forward of whole inputs."""

CHUNK_TOKENS = 256
"""At most this many tokens of one input in one forward, whatever the tick allows: its
attention scores (chunk x positions x heads) outgrow the CPU's caches past that, and one
whole-input forward grew ~16x for 2x tokens (534 tokens: 83 s where prefill took 7.4 s)."""

LOG_PIECES = 2048
"""Pieces kept in :attr:`Embedder.log` (for tests and debugging)."""

CANCELLED = "cancelled"
"""The error a cancelled job's ``done`` gets."""

Vectors = list[list[float]]


@dataclass(slots=True, eq=False)
class EmbedJob:
    """One request's rows (token ids); ``done`` gets the vectors or an error, once (on the
    engine thread). ``user``: whose fairness counter its tokens are charged to."""

    rows: Sequence[Sequence[int]]
    done: Callable[[Vectors | None, str | None], None]
    user: str = ""
    request_id: str = ""
    vectors: Vectors = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)
    read: int = 0
    """Tokens read so far (any thread may read it)."""
    at: int = 0
    """Tokens of the current row (``rows[len(vectors)]``) read into ``cache``."""
    cache: list[Any] | None = None
    total: Any = None
    """The current row's hidden states summed over the positions read (an MLX array)."""

    @property
    def tokens(self) -> int:
        return sum(len(r) for r in self.rows)


@dataclass(frozen=True, slots=True)
class Piece:
    """What one :meth:`Embedder.step` read: ``rows`` rows of ``width`` tokens (padded)
    after ``offset`` cached positions, ``tokens`` real tokens in all, for ``user``."""

    user: str
    rows: int
    width: int
    offset: int
    tokens: int


def _body(model: Any) -> Any:
    return getattr(model, "model", None) or model.language_model.model


def _unit(mean: Any) -> Any:
    import mlx.core as mx

    norm = mx.sqrt((mean * mean).sum(axis=-1, keepdims=True))
    return mean / mx.maximum(norm, 1e-12)


def pooled(model: Any, rows: Sequence[Sequence[int]], pad: int) -> Vectors:
    """One forward of whole ``rows`` through the model's body (no LM head): each row's mean
    final hidden state over its own tokens, with unit L2 norm."""
    import mlx.core as mx  # on the engine thread only, like every MLX call

    width = max(len(r) for r in rows)
    tokens = mx.array([list(r) + [pad] * (width - len(r)) for r in rows])
    lengths = mx.array([len(r) for r in rows])
    hidden = _body(model)(tokens).astype(mx.float32)  # (rows, width, hidden): after the norm
    keep = (mx.arange(width)[None, :] < lengths[:, None]).astype(mx.float32)[..., None]
    out = _unit((hidden * keep).sum(axis=1) / lengths[:, None].astype(mx.float32))
    mx.eval(out)
    return [[float(v) for v in row] for row in out.tolist()]


def read_chunk(model: Any, job: EmbedJob, n: int) -> bool:
    """Read the next ``n`` tokens of the job's current row into its cache and sum; returns
    whether the row is done (its vector is then appended)."""
    import mlx.core as mx

    from appliance.engine.kvcache import sequence_cache

    row = job.rows[len(job.vectors)]
    if job.cache is None:
        job.cache = sequence_cache(model)
    chunk = mx.array(list(row[job.at:job.at + n]))[None]
    hidden = _body(model)(chunk, cache=job.cache).astype(mx.float32)[0]
    part = hidden.sum(axis=0)
    job.total = part if job.total is None else job.total + part
    mx.eval(job.total, [c.state for c in job.cache])
    job.at += n
    if job.at < len(row):
        return False
    vector = _unit(job.total / len(row))
    mx.eval(vector)
    job.vectors.append([float(v) for v in vector.tolist()])
    job.at, job.cache, job.total = 0, None, None
    return True


class Embedder:
    """The engine thread's queue of embedding jobs (``submit`` from any thread)."""

    def __init__(self, model: Any, pad: int, batch_tokens: int = BATCH_TOKENS,
                 chunk_tokens: int = CHUNK_TOKENS) -> None:
        self.model = model
        self.pad = pad
        self.batch_tokens = batch_tokens
        self.chunk_tokens = chunk_tokens
        self._jobs: deque[EmbedJob] = deque()
        self._lock = threading.Lock()
        self.cancelled_total = 0
        self.tokens_total = 0
        self.log: deque[tuple[int, int]] = deque(maxlen=LOG_PIECES)
        """Recent pieces: (the caller's ``mark``, tokens read), oldest first; a piece is
        logged before its job's ``done`` is called."""

    def submit(self, job: EmbedJob) -> None:
        with self._lock:
            self._jobs.append(job)

    @property
    def pending(self) -> bool:
        return bool(self._jobs)

    def __len__(self) -> int:
        return len(self._jobs)

    def next_job(self, order: Callable[[str], float] | None = None) -> EmbedJob | None:
        """The job to read next: cancelled ones leave first (their KV freed, logged, their
        ``done`` told); then the one whose user ``order`` ranks lowest (their fairness
        counter), the oldest among equals."""
        with self._lock:
            gone = [j for j in self._jobs if j.cancelled.is_set()]
            if gone:
                self._jobs = deque(j for j in self._jobs if not j.cancelled.is_set())
            jobs = list(self._jobs)
        for job in gone:
            job.cache = job.total = None
            self.cancelled_total += 1
            log.info("embedding cancelled id=%s rows=%d/%d tokens_read=%d of=%d",
                     job.request_id, len(job.vectors), len(job.rows), job.read, job.tokens)
            self._hand(job, None, CANCELLED)
        if not jobs:
            return None
        if order is None:
            return jobs[0]
        return min(jobs, key=lambda j: order(j.user))  # min keeps the oldest of equals

    def step(self, tokens: int, order: Callable[[str], float] | None = None,
             mark: int = 0) -> Piece | None:
        """Read at most ``tokens`` tokens (at least one) of the next job: whole rows
        together when the next ones fit (none longer than ``chunk_tokens``), else a chunk
        of the current row (at most ``chunk_tokens``). None: no work."""
        job = self.next_job(order)
        if job is None:
            return None
        tokens = max(tokens, 1)
        start = len(job.vectors)
        offset = job.at
        take = self._whole_rows(job, min(tokens, self.batch_tokens), self.chunk_tokens)
        try:
            if take:
                rows = job.rows[start:start + take]
                job.vectors.extend(pooled(self.model, rows, self.pad))
                piece = Piece(job.user, take, max(len(r) for r in rows), 0,
                              sum(len(r) for r in rows))
            else:
                n = min(tokens, self.chunk_tokens, len(job.rows[start]) - job.at)
                read_chunk(self.model, job, n)
                piece = Piece(job.user, 1, n, offset, n)
        except Exception as exc:
            log.error("embedding failed id=%s rows=%d: %s", job.request_id, take or 1,
                      type(exc).__name__)
            self._finish(job, None, "inference backend error")
            return Piece(job.user, 0, 0, 0, 0)
        job.read += piece.tokens
        self.tokens_total += piece.tokens
        self.log.append((mark, piece.tokens))
        if len(job.vectors) == len(job.rows):
            self._finish(job, job.vectors, None)
        return piece

    @staticmethod
    def _whole_rows(job: EmbedJob, tokens: int, widest: int) -> int:
        """How many of the next rows one forward reads whole within ``tokens`` padded
        tokens, none longer than ``widest`` (0: the current row is read in chunks)."""
        if job.at:
            return 0
        start, take, width = len(job.vectors), 0, 0
        while start + take < len(job.rows):
            wider = max(width, len(job.rows[start + take]))
            if (take + 1) * wider > tokens or wider > widest:
                break
            take, width = take + 1, wider
        return take

    def fail_all(self, reason: str) -> None:
        with self._lock:
            jobs, self._jobs = list(self._jobs), deque()
        for job in jobs:
            job.cache = job.total = None
            self._hand(job, None, reason)

    def _finish(self, job: EmbedJob, vectors: Vectors | None, error: str | None) -> None:
        with self._lock:
            if job in self._jobs:
                self._jobs.remove(job)
        job.cache = job.total = None
        self._hand(job, vectors, error)

    @staticmethod
    def _hand(job: EmbedJob, vectors: Vectors | None, error: str | None) -> None:
        try:
            job.done(vectors, error)
        except Exception as exc:  # the caller's hand-off; nobody else's job
            log.error("embedding hand-off failed: %s", type(exc).__name__)
