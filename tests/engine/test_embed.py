"""Embeddings on the engine thread: pooled, normalised, the same alone as in a batch, and
read a bounded piece at a time after the ticks."""

from __future__ import annotations

import math
import queue
from pathlib import Path

from appliance.engine.embed import CANCELLED, Embedder, EmbedJob, pooled
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
    # the same text twice in one batch: the same vector up to the rounding of the products
    # the rows share (35 tokens go to OpenBLAS, whose AVX-512 kernels tile rows unevenly)
    assert max(abs(x - y) for x, y in zip(together[0], together[3], strict=True)) < 1e-6
    assert together[0] != together[1]


@EXACT_BATCHES
def test_a_job_is_read_one_bounded_piece_per_step(tiny_model: Path) -> None:
    loaded = load_model(tiny_model, 0)
    embedder = Embedder(loaded.model, 0)
    got: queue.SimpleQueue[tuple[object, object]] = queue.SimpleQueue()
    embedder.submit(EmbedJob(ROWS, lambda v, e: got.put((v, e))))
    pieces = []
    while (piece := embedder.step(6)) is not None:
        pieces.append((piece.rows, piece.width, piece.offset))
    # the 7 tokens in chunks of 6 and 1; [2, 3] padded to 6; [7] again; [1]
    assert pieces == [(1, 6, 0), (1, 1, 6), (2, 3, 0), (1, 6, 0), (1, 1, 6), (1, 1, 0)]
    vectors, error = got.get_nowait()
    assert error is None
    expected = pooled(loaded.model, ROWS, 0)
    assert isinstance(vectors, list)
    for a, b in zip(vectors, expected, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4  # chunks = whole


def test_a_long_input_costs_pieces_in_proportion(demo_model: Path) -> None:
    """Twice the tokens, twice the pieces, none wider than the allowance: the work grows
    with the input as a prompt's prefill does (one whole-input forward grew ~16x for 2x
    tokens on SmolLM2)."""
    loaded = load_model(demo_model, 0)
    counts = []
    done: list[object] = []
    for n in (128, 256):
        embedder = Embedder(loaded.model, 2)
        row = [(i * 37) % 4000 + 3 for i in range(n)]
        embedder.submit(EmbedJob([row], lambda v, e: done.append(e)))
        widths = []
        while (piece := embedder.step(32)) is not None:
            widths.append(piece.width)
        assert done[-1:] == [None] and max(widths) <= 32 and sum(widths) == n
        counts.append(len(widths))
    assert counts[1] <= 2 * counts[0]


def test_a_cancelled_job_leaves_before_its_next_piece(tiny_model: Path) -> None:
    loaded = load_model(tiny_model, 0)
    embedder = Embedder(loaded.model, 0)
    got: list[object] = []
    job = EmbedJob([list(range(1, 40))], lambda v, e: got.append((v, e)))
    embedder.submit(job)
    assert embedder.step(8) is not None and job.read == 8 and job.cache is not None
    job.cancelled.set()
    assert embedder.step(8) is None
    assert got == [(None, CANCELLED)] and job.cache is None and embedder.cancelled_total == 1
