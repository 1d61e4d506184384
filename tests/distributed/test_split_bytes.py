"""The layers are split by the bytes each machine will hold once its load has fitted the
model to the backend (issue 52: split by the bytes on disk, two machines held 51 and 93 MiB
of SmolLM2, whose 16-bit arrays the CPU widens and whose 4-bit weights it tiles)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from appliance.distributed.group import layer_bytes
from appliance.engine.model import load_model
from tests.engine.arch_models import build


@pytest.mark.parametrize(("bits", "dtype"), [(4, mx.float16), (8, mx.bfloat16), (0, mx.float32)],
                         ids=["q4-f16", "q8-bf16", "fp32"])
def test_the_bytes_counted_before_loading_are_those_held_after(
        tmp_path: Path, demo_model: Path, bits: int, dtype: Any) -> None:
    model_dir = build(tmp_path / "m", demo_model, "llama3", bits=bits, dtype=dtype)
    counted: list[int] = []

    def split(model: Any) -> None:  # as rank 0 splits: the weights not yet read
        layers, edges = layer_bytes(model)
        counted.append(sum(layers) + edges)

    loaded = load_model(model_dir, fast_cpu_ops=True, split=split)
    assert counted == [loaded.weight_bytes]
