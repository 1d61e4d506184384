"""Time-budgeted ticks on the real engine: a long prompt read beside four decoding streams.

The engine books each forward's time through a meter; here the meter replaces the measured
seconds with a fixed cost law (a slow CPU's), so the engine's own clock is deterministic:
the cost model is fitted to it, the scheduler sizes chunks by it, and the test reads the
engine's tick log. No wall-clock assertion.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from appliance.app import engine_config
from appliance.engine.core import Engine
from appliance.engine.request import (
    FinishEvent,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
    blocking_sink,
)
from appliance.engine.ticks import Meter
from tests.helpers import make_settings, wait_until

TOLERANCE = 0.15
"""A tick may overrun its target by this share (the cost model's error after warm-up; the
fit depends a little on how the streams were admitted, which depends on thread timing)."""
WARM_UP = 8
"""Ticks the cost model needs before its predictions are held to the tolerance."""
STREAM_TOKENS = 800
"""Long enough that the streams outlive the long prompt's reading even when the test's
thread is slow to submit it on a loaded machine (the demo model decodes in milliseconds)."""


def slow_cpu(kind: str, rows: int, tokens: int, offset: int, measured: float) -> float:
    """About SmolLM-135M on two CPU cores, in the cost model's own family: a prompt chunk
    read in the decode step's forward (``ride``) pays no fixed cost."""
    if kind == "decode":
        return 0.045 + 0.003 * rows + 0.018 * rows * offset / 1e3
    fixed = 0.0 if kind == "ride" else 0.08
    return fixed + 1.5 * rows * tokens / 1e3 + 7.0 * rows * tokens * (offset + tokens / 2) / 1e6



@contextmanager
def _metered_engine(demo_model: Path, meter: Meter, **overrides: Any) -> Iterator[Engine]:
    """A started engine of the daemon's own assembly (``engine_config``) whose forwards are
    booked through ``meter``; stopped on the way out."""
    # No drafts: the meter prices a verify as a prompt's forward, and tests that hold the
    # engine inside a decode step would find a lone stream verifying instead (the demo
    # model's drafts come true often enough that the four arrivals met in two ticks).
    settings = make_settings(demo_model, max_batch_size=8, **{"draft_tokens": 0, **overrides})
    engine = Engine(engine_config(settings), meter=meter)
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


def _chat(engine: Engine, text: str) -> tuple[int, ...]:
    assert engine.loaded is not None
    return tuple(engine.loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True))


def _ban_eos(engine: Engine) -> SamplingParams:
    assert engine.loaded is not None
    return SamplingParams(logit_bias=tuple((t, -100.0) for t in engine.loaded.eos_token_ids))


def _drain(q: queue.SimpleQueue) -> tuple[int, FinishEvent]:  # type: ignore[type-arg]
    n = 0
    while True:
        ev = q.get(timeout=300)
        if isinstance(ev, FinishEvent):
            return n, ev
        assert isinstance(ev, TokenEvent)
        n += 1


def test_no_decode_gap_exceeds_the_tick_target_while_a_long_prompt_is_read(
        demo_model: Path) -> None:
    with _metered_engine(demo_model, slow_cpu, itl_target_ms=400.0,
                         prompt_cache_entries=0) as engine:
        ban_eos = _ban_eos(engine)
        streams = []
        for i in range(4):
            q: queue.SimpleQueue = queue.SimpleQueue()  # type: ignore[type-arg]
            engine.submit(GenerationRequest(prompt=(5, 6, 7, 8 + i), max_tokens=STREAM_TOKENS,
                                            sampling=ban_eos), blocking_sink(q))
            streams.append(q)
        wait_until(lambda: engine.snapshot.active == 4 and all(
            s.state == "decoding" for s in engine.snapshot.slots), what="4 streams decoding")
        long_q: queue.SimpleQueue = queue.SimpleQueue()  # type: ignore[type-arg]
        prompt = tuple(10 + (i * 37) % 4000 for i in range(1500))
        engine.submit(GenerationRequest(prompt=prompt, max_tokens=4, sampling=ban_eos),
                      blocking_sink(long_q))
        assert _drain(long_q)[1].reason == "length"
        assert all(_drain(q) [1].reason == "length" for q in streams)
        wait_until(lambda: engine.snapshot.active == 0, what="idle")
        log = engine.tick_log()

    # the long prompt came after all four streams decoded (the ticks that admitted them
    # may read several of their prompts beside the first one's decode step)
    streams_up = next(i for i, t in enumerate(log) if t.decode_rows >= 4)
    reading = [t for t in log[streams_up:] if t.prefill_tokens and t.decode_rows]
    assert sum(t.prefill_tokens for t in reading) >= 1500 - 16, "the prompt was read in chunks"
    assert len(reading) >= 5
    # every tick of the long prompt carried a decode step of the four streams: their decode
    # gap is one tick, never a tick of prefill alone
    first = log.index(reading[0])
    last = log.index(reading[-1])
    assert all(t.decode_rows >= 4 for t in log[first:last + 1])
    # and no such tick outlasted its target by more than the tolerance
    for t in reading[WARM_UP:]:
        assert t.target_s is not None
        assert t.measured_s <= t.target_s * (1 + TOLERANCE), t


def test_a_tick_far_over_its_target_is_counted_and_logged(
        demo_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A forward that takes far longer than predicted (a busy machine, a bad fit) shows in
    ``/metrics`` (the snapshot's counter) and in the log, with the tick's numbers."""
    stalled = 30.0

    def one_stall(kind: str, rows: int, tokens: int, offset: int, measured: float) -> float:
        if kind == "prefill" and offset == 0:  # the prompt's first chunk
            return stalled
        return slow_cpu(kind, rows, tokens, offset, measured)

    with _metered_engine(demo_model, one_stall, itl_target_ms=400.0,
                         prompt_cache_entries=0) as engine:
        with caplog.at_level(logging.INFO, logger="appliance.engine.runner"):
            q: queue.SimpleQueue = queue.SimpleQueue()  # type: ignore[type-arg]
            engine.submit(GenerationRequest(prompt=tuple(range(10, 310)), max_tokens=2),
                          blocking_sink(q))
            assert _drain(q)[1].reason in ("length", "stop")
            wait_until(lambda: engine.snapshot.active == 0, what="idle")
        assert engine.snapshot.ticks_over_target == 1
    lines = [r.getMessage() for r in caplog.records if "tick over target" in r.getMessage()]
    assert len(lines) == 1 and "measured_ms=30000" in lines[0], lines


def test_arrivals_that_share_only_the_template_opening_are_read_in_one_forward(
        demo_model: Path) -> None:
    """A user's earlier request leaves its KV in the prompt cache, and every later chat
    prompt of theirs starts with the same few template tokens. Those few are not reused,
    so four prompts arriving together go through the model in one forward (before, each
    was a cache hit read alone, paying a forward's fixed cost per arrival). The engine is
    held inside a decode step while they are submitted, so they meet in one tick."""
    hold = threading.Event()
    release = threading.Event()
    forwards: list[tuple[str, int, int]] = []

    def meter(kind: str, rows: int, tokens: int, offset: int, measured: float) -> float:
        forwards.append((kind, rows, offset))
        if kind == "decode" and hold.is_set() and not release.is_set():
            release.wait(timeout=60)
        return slow_cpu(kind, rows, tokens, offset, measured)

    with _metered_engine(demo_model, meter, itl_target_ms=400.0) as engine:
        try:
            first: queue.SimpleQueue = queue.SimpleQueue()  # type: ignore[type-arg]
            engine.submit(GenerationRequest(prompt=_chat(engine, "Hi"), max_tokens=4,
                                            user_id=1), blocking_sink(first))
            _drain(first)
            ban_eos = _ban_eos(engine)
            stream: queue.SimpleQueue = queue.SimpleQueue()  # type: ignore[type-arg]
            engine.submit(GenerationRequest(prompt=(5, 6, 7), max_tokens=200, sampling=ban_eos,
                                            user_id=2), blocking_sink(stream))
            wait_until(lambda: engine.snapshot.active == 1 and engine.snapshot.slots[0].state
                       == "decoding", what="a stream decoding")
            hold.set()
            wait_until(lambda: bool(forwards) and forwards[-1][0] == "decode",
                       what="the engine inside a decode step")
            before = len(forwards)
            arrivals = []
            for text in ("What is a list?", "What is a tuple?", "What is a set?",
                         "What is a dictionary?"):
                q: queue.SimpleQueue = queue.SimpleQueue()  # type: ignore[type-arg]
                engine.submit(GenerationRequest(prompt=_chat(engine, text), max_tokens=4,
                                                user_id=1), blocking_sink(q))
                arrivals.append(q)
            release.set()
            finished = [_drain(q)[1] for q in arrivals]
            _drain(stream)
        finally:
            release.set()  # before the engine stops: its thread may be held in the meter

    assert all(ev.usage.cached_tokens == 0 for ev in finished)
    # the first forward after the hold that reads prompts reads all four: a prefill forward
    # of four rows, or (the engine reads chunks in the decode step's forward when a batch
    # decodes) a decode step whose forward carries four fresh prompts
    after = forwards[before:]
    first = next(i for i, (kind, _, _) in enumerate(after) if kind in ("prefill", "ride"))
    if after[first][0] == "prefill":
        assert after[first][1:] == (4, 0), after
    else:
        rides = [f for f in after[first:first + 5] if f[0] == "ride"]
        assert rides == [("ride", 1, 0)] * 4, after


def test_requests_sent_together_to_an_idle_engine_are_read_in_one_forward(
        demo_model: Path) -> None:
    """The engine is idle; three chat turns arrive 100 ms apart (a household's clients, not
    quite at once). With ``gather_ms`` longer than those gaps the engine waits for the last
    before it plans, and the three are read in one prefill forward of three rows, so their
    streams start together (read apart, the first would stream while the others were read
    beside it)."""
    forwards: list[tuple[str, int]] = []

    def meter(kind: str, rows: int, tokens: int, offset: int, measured: float) -> float:
        forwards.append((kind, rows))
        return slow_cpu(kind, rows, tokens, offset, measured)

    with _metered_engine(demo_model, meter, gather_ms=500.0,
                         prompt_cache_entries=0) as engine:
        queues = []
        for i, text in enumerate(("What is a list?", "What is a tuple?", "What is a set?")):
            if i:
                threading.Event().wait(0.1)
            q: queue.SimpleQueue = queue.SimpleQueue()  # type: ignore[type-arg]
            engine.submit(GenerationRequest(prompt=_chat(engine, text), max_tokens=4,
                                            user_id=i + 1), blocking_sink(q))
            queues.append(q)
        assert all(_drain(q)[1].reason in ("stop", "length") for q in queues)
    reads = [f for f in forwards if f[0] in ("prefill", "ride")]
    assert reads[0] == ("prefill", 3), forwards


def test_a_chat_turn_of_someone_with_nothing_streaming_is_read_before_the_step(
        demo_model: Path) -> None:
    """Through the daemon's engine assembly: while user 1 streams, user 2's chat turn is
    read in a prefill forward of its own, before the decode step (its first token does not
    wait for the step); the same turn of user 1 rides in the decode step's forward."""
    forwards: list[str] = []

    def meter(kind: str, rows: int, tokens: int, offset: int, measured: float) -> float:
        forwards.append(kind)
        return slow_cpu(kind, rows, tokens, offset, measured)

    read: dict[int, set[str]] = {}
    with _metered_engine(demo_model, meter, itl_target_ms=400.0,
                         prompt_cache_entries=0) as engine:
        stream: queue.SimpleQueue = queue.SimpleQueue()  # type: ignore[type-arg]
        engine.submit(GenerationRequest(prompt=(5, 6, 7), max_tokens=STREAM_TOKENS,
                                        sampling=_ban_eos(engine), user_id=1),
                      blocking_sink(stream))
        wait_until(lambda: engine.snapshot.active == 1 and engine.snapshot.slots[0].state
                   == "decoding", what="a stream decoding")
        for user_id in (2, 1):
            before = len(forwards)
            q: queue.SimpleQueue = queue.SimpleQueue()  # type: ignore[type-arg]
            engine.submit(GenerationRequest(prompt=_chat(engine, "What is a list?"),
                                            max_tokens=2, user_id=user_id), blocking_sink(q))
            _drain(q)
            read[user_id] = {k for k in forwards[before:] if k in ("prefill", "ride")}
            wait_until(lambda: engine.snapshot.active == 1,
                       what="the turn finished and the stream still going")
        _drain(stream)
    assert read == {2: {"prefill"}, 1: {"ride"}}, read


def test_a_chat_turn_shows_its_first_token_before_the_ticks_next_forward(
        demo_model: Path) -> None:
    """bob's chat turn and the end of alice's document are read in one tick, in forwards of
    their own (the turn first). bob's first token goes out as soon as his forward ends, not
    after alice's forward too: the turn's TTFT is its own reading, not the tick's."""
    hold = threading.Event()
    held = threading.Event()
    release = threading.Event()
    order: list[str] = []  # forwards and bob's first token, in the engine thread's order

    def meter(kind: str, rows: int, tokens: int, offset: int, measured: float) -> float:
        order.append(f"{kind}:{tokens}@{offset}")
        part = any(o in ("ride:48@0", "prefill:48@0") for o in order)  # the document's first
        if kind == "decode" and hold.is_set() and part and not release.is_set():
            held.set()  # alice's document is read in part: hold the engine in this step
            release.wait(timeout=60)
        return slow_cpu(kind, rows, tokens, offset, measured)

    def bob_sink(ev: object) -> None:
        if isinstance(ev, TokenEvent) and "bob" not in order:
            order.append("bob")
        bob.put(ev)

    bob: queue.SimpleQueue = queue.SimpleQueue()  # type: ignore[type-arg]
    with _metered_engine(demo_model, meter, itl_target_ms=400.0, prefill_chunk_size=48,
                         prompt_cache_entries=0) as engine:
        try:
            ban_eos = _ban_eos(engine)
            stream: queue.SimpleQueue = queue.SimpleQueue()  # type: ignore[type-arg]
            engine.submit(GenerationRequest(prompt=(5, 6, 7), max_tokens=STREAM_TOKENS,
                                            sampling=ban_eos, user_id=1), blocking_sink(stream))
            wait_until(lambda: engine.snapshot.active == 1 and engine.snapshot.slots[0].state
                       == "decoding", what="a stream decoding")
            hold.set()  # the first decode step after a chunk of the document is held
            doc: queue.SimpleQueue = queue.SimpleQueue()  # type: ignore[type-arg]
            engine.submit(GenerationRequest(prompt=tuple(range(10, 130)), max_tokens=2,
                                            sampling=ban_eos, user_id=1), blocking_sink(doc))
            wait_until(held.is_set, what="the engine inside a decode step")
            turn = _chat(engine, "What is a list?")
            engine.submit(GenerationRequest(prompt=turn, max_tokens=2, user_id=2), bob_sink)
            release.set()
            _drain(bob)
            _drain(doc)
        finally:
            release.set()  # before the engine stops: its thread may be held in the meter
    at = order.index("bob")
    assert order[at - 1] == f"prefill:{len(turn)}@0", order  # his own forward, just before
    # and a forward of alice's document came after it in the same tick, not before it
    assert any(o.startswith("prefill:") and not o.endswith("@0") for o in order[at:at + 2]), \
        order


def test_a_stop_in_the_middle_of_work_logs_that_spells_longest_ticks(
        demo_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A run that ends with the daemon (a benchmark's last level) still names its longest
    ticks: they are logged when the spell ends, and the stop ends it."""
    caplog.set_level(logging.INFO, logger="appliance.engine.runner")
    with _metered_engine(demo_model, slow_cpu) as engine:
        q: queue.SimpleQueue = queue.SimpleQueue()  # type: ignore[type-arg]
        engine.submit(GenerationRequest(prompt=(5, 6, 7, 8), max_tokens=STREAM_TOKENS,
                                        sampling=_ban_eos(engine)), blocking_sink(q))
        while not isinstance(q.get(timeout=300), TokenEvent):
            pass
        wait_until(lambda: len(engine.tick_log()) > 3, what="a few decode ticks")
        assert not [r for r in caplog.records if "longest ticks" in r.getMessage()]
    (line,) = [r.getMessage() for r in caplog.records if "longest ticks" in r.getMessage()]
    assert "decode_rows=1" in line
