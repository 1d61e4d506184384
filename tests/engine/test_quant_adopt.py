"""A loaded model's quantized layers in the kernel's own forms (appliance/backend/quant.py's
``adopt``), on small random 4-bit models of the architectures the riding forward reads:
with x rounded to 16 bits, every 4-bit layer is read from tiles and each group of sibling
layers (q/k/v, gate/up) is one operation, within float32's rounding of the column-wise
kernel; with x in float, the groups alone, to the bit. A long prompt's rows and a layer
whose weights changed take the ordinary products."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from appliance.backend import fast_ops, quant
from tests.engine.arch_models import build

ARCHS = {"llama3": 2, "qwen3": 2, "gemma3_text": 2, "phi3": 0}
"""Groups a layer has: q/k/v and gate/up, none for Phi-3 (its projections are fused in the
checkpoint already)."""


@pytest.fixture(autouse=True)
def on_cpu() -> Iterator[None]:
    if not fast_ops.on_cpu():
        pytest.fail("these tests run where MLX computes on the CPU")
    yield
    quant.uninstall()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adopt")
    made = {arch: build(root / arch, demo_model, arch, bits=4) for arch in [*ARCHS, "qwen2"]}
    made["llama3-q8"] = build(root / "llama3-q8", demo_model, "llama3", bits=8)
    return made


class Counted:
    """The extension with its product calls counted."""

    def __init__(self, ext: Any) -> None:
        self.ext = ext
        self.calls = {"quantized_matmul": 0, "quantized_matmul_many": 0, "tiled_matmul": 0}

    def __getattr__(self, name: str) -> Any:
        if name not in self.calls:
            return getattr(self.ext, name)

        def counted(*args: Any) -> Any:
            self.calls[name] += 1
            return getattr(self.ext, name)(*args)
        return counted


def logits(model: Any, tokens: list[int], monkeypatch: pytest.MonkeyPatch) -> tuple[
        np.ndarray, dict[str, int]]:
    counted = Counted(fast_ops._extension())
    with monkeypatch.context() as patch:
        patch.setattr(fast_ops, "_extension", lambda: counted)
        out = model(mx.array([tokens]))
        mx.eval(out)
    return np.array(out), counted.calls


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("n", [1, 7])
def test_tiles_and_groups_give_the_kernels_numbers(
        arch: str, n: int, models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    assert quant.install() is None
    if quant.activations() != "int16":
        pytest.fail("x is rounded to 16 bits on AVX2 and AVX-512 (this processor has neither)")
    model = load(str(models[arch]))[0]
    layers = len(model.layers)
    tokens = [5 + 37 * i % 4000 for i in range(n)]
    want, alone = logits(model, tokens, monkeypatch)
    groups, tiled_bytes = quant.adopt(model)
    assert groups == ARCHS[arch] * layers and tiled_bytes > 0
    got, adopted = logits(model, tokens, monkeypatch)
    # the same rounded x and integer sums; the float steps' order differs, and a layer's
    # difference moves the next layer's rounded x (3e-4 of the largest: test_mixed_archs's
    # bound for x rounded to 16 bits; 1.03e-4 seen on Gemma 3 with OpenBLAS preloaded)
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-4 * np.abs(want).max())
    # seven products a layer alone (q, k, v, o, gate, up, down; Phi-3's four) and the head:
    # now one per group and one per other layer (o, down; Phi-3's four), and the head (its
    # own layer, or the 4-bit embedding when tied), all tiled
    separate = 4 if arch == "phi3" else 7
    assert alone["quantized_matmul"] == separate * layers + 1
    assert adopted["tiled_matmul"] == 4 * layers + 1
    assert adopted["quantized_matmul"] == 0
    assert adopted["quantized_matmul_many"] == 0


@pytest.mark.parametrize("arch", ["llama3", "gemma3_text"])
def test_with_x_in_float_groups_give_the_bits_of_separate_products(
        arch: str, models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    assert quant.install("float") is None
    model = load(str(models[arch]))[0]
    layers = len(model.layers)
    want, alone = logits(model, [9, 11, 13], monkeypatch)
    assert quant.adopt(model) == (2 * layers, 0)  # no tiles: x is not rounded
    got, grouped = logits(model, [9, 11, 13], monkeypatch)
    assert np.array_equal(got, want)
    assert grouped["quantized_matmul_many"] == 2 * layers
    assert grouped["quantized_matmul"] == alone["quantized_matmul"] - 5 * layers


def test_a_prompts_rows_and_changed_weights_take_ordinary_products(
        models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    assert quant.install() is None
    model = load(str(models["llama3"]))[0]
    layers = len(model.layers)
    quant.adopt(model)
    _, prompt = logits(model, list(range(5, 5 + quant.KERNEL_ROWS + 1)), monkeypatch)
    # tiles take prompts of up to TILED_ROWS rows (four a layer and the tied head)
    assert prompt["tiled_matmul"] == 4 * layers + 1
    _, prompt = logits(model, [5 + i % 4000 for i in range(quant.TILED_ROWS + 1)], monkeypatch)
    assert prompt["tiled_matmul"] == 0 and prompt["quantized_matmul_many"] == 0
    attn = model.layers[0].self_attn
    attn.o_proj.update({"weight": attn.o_proj["weight"] + 0})  # a new array: not adopted
    x = mx.ones((1, 128))
    want = np.array(quant.quantized_matmul(x, attn.o_proj["weight"], attn.o_proj["scales"],
                                           attn.o_proj["biases"], 32, 4))
    _, step = logits(model, [9], monkeypatch)
    assert step["tiled_matmul"] == 4 * layers
    assert np.array_equal(np.array(attn.o_proj(x)), want)
    assert quant.adopt(None) == (0, 0)
    _, forgotten = logits(model, [9], monkeypatch)
    assert forgotten["tiled_matmul"] == 0


def test_an_embedding_is_tiled_only_where_it_is_the_output_layer(
        models: dict[str, Path]) -> None:
    assert quant.install() is None
    for arch, tied in (("llama3", True), ("phi3", False)):
        model = load(str(models[arch]))[0]
        quant.adopt(model)
        embedding = model.model.embed_tokens["weight"]
        assert (id(embedding) in quant._layers) is tied, arch


def test_8_bit_layers_are_tiled_as_4_bit_ones_are(
        models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """8-bit layers (a Q8_0 file's, a Q4_K_M file's Q6_K tensors) and a tied 8-bit embedding,
    the output layer, are read from tiles with x in 16 bits, as 4-bit ones: the float kernel
    took 0.48 ms a prompt token for the 1B shape's 8-bit down_proj, tiles 0.14."""
    assert quant.install() is None
    model = load(str(models["llama3-q8"]))[0]
    tokens = [5, 41, 77]
    want, alone = logits(model, tokens, monkeypatch)
    quant.adopt(model)
    got, adopted = logits(model, tokens, monkeypatch)
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-4 * np.abs(want).max())
    layers = len(model.layers)
    # per layer q/k/v, o, gate/up and down; and the head
    assert alone["tiled_matmul"] == 0 and adopted["tiled_matmul"] == 4 * layers + 1
    for weight in (model.model.embed_tokens["weight"], model.layers[0].self_attn.o_proj["weight"]):
        group, _ = quant._layers[id(weight)]
        assert group.layers[0].tiled is not None and group.layers[0].tiled.bits == 8


def test_products_gives_a_groups_outputs_in_one_call_or_none(
        models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """What the riding forward asks for its siblings (quant.products): the outputs each
    layer's own call gives, from one operation (a lone layer's with a residual added, as
    MLX adds it); None (each layer is then called) where the
    layers are not one adopted group in that order, their weights changed, x has more rows
    than the tiles take, or nothing was adopted."""
    assert quant.install() is None
    model = load(str(models["llama3"]))[0]
    quant.adopt(model)
    attn = model.layers[0].self_attn
    qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
    x = mx.random.normal((3, attn.q_proj["weight"].shape[1] * 8), key=mx.random.key(4))
    counted = Counted(fast_ops._extension())
    with monkeypatch.context() as patch:
        patch.setattr(fast_ops, "_extension", lambda: counted)
        got = quant.products(x, qkv)
    assert got is not None and counted.calls["tiled_matmul"] == 1
    for out, layer in zip(got, qkv, strict=True):
        assert np.array_equal(np.array(out), np.array(layer(x)))
    assert quant.products(x, (attn.k_proj, attn.q_proj, attn.v_proj)) is None
    assert quant.products(x, qkv[:2]) is None
    assert quant.products(mx.ones((quant.TILED_ROWS + 1, x.shape[1])), qkv) is None
    (o,) = quant.products(x, (attn.o_proj,)) or [None]
    assert o is not None and np.array_equal(np.array(o), np.array(attn.o_proj(x)))
    # a residual is added in the product's operation, with the bits of MLX's add
    r = mx.random.normal(o.shape, key=mx.random.key(5))
    (added,) = quant.products(x, (attn.o_proj,), r) or [None]
    assert added is not None and np.array_equal(np.array(added), np.array(r + attn.o_proj(x)))
    assert quant.products(x, qkv, r) is None  # one weight only
    with pytest.raises(ValueError, match="residual"):
        fast_ops._extension().tiled_matmul(x, *quant._layers[id(attn.o_proj["weight"])][0].args,
                                           mx.zeros((3, 5)))
    attn.v_proj.update({"weight": attn.v_proj["weight"] + 0})
    assert quant.products(x, qkv) is None
    quant.adopt(None)
    assert quant.products(x, (attn.o_proj,)) is None


def test_products_add_a_layers_own_bias_as_its_call_does(models: dict[str, Path]) -> None:
    """Qwen 2's q/k/v carry biases, which nn.QuantizedLinear adds after the product: the
    group's one call adds each (and takes no residual past one)."""
    assert quant.install() is None
    model = load(str(models["qwen2"]))[0]
    quant.adopt(model)
    attn = model.layers[0].self_attn
    qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
    assert all("bias" in layer for layer in qkv)
    x = mx.random.normal((2, attn.q_proj["weight"].shape[1] * 8), key=mx.random.key(6))
    got = quant.products(x, qkv)
    assert got is not None
    for out, layer in zip(got, qkv, strict=True):
        assert np.array_equal(np.array(out), np.array(layer(x)))
    assert quant.products(x, (attn.q_proj,), mx.zeros_like(got[0])) is None


@pytest.mark.parametrize("arch", ["llama3", "llama3-q8", "qwen3"])
@pytest.mark.parametrize("stored16", [False, True])
def test_layers_held_once_give_the_same_bits_from_their_tiles_alone(
        arch: str, stored16: bool, models: dict[str, Path]) -> None:
    """``hold_once`` frees the arrays of every tiled layer (the tied embedding too): a
    decode row, a prompt past the tiles' rows (dense, dequantized from the tiles) and the
    embedding's rows give the bits they gave with MLX's arrays beside the tiles; the
    parameters shrink by what was freed; forgetting the layers puts the arrays back, and
    MLX's own products give what they gave before adoption. ``stored16``: scales stored in
    16 bits and widened by float32_on_cpu (a GGUF import on the CPU), the embedding's kept
    in 16 bits in its tiles."""
    from mlx.utils import tree_flatten, tree_map

    from appliance.backend.cpu import float32_on_cpu

    assert quant.install() is None
    if not quant.holds_once():
        pytest.fail("tiles need x rounded to 16 bits (AVX2, AVX-512) and dequantize_tiled")
    model = load(str(models[arch]))[0]
    if stored16:
        model.update(tree_map(lambda a: a.astype(mx.float16) if a.dtype == mx.float32 else a,
                              model.parameters()))
        float32_on_cpu(model)
    short, long = [5, 41, 77], [5 + 37 * i % 4000 for i in range(quant.TILED_ROWS + 1)]

    def run() -> list[np.ndarray]:
        outs = [model(mx.array([short])), model(mx.array([long])),
                model.model.embed_tokens(mx.array([short, short[::-1]]))]
        mx.eval(outs)
        return [np.array(o) for o in outs]

    def size() -> int:
        return sum(v.nbytes for _, v in tree_flatten(model.parameters()))

    alone = run()
    quant.adopt(model)
    want, before = run(), size()
    freed = quant.hold_once(model)
    assert freed > 0 and size() == before - freed
    if "lm_head" not in model:  # tied: the embedding is the output layer, tiled
        assert model.model.embed_tokens["weight"].size == 0
    for got, expected in zip(run(), want, strict=True):
        assert got.dtype == expected.dtype and np.array_equal(got, expected)
    quant.adopt(None)
    assert size() == before
    for got, expected in zip(run(), alone, strict=True):
        assert np.array_equal(got, expected)


@pytest.mark.parametrize("arch", ["llama3", "llama3-q8"])
def test_holding_while_adopting_frees_each_group_before_the_next_is_tiled(
        arch: str, models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """``adopt(model, hold=True)`` (the CPU plug's load) frees a group's arrays as soon as
    its tiles are made, so a load never holds the whole model twice: when a layer is tiled,
    every layer of the groups before it already lost its arrays. The products then give
    the bits that adopting first and ``hold_once`` after give, and nothing is left to hold."""
    import mlx.nn as nn

    assert quant.install() is None
    if not quant.holds_once():
        pytest.fail("tiles need x rounded to 16 bits (AVX2, AVX-512) and dequantize_tiled")
    tokens = [[5, 41, 77], [5 + 37 * i % 4000 for i in range(quant.TILED_ROWS + 1)]]

    def run(model: Any) -> list[np.ndarray]:
        outs = [model(mx.array([t])) for t in tokens]
        mx.eval(outs)
        return [np.array(o) for o in outs]

    first = load(str(models[arch]))[0]
    quant.adopt(first)
    freed_after = quant.hold_once(first)
    want = run(first)

    model = load(str(models[arch]))[0]
    quantized = [m for _, m in model.named_modules()
                 if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    full: list[int] = []
    real_tile = quant.tile

    def tile(*args: Any) -> Any:
        full.append(sum(1 for m in quantized if m["weight"].size))
        return real_tile(*args)

    monkeypatch.setattr(quant, "tile", tile)
    quant.adopt(model, hold=True)
    assert len(full) > 3
    # a group is at most 3 layers (q/k/v): at the i-th tile, at least i - 2 were freed
    assert all(left <= len(quantized) - i + 2 for i, left in enumerate(full)), full
    assert quant.freed_bytes() == freed_after > 0
    assert quant.hold_once(model) == 0
    for got, expected in zip(run(model), want, strict=True):
        assert got.dtype == expected.dtype and np.array_equal(got, expected)
