"""The prompt cache: a user's next turn reuses the KV of the last one, scoped per user."""

from __future__ import annotations

import queue
from pathlib import Path

from appliance.app import start_engine
from appliance.engine.core import Engine
from appliance.engine.prompt_cache import MIN_REUSE_TOKENS
from appliance.engine.request import FinishEvent, GenerationRequest, TokenEvent, blocking_sink
from tests.helpers import make_settings


def _chat(engine: Engine, turns: list[dict[str, str]]) -> tuple[int, ...]:
    assert engine.loaded is not None
    tok = engine.loaded.tokenizer
    return tuple(tok.apply_chat_template(turns, add_generation_prompt=True))


def _ask(engine: Engine, prompt: tuple[int, ...], user_id: int) -> tuple[str, FinishEvent]:
    q: queue.SimpleQueue[TokenEvent | FinishEvent] = queue.SimpleQueue()
    engine.submit(GenerationRequest(prompt=prompt, max_tokens=16, user_id=user_id),
                  blocking_sink(q))
    text = []
    while not isinstance(ev := q.get(timeout=120), FinishEvent):
        assert isinstance(ev, TokenEvent)
        text.append(ev.text)
    return "".join(text) + ev.text, ev


SYSTEM = ("You are the household's assistant. Answer questions about programming in "
          "short, plain sentences, and say so when you do not know.")


def _conversation(engine: Engine, user_id: int) -> list[tuple[str, FinishEvent]]:
    turns = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a list?"}]
    first = _ask(engine, _chat(engine, turns), user_id)
    turns += [{"role": "assistant", "content": first[0]},
              {"role": "user", "content": "And a dictionary?"}]
    return [first, _ask(engine, _chat(engine, turns), user_id)]


def test_the_second_turn_reuses_the_first_and_answers_the_same(demo_model: Path) -> None:
    cold = start_engine(make_settings(demo_model, prompt_cache_entries=0))
    try:
        expected = _conversation(cold, 1)
    finally:
        cold.stop()
    warm = start_engine(make_settings(demo_model))
    try:
        got = _conversation(warm, 1)
        stats = warm.snapshot.prompt_cache
        other = _conversation(warm, 2)  # another user: nothing of user 1's is reused
    finally:
        warm.stop()
    assert [t for t, _ in got] == [t for t, _ in expected]
    assert got[0][1].usage.cached_tokens == 0
    assert got[1][1].usage.cached_tokens > got[0][1].usage.prompt_tokens // 2
    assert expected[1][1].usage.cached_tokens == 0
    assert stats is not None and stats["hits"] >= 1 and stats["tokens_reused"] > 0
    assert other[0][1].usage.cached_tokens == 0


def test_a_prefix_too_short_to_be_worth_a_forward_of_its_own_is_not_reused(
        demo_model: Path) -> None:
    """Two unrelated questions share only the chat template's opening: the second is read
    whole (so it could share a forward with other arrivals), not from a 6-token prefix."""
    engine = start_engine(make_settings(demo_model))
    try:
        _, first = _ask(engine, _chat(engine, [{"role": "user", "content": "Hi"}]), 1)
        prompt = _chat(engine, [{"role": "user", "content": "What is a tuple?"}])
        _, second = _ask(engine, prompt, 1)
    finally:
        engine.stop()
    assert first.usage.cached_tokens == 0 and second.usage.cached_tokens == 0
    assert MIN_REUSE_TOKENS > 6


def test_a_row_taken_out_of_the_batch_holds_only_its_own_kv(demo_model: Path) -> None:
    """What the prompt cache keeps of a preempted or finished row is a copy of that row, not
    a lazy view that holds the whole batch's KV buffers alive after the batch moves on."""
    import gc

    import mlx.core as mx
    from mlx_lm import load

    from appliance.engine.batch import DecodeBatch, cache_nbytes, new_sequence_cache, prefill

    model, _ = load(str(demo_model))
    gc.collect()
    start = mx.get_active_memory()
    batch = DecodeBatch(model)
    for rid in range(4):
        cache = new_sequence_cache(model)
        prefill(model, cache, [5 + rid] * (300 + 40 * rid), True)
        batch.add(rid, cache)
    mx.eval(batch.step([7] * 4))
    held = batch.nbytes
    row = batch.extract(0)
    del batch, cache
    gc.collect()
    own = cache_nbytes(row)
    assert 0 < 4 * own <= held
    assert mx.get_active_memory() - start < 2 * own, "the batch's old KV is still held"
