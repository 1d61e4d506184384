"""The engine thread's host time per decode tick (the plan, building the MLX graph,
sampling, tokens to text and events, the scheduler's update: everything but waiting for
the device), with and without the next step built ahead (``Forwards.look_ahead``), at C
concurrent requests, in-process.

    .venv/bin/python scripts/profile_tick.py /tmp/se-smollm --rows 8 --tokens 96

Run it with the BLAS preload the daemon uses (as scripts/test.sh sets LD_PRELOAD). Only
ticks with ``--rows`` decode rows and no prompt read count; per tick, the median over them,
then the minimum over ``--reps`` runs. ``host`` is the tick log's ``wall_s - wait_s``."""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from appliance.engine import forwards
from appliance.engine.batch import DecodeBatch
from appliance.engine.model import LoadedModel, load_model
from appliance.engine.request import GenerationRequest, RequestHandle, TokenEvent
from appliance.engine.runner import Runner
from appliance.sched.scheduler import Scheduler
from appliance.sched.types import SchedulerConfig

QUESTION = "Tell me a long story about a lighthouse keeper and the sea, in detail."


SPENT: dict[str, float] = defaultdict(float)
"""Seconds per part of the decode forward, summed (``--breakdown``)."""


def timed(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            SPENT[name] += time.perf_counter() - t
    return wrapper


class TimedMx:
    """mlx.core for engine/forwards.py, with its evaluation calls timed."""

    def __getattr__(self, name: str) -> Any:
        f = getattr(mx, name)
        return timed(name, f) if name in ("eval", "async_eval") else f


def breakdown() -> None:
    forwards.mx = TimedMx()  # type: ignore[assignment]
    for name in ("step", "step_ahead"):
        setattr(DecodeBatch, name, timed(name, getattr(DecodeBatch, name)))


FILLER = "The keeper wrote down the weather, the ships and the lamp's hours in his log. "


def run(loaded: LoadedModel, rows: int, tokens: int, look_ahead: bool, context: int = 0
        ) -> tuple[dict[str, float], list[list[int]]]:
    tok = loaded.tokenizer
    filler = FILLER * (context // 16)  # about 16 tokens a sentence
    runner = Runner(loaded, Scheduler(SchedulerConfig(max_batch_size=rows)), time.monotonic,
                    None, look_ahead=look_ahead)
    sinks: list[list[object]] = [[] for _ in range(rows)]
    for i, sink in enumerate(sinks):
        prompt = tuple(tok.apply_chat_template(
            [{"role": "user", "content": f"({i}) {filler}{QUESTION}"}],
            add_generation_prompt=True))
        runner.take([RequestHandle(GenerationRequest(prompt=prompt, max_tokens=tokens),
                                   sink.append)])
    SPENT.clear()
    while runner.tick():
        pass
    decodes = sum(1 for r in runner.timing.log if r.decode_rows)
    parts = {k: v / decodes for k, v in SPENT.items()}  # a mean over every decode tick
    ticks = [r for r in runner.timing.log if r.decode_rows == rows and not r.prefill_tokens]
    out = {"wall": statistics.median(r.wall_s for r in ticks),
           "wait": statistics.median(r.wait_s for r in ticks),
           "host": statistics.median(r.wall_s - r.wait_s for r in ticks),
           "ticks": len(ticks), **parts}
    return out, [[e.token for e in s if isinstance(e, TokenEvent)] for s in sinks]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--context", type=int, default=0,
                    help="about this many tokens of filler before each row's question")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time graph building and MLX's evaluation calls (means)")
    a = ap.parse_args()
    if a.breakdown:
        breakdown()
    loaded = load_model(a.model, fast_cpu_ops=True)
    results: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    streams: dict[bool, list[list[int]]] = {}
    for _ in range(a.reps):
        for ahead in (False, True):  # interleaved: the machine's load falls on both alike
            figures, streams[ahead] = run(loaded, a.rows, a.tokens, ahead, a.context)
            results[ahead].append(figures)
    assert streams[False] == streams[True], "building ahead changed the tokens"
    for ahead in (False, True):
        line = "  ".join(f"{k} {min(r[k] for r in results[ahead]) * 1e3:7.2f} ms"
                         for k in ("wall", "wait", "host", "step", "step_ahead",
                                   "async_eval", "eval") if k in results[ahead][0])
        print(f"look_ahead={ahead!s:5s} {line}  ticks {results[ahead][0]['ticks']:.0f}")


if __name__ == "__main__":
    main()
