"""`python -m bench.quant_act MODEL`: the 4-bit quantized kernel with x in float against x
rounded to 16 bits (appliance/backend/native/quant_matmul.cpp), and the dense path that
products of more than 32 rows take (dequantized weights into MLX's matmul), on one model,
in-process.

For B in ``--rows``: each distinct 4-bit product shape of the model as a product of B rows
by each path, and a decode step of B rows (``model(x, cache)`` after a ``--context``-token
prompt), each the minimum over ``--repeats`` of the CPU time of the process
(``time.process_time``: the figure that holds on a shared machine; ``--clock wall`` for the
wall time, which is what a prompt waits and what threads share). Run it with
``APPLIANCE_QUANT_THREADS=1`` for one thread's cost, and with OpenBLAS preloaded as the
daemon does (scripts/test.sh sets ``LD_PRELOAD``) for the dense path's real cost.
``--products-only`` skips the decode steps (prefill sizes: ``--rows 32,64,128,256,512``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from appliance.backend import fast_ops, quant
from bench import summary

CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.process_time, "wall": time.perf_counter}
clock = CLOCKS["cpu"]


def best(f: Callable[[], Any], repeats: int, inner: int = 1) -> float:
    f()
    out = float("inf")
    for _ in range(repeats):
        t = clock()
        for _ in range(inner):
            f()
        out = min(out, (clock() - t) / inner)
    return out * 1e3


def product(m: nn.QuantizedLinear, b: int, act: str | None, path: str, repeats: int) -> float:
    """One product of b rows through m's weights by ``path``, ms."""
    biases = m.biases
    assert biases is not None
    x = mx.random.normal((b, m.weight.shape[1] * 8))
    mx.eval(x)
    inner = max(2, 50 // max(1, b // 8))
    return best(lambda: mx.eval(quant.quantized_matmul(
        x, m.weight, m.scales, biases, m.group_size, 4, act, path)), repeats, inner)


def decode_step(model: Any, b: int, context: int, repeats: int) -> float:
    """One decode step of b rows after a context-token prompt, ms."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((b, context), dtype=mx.int32) + 42, cache=cache))
    state = [c.state for c in cache]
    tok = mx.zeros((b, 1), dtype=mx.int32) + 7

    def step() -> None:
        for c, s in zip(cache, state, strict=True):
            c.state = s
        mx.eval(model(tok, cache=cache))
    return best(step, repeats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--rows", default="1,4,8")
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--clock", choices=sorted(CLOCKS), default="cpu")
    p.add_argument("--products-only", action="store_true")
    summary.add_arguments(p)
    a = p.parse_args()
    global clock
    clock = CLOCKS[a.clock]
    from mlx_lm import load

    fast_ops.install()
    model = load(a.model)[0]
    layers = {(m.weight.shape[0], m.weight.shape[1] * 8): m for m in model.modules()
              if isinstance(m, nn.QuantizedLinear) and m.bits == 4}
    rows = [int(r) for r in a.rows.split(",")]
    print(f"ms ({a.clock}), min of", a.repeats, "| B:", *rows)
    report: dict[str, Any] = {"meta": {"model": a.model, "clock": a.clock, "rows": rows,
                                       "repeats": a.repeats}, "products_ms": {}, "steps_ms": {}}
    paths: list[tuple[str, str | None, str]] = [
        (act, act, "kernel") for act in quant.ACTIVATIONS] + [("dense", None, "dense")]
    for (n, k), m in sorted(layers.items()):
        for name, act, path in paths:
            cells = [product(m, b, act, path, a.repeats) for b in rows]
            print(f"{n}x{k} {name:6s}", *(f"{c:7.3f}" for c in cells))
            report["products_ms"][f"{n}x{k} {name}"] = cells
    if a.products_only:
        summary.keep("quant_act", report, a.summary, a.trace)
        return
    for act in quant.ACTIVATIONS:
        quant.install(act)
        cells = [decode_step(model, b, a.context, a.repeats) for b in rows]
        quant.uninstall()
        print(f"decode step {act:6s}", *(f"{c:7.1f}" for c in cells))
        report["steps_ms"][act] = cells
    summary.keep("quant_act", report, a.summary, a.trace)


if __name__ == "__main__":
    main()
