"""The KV cache kept in float16 where a quantized model computes in float32 on the CPU
(appliance/engine/kvcache.py): every cache a sequence meets keeps its keys and values in
16 bits (prompts read alone or together, the decode batch's slots, a row taken out of it,
the prompt cache's copies), the KV budget counts 2 bytes a value, and
``APPLIANCE_KV_DTYPE=float32`` keeps float32. With the native code off (MLX as shipped, the
path Metal and CUDA take) nothing changes."""

from __future__ import annotations

import copy
from pathlib import Path

import mlx.core as mx
import pytest

from appliance.engine.batch import DecodeBatch, new_sequence_cache, prefill, prefill_batch
from appliance.engine.kvcache import HalfKV, kv_dtype
from appliance.engine.model import kv_bytes_per_token, load_model
from tests.engine.arch_models import build
from tests.helpers import NATIVE


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kv")
    return {name: build(root / name, demo_model, arch, bits=bits)
            for name, arch, bits in (("q4", "llama3", 4), ("fp32", "llama3", 0),
                                     ("gemma-q4", "gemma3_text", 4))}


def test_a_quantized_models_cache_is_float16_wherever_it_goes(models: dict[str, Path]) -> None:
    loaded = load_model(models["q4"], fast_cpu_ops=True, native=NATIVE)
    want = mx.float16 if NATIVE else mx.float32
    assert loaded.kv_dtype == ("float16" if NATIVE else "float32")
    assert loaded.kv_bytes_per_token == kv_bytes_per_token(loaded.config, 2 if NATIVE else 4)
    model = loaded.model
    alone = new_sequence_cache(model)
    assert all(type(c) is HalfKV for c in alone) == NATIVE
    prefill(model, alone, list(range(5, 40)), False)
    together, _ = prefill_batch(model, [list(range(5, 20)), list(range(7, 30))])
    batch = DecodeBatch(model)
    batch.add(1, alone)
    assert batch.slots is not None
    batch.step([3])
    straight = DecodeBatch(model)  # prompts read straight into an empty batch's slots
    straight.prefill([2, 3], [list(range(5, 20)), list(range(7, 30))])
    assert straight.slots is not None
    kept = copy.deepcopy(alone)  # as the prompt cache fetches a private copy
    taken = batch.slots.extract(0)
    for caches in (alone, together, kept, taken, batch.slots.layers, straight.slots.layers):
        assert {c.keys.dtype for c in caches} == {want}
        assert {c.values.dtype for c in caches} == {want}
    assert type(taken[0]) is type(alone[0])
    taken[0].update_and_fetch(mx.zeros((1, 2, 300, 32)), mx.zeros((1, 2, 300, 32)))
    assert taken[0].keys.dtype == want  # grown past its buffer, still its dtype


def test_float32_is_kept_where_asked_or_where_the_cache_cannot_be_16_bits(
        models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    # an unquantized model keeps its own dtype; so does one whose windowed layers keep
    # mlx-lm's rotating caches (merged as mlx-lm merges them)
    for name in ("fp32", "gemma-q4"):
        loaded = load_model(models[name], fast_cpu_ops=True, native=NATIVE)
        assert loaded.kv_dtype == "float32" and kv_dtype(loaded.model) is None
        assert loaded.kv_bytes_per_token == kv_bytes_per_token(loaded.config, 4)
    monkeypatch.setenv("APPLIANCE_KV_DTYPE", "float32")
    loaded = load_model(models["q4"], fast_cpu_ops=True, native=NATIVE)
    assert loaded.kv_dtype == "float32" and kv_dtype(loaded.model) is None
    assert all(type(c) is not HalfKV for c in new_sequence_cache(loaded.model))


def test_an_unknown_kv_dtype_is_a_clear_error(models: dict[str, Path],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APPLIANCE_KV_DTYPE", "float8")
    with pytest.raises(ValueError, match="APPLIANCE_KV_DTYPE must be float16 or float32"):
        load_model(models["q4"], fast_cpu_ops=True, native=NATIVE)
