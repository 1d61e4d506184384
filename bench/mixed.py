"""`python -m bench.mixed`: a tick's decode step with a prompt chunk read in a
forward of its own, against the chunk read in the decode step's forward
(appliance/engine/mixed.py), on one model.

A child process loads the model through ``mlx_lm.load`` with the daemon's preloads
(skinny_matmul before Debian's OpenBLAS) and fast CPU ops, builds a decode batch of B rows
after ``--context``-token prompts, and a sequence with ``--context`` tokens cached, and
times, for each chunk size n in ``--chunks``:

1. the decode step alone (n = 0);
2. the decode step, then the chunk's forward (the tick before the mixed forward);
3. one forward of both.

Medians of ``--repeats`` runs after one warm-up; every cache is rewound between runs. The
model's numbers, not the server's: the serving and fairness benchmarks show what that makes
of a request.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path
from typing import Any

from appliance.backend.blas import wanted_preload
from bench import summary
from bench.matmul import command_line, emit, facts_line, run_child
from bench.report import relative
from bench.serve import positive_ints

CHILD = textwrap.dedent("""
    import json, statistics, sys, time
    import mlx.core as mx
    from appliance.backend import fast_ops
    from appliance.engine.batch import DecodeBatch, new_sequence_cache, prefill
    from appliance.engine.mixed import restore_offsets, save_offsets
    from appliance.engine.model import load_model

    path, rows, chunks, context, repeats = sys.argv[1], [int(r) for r in sys.argv[2].split(",")], \\
        [int(c) for c in sys.argv[3].split(",")], int(sys.argv[4]), int(sys.argv[5])
    model = load_model(__import__("pathlib").Path(path), fast_cpu_ops=True).model

    def tokens(n, seed):
        return mx.random.randint(3, 4000, (n,), key=mx.random.key(seed)).tolist()

    out = {}
    for b in rows:
        batch = DecodeBatch(model)
        for r in range(b):
            cache = new_sequence_cache(model)
            prefill(model, cache, tokens(context + 7 * r, r), False)
            batch.add(r, cache)
        seq = new_sequence_cache(model)
        prefill(model, seq, tokens(context, 99), False)
        inputs = [5 + r for r in range(b)]

        def median_ms(fn):
            times = []
            for i in range(repeats + 1):
                saved = save_offsets([seq])
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
                restore_offsets([seq], saved)
                batch.slots.advance(-1)  # each run is one step of the batch
            return statistics.median(times[1:]) * 1e3

        step = median_ms(lambda: mx.eval(batch.step(inputs)))
        for n in chunks:
            chunk = tokens(n, 7)

            def apart():
                mx.eval(batch.step(inputs))
                prefill(model, seq, chunk, True)

            out[f"{b},{n}"] = {"step": step, "apart": median_ms(apart),
                               "mixed": median_ms(lambda: batch.step_mixed(
                                   inputs, [(seq, chunk, True)]))}
    print(json.dumps(out))
""")


def report(model: Path, result: dict[str, Any], command: str, facts: str) -> str:
    lines = [f"- command: `{command}`", f"- model: `{relative(model)}`", f"- {facts}", "",
             "| B | chunk | step alone ms | step, then chunk ms | mixed ms | chunk's cost apart"
             " / mixed |", "|---:|---:|---:|---:|---:|---:|"]
    for key, t in result.items():
        b, n = key.split(",")
        extra_apart, extra_mixed = t["apart"] - t["step"], t["mixed"] - t["step"]
        ratio = f"{extra_apart / extra_mixed:.2f}x" if extra_mixed > 0 else "-"
        lines.append(f"| {b} | {n} | {t['step']:.0f} | {t['apart']:.0f} | {t['mixed']:.0f} | "
                     f"{extra_apart:.0f} / {extra_mixed:.0f} ms: {ratio} |")
    return "\n".join(lines) + "\n"


def sizes(text: str) -> str:
    """Positive integers, comma-separated, as the child reads them; anything else is
    argparse's error, not a traceback from the child."""
    values = positive_ints(text, f"expected positive integers like 8,16,32, got {text!r}")
    return ",".join(map(str, values))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.mixed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=".bench/models/smollm-135m")
    p.add_argument("--rows", type=sizes, default="1,4,8", help="decode batch sizes")
    p.add_argument("--chunks", type=sizes, default="8,16,32,64,128",
                   help="prompt chunk sizes")
    p.add_argument("--context", type=int, default=100, help="tokens cached before the step")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--output", help="also write the Markdown report here")
    summary.add_arguments(p)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    model = Path(args.model)
    result = run_child(CHILD, [str(model), args.rows, args.chunks, str(args.context),
                               str(args.repeats)], wanted_preload("auto", True))
    emit(report(model, result, command_line("bench.mixed", argv),
                f"{facts_line()}; skinny_matmul and OpenBLAS preloaded, fast CPU ops"),
         args.output)
    summary.keep("mixed", {"meta": {"model": relative(model)}, "ms": result},
                 args.summary, args.trace)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
