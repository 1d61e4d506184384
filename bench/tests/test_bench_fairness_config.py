"""The fairness benchmark's workload and command line: prompts, end-of-sequence ids, the
personas, the configuration and its phases."""

from __future__ import annotations

import datetime as dt
import json
import random
from pathlib import Path

import pytest

from appliance.sched.simulator import CostModel, Loop, SimResult, Simulator
from appliance.sched.types import SchedulerConfig
from appliance.vocab import Klass
from bench.fairness import server_argv, user_targets
from bench.fairness_config import (
    PERSONAS,
    Config,
    PromptMaker,
    build_parser,
    config_from_args,
    eos_token_ids,
    phase_specs,
)
from bench.fairness_stats import (
    BACKGROUND,
    BACKLOGGED,
    HEAVY,
    HEAVY_LIGHT,
    LIGHT,
    SOLO_LIGHT,
    SOLO_VOICE,
    VOICE,
    VOICE_BACKGROUND,
    WEIGHT,
    WEIGHTED,
    WEIGHTED_GOAL,
    WEIGHTED_USER,
    PhaseWindow,
)
from bench.provision import admin_steps


def test_prompt_maker_hits_the_target_and_never_repeats() -> None:
    maker = PromptMaker(lambda text: len(text.split()), sentences=["one two three", "four"])
    rng = random.Random(0)
    prompts = [maker.make((10, 10), rng) for _ in range(3)]
    assert len(set(prompts)) == 3
    for n, prompt in enumerate(prompts, start=1):
        assert prompt.startswith(f"Request {n}:")
        assert len(prompt.split()) == 10  # "Request", "n:" and then 8 words
    lengths = {len(maker.make((5, 8), rng).split()) for _ in range(50)}
    assert lengths == set(range(5, 9))


def test_eos_token_ids_from_configs_and_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (tmp_path / "tokenizer.json").write_text(json.dumps(
        {"added_tokens": [{"id": 5, "content": "<|im_end|>"}, {"id": 6, "content": "x"}]}))
    assert eos_token_ids(tmp_path) == [0, 2, 5, 7]
    assert eos_token_ids(tmp_path / "missing") == []


def test_admin_steps_make_a_voice_admin_and_keep_passwords_off_the_command_line() -> None:
    steps = admin_steps(PERSONAS)
    assert steps[0] == (["migrate"], None)
    adds = [(argv, stdin) for argv, stdin in steps if argv[:2] == ["user", "add"]]
    assert [argv[2] for argv, _ in adds] == [HEAVY, LIGHT, BACKGROUND, VOICE, WEIGHTED_USER]
    weighted = next(argv for argv, _ in adds if argv[2] == WEIGHTED_USER)
    assert weighted[weighted.index("--weight") + 1] == "4"
    assert all("--weight" not in argv for argv, _ in adds if argv[2] != WEIGHTED_USER)
    voice_argv = next(argv for argv, _ in adds if argv[2] == VOICE)
    assert voice_argv[voice_argv.index("--max-class") + 1] == "voice"
    assert voice_argv[voice_argv.index("--role") + 1] == "admin"
    for argv, stdin in adds:
        assert "--password-stdin" in argv and stdin and stdin.endswith("\n")
        assert stdin.strip() not in " ".join(argv)
    keys = [argv for argv, _ in steps if argv[0] == "key"]
    assert [argv[2] for argv in keys] == [HEAVY, LIGHT, BACKGROUND, VOICE, WEIGHTED_USER]


def test_user_targets_send_the_class_header() -> None:
    targets = user_targets("http://h", {HEAVY: "k1", BACKGROUND: "k2", VOICE: "k3"}, "m")
    assert targets[HEAVY].headers == {"Authorization": "Bearer k1"}
    assert targets[BACKGROUND].headers["x-appliance-class"] == "background"
    assert targets[VOICE].headers["x-appliance-class"] == "voice"


def config(*argv: str) -> Config:
    args = build_parser().parse_args(list(argv))
    return config_from_args(args, "python -m bench.fairness",
                            dt.datetime(2026, 1, 1, tzinfo=dt.UTC))


def test_config_defaults_and_fair_only_flags() -> None:
    cfg = config("--w-in", "1.5", "--aging-seconds", "10", "--server-arg=--log-level=debug")
    assert cfg.model_dir.name == "demo_model"
    assert cfg.policies == ["fcfs", "fair"]
    assert (cfg.w_in, cfg.w_out) == (1.5, 2.0)
    assert cfg.heavy_backlog == 2 * cfg.max_batch_size
    fair = server_argv(cfg, "fair", 1234)
    fcfs = server_argv(cfg, "fcfs", 1234)
    assert fair[fair.index("--policy") + 1] == "fair"
    assert fair[fair.index("--aging-seconds") + 1] == "10"
    assert fair[fair.index("--w-in") + 1] == "1.5" and "--w-out" not in fair
    assert "--aging-seconds" not in fcfs and fcfs[fcfs.index("--policy") + 1] == "fcfs"
    assert fair[-1] == fcfs[-1] == "--log-level=debug"
    assert fcfs[fcfs.index("--host") + 1] == "127.0.0.1"


def test_config_rejects_unknown_policies_and_phases() -> None:
    with pytest.raises(SystemExit):
        config("--policies", "fcfs,lottery")
    with pytest.raises(SystemExit):
        config("--phases", "solo-light,nap")
    assert config("--phases", "backlogged").phases == [BACKLOGGED]


def test_phase_specs_run_solo_first_and_size_the_backlogged_phase_by_windows() -> None:
    cfg = config("--window", "20", "--windows", "3", "--ramp-seconds", "4")
    specs = phase_specs(cfg)
    assert [s.name for s in specs] == [SOLO_LIGHT, SOLO_VOICE, HEAVY_LIGHT, BACKLOGGED,
                                       VOICE_BACKGROUND, WEIGHTED]
    assert specs[0].duration_s is None and specs[0].lanes[0].requests == cfg.solo_requests
    backlogged = specs[3]
    assert backlogged.duration_s == pytest.approx(4 + 60)
    assert backlogged.window() == PhaseWindow(4.0, 64.0)
    heavy = next(lane for lane in backlogged.lanes if lane.user == HEAVY)
    assert heavy.concurrency == cfg.heavy_backlog > cfg.max_batch_size
    voice = next(lane for lane in specs[4].lanes if lane.user == VOICE)
    assert voice.klass == "voice" and voice.concurrency == 1


def test_the_weighted_phase_keeps_two_users_backlogged_for_its_seconds() -> None:
    cfg = config("--weighted-seconds", "30", "--ramp-seconds", "4")
    spec = phase_specs(cfg)[-1]
    assert spec.name == WEIGHTED and spec.window() == PhaseWindow(4.0, 34.0)
    assert [(lane.user, lane.concurrency) for lane in spec.lanes] == [
        (HEAVY, 2 * cfg.max_batch_size), (WEIGHTED_USER, 2 * cfg.max_batch_size)]
    assert all(lane.shape.max_tokens == (256, 256) for lane in spec.lanes)
    assert config("--weighted-backlog", "10").weighted_backlog == 10


DEMO_STEPS = CostModel(decode_base_s=0.002, decode_per_seq_s=0.00025,
                       prefill_per_token_s=0.00005)
"""About the demo model's ticks on 2 cores: 4 ms for a batch of 8, 256 tokens in ~1 s."""
STALLS = ((7.5, 8.8), (19.5, 21.0))
"""When the answers of the fair server's weighted phase reached the client late on
2026-12-04 (the ledger's finishes against the client's ends): 1.3 and 1.5 s."""


def weighted_phase(cfg: Config) -> tuple[SimResult, PhaseWindow]:
    """The weighted phase's lanes on the simulator, the real scheduler deciding, with the
    answers finished during STALLS reaching their clients late."""
    spec = phase_specs(cfg)[-1]
    assert spec.name == WEIGHTED and spec.duration_s is not None
    loops = [Loop(lane.user, Klass.INTERACTIVE, lane.concurrency, lane.shape.prompt_tokens,
                  lane.shape.max_tokens, think_s=0.002, stop=spec.duration_s, seed=i,
                  late=STALLS)
             for i, lane in enumerate(spec.lanes)]
    sim = Simulator(SchedulerConfig(max_batch_size=cfg.max_batch_size), cost=DEMO_STEPS,
                    weights={WEIGHTED_USER: WEIGHT})
    return sim.run(loops=loops), spec.window()


def queued_throughout(res: SimResult, window: PhaseWindow) -> tuple[bool, float]:
    """Whether alice and erin both had a request queued at every tick of the measured span,
    and erin's service over alice's in it."""
    ticks = [k for k, t in enumerate(res.times[:len(res.queued)])
             if window.start_s <= t < window.end_s]
    assert ticks
    got = {u: res.served[ticks[-1]][u] - res.served[ticks[0]][u] for u in (HEAVY, WEIGHTED_USER)}
    return (all({HEAVY, WEIGHTED_USER} <= res.queued[k] for k in ticks),
            got[WEIGHTED_USER] / got[HEAVY])


def test_the_weighted_phase_keeps_both_users_queued_while_answers_arrive_late() -> None:
    """With 8 in flight each on a batch of 8 (the fair run of 2026-12-04), erin's answers
    that reached her client late were not yet replaced: with nothing of hers queued,
    alice's queued requests took the slots erin's left, and erin, back, was lifted to
    alice's counter, her credit gone: the engine served 2.36:1 (its ledger), not 4:1.
    Twice the batch in flight keeps both queued through such a stall."""
    queued, ratio = queued_throughout(*weighted_phase(config()))
    assert queued
    assert ratio == pytest.approx(WEIGHT, rel=WEIGHTED_GOAL)
    queued, _ = queued_throughout(*weighted_phase(config("--weighted-backlog", "8")))
    assert not queued
