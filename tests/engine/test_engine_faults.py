"""One request never stops the engine: a failure anywhere in the engine thread (intake,
prefill, decode, a token, finishing, the caller's sink) ends only that request; a dead or
stalled engine thread is noticed by the supervisor and every waiting request gets a clear
"unavailable" finish instead of hanging."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from appliance.app import start_engine
from appliance.engine.core import Engine, EngineDown
from appliance.engine.faults import fault_from_spec
from appliance.engine.request import (
    Event,
    FinishEvent,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
    blocking_sink,
)
from appliance.engine.supervisor import Supervisor
from tests.helpers import make_settings, wait_until

Q = queue.SimpleQueue  # of Event


def _prompt(engine: Engine) -> tuple[int, ...]:
    tok = engine.loaded.tokenizer  # type: ignore[attr-defined]
    return tuple(tok.apply_chat_template([{"role": "user", "content": "Tell me a story"}],
                                         add_generation_prompt=True))


def _no_eos(engine: Engine) -> SamplingParams:
    eos = engine.loaded.eos_token_ids  # type: ignore[attr-defined]
    return SamplingParams(logit_bias=tuple((t, -100.0) for t in eos))


def _finish(q: Q, timeout: float = 60) -> FinishEvent:  # type: ignore[type-arg]
    while True:
        ev = q.get(timeout=timeout)
        if isinstance(ev, FinishEvent):
            return ev


def _submit(engine: Engine, max_tokens: int, sampling: SamplingParams | None = None,
            sink: Callable[[Event], None] | None = None) -> Q:  # type: ignore[type-arg]
    q: Q = queue.SimpleQueue()  # type: ignore[type-arg]
    engine.submit(GenerationRequest(prompt=_prompt(engine), max_tokens=max_tokens,
                                    sampling=sampling or _no_eos(engine)),
                  sink or blocking_sink(q))
    return q


def _engine(model: Path, spec: str | None = None, **overrides: object) -> Engine:
    settings = make_settings(model, max_batch_size=4, prompt_cache_entries=0, **overrides)
    return start_engine(settings, fault=fault_from_spec(spec))


@pytest.fixture()
def engines(tiny_model: Path) -> Iterator[list[Engine]]:
    started: list[Engine] = []
    yield started
    for e in started:
        e.stop(5)


def _serves(engine: Engine) -> None:
    """A plain request still runs to its length after whatever happened before."""
    fin = _finish(_submit(engine, 6))
    assert fin.reason == "length" and fin.usage.completion_tokens == 6


@pytest.mark.parametrize("phase", ["intake", "prefill", "decode", "batch", "token", "finish"])
def test_an_error_in_any_phase_ends_only_that_request(
        tiny_model: Path, engines: list[Engine], phase: str) -> None:
    engine = _engine(tiny_model, f"{phase}:raise:13")
    engines.append(engine)
    queues = [_submit(engine, n) for n in (20, 13, 20)]
    results = [_finish(q) for q in queues]
    assert results[1].reason == "error"
    assert [results[0].reason, results[2].reason] == ["length", "length"]
    assert results[0].usage.completion_tokens == 20
    assert engine.check() is None
    _serves(engine)


@pytest.mark.parametrize("seed", [-1, -(2 ** 63), 2 ** 70])
def test_a_seed_outside_uint64_ends_only_that_request(
        tiny_model: Path, engines: list[Engine], seed: int) -> None:
    """The HTTP API refuses such a seed with a 400; the engine must survive one anyway
    (before: ``mx.random.key`` raised a TypeError outside any handler and the thread died)."""
    engine = _engine(tiny_model)
    engines.append(engine)
    bad = _submit(engine, 8, SamplingParams(temperature=1.0, seed=seed))
    good = _submit(engine, 8)
    fin = _finish(bad)
    assert fin.reason == "error" and "seed" in (fin.error or "")
    assert _finish(good).reason == "length"
    assert engine.check() is None
    _serves(engine)


def test_a_sink_that_fails_cancels_only_its_own_request(
        tiny_model: Path, engines: list[Engine]) -> None:
    engine = _engine(tiny_model)
    engines.append(engine)

    def broken(event: Event) -> None:
        if isinstance(event, TokenEvent):
            raise RuntimeError("the caller's queue is gone")

    before = engine.snapshot.cancelled_total
    _submit(engine, 30, sink=broken)
    good = _submit(engine, 30)
    assert _finish(good).usage.completion_tokens == 30
    wait_until(lambda: engine.snapshot.cancelled_total == before + 1, 30, "broken one reaped")
    assert engine.snapshot.active == 0
    _serves(engine)


def test_a_dead_engine_thread_is_noticed_and_waiting_requests_end_unavailable(
        tiny_model: Path, engines: list[Engine]) -> None:
    engine = _engine(tiny_model, "decode:die:13")
    engines.append(engine)
    downs: list[str] = []
    sup = Supervisor(engine, downs.append, interval_s=0.05).start()
    try:
        others = [_submit(engine, 200) for _ in range(2)]
        killer = _submit(engine, 13)
        results = [_finish(q) for q in (*others, killer)]
    finally:
        sup.stop()
    assert all(r.reason == "error" and r.unavailable for r in results)
    assert downs and "engine thread died" in downs[0] and "InjectedDeath" in downs[0]
    assert engine.check() == downs[0]
    with pytest.raises(EngineDown):
        _submit(engine, 5)


def test_a_stalled_engine_is_declared_down_after_the_stall_timeout(
        tiny_model: Path, engines: list[Engine]) -> None:
    inside, release = threading.Event(), threading.Event()

    def hang(request: GenerationRequest, phase: str) -> None:
        if request.max_tokens == 13 and phase == "prefill":
            inside.set()
            release.wait()

    settings = make_settings(tiny_model, prompt_cache_entries=0, engine_stall_timeout=30.0)
    engine = start_engine(settings, fault=hang)
    engines.append(engine)
    try:
        waiting = _submit(engine, 13)
        assert inside.wait(30)
        sup = Supervisor(engine)  # stepped by hand with a clock 31 s on: no real waiting
        assert sup.step(time.monotonic()) is False  # within the timeout: still serving
        assert sup.step(time.monotonic() + 31) is True
        fin = _finish(waiting, 5)
        assert fin.unavailable and "stalled" in (fin.error or "")
        assert "stalled" in (engine.check() or "")
        with pytest.raises(EngineDown):
            _submit(engine, 5)
    finally:
        release.set()


def test_an_idle_engine_is_never_called_stalled(tiny_model: Path,
                                                 engines: list[Engine]) -> None:
    engine = _engine(tiny_model, engine_stall_timeout=1.0)
    engines.append(engine)
    _serves(engine)
    assert engine.check(time.monotonic() + 3600) is None  # nothing waits: nothing is stuck
