"""The most prompt lookup can give a lone stream on this machine (appliance/engine/lookup.py):
a stream whose every draft comes true (a logit bias forces one token, so it repeats), with
drafts off and on, in-process, through the daemon's own engine config. Prints output
tokens/s after the first token (the best of ``--reps``; with ``--streams N``, N such
streams together, all their tokens), and with drafts the verifies, the drafts they took on
average and the fitted cost of a lone row's verify in plain steps.

    .venv/bin/python scripts/draft_ceiling.py .bench/models/llama-1b-q4_k_m --itl-factor 2,4

Run it with the BLAS preload the daemon uses (as scripts/test.sh sets LD_PRELOAD). Real text
keeps fewer drafts: the served figures are ``python -m bench.serve --quote``'s."""

from __future__ import annotations

import argparse
import queue
import time
from pathlib import Path

from appliance.app import engine_config
from appliance.engine.core import Engine
from appliance.engine.request import (
    FinishEvent,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
    blocking_sink,
)
from appliance.settings import Settings


def run(model: Path, drafts: int, itl_factor: float, tokens: int, reps: int,
        streams: int = 1) -> str:
    settings = Settings()
    settings.engine.model = str(model)
    settings.engine.draft_tokens = drafts
    settings.engine.itl_factor = itl_factor
    engine = Engine(engine_config(settings))
    engine.start()
    try:
        assert engine.loaded is not None
        tok = engine.loaded.tokenizer
        prompt = tuple(tok.apply_chat_template(
            [{"role": "user", "content": "Say ho many times."}], add_generation_prompt=True))
        ho = tok.encode("ho", add_special_tokens=False)[0]
        best = 0.0
        for rep in range(reps):
            q: queue.SimpleQueue[TokenEvent | FinishEvent] = queue.SimpleQueue()
            for i in range(streams):  # together: each its own user, all in one batch
                engine.submit(GenerationRequest(
                    prompt=prompt, max_tokens=tokens, user_id=rep * streams + i + 1,
                    keep_cache=False, sampling=SamplingParams(logit_bias=((ho, 100.0),))),
                    blocking_sink(q))
            first, n, ended = 0.0, 0, 0
            while ended < streams:
                ev = q.get(timeout=600)
                if isinstance(ev, TokenEvent):
                    n += 1
                    first = first or time.perf_counter()
                elif isinstance(ev, FinishEvent):
                    ended += 1
            best = max(best, (n - streams) / (time.perf_counter() - first))
        line = f"drafts={drafts} itl_factor={itl_factor} streams={streams}: {best:.1f} tok/s"
        runner = getattr(engine, "_runner", None)  # a tool's look inside
        drafting = runner.forwards.drafting if runner is not None else None
        if drafting is not None and drafting.verifies:
            fixed, per = drafting.verify_fit.beta
            line += (f", {drafting.verifies} verifies of {drafting.drafted / drafting.verifies:.1f}"
                     f" drafts, {drafting.accepted} kept; a verify {fixed:.2f} + {per:.2f} a "
                     "draft plain steps")
        return line
    finally:
        engine.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--itl-factor", default="2", help="comma-separated (default: 2)")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--streams", type=int, default=1,
                   help="streams decoding together (all their tokens a second)")
    a = p.parse_args()
    print(run(a.model, 0, 2.0, a.tokens, a.reps, a.streams), flush=True)
    for factor in (float(f) for f in a.itl_factor.split(",")):
        print(run(a.model, 8, factor, a.tokens, a.reps, a.streams), flush=True)


if __name__ == "__main__":
    main()
