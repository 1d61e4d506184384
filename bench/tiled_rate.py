"""`python -m bench.tiled_rate MODEL`: how fast the tiled kernel (appliance/backend/tiles.py,
quant_kernels.h) runs each of a model's product shapes, against what bounds it.

For each distinct (n, k, bits) of the model's quantized layers (its tied embedding read as
the output layer included), random weights of that shape are tiled in enough copies to pass
``--cold-mib`` in all, and the product of B rows (each of ``--rows``) takes the next copy each
call, so its weights come from memory as a decode step's do, not from a cache the last call
filled. Per shape and B: the best of ``--repeats`` calls (wall time), the weights' bytes over
that time (a one-row product is bound by the memory's read rate) and the multiply-adds a
second (many rows are bound by the processor's 16-bit multiply-adds). The machine's copy
bandwidth (bench/prefill.py's numpy copy, one thread, read + write counted) is printed beside.

The values are random: a rate does not depend on them. Run with the daemon's preloads (as
scripts/test.sh sets ``LD_PRELOAD``) and ``APPLIANCE_QUANT_THREADS=1`` for one thread's rate.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from bench import summary
from bench.serve import positive_ints

Shape = tuple[int, int, int]  # n (output columns), k (input width), bits


def rows_arg(text: str) -> list[int]:
    return positive_ints(text, f"expected positive integers like 1,8,128, got {text!r}")


def model_shapes(model: Any) -> list[Shape]:
    """The distinct (n, k, bits) of ``model``'s quantized products: its QuantizedLinear layers
    and, where the head is tied, the quantized embedding read as the output layer."""
    import mlx.nn as nn

    tied = getattr(model, "lm_head", None) is None
    shapes: set[Shape] = set()
    for m in model.modules():
        if isinstance(m, nn.QuantizedLinear) or (tied and isinstance(m, nn.QuantizedEmbedding)):
            n, words = m.weight.shape
            shapes.add((n, words * 32 // m.bits, m.bits))
    return sorted(shapes)


def tiled_bytes(shape: Shape, group: int = 32, scale_bytes: int = 2) -> int:
    """What one product of ``shape`` reads: the packed weights, a scale and a bias per group."""
    n, k, bits = shape
    return n * k * bits // 8 + 2 * scale_bytes * n * (k // group)


def rate(shape: Shape, ms: float, rows: int) -> dict[str, float]:
    n, k, _ = shape
    return {"ms": ms, "gb_per_s": tiled_bytes(shape) / ms / 1e6,
            "gmac_per_s": rows * n * k / ms / 1e6}


def time_shape(shape: Shape, rows: list[int], repeats: int, cold_mib: int) -> dict[int, float]:
    """Best ms of a product of each row count, each call on a copy not read since the last
    round of copies."""
    import mlx.core as mx

    from appliance.backend.tiles import tile, tiled_matmul

    n, k, bits = shape
    w, scales, biases = mx.quantize(mx.random.normal((n, k)) * 0.02, group_size=32, bits=bits)
    copies = max(2, -(-cold_mib * 2**20 // tiled_bytes(shape)))
    tiles = []
    for _ in range(copies):
        t = tile(w + 0, scales.astype(mx.float16), biases.astype(mx.float16), 32)
        mx.eval(t.tiles, t.scales, t.biases)
        tiles.append(t)
    out: dict[int, float] = {}
    for b in rows:
        x = mx.random.normal((b, k))
        mx.eval(x, *tiled_matmul(x, tiles[0]))
        best = float("inf")
        for i in range(repeats):
            t0 = time.perf_counter()
            mx.eval(*tiled_matmul(x, tiles[(i + 1) % copies]))
            best = min(best, time.perf_counter() - t0)
        out[b] = best * 1e3
    return out


def report(model: str, results: dict[Shape, dict[int, float]], copy_gbps: float | None,
           threads: int, facts: str) -> str:
    rows = sorted({b for r in results.values() for b in r})
    lines = [f"### The tiled kernel's rates: `{model}`", "", f"- {facts}",
             f"- threads: {threads}; the machine's copy bandwidth (numpy, one thread, read + "
             f"write): {copy_gbps:.1f} GB/s" if copy_gbps else f"- threads: {threads}", "",
             "| n x k, bits | " + " | ".join(f"B = {b}: ms, GB/s, GMAC/s" for b in rows) + " |",
             "|---|" + "---:|" * len(rows)]
    for shape, cells in sorted(results.items()):
        parts = []
        for b in rows:
            r = rate(shape, cells[b], b)
            parts.append(f"{r['ms']:.2f}, {r['gb_per_s']:.1f}, {r['gmac_per_s']:.0f}")
        lines.append(f"| {shape[0]} x {shape[1]}, {shape[2]} | " + " | ".join(parts) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tiled_rate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--rows", type=rows_arg, default=[1, 8, 128])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--cold-mib", type=int, default=256,
                   help="the copies' size in all (past the last-level cache)")
    summary.add_arguments(p)
    a = p.parse_args(argv)
    import mlx.core as mx
    from mlx_lm import load

    from appliance.backend import fast_ops, quant
    from bench.prefill import measure_bandwidth

    mx.set_default_device(mx.cpu)
    fast_ops.install()
    if (why := quant.install()) is not None:
        p.error(f"the quantized kernel is not available: {why}")
    model = load(a.model, lazy=True)[0]
    shapes = model_shapes(model)
    del model
    copy = measure_bandwidth(512, 5)["bytes_per_s"]
    results = {s: time_shape(s, a.rows, a.repeats, a.cold_mib) for s in shapes}
    threads = int(fast_ops._extension().quant_threads())
    facts = summary.run_facts(argv)
    text = report(str(Path(a.model)), results, copy / 1e9 if copy else None, threads,
                  f"{facts['date']}, git commit `{facts['git_commit'][:12]}`, {facts['machine']}")
    print(text)
    summary.keep("tiled_rate", {
        "meta": {"model": a.model, "rows": a.rows, "repeats": a.repeats, "threads": threads,
                 "copy_bytes_per_s": copy},
        "products": {f"{n}x{k}/{bits}": {str(b): rate((n, k, bits), ms, b)
                                          for b, ms in cells.items()}
                     for (n, k, bits), cells in results.items()}}, a.summary, a.trace)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
