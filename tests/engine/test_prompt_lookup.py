"""Speculative decoding by prompt lookup (appliance/engine/lookup.py): drafts found in a
stream's own tokens, how many a verify is worth, and a lone stream's tokens, finish and
kept KV the same with drafts as without, whatever its sampling."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest

from appliance.engine.lookup import (
    ACCEPT_MEMORY,
    EXPLORE_EVERY,
    ROWS_PRIOR,
    Drafting,
    StreamDrafts,
)
from appliance.engine.model import LoadedModel, load_model
from appliance.engine.request import (
    FinishEvent,
    GenerationRequest,
    RequestHandle,
    SamplingParams,
    TokenEvent,
)
from appliance.engine.runner import Runner
from appliance.sched.budget import TickObjectives
from appliance.sched.cost import CostModel
from appliance.sched.scheduler import Scheduler
from appliance.sched.types import SchedulerConfig


def test_drafts_follow_the_latest_earlier_occurrence_of_the_longest_ngram() -> None:
    s = StreamDrafts()
    tokens = [5, 1, 2, 3, 7, 8, 1, 2, 3, 9, 6, 2, 3]
    # "2 3" last came before 9 6; "1 2 3" does not end the tokens
    assert s.propose(tokens, 3) == [9, 6, 2]
    tokens += [9]
    # now "2 3 9" recurs (longer than "3 9"): what followed it, copied on into itself
    assert s.propose(tokens, 8) == [6, 2, 3, 9, 6, 2, 3, 9]  # the repeat goes on
    assert StreamDrafts().propose([1, 2, 3, 4], 4) == []
    assert StreamDrafts().propose([4, 1, 2, 4], 4) == [], "one token alone is no match"


def test_the_index_grows_with_the_tokens_and_gives_what_a_fresh_one_gives() -> None:
    grown = StreamDrafts()
    tokens: list[int] = []
    for t in [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3]:
        tokens.append(t)
        assert grown.propose(tokens, 5) == StreamDrafts().propose(tokens, 5)


def test_a_verify_that_costs_more_than_its_drafts_keep_is_not_planned() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]
    cheap, dear = Drafting(8), Drafting(8)
    for _ in range(40):  # one draft costs a step as much again: never worth it
        dear.verify_fit.observe((1.0, 1.0), 2.5)
        dear.verify_fit.observe((1.0, 4.0), 4.0)
        cheap.verify_fit.observe((1.0, 1.0), 1.05)
        cheap.verify_fit.observe((1.0, 4.0), 1.2)
    assert dear.plan(StreamDrafts(), tokens, 100) == []
    planned = cheap.plan(StreamDrafts(), tokens, 100)
    assert len(planned) >= 4 and planned == [4, 5, 6, 7, 8, 1, 2, 3][:len(planned)]
    assert cheap.plan(StreamDrafts(), tokens, 3) == [4, 5], "no drafts past max_tokens"
    assert cheap.plan(StreamDrafts(), tokens, 1) == []


def test_a_verify_lasts_no_longer_than_a_tick_may_while_a_stream_decodes() -> None:
    """The stream waits out its verify before the drafts kept: no longer than the ITL
    objective (``itl_factor`` plain steps), however much longer drafts would pay."""
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]
    drafting = Drafting(8, longest=2.0)
    for _ in range(40):  # a verify: 1 + 0.4 a draft
        drafting.verify_fit.observe((1.0, 1.0), 1.4)
        drafting.verify_fit.observe((1.0, 4.0), 2.6)
    sure = StreamDrafts(accepted=100.0, tried=100.0)
    assert drafting.plan(sure, tokens, 100) == [4, 5]
    assert drafting.plan(sure, tokens, 100, longest=4.0) == [4, 5, 6, 7, 8, 9, 1]
    assert drafting.plan(sure, tokens, 100, longest=1.2) == []


def test_a_verify_once_dear_is_looked_at_again() -> None:
    """One slow verify (a cold start, a busy spell) does not shut drafts out for good:
    after EXPLORE_EVERY declined proposals one draft is verified, and the cost refitted."""
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]
    drafting = Drafting(8, longest=2.0)
    for _ in range(3):
        drafting.verify_fit.observe((1.0, 2.0), 3.0)
    sure = StreamDrafts(accepted=100.0, tried=100.0)
    assert all(drafting.plan(sure, tokens, 100) == [] for _ in range(EXPLORE_EVERY - 1))
    assert drafting.plan(sure, tokens, 100) == [4]
    assert drafting.plan(sure, tokens, 100) == []
    doubtful = StreamDrafts(accepted=0.0, tried=100.0)
    assert all(drafting.plan(doubtful, tokens, 100) == [] for _ in range(2 * EXPLORE_EVERY))
    for _ in range(8):  # what the look found: drafts are cheap now
        drafting.verify_fit.observe((1.0, 1.0), 1.1)
        drafting.verify_fit.observe((1.0, 3.0), 1.5)
    assert len(drafting.plan(sure, tokens, 100)) > 1


def test_rows_draft_as_many_each_while_that_pays_and_look_again_after_a_dear_verify(
        ) -> None:
    """Several rows: as many drafts each, as far as the row with fewest goes, while the
    chance that every row's drafts come true pays for their step with the drafts; after
    a verify dearer than its prediction, declined until EXPLORE_EVERY proposals."""
    rows = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3], [5, 6, 7, 5, 6]]
    sure = [StreamDrafts(accepted=100.0, tried=100.0) for _ in rows]
    drafting = Drafting(8, longest=2.0)

    def cost(k: int) -> float:  # the cost model's: 2 rows with 2k drafts riding, over 2 rows
        return 0.5 + 0.15 * k  # times the fitted ratio, from ROWS_PRIOR (2): 1 + 0.3k steps

    assert ROWS_PRIOR == 2.0
    dear = Drafting(8, longest=2.0)  # twice the price of one draft a row is over a tick
    assert dear.plan_rows(sure, rows, [100, 100], lambda k: 1.0 + 0.3 * k) == []
    assert drafting.plan_rows(sure, rows, [100, 100], cost) == [[4, 5, 6], [7, 5, 6]]
    assert drafting.plan_rows(sure, rows, [100, 3], cost) == [[4, 5], [7, 5]]
    assert drafting.plan_rows([sure[0], StreamDrafts()], [rows[0], [1, 2, 3]], [100, 100],
                              cost) == [], "a row with no drafts: no verify"
    doubtful = [StreamDrafts(accepted=0.0, tried=100.0) for _ in rows]
    assert drafting.plan_rows(doubtful, rows, [100, 100], cost) == []
    drafting.declined = 0
    drafting.observe_rows(sure, 3, [3, 1], seconds=6.0, predicted_s=1.0)  # 3x the prior
    assert drafting.accepted == 2 and drafting.drafted == 6
    assert all(drafting.plan_rows(sure, rows, [100, 100], cost) == []
               for _ in range(EXPLORE_EVERY - 1))
    assert drafting.plan_rows(sure, rows, [100, 100], cost) == [[4], [7]]


def test_a_longer_repeat_is_expected_to_go_on_longer() -> None:
    s = StreamDrafts()
    s.propose([7, 1, 2, 9, 1, 2], 4)
    assert s.run == 2 and s.rate(6) == pytest.approx(0.75)
    quoted = [5, 6, 7, 8, 9, 10, 11, 12, 13, 0, 5, 6, 7, 8, 9, 10, 11, 12]
    s.propose(quoted, 4)
    assert s.run == 8 and s.rate(len(quoted)) == pytest.approx(0.9)


def test_a_stream_whose_drafts_fail_drafts_again_later() -> None:
    s = StreamDrafts(run=2)
    assert s.rate(10) == pytest.approx(0.75)
    for _ in range(6):
        s.record(4, 0)
    failed = s.rate(10)
    assert failed < 0.4
    assert s.rate(10 + int(4 * ACCEPT_MEMORY)) > 0.65  # its record has faded
    assert s.rate(10 + int(4 * ACCEPT_MEMORY)) < 0.75


@pytest.fixture(scope="module")
def loaded(demo_model: Path) -> LoadedModel:
    return load_model(demo_model)


REPEAT = ("Repeat after me: the kettle is on the stove, the kettle is on the stove, "
          "the kettle is on the stove, the kettle is on the stove.")
SAMPLINGS: list[tuple[dict[str, Any], int, tuple[str, ...]]] = [
    ({}, 60, ()),
    ({"temperature": 0.8, "seed": 11}, 60, ()),
    ({"temperature": 0.7, "seed": 3, "repetition_penalty": 1.05, "top_p": 0.9}, 40, ()),
    ({}, 7, ()),  # drafts would run past max_tokens
    ({}, 60, ("stove",)),
]


def _runner(loaded: LoadedModel, drafts: int) -> tuple[Runner, tuple[int, ...]]:
    """A runner, and :data:`REPEAT` as a chat prompt."""
    # a verify costs the demo model some two plain steps: a tick objective of four lets
    # drafts through (the default, two, keeps its ITL; docs/decisions/prompt-lookup.md)
    config = SchedulerConfig(prefill_chunk_size=64, objectives=TickObjectives(itl_factor=4.0))
    runner = Runner(loaded, Scheduler(config), time.monotonic, None, drafts=drafts,
                    prompt_cache_entries=8)
    return runner, tuple(loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": REPEAT}], add_generation_prompt=True))


def serve_alone(loaded: LoadedModel, drafts: int) -> tuple[list[Any], Runner]:
    """Each request of :data:`SAMPLINGS` alone, one after the other, by one runner: its
    tokens and finish."""
    tok = loaded.tokenizer
    runner, prompt = _runner(loaded, drafts)
    streams: list[Any] = []
    ho = tok.encode("ho", add_special_tokens=False)
    assert len(ho) == 1
    forced = {"logit_bias": ((ho[0], 100.0),)}  # every draft comes true
    cases = [(kw, n, stop, None, 1) for kw, n, stop in SAMPLINGS] + [
        # stops among kept drafts, each its own user's (its prompt-cache entry its own)
        *((forced, 60, ("ho" * n,), None, 10 + n) for n in (10, 11, 12, 13)),
        (forced, 60, (), len(prompt) + 29, 2)]  # a daily quota (prompt and output)
    for kw, max_tokens, stop, quota, user in cases:
        events: list[Any] = []
        runner.take([RequestHandle(GenerationRequest(
            prompt=prompt, max_tokens=max_tokens, sampling=SamplingParams(**kw), stop=stop,
            user_id=user, tokens_per_day=quota), events.append)])
        while runner.tick():
            pass
        streams.append(([e.token for e in events if isinstance(e, TokenEvent)],
                        [(e.reason, e.usage) for e in events if isinstance(e, FinishEvent)]))
    return streams, runner


def test_a_lone_stream_gives_the_same_tokens_and_finish_with_drafts(
        loaded: LoadedModel) -> None:
    plain, _ = serve_alone(loaded, 0)
    drafted, runner = serve_alone(loaded, 8)
    drafting = runner.forwards.drafting
    assert drafting is not None and drafting.verifies > 0
    assert drafting.accepted > 0, "some drafts should have come true and been kept"
    assert drafted == plain
    assert all(len(finish) == 1 for _, finish in plain)
    assert any(r.drafts for r in runner.timing.log)
    assert runner.snapshot().draft_tokens == drafting.drafted


def test_every_drafting_stream_leaves_its_kv_for_the_next_turn(loaded: LoadedModel) -> None:
    """Its KV may run past its tokens (drafts kept past its stop): it is cut to them, so
    the prompt cache keeps and reuses what it does without drafts."""
    _, plain = serve_alone(loaded, 0)
    _, drafted = serve_alone(loaded, 8)
    assert plain.prompt_cache is not None and drafted.prompt_cache is not None
    same = dataclasses.replace(drafted.prompt_cache.stats, bytes=0)
    assert same == dataclasses.replace(plain.prompt_cache.stats, bytes=0)  # a cut KV keeps its buffer
    assert plain.prompt_cache.stats.hits > 0


def test_a_tick_that_read_a_prompt_in_its_own_forward_does_not_also_verify(
        loaded: LoadedModel) -> None:
    """The tick's time went to the prompt: the lone row takes a plain step, not a verify."""
    tok = loaded.tokenizer
    config = SchedulerConfig(prefill_chunk_size=16, objectives=TickObjectives(itl_factor=4.0))
    runner = Runner(loaded, Scheduler(config), time.monotonic, None, drafts=8, mixed=False)
    ho = tok.encode("ho", add_special_tokens=False)[0]

    def request(text: str, user: int) -> RequestHandle:
        prompt = tuple(tok.apply_chat_template([{"role": "user", "content": text}],
                                               add_generation_prompt=True))
        return RequestHandle(GenerationRequest(
            prompt=prompt, max_tokens=80, user_id=user,
            sampling=SamplingParams(logit_bias=((ho, 100.0),))), lambda e: None)

    runner.take([request("Say ho.", 1)])
    for _ in range(12):
        runner.tick()
    runner.take([request(REPEAT, 2)])  # read 16 tokens a tick beside the lone row
    while runner.tick():
        pass
    log = list(runner.timing.log)
    assert any(r.drafts for r in log), "the lone row should have verified drafts"
    read = [r for r in log if r.prefill_tokens and r.decode_rows == 1]
    assert read, "the second prompt should have been read beside the lone row"
    assert all(r.drafts == 0 for r in read)


def serve_together(loaded: LoadedModel, drafts: int) -> tuple[list[Any], Runner]:
    """Four requests at once, each its own user's: each one's tokens and finish."""
    tok = loaded.tokenizer
    runner, prompt = _runner(loaded, drafts)
    ho = tok.encode("ho", add_special_tokens=False)[0]
    ha = tok.encode("ha", add_special_tokens=False)[0]
    forced = SamplingParams(logit_bias=((ho, 100.0),))  # every draft comes true
    either = [SamplingParams(temperature=1.0, seed=seed, logit_bias=((ho, 100.0), (ha, 100.0)))
              for seed in (5, 9)]  # some do, some do not
    cases = [(forced, 60, ("ho" * 10,)), (forced, 45, ()), (either[0], 60, ()),
             (either[1], 50, ())]
    streams: list[list[Any]] = [[] for _ in cases]
    runner.take([RequestHandle(GenerationRequest(
        prompt=prompt[:len(prompt) - i], max_tokens=n, sampling=sampling, stop=stop,
        user_id=i + 1), streams[i].append) for i, (sampling, n, stop) in enumerate(cases)])
    while runner.tick():
        pass
    return [([e.token for e in events if isinstance(e, TokenEvent)],
             [(e.reason, e.usage) for e in events if isinstance(e, FinishEvent)])
            for events in streams], runner


def test_rows_decoding_together_give_the_same_tokens_with_drafts(loaded: LoadedModel) -> None:
    """Rows of different lengths verify together, each keeping as many drafts as the row
    that keeps fewest (appliance/engine/lookup.py)."""
    plain, _ = serve_together(loaded, 0)
    drafted, runner = serve_together(loaded, 8)
    drafting = runner.forwards.drafting
    assert drafting is not None and drafting.accepted > 0
    assert drafted == plain
    assert all(len(finish) == 1 for _, finish in plain)
    together = [r for r in runner.timing.log if r.drafts and r.decode_rows > 1]
    assert together, "rows decoding together should have verified drafts"
    assert any(r.decode_rows >= 3 for r in together)


def test_rows_serve_on_where_the_cost_model_prices_steps_at_nothing(
        loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fit whose decode steps came to zero seconds (seen in a daemon serving jobs) was
    divided by, which failed the tick and ended every request in flight."""
    monkeypatch.setattr(CostModel, "decode", lambda self, rows, kv_len, riding=(): 0.0)
    plain, _ = serve_together(loaded, 0)
    drafted, _ = serve_together(loaded, 8)
    assert drafted == plain
    assert all(len(finish) == 1 and finish[0][0] != "error" for _, finish in drafted)


def test_rows_verify_together_only_when_their_drafts_riding_are_worth_it(
        loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Several rows' verify is priced as their step with the drafts riding in it, as a
    prompt's tokens ride: where riding tokens are dear (a CPU's 16-bit products) no rows
    verify together, though a step of all their tokens as rows would cost one step."""
    monkeypatch.setattr("appliance.engine.lookup.EXPLORE_EVERY", 1 << 30)
    monkeypatch.setattr(CostModel, "decode", lambda self, rows, kv_len, riding=():
                        0.01 + 0.05 * sum(n for n, _ in riding))
    plain, _ = serve_together(loaded, 0)
    drafted, runner = serve_together(loaded, 8)
    assert drafted == plain
    assert not [r for r in runner.timing.log if r.drafts and r.decode_rows > 1]
