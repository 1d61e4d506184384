"""The one door between the engine and the device (appliance/backend/plug.py): the forward
asks the plug that adopted a model for its kernels, a plug with none is served by MLX's own
path, and the GPU plugs offer none of the CPU's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from appliance.backend import plug
from appliance.backend.profile import PLAIN
from appliance.engine.batch import DecodeBatch, new_sequence_cache, prefill
from appliance.engine.model import load_model
from tests.engine.arch_models import build
from tests.helpers import NATIVE


@pytest.fixture(scope="module")
def llama_q4(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> Path:
    return build(tmp_path_factory.mktemp("plug") / "llama3-4", demo_model, "llama3", bits=4)


def _facts(kind: str) -> dict[str, Any]:
    return {"kind": kind, "device": "Device(gpu, 0)", "native": False, "kernel": None,
            "fast_ops": False, "quant": None, "heap": "not tuned", "profile": PLAIN}


@dataclass
class _Counting:
    """A plug that passes every product on to ``inner``'s and counts what it was asked."""

    inner: Any
    asked: list[int] = field(default_factory=list)
    decode_layer: None = None  # each layer's products come through the door one by one

    def adopt(self, model: Any) -> int:
        return 0  # ``inner`` adopted it already

    @property
    def products(self) -> Callable[..., list[Any] | None]:
        def counted(x: Any, linears: tuple[Any, ...], residual: Any = None
                    ) -> list[Any] | None:
            self.asked.append(len(linears))
            out: list[Any] | None = self.inner.products(x, linears, residual)
            return out
        return counted


def _steps(model: Any, lean: bool) -> mx.array:
    """Logits of one decode step of two rows (``lean``: the appliance's forward, else
    mlx-lm's model call)."""
    batch = DecodeBatch(model)
    batch.lean = batch.lean and lean
    for i, n in enumerate((9, 14)):
        cache = new_sequence_cache(model)
        prefill(model, cache, [5 + i + 3 * t for t in range(n)], False)
        batch.add(i, cache)
    logits = batch.step([11, 12])
    mx.eval(logits)
    return logits


def test_the_gpu_plugs_have_no_kernels_and_build_a_step_ahead() -> None:
    for kind in ("metal", "cuda"):
        gpu = plug.SHIPPED[kind](**_facts(kind))
        assert gpu.decode_layer is None and gpu.products is None and gpu.look_ahead
    cpu = plug.SHIPPED["cpu"](**_facts("cpu"))
    assert cpu.decode_layer is not None and cpu.products is not None and not cpu.look_ahead


def test_the_forward_asks_the_plug_that_adopted_the_model(llama_q4: Path) -> None:
    loaded = load_model(llama_q4, fast_cpu_ops=True, native=NATIVE)
    assert plug.of(loaded.model) is loaded.backend
    _steps(loaded.model, lean=True)  # the forward's state is made with the CPU's plug...
    counting = _Counting(loaded.backend)
    plug.adopt(loaded.model, counting)  # type: ignore[arg-type]
    _steps(loaded.model, lean=True)  # ...and follows the plug that adopted it since
    # q/k/v and gate/up as one question each, the others one layer at a time
    assert {3, 2, 1} <= set(counting.asked)


def test_a_plug_without_kernels_gets_mlxs_own_answer(llama_q4: Path) -> None:
    loaded = load_model(llama_q4, fast_cpu_ops=True, native=NATIVE)
    want = _steps(loaded.model, lean=False)
    plug.adopt(loaded.model, plug.SHIPPED["metal"](**_facts("metal")))
    got = _steps(loaded.model, lean=True)
    largest = mx.abs(want).max().item()
    assert isinstance(largest, float)
    assert mx.allclose(got, want, atol=1e-3 * largest).item()
    assert (got.argmax(-1) == want.argmax(-1)).all().item()
