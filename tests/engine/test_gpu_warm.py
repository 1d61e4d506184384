"""The quantized kernels compiled while the model loads on CUDA (appliance/backend/gpu.py):
one product of each distinct quantized layer at each row count. The products run on this
machine's device; what is checked is which ones run, not where."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest

from appliance.backend import gpu


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 128)
        self.q = nn.Linear(128, 256, bias=False)
        self.q2 = nn.Linear(128, 256, bias=False)  # another layer's q: the same kernels
        self.down = nn.Linear(256, 128, bias=False)
        self.eight = nn.Linear(128, 128, bias=False)
        self.plain = nn.Linear(128, 128)


def test_each_distinct_quantized_layer_runs_once_per_row_count(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = _Model()
    nn.quantize(model, group_size=64, bits=4,
                class_predicate=lambda path, m: path in ("embed", "q", "q2", "down"))
    nn.quantize(model, group_size=32, bits=8, class_predicate=lambda path, m: path == "eight")
    calls: list[tuple[int, int, int]] = []
    real = mx.quantized_matmul

    def spy(x: mx.array, w: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        calls.append((x.shape[0], x.shape[-1], w.shape[0]))
        return real(x, w, *args, **kwargs)

    monkeypatch.setattr(mx, "quantized_matmul", spy)
    rows = (1, 3)
    assert gpu.warm_quantized(model, rows) == 4 * len(rows)
    # (rows, input width, output width): the embedding as the head, q (once), down, 8-bit
    widths = {(128, 64), (128, 256), (256, 128), (128, 128)}
    assert sorted(calls) == sorted((r, i, o) for r in rows for i, o in widths)


def test_an_embedding_that_is_not_the_head_is_never_a_product() -> None:
    model = _Model()
    model.lm_head = nn.Linear(128, 64, bias=False)
    nn.quantize(model, group_size=64, bits=4, class_predicate=lambda path, m: path == "embed")
    nn.quantize(model, group_size=32, bits=8, class_predicate=lambda path, m: path == "eight")
    assert gpu.warm_quantized(model, (1, 3)) == 2  # the 8-bit layer's alone


def test_a_model_without_quantized_layers_warms_nothing() -> None:
    assert gpu.warm_quantized(nn.Sequential(nn.Linear(8, 8), nn.ReLU())) == 0


@pytest.mark.parametrize(("kind", "warmed"), [("cuda", 1), ("cpu", 0), ("metal", 0)])
def test_loading_warms_the_kernels_on_cuda_only(kind: str, warmed: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from appliance.backend import plug, quant
    from appliance.backend.profile import profile_for

    calls: list[Any] = []
    monkeypatch.setattr(gpu, "warm_quantized", lambda model: calls.append(model) or 0)
    monkeypatch.setattr(quant, "adopt", lambda model, hold=False: (0, 0))  # this process's kernel state
    described = plug.SHIPPED[kind](kind=kind, device="Device(gpu, 0)", native=False,
                                   kernel=None, fast_ops=False, quant=None, heap="not tuned",
                                   profile=profile_for(False))
    model = _Model()
    assert plug.adopt(model, described) == 0
    assert calls == [model] * warmed
