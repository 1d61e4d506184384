"""Memory pressure on the real engine: with preemption on, every request completes, and a
preempted stream continues exactly where it was (no gap, no duplicate)."""

from __future__ import annotations

import queue
from pathlib import Path

from appliance.app import start_engine
from appliance.engine.core import Engine
from appliance.engine.request import (
    FinishEvent,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
    blocking_sink,
)
from tests.helpers import make_settings


def _run_all(engine: Engine, reqs: list[GenerationRequest]) -> list[tuple[list[int], FinishEvent]]:
    queues = []
    for r in reqs:
        q: queue.SimpleQueue = queue.SimpleQueue()  # type: ignore[type-arg]
        engine.submit(r, blocking_sink(q))
        queues.append(q)
    out = []
    for q in queues:
        tokens: list[int] = []
        while True:
            ev = q.get(timeout=120)
            if isinstance(ev, FinishEvent):
                out.append((tokens, ev))
                break
            assert isinstance(ev, TokenEvent)
            tokens.append(ev.token)
    return out


def _requests(engine: Engine) -> list[GenerationRequest]:
    ban = tuple((t, -100.0) for t in engine.loaded.eos_token_ids)  # type: ignore[attr-defined]
    return [GenerationRequest(prompt=tuple(range(5 + i, 45 + i)), max_tokens=80,
                              sampling=SamplingParams(logit_bias=ban), user_id=i % 3)
            for i in range(6)]


def test_under_memory_pressure_every_request_completes_with_unchanged_tokens(
        tiny_model: Path) -> None:
    roomy = start_engine(make_settings(tiny_model, kv_cache_budget="none"))
    try:
        expected = _run_all(roomy, _requests(roomy))
    finally:
        roomy.stop()
    kv_per_token = 512  # the tiny shape: 2 layers x 2 KV heads x 32 dims x 2 x fp32
    tight = start_engine(make_settings(tiny_model, kv_cache_budget=str(400 * kv_per_token),
                                       enable_preemption=True))
    try:
        got = _run_all(tight, _requests(tight))
        snap = tight.snapshot
    finally:
        tight.stop()
    assert [f.reason for _, f in got] == ["length"] * 6
    assert [t for t, _ in got] == [t for t, _ in expected]
    assert snap.preemptions_total > 0
    per_request = snap.preemptions_total / len(got)
    print(f"\npreemptions per completed request: {per_request:.2f}")
    assert sum(f.preemptions for _, f in got) == snap.preemptions_total


def test_without_preemption_a_tight_budget_admits_fewer_at_once_but_finishes_all(
        tiny_model: Path) -> None:
    tight = start_engine(make_settings(tiny_model, kv_cache_budget=str(400 * 512)))
    try:
        got = _run_all(tight, _requests(tight))
        assert tight.snapshot.preemptions_total == 0
    finally:
        tight.stop()
    assert [f.reason for _, f in got] == ["length"] * 6
