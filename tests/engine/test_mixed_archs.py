"""Every architecture the riding forward reads (appliance/engine/mixed.py: Llama 3.x,
Mistral, Qwen 3, Phi-3, Gemma 3 text), on small random-weight models built with mlx-lm's own
classes, in float32 and 4-bit: each part of a mixed forward gets the numbers of its own
forward, and the engine's greedy output (streams decoding together, prompts read in chunks
beside them) is mlx-lm's greedy output for each prompt alone."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step

from appliance.engine.batch import DecodeBatch, new_sequence_cache, prefill
from appliance.engine.mixed import mixed_step, supports_mixed
from appliance.engine.model import LoadedModel, hidden_dtype, kv_bytes_per_token, load_model
from appliance.engine.request import GenerationRequest, RequestHandle
from appliance.engine.runner import Runner
from appliance.sched.scheduler import Scheduler
from appliance.sched.types import SchedulerConfig
from tests.devices import EXACT_BATCHES
from tests.engine.arch_models import CONFIGS, build
from tests.helpers import NATIVE

ATOL = 1e-4
"""fp32 sums of the same products in another grouping of rows."""
X16 = 3e-4
"""4-bit: a part alone (at most 32 rows) goes through the quantized kernel, which rounds x to
16 bits on AVX2 and AVX-512; the mixed forward's 34 rows go dense, x in float
(appliance/backend/quant.py). The rounding moves a product by at most 1e-4 of its largest
output on SmolLM2 (tests/engine/test_quant_activations.py bounds it at 3e-4): this share of
the largest logit."""


def _atol(bits: int, want: mx.array) -> float:
    return ATOL + (X16 * mx.abs(want).max().item() if bits == 4 else 0.0)

RIDES_IN_ENGINE = {"llama3", "mistral", "qwen3", "phi3"}
"""Gemma 3's sliding-window layers keep rotating caches, which the engine's decode slots do
not hold: it is read one forward per part there (docs/models.md)."""

CASES = [pytest.param(arch, bits, id=f"{arch}-{'q4' if bits else 'fp32'}")
         for arch in CONFIGS for bits in (0, 4)]


def _tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in mx.random.randint(3, 4000, (n,), key=mx.random.key(seed)).tolist()]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("archs")
    return {f"{arch}-{bits}": build(root / f"{arch}-{bits}", demo_model, arch, bits=bits)
            for arch in [*CONFIGS, "qwen2"] for bits in (0, 4)}


def _load(models: dict[str, Path], arch: str, bits: int) -> LoadedModel:
    return load_model(models[f"{arch}-{bits}"], fast_cpu_ops=True, native=NATIVE)


def _batch(model: Any, lengths: list[int], lean: bool) -> DecodeBatch:
    batch = DecodeBatch(model)
    batch.lean = batch.lean and lean
    for i, n in enumerate(lengths):
        cache = new_sequence_cache(model)
        prefill(model, cache, _tokens(n, i), False)
        batch.add(i, cache)
    return batch


@EXACT_BATCHES
@pytest.mark.parametrize(("arch", "bits"), CASES)
def test_each_part_of_a_mixed_forward_gets_its_own_forwards_numbers(
        models: dict[str, Path], arch: str, bits: int) -> None:
    model = _load(models, arch, bits).model
    assert supports_mixed(model)
    lengths, inputs = [40, 23, 57], [11, 12, 13]
    fresh, deep = _tokens(19, 7), _tokens(12, 8)

    own = _batch(model, lengths, lean=False)  # mlx-lm's model call over the batch
    want = own.step(inputs)
    fresh_cache = new_sequence_cache(model)
    fresh_want = prefill(model, fresh_cache, fresh, True)

    mixed = _batch(model, lengths, lean=True)
    fresh_mixed, deep_mixed = new_sequence_cache(model), new_sequence_cache(model)
    prefill(model, deep_mixed, _tokens(30, 9), False)
    chunks: list[tuple[list[Any], list[int], bool]] = [(fresh_mixed, fresh, True),
                                                       (deep_mixed, deep, False)]
    if mixed.lean:
        logits, lasts = mixed.step_mixed(inputs, chunks)
    else:  # Gemma 3: the batch's KV in mlx-lm's batched (rotating) caches
        assert arch not in RIDES_IN_ENGINE and mixed.layers is not None
        logits, lasts = mixed_step(model, mixed.layers, inputs, chunks)
    assert mx.allclose(logits, want, atol=_atol(bits, want)).item()
    assert (logits.argmax(-1) == want.argmax(-1)).all().item()
    assert lasts[1] is None and lasts[0] is not None and fresh_want is not None
    assert mx.allclose(lasts[0], fresh_want, atol=_atol(bits, fresh_want)).item()
    assert [c.offset for c in fresh_mixed] == [c.offset for c in fresh_cache]
    # and the next decode step of the batch is the same after either
    after = own.step([1, 2, 3])  # (the mixed forward's KV was written by the dense path)
    assert mx.allclose(mixed.step([1, 2, 3]), after, atol=_atol(bits, after)).item()


@pytest.mark.parametrize(("arch", "bits"), [
    *(c for c in CASES if c.values[0] in RIDES_IN_ENGINE),
    *(pytest.param("qwen2", bits, id=f"qwen2-{'q4' if bits else 'fp32'}") for bits in (0, 4))])
def test_a_decode_step_has_the_bits_of_the_models_own_forward(
        models: dict[str, Path], arch: str, bits: int) -> None:
    """The plain decode step of a model that rides runs mixed_step: the same bits as
    mlx-lm's model call, with left-padded rows."""
    model = _load(models, arch, bits).model
    lean, own = _batch(model, [40, 23, 57], lean=True), _batch(model, [40, 23, 57], lean=False)
    assert lean.lean and not own.lean
    inputs = [11, 12, 13]
    for _ in range(3):
        ours, theirs = lean.step(inputs), own.step(inputs)
        assert mx.array_equal(ours, theirs).item()
        inputs = ours.argmax(-1).tolist()


def _reference(model: Any, prompt: list[int], n: int) -> list[int]:
    """mlx-lm's own greedy generation of ``prompt`` alone."""
    steps = generate_step(mx.array(prompt), model, max_tokens=n,
                          sampler=lambda x: mx.argmax(x, axis=-1))
    return [int(token) for token, _ in steps]


def _served(loaded: LoadedModel) -> Runner:
    """Two streams decode; a long prompt and two short ones arrive while they do (read in
    chunks of 8 beside them): each stream's tokens must be those mlx-lm generates for it
    alone. The runner, for what it counted."""
    got: dict[int, list[int]] = {}

    def record(request: GenerationRequest, phase: str) -> None:
        # At its finish, a sequence's tokens are the whole answer (a token whose text is held
        # back, a byte of a character or a special token, has no TokenEvent of its own).
        if phase == "finish":
            got[request.rid] = runner.seqs[request.rid].tokens[len(request.prompt):]

    runner = Runner(loaded, Scheduler(SchedulerConfig(prefill_chunk_size=8)), time.monotonic,
                    record)
    prompts = [(_tokens(12, 1), 24), (_tokens(7, 2), 24), (_tokens(45, 3), 10),
               (_tokens(9, 4), 12), (_tokens(20, 5), 12)]
    rids: list[int] = []

    def submit(i: int) -> None:
        request = GenerationRequest(prompt=tuple(prompts[i][0]), max_tokens=prompts[i][1])
        rids.append(request.rid)
        runner.take([RequestHandle(request, lambda event: None)])

    submit(0)
    submit(1)
    for _ in range(3):
        runner.tick()
    submit(2)
    submit(3)
    runner.tick()
    submit(4)
    while runner.tick():
        pass
    for (prompt, n), rid in zip(prompts, rids, strict=True):
        tokens = got[rid]
        assert tokens, "every request produced a token"
        assert tokens == _reference(loaded.model, prompt, n)[:len(tokens)]
    assert sum(len(t) for t in got.values()) > 40  # not all cut short by an end-of-text token
    return runner


@EXACT_BATCHES
@pytest.mark.parametrize(("arch", "bits"), CASES)
def test_greedy_output_through_the_engine_is_mlx_lms_alone(
        models: dict[str, Path], arch: str, bits: int) -> None:
    runner = _served(_load(models, arch, bits))
    if arch in RIDES_IN_ENGINE:
        assert runner.mixed_forwards >= 4, "the prompts' chunks rode in decode steps"
    else:
        assert runner.mixed_forwards == 0


@EXACT_BATCHES
@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_a_bfloat16_4bit_model_is_computed_in_float32_on_the_cpu(
        tmp_path: Path, demo_model: Path, arch: str) -> None:
    """A 4-bit model as mlx-lm's convert writes it, scales and norms in bfloat16 (the MLX
    models households download), computes in float32 on the CPU, where MLX has no 16-bit
    arithmetic of its own and the appliance's kernels take float32: every float array is
    cast at load but the linear layers' scales and biases, the hidden states are float32,
    the KV cache float16 (appliance/engine/kvcache.py; the KV budget counts 2 bytes), and
    its prompts ride in the decode step as a float32 model's do."""
    path = build(tmp_path / arch, demo_model, arch, bits=4, dtype=mx.bfloat16)
    saved = mx.load(str(path / "model.safetensors"))
    assert isinstance(saved, dict)
    assert saved["model.norm.weight"].dtype == mx.bfloat16  # as written
    loaded = load_model(path, fast_cpu_ops=True, native=NATIVE)
    floats = {name: v.dtype for name, v in tree_flatten(loaded.model.parameters())
              if mx.issubdtype(v.dtype, mx.floating)}
    quantization = {n for n in floats if n.endswith((".scales", ".biases"))
                    and "embed_tokens" not in n}  # the products read them as they are
    assert quantization and {floats[n] for n in quantization} == {mx.bfloat16}
    assert {floats[n] for n in floats.keys() - quantization} == {mx.float32}
    assert hidden_dtype(loaded.model) == mx.float32
    half = NATIVE  # the cache is kept in 16 bits where the appliance's kernels read it
    assert loaded.kv_dtype == ("float16" if half else "float32")
    assert loaded.kv_bytes_per_token == kv_bytes_per_token(loaded.config, 2 if half else 4)
    assert _served(loaded).mixed_forwards >= 4
