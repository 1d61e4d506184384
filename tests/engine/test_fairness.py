"""The fair policy on the real MLX engine: a light user is not stuck behind a heavy one."""

from __future__ import annotations

import queue
import time
from pathlib import Path

import pytest

from appliance.engine.core import Engine
from appliance.engine.request import (
    FinishEvent,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
    blocking_sink,
)
from tests.helpers import make_settings, wait_until

HEAVY, LIGHT = 1, 2


def _order_of_events(policy: str, tiny_model: Path) -> tuple[int, float]:
    """Heavy requests finished before the light user's first token, and its TTFT."""
    from appliance.app import start_engine

    engine: Engine = start_engine(make_settings(tiny_model, policy=policy, max_batch_size=4))
    try:
        ban = tuple((t, -100.0) for t in engine.loaded.eos_token_ids)  # type: ignore[attr-defined]
        sp = SamplingParams(logit_bias=ban)
        events: queue.SimpleQueue = queue.SimpleQueue()  # type: ignore[type-arg]
        for i in range(12):
            engine.submit(GenerationRequest(prompt=tuple(range(3, 40 + i)), max_tokens=24,
                                            sampling=sp, user="alice", user_id=HEAVY),
                          lambda ev, i=i: events.put(("heavy", i, ev)))
        wait_until(lambda: engine.snapshot.active == 4, what="heavy user running")
        sent = time.monotonic()
        engine.submit(GenerationRequest(prompt=(5, 6, 7), max_tokens=4, sampling=sp,
                                        user="bob", user_id=LIGHT),
                      lambda ev: events.put(("light", 0, ev)))
        finished_heavy = 0
        while True:
            who, _, ev = events.get(timeout=120)
            if who == "heavy" and isinstance(ev, FinishEvent):
                finished_heavy += 1
            if who == "light" and isinstance(ev, (TokenEvent, FinishEvent)):
                return finished_heavy, time.monotonic() - sent
    finally:
        engine.stop()


def _solo_ttft(tiny_model: Path) -> float:
    from appliance.app import start_engine

    engine = start_engine(make_settings(tiny_model))
    try:
        q: queue.SimpleQueue = queue.SimpleQueue()  # type: ignore[type-arg]
        sent = time.monotonic()
        engine.submit(GenerationRequest(prompt=(5, 6, 7), max_tokens=4), blocking_sink(q))
        q.get(timeout=60)
        return time.monotonic() - sent
    finally:
        engine.stop()


def test_the_light_user_goes_next_under_fair_and_waits_the_backlog_under_fcfs(
        tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fair_before, fair_ttft = _order_of_events("fair", tiny_model)
    fcfs_before, fcfs_ttft = _order_of_events("fcfs", tiny_model)
    solo = _solo_ttft(tiny_model)
    with capsys.disabled():
        print(f"\nlight TTFT: solo {solo * 1000:.0f} ms, fair {fair_ttft * 1000:.0f} ms "
              f"({fair_before} heavy done first), fcfs {fcfs_ttft * 1000:.0f} ms "
              f"({fcfs_before} heavy done first)")
    # fair: the first slot that frees goes to the light user (the heavy batch of 4 ends
    # together); fcfs: the light user waits for the 8 queued heavy requests to be admitted.
    assert fair_before <= 4
    assert fcfs_before >= 8
