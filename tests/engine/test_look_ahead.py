"""The decode step built ahead (``Forwards.look_ahead``): the same tokens, finishes and
cancellations as without it, whatever changes the batch between two steps."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from appliance.engine.model import LoadedModel, load_model
from appliance.engine.request import (
    FinishEvent,
    GenerationRequest,
    RequestHandle,
    SamplingParams,
    TokenEvent,
)
from appliance.engine.runner import Runner
from appliance.sched.scheduler import Scheduler
from appliance.sched.types import SchedulerConfig

QUESTIONS = ["Name three rivers.", "Say hello.", "Count to ten.", "What is tea?"]


@pytest.fixture(scope="module")
def loaded(demo_model: Path) -> LoadedModel:
    return load_model(demo_model)


def serve(loaded: LoadedModel, look_ahead: bool) -> tuple[list[Any], int]:
    """Rows that finish at different steps, one seeded sampler, one that joins late and one
    cancelled midway: each stream's tokens and finish, and the steps run from ahead."""
    tok = loaded.tokenizer
    runner = Runner(loaded, Scheduler(SchedulerConfig(prefill_chunk_size=32)),
                    time.monotonic, None, look_ahead=look_ahead)
    sinks: list[list[Any]] = [[] for _ in range(len(QUESTIONS) + 1)]

    def handle(i: int, question: str, max_tokens: int, **kw: Any) -> RequestHandle:
        prompt = tuple(tok.apply_chat_template([{"role": "user", "content": question}],
                                               add_generation_prompt=True))
        return RequestHandle(GenerationRequest(prompt=prompt, max_tokens=max_tokens, **kw),
                             sinks[i].append)

    handles = [handle(0, QUESTIONS[0], 24), handle(1, QUESTIONS[1], 9),
               handle(2, QUESTIONS[2], 30, sampling=SamplingParams(temperature=0.8, seed=7)),
               handle(3, QUESTIONS[3], 30)]
    runner.take(handles)
    for step in range(200):
        if step == 5:  # joins the batch while it decodes
            runner.take([handle(4, "Tell me about the sea.", 12)])
        if step == 8:
            handles[3].cancel()
        if not runner.tick():
            break
    streams = [([e.token for e in s if isinstance(e, TokenEvent)],
                [(e.reason, e.usage) for e in s if isinstance(e, FinishEvent)]) for s in sinks]
    return streams, runner.forwards.steps_ahead


def test_it_gives_the_same_streams_with_the_step_built_ahead(loaded: LoadedModel) -> None:
    plain, none_ahead = serve(loaded, look_ahead=False)
    ahead, steps_ahead = serve(loaded, look_ahead=True)
    assert none_ahead == 0
    assert steps_ahead > 10  # most decode steps ran the graph built during the one before
    assert ahead == plain
    assert all(len(finish) == 1 for _, finish in plain)
