"""`python -m bench.matmul`: decode steps and their matrix products with and
without the skinny_matmul kernel (appliance/backend/native/skinny_matmul.c), on one model.

Two child processes load the model through ``mlx_lm.load``, one with Debian's OpenBLAS
preloaded alone (MLX's products all go to OpenBLAS's gemm) and one with skinny_matmul
before it, as ``appliance serve`` runs. Each times, on the model's own weights:

1. every distinct weight-matrix shape as a product of B rows (``x @ W.T``), B in ``--rows``;
2. a decode step of B rows (``model(x, cache)`` after a ``--context``-token prompt).

Medians of ``--repeats`` runs after one warm-up; the report gives both and their ratio.
The model's numbers, not the server's: the serving and prefill benchmarks show what that
makes of a request.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from appliance.backend.blas import blas_env, openblas_lib, skinny_matmul_lib
from bench import summary
from bench.report import git_commit, relative

CHILD = textwrap.dedent("""
    import json, statistics, sys, time
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    path, rows, context, repeats = sys.argv[1], [int(r) for r in sys.argv[2].split(",")], \\
        int(sys.argv[3]), int(sys.argv[4])
    model, _ = load(path)

    def median_ms(fn):
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    shapes = sorted({tuple(v.shape) for _, v in tree_flatten(model.parameters())
                     if v.ndim == 2 and v.dtype == mx.float32})
    weights = {s: mx.random.normal(s) for s in shapes}
    mx.eval(list(weights.values()))
    products = {}
    for s, w in weights.items():
        for b in rows:
            x = mx.random.normal((b, s[1]))
            mx.eval(x)
            products[f"{b} x {s[1]} @ ({s[0]} x {s[1]}).T"] = median_ms(lambda: mx.eval(x @ w.T))
    steps = {}
    for b in rows:
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([[7] * context] * b), cache=cache))
        x = mx.array([[5]] * b)
        steps[f"B = {b}"] = median_ms(lambda: mx.eval(model(x, cache=cache)))
    print(json.dumps({"products": products, "steps": steps}))
""")


def run_child(script: str, args: list[str], preload: list[str]) -> dict[str, Any]:
    """Run ``script`` in a child Python with ``preload`` in LD_PRELOAD (and OpenBLAS's spin
    as the daemon sets it); its last line of output, as JSON."""
    env = blas_env(preload)
    run = subprocess.run([sys.executable, "-c", script, *args], capture_output=True,
                         text=True, env=env, check=False)
    if run.returncode != 0:
        raise SystemExit(f"benchmark child failed:\n{run.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return result


def measure(model: Path, preload: list[str], rows: str, context: int, repeats: int
            ) -> dict[str, Any]:
    return run_child(CHILD, [str(model), rows, str(context), str(repeats)], preload)


def report(model: Path, plain: dict[str, Any], skinny: dict[str, Any], command: str,
           facts: str = "") -> str:
    lines = [f"- command: `{command}`", f"- model: `{relative(model)}`",
             *([f"- {facts}"] if facts else []),
             "- plain: Debian's OpenBLAS preloaded alone; skinny: skinny_matmul before it", "",
             "| decode step | plain ms | skinny ms | plain / skinny |", "|---|---:|---:|---:|"]
    for name, ms in plain["steps"].items():
        lines.append(f"| {name} | {ms:.1f} | {skinny['steps'][name]:.1f} | "
                     f"{ms / skinny['steps'][name]:.2f}x |")
    lines += ["", "| product | plain ms | skinny ms | plain / skinny |", "|---|---:|---:|---:|"]
    for name, ms in plain["products"].items():
        lines.append(f"| {name} | {ms:.3f} | {skinny['products'][name]:.3f} | "
                     f"{ms / skinny['products'][name]:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.matmul", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=".bench/models/smollm-135m")
    p.add_argument("--rows", default="1,4,8", help="batch sizes (rows of each product)")
    p.add_argument("--context", type=int, default=100, help="prompt tokens before the steps")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--output", help="also write the Markdown report here")
    summary.add_arguments(p)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    blas, kernel = openblas_lib(), skinny_matmul_lib()
    if blas is None or kernel is None:
        raise SystemExit("needs Linux with libopenblas0-pthread and the built skinny_matmul "
                         "library (pip install -e . with gcc)")
    model = Path(args.model)
    plain = measure(model, [blas], args.rows, args.context, args.repeats)
    skinny = measure(model, [kernel, blas], args.rows, args.context, args.repeats)
    emit(report(model, plain, skinny, command_line("bench.matmul", argv),
                facts_line()), args.output)
    summary.keep("matmul", {"meta": {"model": relative(model)}, "plain": plain,
                            "skinny": skinny}, args.summary, args.trace)
    return 0


def command_line(module: str, argv: list[str] | None) -> str:
    """The command that reproduces this run, for the report."""
    return f"python -m {module} {' '.join(sys.argv[1:] if argv is None else argv)}".strip()


def facts_line() -> str:
    """When, at which commit, on what machine."""
    return (f"{dt.datetime.now(dt.UTC).isoformat(timespec='minutes')}, git commit "
            f"`{git_commit(Path.cwd())}`, {platform.system()} {platform.machine()}, "
            f"{os.cpu_count()} CPUs")


def emit(text: str, output: str | None) -> None:
    """Print the Markdown report, and write it to ``output`` when given."""
    print(text)
    if output:
        Path(output).write_text(text)


if __name__ == "__main__":
    raise SystemExit(main())
