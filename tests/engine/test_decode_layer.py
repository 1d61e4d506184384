"""A decoder layer's decode step in one operation (appliance/backend/decode_layer.py,
appliance/backend/native/decode_layer.cpp) on small random 4-bit models of the architectures
it takes (and two with 8-bit v and down projections): every layer of a plain decode step goes through it, with the bits of the
operations one by one (logits and KV buffers); prompt chunks ride in it, the decode rows
keeping those bits and the chunks their numbers; a buffer someone else still holds is
copied, not written; what it does not take goes the old way; bad arguments get a clear
error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from appliance.backend import decode_layer, fast_ops
from appliance.engine.batch import new_sequence_cache, prefill
from appliance.engine.model import load_model
from tests.devices import CPU_TUNING
from tests.engine.arch_models import build
from tests.engine.test_mixed_archs import _batch, _tokens

pytestmark = CPU_TUNING

TAKEN = ("llama3", "mistral", "qwen2", "qwen3")
MIXED = ("llama3", "qwen2")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("decode-layer")
    made = {arch: build(root / arch, demo_model, arch, bits=4)
            for arch in (*TAKEN, "phi3", "gemma3_text")}
    made["llama3-fp32"] = build(root / "llama3-fp32", demo_model, "llama3", bits=0)
    for arch in MIXED:  # a Q4_K_M file's import: v_proj and down_proj in 8 bits
        made[f"{arch}-mixed"] = build(root / f"{arch}-mixed", demo_model, arch, bits=4,
                                      eight=("v_proj", "down_proj"))
    return made


def _model(models: dict[str, Path], name: str) -> Any:
    return load_model(models[name], fast_cpu_ops=True, native=True).model


@pytest.mark.parametrize("arch", [*TAKEN, *(f"{a}-mixed" for a in MIXED)])
def test_each_layer_of_a_decode_step_is_one_operation_with_the_same_bits(
        models: dict[str, Path], arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Also where a layer's linears differ in bits (4 and 8, as a Q4_K_M file's): those
    layers went the old way, each operation on its own, a Q4_K_M step's half."""
    model = _model(models, arch)
    plan = decode_layer.plan(model, qk_norm=arch == "qwen3")
    assert plan is not None and all(layer is not None for layer in plan)
    calls = []
    step = decode_layer.step
    monkeypatch.setattr(decode_layer, "step", lambda *a: calls.append(1) or step(*a))
    one, plain = _batch(model, [40, 23, 57], lean=True), _batch(model, [40, 23, 57], lean=True)
    inputs = [11, 12, 13]
    for _ in range(3):
        got = one.step(inputs)
        with monkeypatch.context() as m:
            m.setattr(decode_layer, "plan", lambda *a, **k: None)
            want = plain.step(inputs)
        assert mx.array_equal(got, want).item()
        inputs = got.argmax(-1).tolist()
    assert len(calls) == 3 * len(plan)
    layout = one.slots.layers[0].layout
    for a, b in zip(one.slots.layers, plain.slots.layers, strict=True):
        assert a.base == b.base and a.keys is not None and b.keys is not None
        for buf_a, buf_b in ((a.keys, b.keys), (a.values, b.values)):
            assert buf_a is not None and buf_b is not None
            start, end = layout.start - a.base, layout.end - a.base
            assert mx.array_equal(buf_a[:3, :, start:end], buf_b[:3, :, start:end]).item()


@pytest.mark.parametrize("arch", TAKEN)
def test_prompt_chunks_ride_in_the_operation(
        models: dict[str, Path], arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh prompt's chunk and a later chunk of a prompt read before ride in the step:
    the decode rows get the bits of the operations one by one, the chunks their numbers
    (attention summed in another order), each cache its positions; a chunk's buffers that
    someone else still holds are copied, not written."""
    model = _model(models, arch)
    plan = decode_layer.plan(model, qk_norm=arch == "qwen3")
    assert plan is not None
    rode = []
    step = decode_layer.step
    monkeypatch.setattr(decode_layer, "step", lambda *a: rode.append(len(a[8])) or step(*a))

    def run(fused: bool) -> tuple[mx.array, mx.array | None, list[Any], list[Any], Any]:
        batch = _batch(model, [40, 23, 57], lean=True)
        fresh, deep = new_sequence_cache(model), new_sequence_cache(model)
        prefill(model, deep, _tokens(30, 9), False)
        held = [mx.array(c.keys) for c in deep], [c.keys for c in deep]
        chunks = [(fresh, _tokens(19, 7), True), (deep, _tokens(12, 8), False)]
        with monkeypatch.context() as m:
            if not fused:
                m.setattr(decode_layer, "plan", lambda *a, **k: None)
            logits, lasts = batch.step_mixed([11, 12, 13], chunks)
            after = batch.step([1, 2, 3])
        for before, still in zip(*held, strict=True):  # (mlx-lm's cache updates the object)
            assert mx.array_equal(before, still).item() or not fused  # copied, not written
        assert lasts[1] is None
        return logits, lasts[0], fresh, deep, after

    logits, last, fresh, deep, after = run(True)
    assert rode == [2] * len(plan) + [0] * len(plan)
    want, want_last, fresh_want, deep_want, after_want = run(False)
    assert mx.array_equal(logits, want).item()
    assert last is not None and want_last is not None
    assert mx.allclose(last, want_last, atol=1e-4 * mx.abs(want_last).max().item()).item()
    assert mx.allclose(after, after_want, atol=1e-4 * mx.abs(after_want).max().item()).item()
    for got, ref in ((fresh, fresh_want), (deep, deep_want)):
        assert [c.offset for c in got] == [c.offset for c in ref] == [ref[0].offset] * len(plan)
        n = ref[0].offset
        # layer 0's keys and values come before any attention: the same bits
        assert mx.array_equal(got[0].keys[..., :n, :], ref[0].keys[..., :n, :]).item()
        assert mx.array_equal(got[0].values[..., :n, :], ref[0].values[..., :n, :]).item()
        # a quantized model's cache is float16 on the CPU (appliance/engine/kvcache.py):
        # keys whose float32 values differ by rounding may round a float16 step apart
        assert got[0].keys.dtype == mx.float16
        for a, b in zip(got, ref, strict=True):
            assert a.keys.shape == b.keys.shape
            want_keys = b.keys[..., :n, :]
            worst = mx.abs(a.keys[..., :n, :] - want_keys).max().item()
            assert worst <= (1e-4 + 2**-10) * mx.abs(want_keys).max().item(), worst


@pytest.mark.parametrize(("arch", "lengths"), [
    *((a, [40]) for a in (*TAKEN, "llama3-mixed")), ("llama3", [40, 23, 57]),
    ("qwen3", [23, 40]), ("llama3-mixed", [31, 31])])
def test_a_verify_is_one_operation_a_layer_with_plain_steps_bits(
        models: dict[str, Path], arch: str, lengths: list[int],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each row's next token and drafts (appliance/engine/lookup.py) go through each layer
    as its span (rows of other lengths padded, or not): every position's logits and KV are
    those of plain steps one at a time, bit for bit, so drafts change no token even where
    logits tie."""
    model = _model(models, arch)
    plan = decode_layer.plan(model, qk_norm=arch == "qwen3")
    assert plan is not None
    spans = []
    step = decode_layer.step
    monkeypatch.setattr(decode_layer, "step", lambda *a: spans.append(a[9]) or step(*a))
    b, n = len(lengths), 5
    tokens = [[11 + 7 * r + i for i in range(n)] for r in range(b)]
    drafted, plain = _batch(model, lengths, lean=True), _batch(model, lengths, lean=True)
    logits, _ = drafted.verify(tokens)
    assert spans == [n] * len(plan)
    steps = [plain.step([row[i] for row in tokens]) for i in range(n)]
    want = mx.stack(steps, axis=1).reshape(b * n, -1)  # row by row, as the verify's
    assert mx.array_equal(logits, want).item()
    drafted.keep(2)  # the last two drafts not kept: plain steps write over them
    for i in (3, 4):
        assert mx.array_equal(drafted.step([row[i] for row in tokens]), steps[i]).item()
    layout = drafted.slots.layout
    assert layout.end - layout.start == max(lengths) + n
    for a, c in zip(drafted.slots.layers, plain.slots.layers, strict=True):
        for r in range(b):
            assert mx.array_equal(a.row(r)[0], c.row(r)[0]).item()
            assert mx.array_equal(a.row(r)[1], c.row(r)[1]).item()


def _arguments(model: Any) -> tuple[decode_layer.Layer, mx.array, mx.array]:
    plan = decode_layer.plan(model, qk_norm=False)
    assert plan is not None and plan[0] is not None
    layer = plan[0]
    h = mx.random.normal((2, layer.hidden), key=mx.random.key(3))
    return layer, h, mx.array([5, 4], dtype=mx.int32)


def _buffers(layer: decode_layer.Layer) -> tuple[mx.array, mx.array]:
    shape = (3, layer.kv_heads, 8, layer.head_dim)
    keys = mx.random.normal(shape, key=mx.random.key(1))
    values = mx.random.normal(shape, key=mx.random.key(2))
    mx.eval(keys, values)
    return keys, values


def test_a_buffer_held_elsewhere_is_copied_and_one_let_go_is_written_alike(
        models: dict[str, Path]) -> None:
    layer, h, offset = _arguments(_model(models, "llama3"))
    keys, values = _buffers(layer)
    before = mx.array(keys), mx.array(values)  # copies: the buffers themselves stay held
    mx.eval(*before)
    h1, k1, v1 = decode_layer.step(layer, h, keys, values, offset, None, 5, 2) or ()
    mx.eval(h1, k1, v1)
    assert mx.array_equal(keys, before[0]).item() and mx.array_equal(values, before[1]).item()
    for new, old in ((k1, keys), (v1, values)):
        assert not mx.array_equal(new[:2, :, 5], old[:2, :, 5]).item()  # written there
        assert mx.array_equal(new[2], old[2]).item()                      # a row past B
        assert mx.array_equal(new[:, :, :5], old[:, :, :5]).item()
        assert mx.array_equal(new[:, :, 6:], old[:, :, 6:]).item()
    keys, values = _buffers(layer)  # the same numbers, no one else holding them
    where = [np.asarray(b).ctypes.data for b in (keys, values)]
    h2, k2, v2 = decode_layer.step(layer, h, keys, values, offset, None, 5, 2) or ()
    del keys, values
    mx.eval(h2, k2, v2)
    assert mx.array_equal(h1, h2).item() and mx.array_equal(k1, k2).item()
    assert mx.array_equal(v1, v2).item()
    # written where they lay (donated, as MLX's slice update would), not copied
    assert [np.asarray(b).ctypes.data for b in (k2, v2)] == where


def test_bad_arguments_get_a_clear_error(models: dict[str, Path]) -> None:
    layer, h, offset = _arguments(_model(models, "llama3"))
    keys, values = _buffers(layer)
    with pytest.raises(ValueError, match="positions first..at"):
        decode_layer.step(layer, h, keys, values, offset, None, 8, 2)
    with pytest.raises(ValueError, match="mask"):
        decode_layer.step(layer, h, keys, values, offset, mx.ones((2, 1, 1, 3), mx.bool_), 5, 2)
    with pytest.raises(ValueError, match="offset"):
        decode_layer.step(layer, h, keys, values, mx.array([5, 4, 3], mx.int32), None, 5, 2)
    with pytest.raises(ValueError, match="B rows"):
        decode_layer.step(layer, mx.concatenate([h, h]), keys, values, offset[:1], None, 5, 2)
    # float16 buffers are taken (a cache kept in 16 bits); bfloat16 or mixed ones are not
    half = keys.astype(mx.float16)
    assert decode_layer.step(layer, h, half, half, offset, None, 5, 2) is not None
    brain = keys.astype(mx.bfloat16)
    assert decode_layer.step(layer, h, brain, brain, offset, None, 5, 2) is None
    assert decode_layer.step(layer, h, half, values, offset, None, 5, 2) is None
    assert decode_layer.step(layer, mx.concatenate([h, h[:1]]), keys, values, offset, None,
                             5, 2, [(half[:1], half[:1], 3, 1)]) is None
    with pytest.raises(ValueError, match="one shape and dtype"):  # past the Python check
        fast_ops._extension().decode_layer(h, half, values, offset, None, layer.native, 5, 2,
                                           [], [], [])
    # a chunk riding after the two decode rows: its buffers [1, KV, W, d], room for its tokens
    rows = mx.concatenate([h, h[:1]])
    own = keys[:1], values[:1]
    assert decode_layer.step(layer, rows, keys, values, offset, None, 5, 2,
                             [(*own, 3, 1)]) is not None
    with pytest.raises(ValueError, match="positions must lie in its buffers"):
        decode_layer.step(layer, rows, keys, values, offset, None, 5, 2, [(*own, 8, 1)])
    with pytest.raises(ValueError, match=r"\[1, KV, W, d\]"):
        decode_layer.step(layer, rows, keys, values, offset, None, 5, 2, [(keys, values, 3, 1)])
    with pytest.raises(ValueError, match="B rows"):  # more chunk tokens than rows after B
        decode_layer.step(layer, rows, keys, values, offset, None, 5, 2, [(*own, 0, 3)])
    with pytest.raises(ValueError, match="each chunk needs"):
        fast_ops._extension().decode_layer(rows, keys, values, offset, None, layer.native, 5, 2,
                                           [own[0]], [3], [1])
    assert decode_layer.step(layer, rows, keys, values, offset, None, 5, 2,
                             [(own[0].astype(mx.float16), own[1], 3, 1)]) is None
    # a verify's span: two rows of two tokens each, at 5 and 6 of W = 8
    spans = mx.concatenate([h, h])
    assert decode_layer.step(layer, spans, keys, values, offset, None, 5, 2, span=2) is not None
    with pytest.raises(ValueError, match="span must be at least 1 and divide"):
        decode_layer.step(layer, spans[:3], keys, values, offset, None, 5, 2, span=2)
    with pytest.raises(ValueError, match=r"first..at \+ span - 1 must lie in W"):
        decode_layer.step(layer, spans, keys, values, offset, None, 7, 2, span=2)
    with pytest.raises(ValueError, match="a span's mask"):
        decode_layer.step(layer, spans, keys, values, offset, mx.ones((2, 1, 1, 5), mx.bool_),
                          5, 2, span=2)
    assert decode_layer.step(layer, spans, keys, values, offset, mx.ones((2, 1, 2, 5), mx.bool_),
                             5, 2, span=2) is not None


@pytest.mark.parametrize("name", ["llama3-fp32", "phi3", "gemma3_text"])
def test_what_it_does_not_take_goes_the_old_way(models: dict[str, Path], name: str) -> None:
    """Float32 weights (no tiles), Phi-3's fused q/k/v, Gemma 3's norms and blocks."""
    assert decode_layer.plan(_model(models, name), qk_norm=name == "gemma3_text") is None
