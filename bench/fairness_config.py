"""What the fairness benchmark (fairness.py) runs: its users, the shapes of their requests,
the phases, the prompts, and its configuration from the command line."""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import math
import random
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance.sched.types import DEFAULT_W_IN, DEFAULT_W_OUT
from appliance.vocab import Klass
from bench import summary
from bench.chat_load import QUESTIONS
from bench.fairness_stats import (
    BACKGROUND,
    BACKLOGGED,
    HEAVY,
    HEAVY_LIGHT,
    LIGHT,
    PHASES,
    SOLO_LIGHT,
    SOLO_VOICE,
    VOICE,
    VOICE_BACKGROUND,
    WEIGHT,
    WEIGHTED,
    WEIGHTED_USER,
    PhaseWindow,
)
from bench.process import (
    OPENBLAS_PATH,
    default_blas,
)
from bench.provision import BenchUser
from bench.serve import resolve_model

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_MODEL_DIR = REPO_ROOT / "appliance" / "demo_model"
DEFAULT_OUTPUT_ROOT = Path(".bench/fairness")
POLICIES = ("fcfs", "fair")
KEY_NAME = "bench-fairness"

PERSONAS = (
    BenchUser(HEAVY, key_name=KEY_NAME),
    BenchUser(LIGHT, key_name=KEY_NAME),
    BenchUser(BACKGROUND, key_name=KEY_NAME),
    BenchUser(VOICE, role="admin", max_class=Klass.VOICE, key_name=KEY_NAME),
    BenchUser(WEIGHTED_USER, key_name=KEY_NAME, weight=WEIGHT),
)


# --------------------------------------------------------------------------------------
# workload
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    prompt_tokens: tuple[int, int]
    max_tokens: tuple[int, int]


@dataclass(frozen=True)
class Lane:
    """A closed-loop client: `concurrency` requests in flight, each followed by a think
    time, until the phase's deadline or `requests` requests per slot."""

    user: str
    klass: str | None
    concurrency: int
    shape: Shape
    think_s: tuple[float, float] = (0.0, 0.0)
    requests: int | None = None


@dataclass(frozen=True)
class PhaseSpec:
    name: str
    lanes: tuple[Lane, ...]
    duration_s: float | None
    """None: until every lane has sent its `requests`."""
    ramp_s: float = 0.0
    """Not measured: the start of a loaded phase, while the backlog builds up."""

    def window(self) -> PhaseWindow:
        if self.duration_s is None:
            return PhaseWindow(0.0, math.inf)
        return PhaseWindow(self.ramp_s, self.duration_s)


class PromptMaker:
    """Distinct prompts of about a given number of tokens: a serial number, then household
    questions, word by word, until the target is reached (token counts from the model's own
    tokenizer, summed per word; the chat template adds its own few tokens on top)."""

    def __init__(self, count_tokens: Callable[[str], int],
                 sentences: Sequence[str] = QUESTIONS) -> None:
        self._count = count_tokens
        self._sentences = [s.split() for s in sentences]
        self._sizes: dict[str, int] = {}
        self._serials = itertools.count(1)

    def _size(self, word: str) -> int:
        if word not in self._sizes:
            self._sizes[word] = max(1, self._count(" " + word))
        return self._sizes[word]

    def make(self, tokens: tuple[int, int], rng: random.Random) -> str:
        target = rng.randint(*tokens)
        head = f"Request {next(self._serials)}:"
        words, total = [head], self._count(head)
        order = self._sentences[:]
        rng.shuffle(order)
        for word in itertools.chain.from_iterable(itertools.cycle(order)):
            if total >= target:
                break
            words.append(word)
            total += self._size(word)
        return " ".join(words)


def token_counter(model_dir: Path) -> Callable[[str], int]:
    """Count tokens with the model's tokenizer.json (about 4 characters a token without)."""
    path = model_dir / "tokenizer.json"
    if not path.exists():
        return lambda text: max(1, len(text) // 4)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


def eos_token_ids(model_dir: Path) -> list[int]:
    """End-of-sequence ids from config.json, generation_config.json and the tokenizer."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        if path.exists():
            value = json.loads(path.read_text()).get("eos_token_id")
            ids.update(value if isinstance(value, list) else [] if value is None else [value])
    tok_cfg, tok_json = model_dir / "tokenizer_config.json", model_dir / "tokenizer.json"
    if tok_cfg.exists() and tok_json.exists():
        eos = json.loads(tok_cfg.read_text()).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        added = json.loads(tok_json.read_text()).get("added_tokens") or []
        ids.update(t["id"] for t in added if eos is not None and t.get("content") == eos)
    return sorted(i for i in ids if isinstance(i, int))


@dataclass
class Config:
    model_dir: Path
    policies: list[str]
    blas: str
    our_cmd: list[str]
    server_args: list[str]
    max_batch_size: int
    heavy_concurrency: int
    heavy_backlog: int
    light_backlog: int
    weighted_backlog: int
    background_concurrency: int
    solo_requests: int
    heavy_light_s: float
    voice_background_s: float
    window_s: float
    windows: int
    ramp_s: float
    w_in: float
    w_out: float
    fair_flags: list[str]
    seed: int
    eos_bias: bool
    phases: list[str]
    output_dir: Path
    ready_timeout_s: float
    request_timeout_s: float
    drain_timeout_s: float
    command: str
    heavy: Shape = Shape((600, 1000), (192, 320))
    light: Shape = Shape((30, 30), (32, 32))
    voice: Shape = Shape((30, 30), (24, 24))
    background: Shape = Shape((300, 600), (96, 160))
    light_think_s: tuple[float, float] = (0.3, 1.0)
    voice_think_s: tuple[float, float] = (0.5, 1.5)
    rounds: int = 1
    weighted_s: float = 20.0
    weighted: Shape = Shape((30, 30), (256, 256))
    """The weighted phase's requests: short prompts, long answers, all of one length."""
    ranks: int = 1
    """Our server on this many ranks of this machine, each pinned to a core (bench.ranks)."""
    join_cmd: list[str] = field(default_factory=list)


def phase_specs(cfg: Config) -> list[PhaseSpec]:
    """The six phases, in the order each server runs them."""
    n = cfg.solo_requests
    bob = Lane(LIGHT, None, 1, cfg.light, cfg.light_think_s)
    dave = Lane(VOICE, Klass.VOICE.label, 1, cfg.voice, cfg.voice_think_s)
    alice = Lane(HEAVY, None, cfg.heavy_concurrency, cfg.heavy)
    return [
        PhaseSpec(SOLO_LIGHT, (Lane(LIGHT, None, 1, cfg.light, cfg.light_think_s, n),), None),
        PhaseSpec(SOLO_VOICE,
                  (Lane(VOICE, Klass.VOICE.label, 1, cfg.voice, cfg.voice_think_s, n),), None),
        PhaseSpec(HEAVY_LIGHT, (alice, bob), cfg.ramp_s + cfg.heavy_light_s, cfg.ramp_s),
        PhaseSpec(BACKLOGGED, (Lane(HEAVY, None, cfg.heavy_backlog, cfg.heavy),
                               Lane(LIGHT, None, cfg.light_backlog, cfg.light)),
                  cfg.ramp_s + cfg.window_s * cfg.windows, cfg.ramp_s),
        PhaseSpec(VOICE_BACKGROUND,
                  (Lane(BACKGROUND, Klass.BACKGROUND.label, cfg.background_concurrency,
                        cfg.background),
                   dave),
                  cfg.ramp_s + cfg.voice_background_s, cfg.ramp_s),
        PhaseSpec(WEIGHTED, (Lane(HEAVY, None, cfg.weighted_backlog, cfg.weighted),
                             Lane(WEIGHTED_USER, None, cfg.weighted_backlog, cfg.weighted)),
                  cfg.ramp_s + cfg.weighted_s, cfg.ramp_s),
    ]


def describe_workload(cfg: Config) -> str:
    def span(lo: int, hi: int) -> str:
        return f"{lo}" if lo == hi else f"{lo}-{hi}"

    def shape(s: Shape) -> str:
        return (f"{span(*s.prompt_tokens)}-token prompts, {span(*s.max_tokens)} output "
                "tokens")

    return (
        f"{HEAVY} (heavy) {cfg.heavy_concurrency} in flight, {shape(cfg.heavy)}; "
        f"{LIGHT} (light) one at a time, {shape(cfg.light)}, think "
        f"{cfg.light_think_s[0]:g}-{cfg.light_think_s[1]:g} s; in the backlogged phase "
        f"{HEAVY} {cfg.heavy_backlog} and {LIGHT} {cfg.light_backlog} in flight; {BACKGROUND} (background class) "
        f"{cfg.background_concurrency} in flight, {shape(cfg.background)}; {VOICE} (voice "
        f"class) one at a time, {shape(cfg.voice)}, think {cfg.voice_think_s[0]:g}-"
        f"{cfg.voice_think_s[1]:g} s; in the {WEIGHTED} phase {HEAVY} (weight 1) and "
        f"{WEIGHTED_USER} (weight {WEIGHT:g}) {cfg.weighted_backlog} in flight each, "
        f"{shape(cfg.weighted)}. Solo baselines {cfg.solo_requests} requests each; "
        f"{HEAVY_LIGHT} {cfg.heavy_light_s:g} s, {BACKLOGGED} {cfg.windows} × "
        f"{cfg.window_s:g} s windows, {VOICE_BACKGROUND} {cfg.voice_background_s:g} s, "
        f"{WEIGHTED} {cfg.weighted_s:g} s, each "
        f"after {cfg.ramp_s:g} s unmeasured ramp-up; temperature 0, EOS "
        f"{'suppressed (fixed output lengths)' if cfg.eos_bias else 'allowed'}, distinct "
        "prompts"
    )


# --------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------


def positive(kind: type[int] | type[float]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    return parse


def token_range(text: str) -> tuple[int, int]:
    """'LO,HI' (or one number) as a (lo, hi) pair of positive token counts."""
    parts = [int(p) for p in text.split(",") if p.strip()]
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or not 0 < parts[0] <= parts[1]:
        raise argparse.ArgumentTypeError("expected LO,HI with 0 < LO <= HI")
    return parts[0], parts[1]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.fairness",
        description="Our server under --policy fcfs and --policy fair on the same load: "
        "light-user and voice TTFT against solo, service difference, throughput.")
    p.add_argument("--model", default="demo",
                   help="model directory, or 'demo' (the bundled demo model, the default: a "
                   "run takes ~8 min on 2 cores) or 'smollm-135m' (the random SmolLM-135M "
                   "shape of `bench serve`, built once; much slower)")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="comma-separated policies, one server each, in this order "
                   "(default: fcfs,fair)")
    p.add_argument("--rounds", type=positive(int), default=1,
                   help="run each policy this many times, the order of --policies reversed "
                        "every other round (fcfs, fair, fair, fcfs, ...), and pool each "
                        "policy's figures over its rounds")
    p.add_argument("--max-batch-size", type=positive(int), default=8)
    p.add_argument("--heavy-concurrency", type=positive(int), default=6,
                   help="alice's requests in flight (default: 6)")
    p.add_argument("--heavy-backlog", type=positive(int), default=None,
                   help="alice's requests in flight in the backlogged phase (default: twice the "
                   "max batch size, so that some wait even when hers fill the batch)")
    p.add_argument("--light-backlog", type=positive(int), default=12,
                   help="bob's requests in flight in the backlogged phase (default: 12)")
    p.add_argument("--weighted-backlog", type=positive(int), default=None,
                   help="alice's and erin's requests in flight each in the weighted phase "
                   "(default: twice the max batch size, so that both still have requests "
                   "queued while finished answers are on their way back to the client)")
    p.add_argument("--background-concurrency", type=positive(int), default=12,
                   help="carol's background requests in flight (default: 12)")
    p.add_argument("--solo-requests", type=positive(int), default=20,
                   help="requests of each solo baseline (default: 20)")
    p.add_argument("--heavy-light-seconds", type=positive(float), default=40.0)
    p.add_argument("--voice-background-seconds", type=positive(float), default=40.0)
    p.add_argument("--weighted-seconds", type=positive(float), default=20.0,
                   help="measured length of the weighted phase (default: 20)")
    p.add_argument("--window", type=positive(float), default=15.0,
                   help="service-difference window in seconds (default: 15; the VTC paper "
                   "uses 60, too long for a short run)")
    p.add_argument("--windows", type=positive(int), default=4,
                   help="windows in the backlogged phase (default: 4)")
    p.add_argument("--ramp-seconds", type=float, default=5.0,
                   help="unmeasured start of each loaded phase (default: 5)")
    p.add_argument("--aging-seconds", type=float, default=None,
                   help="passed to the fair server (default: the daemon's)")
    p.add_argument("--w-in", type=float, default=None,
                   help=f"passed to the fair server and used for the service figures "
                   f"(default: {DEFAULT_W_IN:g})")
    p.add_argument("--w-out", type=float, default=None,
                   help=f"as --w-in, for output tokens (default: {DEFAULT_W_OUT:g})")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for both servers (repeatable), e.g. "
                   "--server-arg=--enable-preemption")
    p.add_argument("--allow-eos", action="store_true",
                   help="let the model stop on its own (default: EOS gets a -100 logit bias, "
                   "so output lengths are fixed)")
    p.add_argument("--phases", default=",".join(PHASES),
                   help="comma-separated phases to run (default: all, in this order)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--blas", choices=("openblas", "bundled"), default=None,
                   help="default: openblas when installed")
    p.add_argument("--our-cmd", default=f"{shlex.quote(sys.executable)} -m appliance serve",
                   help="command prefix of our server")
    p.add_argument("--ranks", type=int, default=1,
                   help="serve across this many ranks of this machine, one core each "
                   "(appliance serve --distributed and appliance join; default 1)")
    p.add_argument("--join-cmd", default=f"{shlex.quote(sys.executable)} -m appliance join",
                   help="command prefix of our follower ranks")
    p.add_argument("--heavy-prompt-tokens", type=token_range, default=(600, 1000),
                   metavar="LO,HI", help="the heavy user's document lengths (default 600,1000)")
    p.add_argument("--heavy-output-tokens", type=token_range, default=(192, 320),
                   metavar="LO,HI", help="the heavy user's output lengths (default 192,320)")
    p.add_argument("--request-timeout", type=positive(float), default=600.0)
    p.add_argument("--ready-timeout", type=positive(float), default=300.0)
    p.add_argument("--drain-timeout", type=positive(float), default=120.0,
                   help="seconds a loaded phase waits, after its end, for requests in flight")
    p.add_argument("--output-dir", type=Path, default=None,
                   help=f"logs, data dirs, report (default: {DEFAULT_OUTPUT_ROOT}/<time>)")
    summary.add_arguments(p)
    return p


def model_dir_from(arg: str) -> Path:
    if arg == "demo":
        return DEMO_MODEL_DIR
    if arg == "smollm-135m":
        return resolve_model(None)
    return resolve_model(Path(arg))


def config_from_args(args: argparse.Namespace, command: str, started: dt.datetime) -> Config:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies or any(p not in POLICIES for p in policies):
        raise SystemExit(f"--policies: choose from {', '.join(POLICIES)}")
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    if not phases or any(p not in PHASES for p in phases):
        raise SystemExit(f"--phases: choose from {', '.join(PHASES)}")
    blas = args.blas or default_blas()
    if blas == "openblas" and not OPENBLAS_PATH.exists():
        raise SystemExit(f"--blas openblas: {OPENBLAS_PATH} not found "
                         "(apt-get install libopenblas0-pthread)")
    fair_flags: list[str] = []
    for flag, value in (("--aging-seconds", args.aging_seconds), ("--w-in", args.w_in),
                        ("--w-out", args.w_out)):
        if value is not None:
            fair_flags += [flag, f"{value:g}"]
    stamp = started.strftime("%Y%m%dT%H%M%SZ")
    return Config(
        model_dir=model_dir_from(args.model),
        policies=policies,
        rounds=args.rounds,
        blas=blas,
        our_cmd=shlex.split(args.our_cmd),
        server_args=list(args.server_arg),
        max_batch_size=args.max_batch_size,
        heavy_concurrency=args.heavy_concurrency,
        heavy_backlog=args.heavy_backlog or 2 * args.max_batch_size,
        light_backlog=args.light_backlog,
        weighted_backlog=args.weighted_backlog or 2 * args.max_batch_size,
        background_concurrency=args.background_concurrency,
        solo_requests=args.solo_requests,
        heavy_light_s=args.heavy_light_seconds,
        voice_background_s=args.voice_background_seconds,
        weighted_s=args.weighted_seconds,
        window_s=args.window,
        windows=args.windows,
        ramp_s=max(0.0, args.ramp_seconds),
        w_in=DEFAULT_W_IN if args.w_in is None else args.w_in,
        w_out=DEFAULT_W_OUT if args.w_out is None else args.w_out,
        fair_flags=fair_flags,
        seed=args.seed,
        ranks=args.ranks,
        join_cmd=shlex.split(args.join_cmd),
        eos_bias=not args.allow_eos,
        phases=phases,
        output_dir=(args.output_dir or DEFAULT_OUTPUT_ROOT / stamp).resolve(),
        ready_timeout_s=args.ready_timeout,
        request_timeout_s=args.request_timeout,
        drain_timeout_s=args.drain_timeout,
        command=command,
        heavy=Shape(args.heavy_prompt_tokens, args.heavy_output_tokens),
    )


def run_order(policies: Sequence[str], rounds: int) -> list[tuple[str, str]]:
    """(policy, run name) in the order the servers run: the policies as given, then
    reversed, and so on (fair, fcfs, fcfs, fair, ...), so a machine that slows or speeds
    up during the benchmark favours neither. One round: the runs are named by policy."""
    order = []
    for r in range(rounds):
        for policy in (policies if r % 2 == 0 else policies[::-1]):
            order.append((policy, policy if rounds == 1 else f"{policy}-{r + 1}"))
    return order
