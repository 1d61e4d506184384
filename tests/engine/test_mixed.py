"""Prompt chunks read in the decode step's forward (appliance/engine/mixed.py), on the real
demo model: each part gets the numbers of its own forward, a failed forward leaves every
cache as it was, and the engine's greedy output is the same with and without it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from appliance.engine.batch import DecodeBatch, new_sequence_cache, prefill
from appliance.engine.mixed import decode_mask, supports_mixed
from appliance.engine.model import load_model
from appliance.engine.request import GenerationRequest, RequestHandle, TokenEvent
from appliance.engine.runner import Runner
from appliance.sched.scheduler import Scheduler
from appliance.sched.types import SchedulerConfig
from tests.devices import EXACT_BATCHES
from tests.helpers import NATIVE

ATOL = 1e-4
"""fp32 sums of the same products in another grouping of rows."""


def _tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in mx.random.randint(3, 4000, (n,), key=mx.random.key(seed)).tolist()]


def _batch(model: Any, lengths: list[int]) -> DecodeBatch:
    """A decode batch of rows with prompts of ``lengths`` (left-padded to the longest)."""
    batch = DecodeBatch(model)
    for i, n in enumerate(lengths):
        cache = new_sequence_cache(model)
        prefill(model, cache, _tokens(n, i), False)
        batch.add(i, cache)
    return batch


def _kv(cache: list[Any]) -> list[mx.array]:
    return [c.state[0][..., :c.offset, :] for c in cache]


@pytest.fixture(scope="module")
def model(demo_model: Path) -> Any:
    loaded = load_model(demo_model, fast_cpu_ops=True, native=NATIVE)
    assert supports_mixed(loaded.model)
    return loaded.model


@EXACT_BATCHES
def test_each_part_of_a_mixed_forward_gets_its_own_forwards_numbers(model: Any) -> None:
    lengths = [40, 23, 57]
    inputs = [11, 12, 13]
    fresh, deep = _tokens(19, 7), _tokens(12, 8)

    alone = _batch(model, lengths)
    want = mx.array(alone.step(inputs))
    fresh_cache = new_sequence_cache(model)
    fresh_want = prefill(model, fresh_cache, fresh, True)
    deep_cache = new_sequence_cache(model)
    prefill(model, deep_cache, _tokens(30, 9), False)
    prefill(model, deep_cache, deep, False)

    mixed = _batch(model, lengths)
    fresh_mixed = new_sequence_cache(model)
    deep_mixed = new_sequence_cache(model)
    prefill(model, deep_mixed, _tokens(30, 9), False)
    logits, lasts = mixed.step_mixed(inputs, [(fresh_mixed, fresh, True),
                                              (deep_mixed, deep, False)])

    assert logits.shape == want.shape
    assert mx.allclose(logits, want, atol=ATOL).item()
    assert (logits.argmax(-1) == want.argmax(-1)).all().item()
    assert lasts[1] is None and lasts[0] is not None and fresh_want is not None
    assert mx.allclose(lasts[0], fresh_want, atol=ATOL).item()
    # every cache advanced as its own forward advanced it, with the same keys
    assert mixed.padded_len == alone.padded_len
    for ours, theirs in ((fresh_mixed, fresh_cache), (deep_mixed, deep_cache)):
        assert [c.offset for c in ours] == [c.offset for c in theirs]
        for a, b in zip(_kv(ours), _kv(theirs), strict=True):
            assert mx.allclose(a, b, atol=ATOL).item()
    # and the next decode step of the batch is the same after either
    assert mx.allclose(mixed.step([1, 2, 3]), alone.step([1, 2, 3]), atol=ATOL).item()


def test_a_decode_step_has_the_numbers_of_the_models_own_forward(model: Any) -> None:
    """The plain decode step runs mixed_step (2-D hidden states, weights transposed once,
    no mask for rows none of which is padded): the same bits as mlx-lm's model call, with
    left-padded rows and for the one row left after the others finished."""
    lengths = [40, 23, 57]
    lean, own = _batch(model, lengths), _batch(model, lengths)
    own.lean = False
    assert lean.lean
    inputs = [11, 12, 13]
    for _ in range(3):
        ours, theirs = lean.step(inputs), own.step(inputs)
        assert mx.array_equal(ours, theirs).item()
        inputs = ours.argmax(-1).tolist()
    for batch in (lean, own):
        batch.remove({0, 2})
    assert decode_mask(lean.layers[0], mx.zeros((1, 4))) is None  # no padding
    inputs = [inputs[1]]
    for _ in range(3):
        ours, theirs = lean.step(inputs), own.step(inputs)
        assert mx.array_equal(ours, theirs).item()
        inputs = ours.argmax(-1).tolist()


def test_a_failed_mixed_forward_leaves_every_cache_as_it_was(model: Any) -> None:
    batch = _batch(model, [20, 31])
    chunk_cache = new_sequence_cache(model)
    prefill(model, chunk_cache, _tokens(10, 3), False)
    padded, offsets = batch.padded_len, [c.offset for c in chunk_cache]
    layer = model.model.layers[2]

    def broken(x: mx.array) -> mx.array:
        raise RuntimeError("a kernel failed")

    norm = layer.post_attention_layernorm
    layer.post_attention_layernorm = broken
    try:
        with pytest.raises(RuntimeError, match="a kernel failed"):
            batch.step_mixed([5, 6], [(chunk_cache, _tokens(8, 4), True)])
    finally:
        layer.post_attention_layernorm = norm

    assert batch.padded_len == padded
    assert [c.offset for c in chunk_cache] == offsets
    fresh = _batch(model, [20, 31])
    assert mx.allclose(batch.step([5, 6]), fresh.step([5, 6]), atol=ATOL).item()


def _run(loaded: Any, mixed: bool) -> tuple[list[list[int]], int]:
    """Two streams decoding, then a long prompt and two short ones arriving while they do
    (chunks of them read beside the streams); greedy tokens of each, and the mixed
    forwards the runner ran."""
    runner = Runner(loaded, Scheduler(SchedulerConfig(prefill_chunk_size=24)), time.monotonic,
                    None, mixed=mixed)
    tok = loaded.tokenizer

    def chat(text: str) -> tuple[int, ...]:
        return tuple(tok.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True))

    sinks: list[list[object]] = []

    def submit(text: str, max_tokens: int) -> None:
        sink: list[object] = []
        sinks.append(sink)
        runner.take([RequestHandle(GenerationRequest(prompt=chat(text), max_tokens=max_tokens),
                                   sink.append)])

    submit("Tell me about the sea.", 40)
    submit("What is a tree?", 40)
    for _ in range(3):
        runner.tick()
    submit(" ".join(["Lists, tuples and sets are the kinds of collection."] * 12), 10)
    submit("What is a list?", 12)
    runner.tick()
    submit("What is a dictionary?", 12)
    while runner.tick():
        pass
    return [[e.token for e in sink if isinstance(e, TokenEvent)] for sink in sinks], \
        runner.mixed_forwards


def test_greedy_output_is_the_same_with_chunks_read_in_the_decode_step(
        demo_model: Path) -> None:
    loaded = load_model(demo_model, fast_cpu_ops=True, native=NATIVE)
    apart, none = _run(loaded, mixed=False)
    together, mixed = _run(loaded, mixed=True)
    assert none == 0 and mixed >= 5, "the long prompt's chunks rode in decode steps"
    assert together == apart
    assert all(len(tokens) > 0 for tokens in together)


def test_a_prompt_that_fails_beside_decoding_streams_ends_alone(demo_model: Path) -> None:
    """A fault while a prompt is read in the decode step's forward: the forward is undone,
    the parts are read one forward each, and only the culprit ends."""
    def fault(request: GenerationRequest, phase: str) -> None:
        if request.max_tokens == 13 and phase == "prefill":
            raise RuntimeError("injected into the prefill")

    loaded = load_model(demo_model, fast_cpu_ops=True, native=NATIVE)
    runs = []
    for hook in (None, fault):
        runner = Runner(loaded, Scheduler(SchedulerConfig()), time.monotonic, hook)
        events: list[list[Any]] = [[], [], []]
        prompts = [(5, 6, 7), (5, 6, 8), tuple(range(10, 60))]
        for i, (prompt, n) in enumerate(zip(prompts, (20, 20, 13), strict=True)):
            runner.take([RequestHandle(GenerationRequest(prompt=prompt, max_tokens=n),
                                       events[i].append)])
            if i == 1:
                runner.tick()  # the two streams decode before the third prompt comes
        while runner.tick():
            pass
        runs.append(([[e.token for e in ev if isinstance(e, TokenEvent)] for ev in events],
                     [ev[-1].reason for ev in events], runner.mixed_forwards))
    (clean, clean_reasons, clean_mixed), (faulty, faulty_reasons, faulty_mixed) = runs
    assert clean_mixed > 0 and faulty_mixed == 0  # the third prompt rode, or fell back
    assert faulty_reasons == [*clean_reasons[:2], "error"]
    assert faulty[:2] == clean[:2]


def test_a_chat_turn_of_someone_with_nothing_streaming_is_read_in_a_forward_of_its_own(
        demo_model: Path) -> None:
    """Beside user 1's two streams, user 2's chat turn is read in a forward of its own (the
    runner reads such forwards before the decode step, so its first token does not wait for
    the step); the same turn of user 1 rides in the step. Either way its first token comes
    in that tick."""
    loaded = load_model(demo_model, fast_cpu_ops=True, native=NATIVE)
    runner = Runner(loaded, Scheduler(SchedulerConfig(prefill_chunk_size=0)), time.monotonic,
                    None)

    def submit(user_id: int, prompt: tuple[int, ...], n: int) -> int:
        request = GenerationRequest(prompt=prompt, max_tokens=n, user_id=user_id)
        runner.take([RequestHandle(request, lambda event: None)])
        return request.rid

    submit(1, (5, 6, 7), 30)
    submit(1, (5, 6, 8), 30)
    for _ in range(3):
        runner.tick()
    for user_id, rides in ((2, False), (1, True)):
        mixed, apart = runner.mixed_forwards, runner.costs.prefill_fit.observations
        rid = submit(user_id, tuple(range(10, 40)), 4)
        runner.tick()
        assert runner.mixed_forwards == mixed + rides
        assert runner.costs.prefill_fit.observations == apart + (not rides)
        assert runner.seqs[rid].first_token_at is not None


def test_a_document_read_beside_streams_joins_them_without_a_copy(demo_model: Path) -> None:
    """While a long prompt is read in chunks beside two short streams, the runner tells the
    batch it will join (``SlotBatch.expect``), and the batch makes its room a share of the
    layers a tick: no tick copies every layer, as the join alone did before."""
    loaded = load_model(demo_model, fast_cpu_ops=True, native=NATIVE)
    runner = Runner(loaded, Scheduler(SchedulerConfig(prefill_chunk_size=24)), time.monotonic,
                    None)
    slots = runner.batch.slots
    assert slots is not None
    layers = len(slots.layers)

    def submit(prompt: list[int], max_tokens: int) -> list[object]:
        sink: list[object] = []
        runner.take([RequestHandle(GenerationRequest(prompt=tuple(prompt),
                                                     max_tokens=max_tokens), sink.append)])
        return sink

    submit([5, 6, 7, 8], 60)
    submit([9, 10, 11], 60)
    for _ in range(3):
        runner.tick()
    document = submit([3 + i % 300 for i in range(400)], 4)
    copied = []
    while not any(isinstance(e, TokenEvent) for e in document):
        before = slots.reallocations
        assert runner.tick()
        copied.append(slots.reallocations - before)
    runner.tick()  # its row joined after the tick that read its last chunk
    assert len(runner.batch.rids) == 3
    assert sum(copied) >= layers, "the document's room was made"
    assert max(copied) < layers, copied
    logged = [r.kv_copies for r in runner.timing.log][-len(copied) - 1:-1]
    assert logged == copied, "the tick log names each tick's copies"


def test_the_tick_log_counts_the_rows_that_join_and_leave(demo_model: Path) -> None:
    """A tick in which rows finish does host work the cost model does not see (their KV
    copied into the prompt cache, their slots filled, their streams ended): the tick log
    says how many rows left and joined, so such a tick explains its own length."""
    loaded = load_model(demo_model, fast_cpu_ops=True, native=NATIVE)
    runner = Runner(loaded, Scheduler(SchedulerConfig()), time.monotonic, None)
    for prompt, n in (([5, 6, 7, 8], 3), ([9, 10, 11], 4), ([12, 13], 9)):
        runner.take([RequestHandle(GenerationRequest(prompt=tuple(prompt), max_tokens=n),
                                   lambda _event: None)])
    while runner.tick():
        pass
    log = list(runner.timing.log)
    assert sum(r.joined for r in log) == 3 and sum(r.left for r in log) == 3
    assert log[-1].left >= 1 and log[-1].decode_rows >= 1  # the last row ended in the last
    assert "left=" in log[-1].describe() and "joined=" in log[-1].describe()
