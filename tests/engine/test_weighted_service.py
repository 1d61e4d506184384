"""Weights shape service on the real engine (issue #37, item 0): two users who both keep the
batch full, one of weight 4, receive output in the ratio 4:1 within 20 %, although every
request runs to its end (256 tokens, end-of-sequence suppressed)."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from appliance.app import start_engine
from appliance.engine.core import Engine
from appliance.engine.request import FinishEvent, GenerationRequest, SamplingParams, TokenEvent
from tests.helpers import live_server, make_settings

ALICE, BOB = 1, 2
IN_FLIGHT = 8
WARM_S, MEASURE_S = 3.0, 15.0


@pytest.fixture(scope="module")
def engine(demo_model: Path) -> Iterator[Engine]:
    eng = start_engine(make_settings(demo_model, max_batch_size=8, max_queue_depth=64))
    yield eng
    eng.stop()


def _request(engine: Engine, user_id: int) -> GenerationRequest:
    tok = engine.loaded.tokenizer  # type: ignore[attr-defined]
    prompt = tok.apply_chat_template([{"role": "user", "content": "Tell me a story."}],
                                     add_generation_prompt=True)
    ban = tuple((t, -100.0) for t in engine.loaded.eos_token_ids)  # type: ignore[attr-defined]
    return GenerationRequest(prompt=tuple(prompt), max_tokens=256, user_id=user_id,
                             user=f"user{user_id}", sampling=SamplingParams(logit_bias=ban))


def _closed_loops(engine: Engine, seconds: float, alice: int = ALICE, bob: int = BOB
                  ) -> list[tuple[float, int]]:
    """Both users keep IN_FLIGHT requests in flight for ``seconds``; (time, user) per token."""
    events: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
    handles = []

    def send(user_id: int) -> None:
        handles.append(engine.submit(_request(engine, user_id),
                                     lambda ev, u=user_id: events.put((u, ev))))

    for _ in range(IN_FLIGHT):
        for user_id in (alice, bob):
            send(user_id)
    tokens: list[tuple[float, int]] = []
    end = time.monotonic() + seconds
    while (now := time.monotonic()) < end:
        try:
            user_id, ev = events.get(timeout=end - now)
        except queue.Empty:
            break
        if isinstance(ev, TokenEvent):
            tokens.append((time.monotonic(), user_id))
        elif isinstance(ev, FinishEvent):
            assert ev.reason == "length", ev
            send(user_id)
    for h in handles:
        engine.cancel(h)
    return tokens


def test_a_weight_of_four_gets_four_times_the_service_while_both_are_backlogged(
        engine: Engine, capsys: pytest.CaptureFixture[str]) -> None:
    engine.set_weights({str(BOB): 4.0})
    start = time.monotonic()
    tokens = _closed_loops(engine, WARM_S + MEASURE_S)
    counted = {ALICE: 0, BOB: 0}
    for t, user_id in tokens:
        if t >= start + WARM_S:
            counted[user_id] += 1
    ratio = counted[BOB] / max(counted[ALICE], 1)
    with capsys.disabled():
        print(f"\nweighted service over {MEASURE_S:.0f} s: alice {counted[ALICE]} tokens, "
              f"bob (weight 4) {counted[BOB]}: {ratio:.2f}x; "
              f"preemptions {engine.snapshot.preemptions_total}")
    assert counted[ALICE] > 0
    assert ratio == pytest.approx(4.0, rel=0.2)


def test_a_weight_set_live_through_the_admin_api_shapes_service(demo_model: Path) -> None:
    """Issue 52, item 3: the weight an admin sets on a running daemon (PATCH
    /admin/users/{id}) reaches the running scheduler: 4x the service within 20 %."""
    settings = make_settings(demo_model, max_batch_size=8, max_queue_depth=64)
    with live_server(settings) as srv:
        bob, carol = srv.user_ids["bob"], srv.user_ids["carol"]
        with srv.client("alice") as admin:
            r = admin.patch(f"/admin/users/{bob}", json={"weight": 4})
            assert r.status_code == 200 and r.json()["weight"] == 4.0
        start = time.monotonic()
        tokens = _closed_loops(srv.engine, WARM_S + 10.0, alice=carol, bob=bob)
    counted = {carol: 0, bob: 0}
    for t, user_id in tokens:
        if t >= start + WARM_S:
            counted[user_id] += 1
    assert counted[carol] > 0
    assert counted[bob] / counted[carol] == pytest.approx(4.0, rel=0.2)
