"""The quantized matmul kernel (appliance/backend/native/quant_matmul.cpp, appliance/backend/quant.py):
MLX's affine 4- and 8-bit products against float64 for every group size and a spread of rows (4-bit
ones with x in float and rounded to 16 bits), by the kernel and by the dense path that products of
more than 32 rows take (dequantized weights into MLX's matmul), the same bits for a row alone and in
a batch up to 32 rows, each SIMD variant (forced in a subprocess) agreeing with the others, what it
does not take going to MLX unchanged, and the imported 4-bit SmolLM2 answering with MLX's own
greedy tokens. The same for 4- and 8-bit weights in tiles of 16 columns (``tiles.tile``), for
products of one x made as one, and for inputs that are views."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from appliance.backend import fast_ops, quant, tiles

ROOT = Path(__file__).resolve().parents[2]
ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 16, 31, 33, 40, 96)  # decode sizes, a slice's edge, a prefill
PATHS = [(4, "float"), (4, "int16"), (8, None)]  # 8-bit products always take x in float


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    why = quant.available()
    if why is not None:
        pytest.fail(f"quantized kernel unavailable: {why} (scripts/test.sh builds it with g++)")


@pytest.fixture
def installed() -> Iterator[None]:
    quant.install()
    yield
    quant.uninstall()


def packed(n: int, k: int, bits: int, group: int, scale_dtype: mx.Dtype = mx.float16,
           seed: int = 0) -> tuple[mx.array, mx.array, mx.array, np.ndarray]:
    """Random weights quantized as MLX does, and their dequantized values in float64."""
    rng = np.random.default_rng(seed)
    w, s, b = mx.quantize(mx.array(rng.standard_normal((n, k)).astype(np.float32)),
                          group_size=group, bits=bits)
    s, b = s.astype(scale_dtype), b.astype(scale_dtype)
    dense = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=group,
                          bits=bits)
    return w, s, b, np.array(dense).astype(np.float64)


def rows(m: int, k: int, seed: int = 1) -> mx.array:
    return mx.array(np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32))


def rounding_bound(x: np.ndarray, dense: np.ndarray) -> np.ndarray:
    """The most that rounding x to 16 bits per block of 32 (steps of max|x| / 32767 of the
    block, so at most half a step an element) can move each output of x @ dense.T."""
    m, k = x.shape
    amax = np.abs(x.reshape(m, k // 32, 32)).max(axis=-1).astype(np.float64)
    return (np.repeat(amax, 32, axis=1) / 65534) @ np.abs(dense).T


def assert_close(got: np.ndarray, want: np.ndarray, x: mx.array, dense: np.ndarray,
                 activations: str | None) -> None:
    """Float32 rounding of the sums (2e-5 of the largest output), plus, for x in 16 bits,
    the rounding of x (:func:`rounding_bound`)."""
    atol = 2e-5 * np.abs(want).max()
    if activations == "int16":
        atol = atol + rounding_bound(np.array(x), dense)
    assert np.all(np.abs(got - want) <= atol), np.abs(got - want).max()


@pytest.mark.parametrize(("bits", "activations"), PATHS)
@pytest.mark.parametrize("group", quant.GROUP_SIZES)
def test_it_matches_float64_for_every_width_group_and_row_count(
        bits: int, activations: str | None, group: int) -> None:
    # 576: a partial last block of 16 words (and of 4 blocks of 32 for 16-bit x)
    k = 576 if 576 % group == 0 else 640
    w, s, b, dense = packed(97, k, bits, group)
    for m in ROWS:
        x = rows(m, k)
        want = np.array(x).astype(np.float64) @ dense.T
        for path in ("kernel", None):  # None: the dense path past KERNEL_ROWS
            got = np.array(quant.quantized_matmul(x, w, s, b, group, bits, activations, path))
            assert got.shape == (m, 97)
            taken = "kernel" if path == "kernel" or m <= quant.KERNEL_ROWS else "dense"
            assert_close(got, want, x, dense, activations if taken == "kernel" else "float")


@pytest.mark.parametrize("bits", quant.BITS)
@pytest.mark.parametrize("group", quant.GROUP_SIZES)
@pytest.mark.parametrize("scale_dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("pieces", [False, True])
def test_the_dense_path_matches_float64_for_every_width_group_and_scale_type(
        bits: int, group: int, scale_dtype: mx.Dtype, pieces: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    if pieces:  # weights dequantized in pieces of rows (16 at K = 1024, the last of 6)
        monkeypatch.setattr(quant, "DENSE_WHOLE", 0)
        monkeypatch.setattr(quant, "DENSE_PIECE", 16 * 1024)
    # K with a partial last block of 16 words where the group allows one (576 and 448 at 4
    # bits, 608 at 8), and a whole number of blocks (1024)
    for k in (576, 448, 608, 1024):
        if k % group:
            continue
        w, s, b, dense = packed(70, k, bits, group, scale_dtype, seed=k)
        for shape in ((1, k), (33, k), (200, k), (2, 20, k)):
            x = mx.array(np.random.default_rng(k).standard_normal(shape).astype(np.float32))
            got = np.array(quant.quantized_matmul(x, w, s, b, group, bits, path="dense"))
            want = np.array(x).astype(np.float64) @ dense.T
            assert got.shape == (*shape[:-1], 70)
            assert np.abs(got - want).max() <= 2e-5 * np.abs(want).max()


def block_order(k: int, bits: int) -> list[int]:
    """The kernel's order of K: blocks of 16 words, element i * per + j of a block at
    j * 16 + i (per = 32 / bits a word), the last, partial block of v words at j * v + i."""
    per = 32 // bits
    order: list[int] = []
    for b0 in range(0, k, 16 * per):
        v = min(16 * per, k - b0) // per
        order.extend(b0 + i * per + j for j in range(per) for i in range(v))
    return order


@pytest.mark.parametrize("bits", quant.BITS)
@pytest.mark.parametrize("group", quant.GROUP_SIZES)
def test_the_dequantized_weights_are_mlxs_in_the_order_x_is_put_in(bits: int, group: int) -> None:
    # bf16 scales, as imported GGUF models keep them; 576 and 448: a partial last block
    ext = fast_ops._extension()
    for k in (576, 448, 1024):
        if k % group:
            continue
        w, s, b, _ = packed(50, k, bits, group, mx.bfloat16)
        order = block_order(k, bits)
        assert sorted(order) == list(range(k))
        want = np.array(mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32),
                                      group_size=group, bits=bits))
        assert np.array_equal(np.array(ext.dequantize_blocked(w, s, b, group, bits)),
                              want[:, order])
        x = rows(3, k)
        assert np.array_equal(np.array(ext.block_order(x, bits)), np.array(x)[:, order])


@pytest.mark.parametrize("bits", quant.BITS)
@pytest.mark.parametrize("group", quant.GROUP_SIZES)
@pytest.mark.parametrize("scale_dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_tiles_dequantize_to_the_floats_of_mlxs_arrays(bits: int, group: int,
                                                        scale_dtype: mx.Dtype) -> None:
    """A layer held once has only its tiles: any rows of them dequantize to what
    dequantize_blocked gives from MLX's arrays, bit for bit (50 rows: a partial last
    tile; 576: a partial last block), and untile gives MLX's arrays back."""
    ext = fast_ops._extension()
    for k in (576, 1024):
        if k % group:
            continue
        w, s, b, _ = packed(50, k, bits, group, scale_dtype)
        t = tiles.tile(w, s, b, group)
        want = np.array(ext.dequantize_blocked(w, s, b, group, bits))
        for row0, count in ((0, 50), (0, 1), (7, 20), (16, 16), (33, 17), (49, 1)):
            got = ext.dequantize_tiled(t.tiles, t.scales, t.biases, row0, count, group, bits)
            assert np.array_equal(np.array(got), want[row0:row0 + count]), (row0, count)
        for mine, theirs in zip(tiles.untile(t), (w, s, b), strict=True):
            assert mine.dtype == theirs.dtype and mx.array_equal(mine, theirs).item()
        with pytest.raises(ValueError, match="rows outside"):
            ext.dequantize_tiled(t.tiles, t.scales, t.biases, 40, 30, group, bits)


@pytest.mark.parametrize("bits", quant.BITS)
def test_tiles_made_a_piece_of_rows_at_a_time_are_the_same(
        bits: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``tile`` converts ``TILE_PIECE`` rows at a time (the whole weight's temporaries were
    a load's peak): pieces of 16 and 32 rows, the last one partial, give one piece's tiles."""
    w, s, b, _ = packed(50, 576, bits, 32)
    whole = tiles.tile(w, s, b, 32)
    for piece in (16, 32):
        monkeypatch.setattr(tiles, "TILE_PIECE", piece)
        for got, want in zip(tiles.tile(w, s, b, 32)[:3], whole[:3], strict=True):
            assert got.dtype == want.dtype and mx.array_equal(got, want).item()


def test_products_of_up_to_32_rows_take_the_kernel_and_more_go_dense() -> None:
    from appliance.backend import profile

    assert quant.KERNEL_ROWS == profile.KERNEL_ROWS  # where the cost model steps
    w, s, b, _ = packed(300, 576, 4, 64)
    x = rows(quant.KERNEL_ROWS + 1, 576)
    for m, path in ((1, "kernel"), (quant.KERNEL_ROWS, "kernel"), (quant.KERNEL_ROWS + 1, "dense")):
        auto = np.array(quant.quantized_matmul(x[:m], w, s, b, 64, 4))
        assert np.array_equal(auto, np.array(quant.quantized_matmul(x[:m], w, s, b, 64, 4,
                                                                    path=path)))
    # rows counted over every axis but the last: 3 x 11 is a prompt's 33
    x3 = x.reshape(3, 11, 576)
    assert np.array_equal(np.array(quant.quantized_matmul(x3, w, s, b, 64, 4)),
                          np.array(quant.quantized_matmul(x3, w, s, b, 64, 4, path="dense")))


def test_16_bit_x_is_within_its_rounding_where_float_x_is_within_float32() -> None:
    # One outlier an x row, as the normed hidden states of real models have: the 16-bit path
    # keeps it to its block, and the bound is tight enough to mean something.
    w, s, b, dense = packed(97, 576, 4, 32)
    xn = np.array(rows(8, 576))
    xn[:, 7] *= 300
    x = mx.array(xn)
    want = xn.astype(np.float64) @ dense.T
    bound = rounding_bound(xn, dense)
    err = np.abs(np.array(quant.quantized_matmul(x, w, s, b, 32, 4, "int16")) - want)
    assert np.all(err <= bound + 2e-5 * np.abs(want).max())
    assert bound.max() < 3e-4 * np.abs(want).max()
    err = np.abs(np.array(quant.quantized_matmul(x, w, s, b, 32, 4, "float")) - want)
    assert err.max() < 2e-5 * np.abs(want).max()


@pytest.mark.parametrize("scale_dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_it_reads_scales_of_each_float_type(scale_dtype: mx.Dtype) -> None:
    w, s, b, dense = packed(40, 256, 4, 64, scale_dtype)
    x = rows(3, 256)
    want = np.array(x).astype(np.float64) @ dense.T
    for activations in ("float", "int16"):
        got = np.array(quant.quantized_matmul(x, w, s, b, 64, 4, activations))
        assert_close(got, want, x, dense, activations)


@pytest.mark.parametrize(("bits", "activations"), PATHS)
@pytest.mark.parametrize("path", ["kernel", None])
def test_a_row_gets_the_same_bits_alone_and_in_a_batch(
        bits: int, activations: str | None, path: str | None) -> None:
    # 2000 columns: big enough to be shared with the pool's helpers. The kernel keeps the
    # promise at any size (40 rows: past a slice's edge); the process's choice up to 32 rows.
    w, s, b, _ = packed(2000, 576, bits, 32)
    m_all = 40 if path == "kernel" else quant.KERNEL_ROWS
    x = rows(m_all, 576)
    batch = np.array(quant.quantized_matmul(x, w, s, b, 32, bits, activations, path))
    for m in (1, 3, 8, 31, 33):
        if m < m_all:
            part = np.array(quant.quantized_matmul(x[:m], w, s, b, 32, bits, activations, path))
            assert np.array_equal(part, batch[:m])
    for r in (0, 5, m_all - 1):
        alone = np.array(quant.quantized_matmul(x[r:r + 1], w, s, b, 32, bits, activations,
                                                path))
        assert np.array_equal(alone[0], batch[r])


def test_batch_axes_are_kept(installed: None) -> None:
    w, s, b, dense = packed(64, 128, 8, 64)
    x = mx.array(np.random.default_rng(2).standard_normal((2, 3, 128)).astype(np.float32))
    got = mx.quantized_matmul(x, w, scales=s, biases=b, group_size=64, bits=8)
    assert got.shape == (2, 3, 64) and got.dtype == mx.float32
    want = np.array(x).astype(np.float64) @ dense.T
    np.testing.assert_allclose(np.array(got), want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_what_it_does_not_take_goes_to_mlx_unchanged(installed: None) -> None:
    own = quant.mlx_own()
    w, s, b, _ = packed(64, 128, 4, 32, mx.float32)
    x = rows(2, 128)
    cases = [
        dict(x=x.astype(mx.float16), transpose=True, group_size=32, bits=4),  # half activations
        dict(x=rows(2, 64), transpose=False, group_size=32, bits=4),  # x @ W
    ]
    for case in cases:
        xc = case.pop("x")
        assert not quant.takes(xc, w, s, b, case["transpose"], case["group_size"], case["bits"],
                               "affine")
        got = mx.quantized_matmul(xc, w, scales=s, biases=b, **case)
        want = own(xc, w, scales=s, biases=b, **case)
        assert got.dtype == want.dtype and np.array_equal(np.array(got), np.array(want))


def test_uninstall_puts_mlx_back() -> None:
    own = mx.quantized_matmul
    assert quant.install() is None and quant.installed() and mx.quantized_matmul is not own
    assert quant.simd() in ("avx512", "avx2", "portable")
    quant.uninstall()
    assert mx.quantized_matmul is own and quant.simd() is None


VARIANT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import mlx.core as mx
    from appliance.backend import quant, tiles
    out = {"simd": quant.fast_ops._extension().quant_simd()}
    rng = np.random.default_rng(0)
    for bits, group, k in ((4, 32, 576), (8, 32, 576), (4, 128, 640), (8, 64, 576),
                           (4, 64, 448), (4, 32, 480), (4, 32, 544)):
        w, s, b = mx.quantize(mx.array(rng.standard_normal((300, k)).astype(np.float32)),
                              group_size=group, bits=bits)
        s, b = s.astype(mx.float16), b.astype(mx.float16)
        x = mx.array(rng.standard_normal((9, k)).astype(np.float32))
        for act in ("float", "int16") if bits == 4 else (None,):
            y = quant.quantized_matmul(x, w, s, b, group, bits, act)
            out[f"{bits}/{group}/{k}/{act}"] = np.array(y).tolist()
        y = tiles.tiled_matmul(x, tiles.tile(w, s, b, group))[0]
        out[f"{bits}/{group}/{k}/tiled"] = np.array(y).tolist()
        x = mx.array(rng.standard_normal((40, k)).astype(np.float32))
        y = quant.quantized_matmul(x, w, s, b, group, bits, path="dense")
        out[f"{bits}/{group}/{k}/dense"] = np.array(y).tolist()
    # a KV cache kept in float16, widened by the variant (appliance/engine/kvcache.py)
    q = mx.array(rng.standard_normal((2, 6, 1, 40)).astype(np.float32))
    kv = mx.array(rng.standard_normal((2, 2, 150, 40)).astype(np.float16))
    y = quant.fast_ops._extension().decode_attention(q, kv, kv * 0.5, 0.2, None)
    out["attention/float16"] = np.array(y).tolist()
    print(json.dumps(out))
""")


def test_each_simd_variant_agrees_with_the_others() -> None:
    results = {}
    for want in ("portable", "avx2", "avx512"):
        env = {**os.environ, "APPLIANCE_SIMD": want}
        done = subprocess.run([sys.executable, "-c", VARIANT], env=env, capture_output=True,
                              text=True, timeout=300, cwd=ROOT)
        assert done.returncode == 0, done.stderr
        got = json.loads(done.stdout)
        if got["simd"] != want:  # this processor lacks it: it must fall back, never SIGILL
            assert want != "portable"
            continue
        results[want] = got
    assert "portable" in results
    base = results["portable"]
    for name, got in results.items():
        for key in base:
            if key == "simd":
                continue
            a, b = np.array(got[key]), np.array(base[key])
            # int16 and tiled: exact integer sums, the same float steps; dense: s * q exact
            # for 16-bit scales, then the same sgemm: the same bits
            if key.endswith(("int16", "tiled", "dense")):
                assert np.array_equal(a, b), (name, key)
            elif key.endswith("float16") and name != "portable" and "avx2" in results:
                # the fast ops' loops follow the same choice (simd.h): AVX2's and AVX-512's
                # multiply-adds are the same FMAs, the same bits; the baseline has none
                assert np.array_equal(a, np.array(results["avx2"][key])), (name, key)
            else:
                np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max(),
                                           err_msg=name)


def test_the_imported_4_bit_model_answers_with_mlx_own_greedy_tokens(smollm2: Path) -> None:
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    if not fast_ops.on_cpu():
        pytest.skip("the kernel replaces MLX's only on the CPU")
    model, tokenizer = load(str(smollm2))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True)

    def greedy(n: int) -> tuple[list[int], np.ndarray]:
        cache = make_prompt_cache(model)
        logits = model(mx.array([prompt]), cache=cache)[:, -1]
        first = np.array(logits[0])
        tokens = []
        for _ in range(n):
            token = int(mx.argmax(logits, axis=-1).item())
            tokens.append(token)
            logits = model(mx.array([[token]]), cache=cache)[:, -1]
        return tokens, first

    theirs, their_logits = greedy(16)
    quant.install()
    try:
        ours, our_logits = greedy(16)
    finally:
        quant.uninstall()
    # Sums run in another order than MLX's, and x is rounded to 16 bits where the variant
    # does so (within 2e-4 of the largest logit here), so logits differ by little.
    np.testing.assert_allclose(our_logits, their_logits, rtol=0,
                               atol=1e-3 * np.abs(their_logits).max())
    assert ours == theirs
    assert "Paris" in tokenizer.decode(ours)


def test_the_backend_reports_the_kernel_and_native_off_leaves_mlx_alone() -> None:
    from appliance.backend.plug import start

    own = mx.quantized_matmul
    try:
        on = start(native=True)
        assert on.quant in ("avx512", "avx2", "portable") and on.describe()["quant"] == on.quant
        assert mx.quantized_matmul is not own
        off = start(native=False)
        assert off.quant is None and mx.quantized_matmul is own
    finally:
        quant.uninstall()
        fast_ops.uninstall()


@pytest.mark.parametrize(("bits", "activations"), PATHS)
def test_products_of_one_x_made_as_one_give_each_its_own_bits(
        bits: int, activations: str | None) -> None:
    # q/k/v-like widths and one big enough to be shared with the pool's helpers; 40 rows: a
    # slice's edge
    parts = [packed(n, 576, bits, 32, seed=i)[:3] for i, n in enumerate((576, 192, 2000))]
    act = -1 if activations is None else quant.ACTIVATIONS.index(activations)
    for m in (1, 8, 40):
        x = rows(m, 576, seed=m)
        outs = fast_ops._extension().quantized_matmul_many(
            x, [p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts], 32, bits,
            act)
        assert len(outs) == len(parts)
        for out, (w, s, b) in zip(outs, parts, strict=True):
            alone = quant.quantized_matmul(x, w, s, b, 32, bits, activations, "kernel")
            assert out.shape == (m, w.shape[0]) and np.array_equal(np.array(out),
                                                                   np.array(alone))


def test_products_made_as_one_refuse_parts_that_do_not_match() -> None:
    many = fast_ops._extension().quantized_matmul_many
    w, s, b, _ = packed(64, 128, 4, 32)
    w2, s2, b2, _ = packed(64, 256, 4, 32)
    x = rows(2, 128)
    with pytest.raises(ValueError, match="last axis must be K"):
        many(x, [w, w2], [s, s2], [b, b2], 32, 4)
    with pytest.raises(ValueError, match="share a dtype"):
        many(x, [w, w], [s, s.astype(mx.float32)], [b, b.astype(mx.float32)], 32, 4)
    with pytest.raises(ValueError, match="one scales and biases"):
        many(x, [], [], [], 32, 4)


@pytest.mark.parametrize("bits", quant.BITS)
@pytest.mark.parametrize("group", quant.GROUP_SIZES)
@pytest.mark.parametrize("scale_dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_tiled_weights_match_float64_within_the_rounding_of_x(
        bits: int, group: int, scale_dtype: mx.Dtype) -> None:
    # 300 columns: not a whole number of tiles
    w, s, b, dense = packed(300, 2 * 384, bits, group, scale_dtype)
    tiled = tiles.tile(w, s, b, group)
    assert tiled.tiles.shape == (19, 2 * 384 * 2 * bits) and tiled.scales.dtype == scale_dtype
    for m in (1, 2, 3, 8, 9, 32):
        x = rows(m, 2 * 384, seed=m)
        got = np.array(tiles.tiled_matmul(x, tiled)[0])
        assert got.shape == (m, 300)
        assert_close(got, np.array(x).astype(np.float64) @ dense.T, x, dense, "int16")


@pytest.mark.parametrize("bits", quant.BITS)
def test_tiled_weights_give_a_row_the_same_bits_alone_and_in_a_batch(bits: int) -> None:
    w, s, b, _ = packed(2000, 576, bits, 32)  # shared with the pool's helpers
    parts = (tiles.tile(w, s, b, 32), tiles.tile(*packed(200, 576, bits, 32, seed=3)[:3], 32))
    x = rows(32, 576)
    batch = [np.array(y) for y in tiles.tiled_matmul(x, *parts)]
    for m in (1, 3, 8, 9, 31):
        for got, want in zip(tiles.tiled_matmul(x[:m], *parts), batch, strict=True):
            assert np.array_equal(np.array(got), want[:m])
    for r in (0, 5, 31):
        alone = tiles.tiled_matmul(x[r:r + 1], parts[1])[0]
        assert np.array_equal(np.array(alone)[0], batch[1][r])


def test_inputs_that_are_views_are_read_in_their_own_order(installed: None) -> None:
    w, s, b, dense = packed(64, 128, 4, 32)
    tiled = tiles.tile(w, s, b, 32)
    x = rows(128, 3).T  # a transposed view: not row-contiguous
    want = np.array(mx.contiguous(x))
    for got in (quant.quantized_matmul(x, w, s, b, 32, 4, "int16"),
                quant.quantized_matmul(x, w, s, b, 32, 4, "float"),
                tiles.tiled_matmul(x, tiled)[0]):
        np.testing.assert_allclose(np.array(got), want @ dense.T, rtol=0,
                                   atol=1e-3 * np.abs(want @ dense.T).max())
    broadcast = mx.broadcast_to(rows(1, 128), (4, 128))
    got = np.array(tiles.tiled_matmul(broadcast, tiled)[0])
    assert np.array_equal(got[0], got[3])


def test_tiled_products_refuse_what_does_not_match() -> None:
    ext = fast_ops._extension()
    w, s, b, _ = packed(40, 256, 4, 32)
    t = tiles.tile(w, s, b, 32)
    x = rows(2, 256)
    with pytest.raises(ValueError, match="tiles must be uint8"):
        ext.tiled_matmul(x, [t.tiles], [t.scales], [t.biases], [60], 32)
    with pytest.raises(ValueError, match="tiles must be uint8"):
        ext.tiled_matmul(rows(2, 128), [t.tiles], [t.scales], [t.biases], [40], 32)
    with pytest.raises(ValueError, match="one scales, biases and n"):
        ext.tiled_matmul(x, [t.tiles], [t.scales], [t.biases], [], 32)
    with pytest.raises(ValueError, match="group_size must be"):
        ext.tiled_matmul(x, [t.tiles], [t.scales], [t.biases], [40], 16)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        ext.tiled_matmul(x, [t.tiles], [t.scales], [t.biases], [40], 32, None, 2)
    with pytest.raises(ValueError, match="tiles must be uint8"):  # 4-bit tiles read as 8
        ext.tiled_matmul(x, [t.tiles], [t.scales], [t.biases], [40], 32, None, 8)
