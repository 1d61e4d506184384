"""Embeddings on the engine thread: pooled, normalised, the same alone as in a batch, and
read a bounded batch at a time between ticks."""

from __future__ import annotations

import math
import queue
from pathlib import Path

from appliance.engine.embed import Embedder, EmbedJob, pooled
from appliance.engine.model import load_model
from tests.devices import EXACT_BATCHES

ROWS = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12], [1, 2, 3, 4, 5, 6, 7], [13]]


@EXACT_BATCHES
def test_vectors_are_unit_length_and_do_not_depend_on_their_batch(tiny_model: Path) -> None:
    loaded = load_model(tiny_model, 0)
    together = pooled(loaded.model, ROWS, 0)
    alone = [pooled(loaded.model, [r], 0)[0] for r in ROWS]
    for a, b in zip(together, alone, strict=True):
        assert math.isclose(sum(x * x for x in a), 1.0, rel_tol=1e-4)
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4  # pads unread
    assert together[0] == together[3] and together[0] != together[1]


@EXACT_BATCHES
def test_a_job_is_read_one_bounded_batch_per_step(tiny_model: Path) -> None:
    loaded = load_model(tiny_model, 0)
    embedder = Embedder(loaded.model, 0, batch_tokens=8)
    got: queue.SimpleQueue[tuple[object, object]] = queue.SimpleQueue()
    embedder.submit(EmbedJob(ROWS, lambda v, e: got.put((v, e))))
    steps = 0
    while embedder.step():
        steps += 1
    vectors, error = got.get_nowait()
    assert error is None and steps == 4  # [7], [2, 3] (6 padded), [7], [1]
    expected = pooled(loaded.model, ROWS, 0)
    assert isinstance(vectors, list)
    for a, b in zip(vectors, expected, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4
