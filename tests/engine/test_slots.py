"""The decode batch's KV in slots (appliance/engine/slots.py), on the real demo model: a row
joins and leaves without copying the other rows, the buffers grow one layer a step, and every
row's numbers stay those of its own forward (greedy tokens equal, logits within fp32
rounding) through joins, leaves, growth and a longer row joining."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from appliance.engine.batch import DecodeBatch, new_sequence_cache, prefill
from appliance.engine.model import load_model
from appliance.engine.slots import SlotBatch
from tests.devices import EXACT_BATCHES
from tests.helpers import NATIVE

ATOL = 1e-4


def _tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in mx.random.randint(3, 4000, (n,), key=mx.random.key(seed)).tolist()]


class Alone:
    """One sequence in its own cache, stepped by the model's own forward: the reference."""

    def __init__(self, model: Any, n: int, seed: int) -> None:
        self.model = model
        self.cache = new_sequence_cache(model)
        self.prompt = _tokens(n, seed)
        first = prefill(model, self.cache, self.prompt, True)
        assert first is not None
        self.first = first[0]
        """The prompt's last-position logits."""

    def step(self, token: int) -> mx.array:
        return self.model(mx.array([[token]]), cache=self.cache)[0, -1]


@pytest.fixture(scope="module")
def model(demo_model: Path) -> Any:
    return load_model(demo_model, fast_cpu_ops=True, native=NATIVE).model


def _join(batch: DecodeBatch, rid: int, alone: Alone) -> None:
    copy = new_sequence_cache(batch.model)
    for mine, theirs in zip(copy, alone.cache, strict=True):
        mine.update_and_fetch(theirs.keys[..., :theirs.offset, :],
                              theirs.values[..., :theirs.offset, :])
    batch.add(rid, copy)


def _address(buffer: Any) -> int:
    return int(np.asarray(buffer).ctypes.data)


def _same(batch: DecodeBatch, seqs: dict[int, Alone], inputs: dict[int, int]) -> dict[int, int]:
    """One step of the batch against each row alone; the next greedy token of each row."""
    logits = batch.step([inputs[rid] for rid in batch.rids])
    mx.eval(logits)
    out = {}
    for i, rid in enumerate(batch.rids):
        want = seqs[rid].step(inputs[rid])
        assert mx.allclose(logits[i], want, atol=ATOL).item(), f"row {rid}"
        assert int(logits[i].argmax()) == int(want.argmax())
        out[rid] = int(want.argmax())
    return out


@EXACT_BATCHES
def test_a_row_joins_and_leaves_without_copying_the_others(
        model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("appliance.engine.slots.AHEAD_BYTES", 1)  # the floor: a layer a step
    batch = DecodeBatch(model, max_rows=4)
    assert batch.slots is not None
    seqs = {rid: Alone(model, n, rid) for rid, n in enumerate((300, 280, 310, 40))}
    inputs = dict.fromkeys(seqs, 5)
    for rid in (0, 1, 2):
        _join(batch, rid, seqs[rid])
    layers = len(model.model.layers)
    for _ in range(layers):  # the steps before it make a free slot, one layer a step
        before = batch.slots.reallocations
        inputs.update(_same(batch, seqs, inputs))
        assert batch.slots.reallocations - before <= 1
    assert min(c.row_capacity for c in batch.slots.layers) == 4
    copies = batch.slots.reallocations
    _join(batch, 3, seqs[3])  # a short chat turn into a batch of documents: a slot write
    assert batch.slots.reallocations == copies
    for _ in range(3):
        inputs.update(_same(batch, seqs, inputs))
    where = [_address(b) for c in batch.slots.layers for b in (c.keys, c.values)]
    taken = batch.extract(0)  # what the prompt cache keeps of a finished row
    kept = [np.array(c.keys) for c in taken]
    batch.remove({0})  # the last row moves into the hole, in place
    assert batch.rids == [3, 1, 2] and batch.slots.reallocations == copies
    assert [_address(b) for c in batch.slots.layers for b in (c.keys, c.values)] == where
    assert all((np.asarray(c.keys) == k).all() for c, k in zip(taken, kept, strict=True))
    for _ in range(3):
        inputs.update(_same(batch, seqs, inputs))
    batch.remove({1, 2})  # only the short row is left: attention reads only its positions
    assert batch.rids == [3] and batch.padded_len == 40 + 6
    inputs.update(_same(batch, seqs, inputs))


@EXACT_BATCHES
def test_the_buffers_grow_one_layer_a_step(model: Any) -> None:
    batch = DecodeBatch(model, max_rows=2)
    assert batch.slots is not None
    seqs = {0: Alone(model, 200, 0), 1: Alone(model, 150, 1)}
    for rid in seqs:
        _join(batch, rid, seqs[rid])
    inputs = dict.fromkeys(seqs, 7)
    grew: list[int] = []
    first = batch.slots.layers[0]
    for _ in range(first.base + first.capacity - batch.padded_len + 8):  # past its end
        before = batch.slots.reallocations
        inputs.update(_same(batch, seqs, inputs))
        grew.append(batch.slots.reallocations - before)
    assert sum(grew) == len(model.model.layers), "every layer grew once"
    assert max(grew) == 1, "one layer a step"


@EXACT_BATCHES
@pytest.mark.parametrize("ahead", [1, 1 << 20])
def test_a_free_slot_is_made_a_few_layers_a_step(model: Any, monkeypatch: pytest.MonkeyPatch,
                                                 ahead: int) -> None:
    """Nobody can foresee when a row joins: slots for more rows are made ahead of need in
    layers of at most ``AHEAD_BYTES`` a step (at least one), and the row then joins without
    a copy."""
    monkeypatch.setattr("appliance.engine.slots.AHEAD_BYTES", ahead)
    batch = DecodeBatch(model, max_rows=4)
    assert batch.slots is not None
    seqs = {0: Alone(model, 200, 0), 1: Alone(model, 150, 1), 2: Alone(model, 60, 2)}
    _join(batch, 0, seqs[0])
    _join(batch, 1, seqs[1])
    inputs = dict.fromkeys(seqs, 7)
    layer_bytes = batch.slots.layers[0].nbytes
    grew: list[int] = []
    while min(c.row_capacity for c in batch.slots.layers) < 3:
        before = batch.slots.reallocations
        inputs.update(_same(batch, seqs, inputs))
        grew.append(batch.slots.reallocations - before)
    assert sum(grew) == len(model.model.layers)
    assert max(grew) == max(1, ahead // layer_bytes) < len(model.model.layers), grew
    copies = batch.slots.reallocations
    _join(batch, 2, seqs[2])
    assert batch.slots.reallocations == copies
    inputs.update(_same(batch, seqs, inputs))


@EXACT_BATCHES
def test_a_longer_row_joins_a_batch_of_short_ones(model: Any) -> None:
    """A row that starts before the buffers' window: each layer is copied into a new one,
    and the rows already in keep their numbers."""
    batch = DecodeBatch(model, max_rows=1)  # row capacity grows past the setting
    assert batch.slots is not None
    seqs = {0: Alone(model, 20, 0), 1: Alone(model, 30, 1), 2: Alone(model, 600, 2)}
    inputs = dict.fromkeys(seqs, 9)
    _join(batch, 0, seqs[0])
    _join(batch, 1, seqs[1])
    inputs.update(_same(batch, seqs, inputs))
    copies = batch.slots.reallocations
    _join(batch, 2, seqs[2])
    assert batch.slots.reallocations == copies + len(model.model.layers)
    for _ in range(3):
        inputs.update(_same(batch, seqs, inputs))
    assert batch.padded_len == 600 + 3


@EXACT_BATCHES
def test_a_long_row_announced_ahead_joins_without_a_copy(model: Any) -> None:
    """A document still being read will join a batch of short rows: its room is made a
    share of the layers each step before (:meth:`SlotBatch.expect`), so its join, which
    copied every layer at once, copies none."""
    batch = DecodeBatch(model, max_rows=4)
    assert batch.slots is not None
    seqs = {0: Alone(model, 20, 0), 1: Alone(model, 30, 1), 2: Alone(model, 600, 2)}
    inputs = dict.fromkeys(seqs, 9)
    _join(batch, 0, seqs[0])
    _join(batch, 1, seqs[1])
    layers = len(model.model.layers)
    ticks = 3
    grew = []
    for left in range(ticks, 0, -1):
        batch.expect(1, 600, left)
        before = batch.slots.reallocations
        inputs.update(_same(batch, seqs, inputs))
        grew.append(batch.slots.reallocations - before)
    assert sum(grew) == layers and max(grew) == -(-layers // ticks), grew
    batch.expect(0, 0, 1)
    copies = batch.slots.reallocations
    _join(batch, 2, seqs[2])
    assert batch.slots.reallocations == copies
    for _ in range(3):
        inputs.update(_same(batch, seqs, inputs))


@EXACT_BATCHES
def test_a_row_taken_out_holds_its_own_kv(model: Any) -> None:
    batch = DecodeBatch(model)
    seqs = {0: Alone(model, 90, 0), 1: Alone(model, 50, 1)}
    for rid in seqs:
        _join(batch, rid, seqs[rid])
    _same(batch, seqs, dict.fromkeys(seqs, 4))
    row = batch.extract(1)
    for mine, theirs in zip(row, seqs[1].cache, strict=True):
        assert mine.offset == theirs.offset == 51
        assert mx.allclose(mine.keys, theirs.keys[..., :51, :], atol=ATOL).item()
        assert mx.allclose(mine.values, theirs.values[..., :51, :], atol=ATOL).item()


def _rows(lengths: list[int], dtype: Any) -> list[list[tuple[mx.array, mx.array]]]:
    """Rows of two layers, every position of row ``r`` holding ``r + 1`` (values negated)."""
    return [[(mx.full((1, 2, n, 4), r + 1, dtype), mx.full((1, 2, n, 4), -(r + 1), dtype))
             for _ in range(2)] for r, n in enumerate(lengths)]


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_rows_leave_and_are_taken_out_in_every_kv_dtype(
        dtype: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 (a Mac's KV) has no NumPy dtype: a row leaving such a batch raised. Rows
    past the new end fill the holes, each moved once; a copy taken out is its own."""
    batch = SlotBatch(2, 4)
    batch.join(_rows([5, 7, 6, 3], dtype))
    taken = batch.extract(1)
    assert [c.offset for c in taken] == [7, 7] and taken[0].keys.dtype == dtype
    moves: list[list[tuple[int, int]]] = []
    move = batch._move
    monkeypatch.setattr(batch, "_move", lambda m: (moves.append(m), move(m)))
    assert batch.remove({0, 1, 2}) == [3]
    assert moves == [[(3, 0)]]
    for c in batch.layers:
        keys, values = c.row(0)
        assert keys.shape[2] == 3 and keys.dtype == dtype
        assert (np.array(keys.astype(mx.float32)) == 4).all()
        assert (np.array(values.astype(mx.float32)) == -4).all()
    for c in taken:  # written over by the move, the batch's slot 1 is not the copy's
        assert (np.array(c.keys.astype(mx.float32)) == 2).all()
        assert (np.array(c.values.astype(mx.float32)) == -2).all()


@EXACT_BATCHES
def test_prompts_read_straight_into_an_empty_batch(model: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Fresh prompts arriving together while nothing decodes are read by one forward into
    the batch's own slots (left-padded): each row's first logits and later steps are those
    of its own forward, there is a free slot for the next row, and nothing was copied."""
    batch = DecodeBatch(model, max_rows=8)
    assert batch.slots is not None
    seqs = {rid: Alone(model, n, rid) for rid, n in enumerate((40, 25, 33))}
    logits = batch.prefill(list(seqs), [a.prompt for a in seqs.values()])
    for i, (rid, alone) in enumerate(seqs.items()):
        assert mx.allclose(logits[i], alone.first, atol=ATOL).item(), f"row {rid}"
        assert int(logits[i].argmax()) == int(alone.first.argmax())
    assert batch.rids == [0, 1, 2] and batch.padded_len == 40
    assert all(c.row_capacity == 6 and c.pending is None for c in batch.slots.layers)
    inputs = dict.fromkeys(seqs, 11)
    for _ in range(3):
        inputs.update(_same(batch, seqs, inputs))
    seqs[3] = Alone(model, 30, 3)
    _join(batch, 3, seqs[3])
    assert batch.slots.reallocations == 0
    inputs[3] = 11
    inputs.update(_same(batch, seqs, inputs))

    def broken(*_: Any) -> Any:
        raise RuntimeError("forward failed")

    empty = DecodeBatch(model, max_rows=8)
    assert empty.slots is not None
    monkeypatch.setattr("appliance.engine.batch.last_logits", broken)
    with pytest.raises(RuntimeError):
        empty.prefill([5, 6], [seqs[0].prompt, seqs[1].prompt])
    assert empty.rids == [] and empty.slots.rows == 0 and empty.padded_len == 0
    assert all(c.keys is None and c.pending is None for c in empty.slots.layers)
