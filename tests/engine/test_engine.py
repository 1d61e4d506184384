"""The real MLX engine on a real model (CPU): parity, isolation, cancellation."""

from __future__ import annotations

import queue
from pathlib import Path

import pytest

from appliance.app import engine_config, start_engine
from appliance.engine.core import Engine
from appliance.engine.request import (
    FinishEvent,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
    blocking_sink,
)
from tests.devices import EXACT_BATCHES
from tests.helpers import make_settings

QUESTIONS = ["What is a list?", "Tell me about files.", "How do I sort numbers?",
             "What does a dictionary hold?", "Explain the loop.", "Where is the kitchen?"]


def _prompt(engine: Engine, text: str) -> tuple[int, ...]:
    tok = engine.loaded.tokenizer  # type: ignore[attr-defined]
    return tuple(tok.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True))


def _collect(q: queue.SimpleQueue) -> tuple[list[int], FinishEvent]:  # type: ignore[type-arg]
    tokens: list[int] = []
    while True:
        ev = q.get(timeout=120)
        if isinstance(ev, FinishEvent):
            return tokens, ev
        assert isinstance(ev, TokenEvent)
        tokens.append(ev.token)


def _submit(engine: Engine, requests: list[GenerationRequest]) -> list[queue.SimpleQueue]:  # type: ignore[type-arg]
    queues = []
    for r in requests:
        q: queue.SimpleQueue = queue.SimpleQueue()  # type: ignore[type-arg]
        engine.submit(r, blocking_sink(q))
        queues.append(q)
    return queues


def _run(engine: Engine, requests: list[GenerationRequest]) -> list[tuple[list[int], FinishEvent]]:
    return [_collect(q) for q in _submit(engine, requests)]


@pytest.fixture(scope="module")
def demo_engine(demo_model: Path):  # type: ignore[no-untyped-def]
    # The prompt cache is off here: these tests compare batching, not cache reuse.
    engine = start_engine(make_settings(demo_model, max_batch_size=8, max_queue_depth=64,
                                        prompt_cache_entries=0))
    yield engine
    engine.stop()


def test_greedy_output_is_the_same_alone_and_in_a_batch(demo_engine: Engine) -> None:
    reqs = [GenerationRequest(prompt=_prompt(demo_engine, q), max_tokens=24) for q in QUESTIONS]
    alone = [_run(demo_engine, [r])[0] for r in reqs]
    together = _run(demo_engine, [GenerationRequest(prompt=r.prompt, max_tokens=24)
                                  for r in reqs])
    for (a_tokens, a_fin), (b_tokens, b_fin) in zip(alone, together, strict=True):
        assert a_fin.reason in ("stop", "length")
        assert a_tokens == b_tokens
        assert a_fin.usage == b_fin.usage


@EXACT_BATCHES
def test_a_seeded_sample_does_not_depend_on_its_neighbours(demo_engine: Engine) -> None:
    sampling = SamplingParams(temperature=1.0, seed=1234)
    req = GenerationRequest(prompt=_prompt(demo_engine, QUESTIONS[0]), max_tokens=16,
                            sampling=sampling)
    alone = _run(demo_engine, [req])[0]
    others = [GenerationRequest(prompt=_prompt(demo_engine, q), max_tokens=16,
                                sampling=SamplingParams(temperature=0.7))
              for q in QUESTIONS[1:4]]
    mixed = _run(demo_engine, [*others[:2], GenerationRequest(
        prompt=req.prompt, max_tokens=16, sampling=sampling), others[2]])[2]
    assert alone[0] == mixed[0]


def test_usage_counts_prompt_and_output_tokens(demo_engine: Engine) -> None:
    prompt = _prompt(demo_engine, "Say something.")
    tokens, fin = _run(demo_engine, [GenerationRequest(prompt=prompt, max_tokens=5)])[0]
    assert fin.usage.prompt_tokens == len(prompt)
    # A token whose text the detokenizer holds (the demo tokenizer's spaces join the next
    # word) has no event of its own, so events can be fewer than the tokens counted.
    assert fin.usage.completion_tokens == 5 or fin.reason == "stop"
    assert 0 < len(tokens) <= fin.usage.completion_tokens <= 5
    assert fin.ttft_s is not None and fin.ttft_s >= 0


def test_chunked_prefill_gives_the_same_tokens_as_one_chunk(demo_model: Path) -> None:
    text = " ".join(QUESTIONS * 6)
    outputs = []
    for chunk in (0, 16):
        engine = start_engine(make_settings(demo_model, prefill_chunk_size=chunk))
        try:
            outputs.append(_run(engine, [GenerationRequest(prompt=_prompt(engine, text),
                                                           max_tokens=12)])[0][0])
        finally:
            engine.stop()
    assert outputs[0] == outputs[1]


def test_an_error_in_one_request_ends_only_that_request(tiny_model: Path) -> None:
    def fault(request: GenerationRequest, phase: str) -> None:
        if request.max_tokens == 13 and phase == "decode":
            raise RuntimeError("injected")

    settings = make_settings(tiny_model)
    from appliance.engine.core import Engine as _Engine
    engine = _Engine(engine_config(settings), fault=fault)
    engine.start()
    try:
        ban_eos = tuple((t, -100.0) for t in engine.loaded.eos_token_ids)  # type: ignore[attr-defined]
        sp = SamplingParams(logit_bias=ban_eos)
        reqs = [GenerationRequest(prompt=(1, 2, 3, i), max_tokens=m, sampling=sp)
                for i, m in enumerate((20, 13, 20))]
        results = _run(engine, reqs)
        assert [fin.reason for _, fin in results] == ["length", "error", "length"]
        assert results[1][1].error == "inference backend error"
        assert [fin.usage.completion_tokens for _, fin in results] == [20, 1, 20]
        # the daemon keeps serving
        assert _run(engine, [GenerationRequest(prompt=(5, 6), max_tokens=3,
                                               sampling=sp)])[0][1].reason == "length"
    finally:
        engine.stop()


def test_the_ledger_row_is_handed_off_before_the_caller_hears_the_finish(
        tiny_model: Path) -> None:
    # A client that got its answer and then reads its usage must find the row queued.
    q: queue.SimpleQueue = queue.SimpleQueue()  # type: ignore[type-arg]
    seen: list[bool] = []

    def on_finish(_record: object) -> None:
        events = []
        while not q.empty():
            events.append(q.get())
        seen.append(any(isinstance(e, FinishEvent) for e in events))
        for e in events:
            q.put(e)

    engine = Engine(engine_config(make_settings(tiny_model)), on_finish=on_finish)
    engine.start()
    try:
        engine.submit(GenerationRequest(prompt=(1, 2, 3), max_tokens=3), blocking_sink(q))
        _collect(q)
    finally:
        engine.stop()
    assert seen == [False]


def test_a_cancelled_request_leaves_the_batch(tiny_model: Path) -> None:
    engine = start_engine(make_settings(tiny_model))
    try:
        ban_eos = tuple((t, -100.0) for t in engine.loaded.eos_token_ids)  # type: ignore[attr-defined]
        q: queue.SimpleQueue = queue.SimpleQueue()  # type: ignore[type-arg]
        handle = engine.submit(GenerationRequest(prompt=(1, 2, 3), max_tokens=100_000,
                                                 sampling=SamplingParams(logit_bias=ban_eos)),
                               blocking_sink(q))
        assert isinstance(q.get(timeout=60), TokenEvent)
        engine.cancel(handle)
        while not isinstance(ev := q.get(timeout=60), FinishEvent):
            pass
        assert ev.reason == "cancelled"
        from tests.helpers import wait_until
        wait_until(lambda: engine.snapshot.active == 0 and engine.snapshot.kv_bytes == 0)
    finally:
        engine.stop()


def test_a_failed_batched_step_is_retried_row_by_row_and_only_the_culprit_ends(
        tiny_model: Path) -> None:
    def fault(request: GenerationRequest, phase: str) -> None:
        if request.max_tokens == 13 and phase == "batch":
            raise RuntimeError("injected into the batched forward")

    settings = make_settings(tiny_model, prompt_cache_entries=0)
    from appliance.engine.core import Engine as _Engine
    alone = start_engine(settings)
    try:
        ban_eos = tuple((t, -100.0) for t in alone.loaded.eos_token_ids)  # type: ignore[attr-defined]
        sp = SamplingParams(logit_bias=ban_eos)
        expected = _run(alone, [GenerationRequest(prompt=(1, 2, 3, 0), max_tokens=20,
                                                  sampling=sp)])[0]
    finally:
        alone.stop()
    engine = _Engine(engine_config(settings), fault=fault)
    engine.start()
    try:
        reqs = [GenerationRequest(prompt=(1, 2, 3, i), max_tokens=m, sampling=sp)
                for i, m in enumerate((20, 13, 20))]
        results = _run(engine, reqs)
    finally:
        engine.stop()
    assert [fin.reason for _, fin in results] == ["length", "error", "length"]
    assert results[0][0] == expected[0]  # the survivor's tokens are unchanged


def test_a_prompt_that_fails_in_a_shared_prefill_ends_alone(tiny_model: Path) -> None:
    def fault(request: GenerationRequest, phase: str) -> None:
        if request.max_tokens == 13 and phase == "prefill":
            raise RuntimeError("injected into the prefill")

    from appliance.engine.core import Engine as _Engine
    engine = _Engine(engine_config(make_settings(tiny_model)), fault=fault)
    engine.start()
    try:
        ban_eos = tuple((t, -100.0) for t in engine.loaded.eos_token_ids)  # type: ignore[attr-defined]
        sp = SamplingParams(logit_bias=ban_eos)
        reqs = [GenerationRequest(prompt=tuple(range(1, 5 + i)), max_tokens=m, sampling=sp)
                for i, m in enumerate((9, 13, 9, 9))]
        results = _run(engine, reqs)
    finally:
        engine.stop()
    assert [fin.reason for _, fin in results] == ["length", "error", "length", "length"]
    assert [fin.usage.completion_tokens for _, fin in results] == [9, 0, 9, 9]


def test_prompts_read_together_give_the_tokens_they_give_alone(demo_model: Path) -> None:
    """Four prompts taken in one tick are prefilled in one batched call (left-padded),
    straight into the empty batch's slots; each one's greedy tokens are the same as when it
    runs alone."""
    import time

    from appliance.engine.model import load_model
    from appliance.engine.request import RequestHandle
    from appliance.engine.runner import Runner
    from appliance.sched.scheduler import Scheduler
    from appliance.sched.types import SchedulerConfig

    loaded = load_model(demo_model)
    tok = loaded.tokenizer

    def run(questions: list[str]) -> list[list[int]]:
        runner = Runner(loaded, Scheduler(SchedulerConfig()), time.monotonic, None)
        sinks: list[list[object]] = [[] for _ in questions]
        runner.take([RequestHandle(GenerationRequest(
            prompt=tuple(tok.apply_chat_template([{"role": "user", "content": q}],
                                                 add_generation_prompt=True)),
            max_tokens=16), sink.append) for q, sink in zip(questions, sinks, strict=True)])
        runner.tick()
        assert len(runner.batch) + runner.completed == len(questions)  # one tick read all
        # its first token each, and no decode step in the tick that read them
        assert [sum(isinstance(e, TokenEvent) for e in sink) for sink in sinks] == \
            [1] * len(questions)
        while runner.tick():
            pass
        return [[e.token for e in sink if isinstance(e, TokenEvent)] for sink in sinks]

    together = run(QUESTIONS[:4])
    assert together == [run([q])[0] for q in QUESTIONS[:4]]


def test_greedy_output_is_mlx_lms_alone_and_in_a_batch(demo_engine: Engine,
                                                        demo_model: Path) -> None:
    """Greedy parity with mlx-lm's own generation, MLX's operations as shipped (the fast CPU
    ops taken out for the reference): on the native path (kernel and fast ops, which round
    differently) and on the pure one (CI's APPLIANCE_NATIVE=off leg) alike."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    from appliance.backend import fast_ops

    was = fast_ops.installed()
    fast_ops.uninstall()
    try:
        model, tok = load(str(demo_model))
        want = []
        for q in QUESTIONS[:4]:
            prompt = _prompt(demo_engine, q)
            out = []
            for token, _ in generate_step(mx.array(prompt), model, max_tokens=16):
                if token in tok.eos_token_ids:
                    break
                out.append(int(token))
            want.append((tok.decode(out), len(out)))
    finally:
        if was:
            assert fast_ops.install() is None
    reqs = [GenerationRequest(prompt=_prompt(demo_engine, q), max_tokens=16)
            for q in QUESTIONS[:4]]
    alone = [_answers(demo_engine, [r])[0] for r in reqs]
    together = _answers(demo_engine, [GenerationRequest(prompt=r.prompt, max_tokens=16)
                                      for r in reqs])
    assert alone == together == want


def _answers(engine: Engine, requests: list[GenerationRequest]) -> list[tuple[str, int]]:
    """Each answer's text as its caller reads it, and its output tokens."""
    out = []
    for q in _submit(engine, requests):
        text = ""
        while not isinstance(ev := q.get(timeout=120), FinishEvent):
            text += ev.text
        out.append((text + ev.text, ev.usage.completion_tokens))
    return out


def test_requests_that_end_while_queued_give_back_their_place_in_the_queue(
        tiny_model: Path) -> None:
    """The queue's back-pressure counts only requests still waiting: cancelled or failed
    while queued, they leave it, however they ended (a storm of clients that hang up once
    left the queue full with nothing in it)."""
    def fault(request: GenerationRequest, phase: str) -> None:
        if request.max_tokens == 7 and phase == "intake":
            raise RuntimeError("injected at intake")

    from appliance.engine.core import Engine as _Engine
    from appliance.engine.core import EngineBusy
    from tests.helpers import wait_until
    engine = _Engine(engine_config(make_settings(tiny_model, max_batch_size=1,
                                                 max_queue_depth=3)), fault=fault)
    engine.start()
    try:
        ban_eos = tuple((t, -100.0) for t in engine.loaded.eos_token_ids)  # type: ignore[attr-defined]
        sp = SamplingParams(logit_bias=ban_eos)
        q: queue.SimpleQueue = queue.SimpleQueue()  # type: ignore[type-arg]
        long = engine.submit(GenerationRequest(prompt=(1, 2, 3), max_tokens=100_000,
                                               sampling=sp), blocking_sink(q))
        assert isinstance(q.get(timeout=60), TokenEvent)  # it holds the batch's one row
        wait_until(lambda: engine.snapshot.active == 1)  # its tick has ended
        for _ in range(5):
            waiting = [engine.submit(GenerationRequest(prompt=(1, 2, 4), max_tokens=5),
                                     blocking_sink(queue.SimpleQueue())) for _ in range(2)]
            assert engine.snapshot.queued >= 2  # counted from submission, not the next tick
            failing: queue.SimpleQueue = queue.SimpleQueue()  # type: ignore[type-arg]
            engine.submit(GenerationRequest(prompt=(1, 2, 5), max_tokens=7),
                          blocking_sink(failing))
            assert _collect(failing)[1].reason == "error"
            with pytest.raises(EngineBusy):
                for _ in range(2):  # the failed one's place is free again, not a third
                    engine.submit(GenerationRequest(prompt=(1, 2, 6), max_tokens=5),
                                  blocking_sink(queue.SimpleQueue()))
            for h in engine._open.copy().values():  # type: ignore[attr-defined]
                if h is not long:
                    engine.cancel(h)
            wait_until(lambda: len(engine._open) == 1)  # type: ignore[attr-defined]
            del waiting
        engine.cancel(long)
        wait_until(lambda: not engine._open)  # type: ignore[attr-defined]
        done: queue.SimpleQueue = queue.SimpleQueue()  # type: ignore[type-arg]
        engine.submit(GenerationRequest(prompt=(1, 2, 3), max_tokens=2), blocking_sink(done))
        assert _collect(done)[1].reason == "length"
    finally:
        engine.stop()
