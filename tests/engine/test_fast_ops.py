"""The fast CPU ops (appliance/backend/native/mlx_fast.cpp, appliance/backend/fast_ops.py): softmax,
SwiGLU's gate, RoPE, RMSNorm and attention (a decode step's in one operation) agree with MLX's own to float32 rounding in every shape,
offset and mask mlx-lm hands them; a row with nothing to attend to gives zeros, not NaN; the real model's
logits and greedy tokens do not change; `appliance run` installs them and
`--no-fast-cpu-ops` does not."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from appliance.backend import fast_ops

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    why = fast_ops.available()
    if why is not None:
        pytest.fail(f"fast CPU ops unavailable: {why} (scripts/test.sh builds them with g++)")


@pytest.fixture
def without_fast_ops() -> Iterator[None]:
    """mlx-lm's own functions for the test, and the switch restored after it."""
    was = fast_ops.installed()
    fast_ops.uninstall()
    yield
    fast_ops.uninstall()
    if was:
        assert fast_ops.install() is None


def close(a: mx.array, b: mx.array, tol: float = 2e-6) -> bool:
    return bool(mx.allclose(a, b, rtol=tol, atol=tol).item())


@pytest.mark.parametrize("shape", [(7,), (3, 1), (2, 33), (4, 3, 5, 100), (1, 9, 1, 1500)])
def test_softmax_matches_mlx(shape: tuple[int, ...]) -> None:
    x = mx.random.normal(shape, key=mx.random.key(1)) * 6
    assert close(fast_ops.softmax(x), mx.softmax(x, axis=-1, precise=True))
    assert close(fast_ops.softmax(x.T.T), mx.softmax(x, axis=-1))  # views are copied first
    if len(shape) > 1:
        xt = x.swapaxes(0, -1)  # not contiguous
        assert close(fast_ops.softmax(xt), mx.softmax(xt, axis=-1))


def test_masked_scores_give_exact_zeros_and_an_empty_row_zeros() -> None:
    x = mx.random.normal((3, 40), key=mx.random.key(2))
    keep = mx.arange(40)[None] < mx.array([[40], [17], [0]])
    got = fast_ops.softmax(mx.where(keep, x, mx.array(-mx.inf)))
    want = mx.softmax(mx.where(keep[:2], x[:2], mx.array(-mx.inf)), axis=-1)
    assert close(got[:2], want)
    assert mx.all(got[1, 17:] == 0).item()  # exactly 0: a padded position adds nothing
    assert mx.all(got[2] == 0).item()  # MLX gives NaN here
    assert mx.all(mx.abs(got[:2].sum(-1) - 1) < 1e-6).item()


@pytest.mark.parametrize("rows,causal,n", [
    (3 * 37, 37, 37),  # a prompt read whole: 3 query heads to a KV head
    (3 * 33, 33, 120),  # a chunk after a cache, its tail not a whole vector
    (2 * 256, 256, 1040),  # big enough for the second thread (rows split mid-group)
    (5, 1, 9),  # one query: it sees every key
])
def test_the_causal_softmax_is_the_masked_one_bit_for_bit(rows: int, causal: int,
                                                            n: int) -> None:
    x = mx.random.normal((1, rows, n), key=mx.random.key(3)) * 6
    query = mx.arange(rows)[:, None] % causal
    keep = mx.arange(n)[None] <= n - causal + query
    masked = fast_ops.softmax(mx.where(keep, x, mx.array(-mx.inf)))
    got = fast_ops.softmax(x, causal=causal)
    assert mx.array_equal(got, masked).item()
    assert mx.all(mx.where(keep, 0, got) == 0).item()


@pytest.mark.parametrize("causal", [-1, 4, 7])
def test_the_causal_softmax_refuses_a_group_that_does_not_fit(causal: int) -> None:
    with pytest.raises(ValueError, match="causal must be 0 or divide"):
        fast_ops.softmax(mx.zeros((1, 6, 5)), causal=causal)  # 6 rows, 5 columns


def test_silu_mul_matches_mlx_and_refuses_what_it_cannot_do() -> None:
    g = mx.random.normal((5, 1537), key=mx.random.key(3)) * 8
    u = mx.random.normal((5, 1537), key=mx.random.key(4))
    assert close(fast_ops.swiglu(g, u), nn.silu(g) * u, 1e-5)
    assert close(fast_ops.swiglu(mx.array([-200.0, 0.0, 200.0]), mx.ones(3)),
                 mx.array([0.0, 0.0, 200.0]))
    with pytest.raises(ValueError, match="float32"):
        fast_ops.swiglu(g.astype(mx.float16), u.astype(mx.float16))
    with pytest.raises(ValueError, match="shapes"):
        fast_ops.swiglu(g, u[:, :7])


ROPE_CASES = {
    # name: (shape, dims, traditional, offset, freqs)
    "decode, one row": ((1, 9, 1, 64), 64, False, 500, False),
    "decode, batched, an offset a row": ((4, 3, 1, 64), 64, False, [5, 9, 300, 2047], False),
    "prefill chunk": ((1, 9, 37, 64), 64, False, 123, False),
    "traditional pairs": ((2, 4, 6, 32), 32, True, 7, False),
    "part of the features": ((1, 2, 5, 64), 32, False, 40, False),
    "three axes, far position": ((1, 5, 80), 80, False, 30000, False),
    "scaled frequencies (Llama 3)": ((2, 3, 4, 64), 64, False, [0, 17], True),
}


@pytest.mark.parametrize("name", list(ROPE_CASES))
def test_rope_matches_mlx(name: str) -> None:
    shape, dims, traditional, offset, scaled = ROPE_CASES[name]
    x = mx.random.normal(shape, key=mx.random.key(7))
    if isinstance(offset, list):
        offset = mx.array(offset)
    freqs = 10000.0 ** (mx.arange(0, dims, 2) / dims) * 1.7 if scaled else None
    base = None if scaled else 10000.0
    for scale in (1.0, 0.25):
        want = fast_ops.mlx_own("rope")(x, dims, traditional=traditional, base=base,
                                          scale=scale, offset=offset, freqs=freqs)
        got = fast_ops.rope(x, dims, traditional, base, scale, offset, freqs)
        assert close(got, want), (name, scale)
    if x.ndim == 4:  # a transposed view, as the attention's heads are, is copied first
        view = x.swapaxes(1, 2).swapaxes(1, 2)
        assert close(fast_ops.rope(view, dims, traditional, base, 1.0, offset, freqs),
                     fast_ops.rope(x, dims, traditional, base, 1.0, offset, freqs))


def test_rope_refuses_what_it_cannot_do_and_the_switch_passes_it_on() -> None:
    x = mx.random.normal((1, 2, 3, 8), key=mx.random.key(8))
    for bad, match in (((x, 7, False, 10000.0, 1.0, 0), "dims"),
                       ((x, 8, False, None, 1.0, 0), "base and freqs"),
                       ((x, 8, False, 10000.0, 1.0, mx.array([1, 2, 3])), "offset"),
                       ((x[0, 0], 8, False, 10000.0, 1.0, 0), "3 axes"),
                       ((x.astype(mx.float16), 8, False, 10000.0, 1.0, 0), "float32")):
        with pytest.raises(ValueError, match=match):
            fast_ops.rope(*bad)
    assert fast_ops.install() is None
    assert mx.fast.rope is not fast_ops.mlx_own("rope")
    half = x.astype(mx.float16)  # not ours: MLX's own, through the switch
    assert mx.fast.rope(half, 8, traditional=False, base=10000.0, scale=1.0,
                        offset=3).dtype == mx.float16


@pytest.mark.parametrize("shape", [(1, 1, 576), (8, 1, 576), (1, 300, 576), (3, 7, 33), (5,)])
def test_rms_norm_matches_mlx(shape: tuple[int, ...]) -> None:
    x = mx.random.normal(shape, key=mx.random.key(9)) * 3
    w = mx.random.normal(shape[-1:], key=mx.random.key(10))
    for weight in (w, None):
        want = fast_ops.mlx_own("rms_norm")(x, weight, 1e-5)
        assert close(fast_ops.rms_norm(x, weight, 1e-5), want, 1e-5), (shape, weight is None)
    if len(shape) > 1:  # a view is copied first
        assert close(fast_ops.rms_norm(x.swapaxes(0, -1).swapaxes(0, -1), w, 1e-5),
                     fast_ops.rms_norm(x, w, 1e-5))
    with pytest.raises(ValueError, match="weight"):
        fast_ops.rms_norm(x, w[:-1], 1e-5)
    with pytest.raises(ValueError, match="float32"):
        fast_ops.rms_norm(x.astype(mx.float16), None, 1e-5)
    assert fast_ops.install() is None
    assert mx.fast.rms_norm(x.astype(mx.float16), None, 1e-5).dtype == mx.float16  # MLX's


ATTENTION_CASES = {
    # name: (B, H, KV, Lq, L, mask)
    "decode, batched, left padding": (4, 9, 3, 1, 300, "padding"),
    "decode, alone, no mask": (1, 9, 3, 1, 300, None),
    "prefill from empty, causal": (1, 9, 3, 70, 70, "causal"),
    "prefill chunk after a cache, causal": (1, 9, 3, 33, 120, "causal"),
    "batched prefill, causal and left padding": (3, 4, 4, 20, 20, "causal+padding"),
    "additive mask, per head": (2, 6, 2, 5, 40, "additive"),
}


def _mask(kind: str | None, b: int, h: int, lq: int, length: int) -> mx.array | str | None:
    if kind in (None, "causal"):
        return kind
    pads = mx.array([i * 3 for i in range(b)])
    cols = mx.arange(length)
    padding = (pads[:, None, None, None] <= cols)  # [B, 1, 1, L]
    if kind == "padding":
        return padding
    causal = mx.arange(length - lq, length)[:, None] >= cols[None]
    if kind == "causal+padding":
        return padding & causal
    return mx.random.normal((b, h, lq, length), key=mx.random.key(5))


@pytest.mark.parametrize("name", list(ATTENTION_CASES))
def test_attention_matches_mlx_sdpa(name: str) -> None:
    b, h, kv, lq, length, kind = ATTENTION_CASES[name]
    keys = mx.random.split(mx.random.key(6), 3)
    q = mx.random.normal((b, h, lq, 64), key=keys[0])
    k = mx.random.normal((b, kv, length, 64), key=keys[1])
    v = mx.random.normal((b, kv, length, 64), key=keys[2])
    mask = _mask(kind, b, h, lq, length)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    got = fast_ops.attention(q, k, v, 0.125, mask)
    # A query row of left padding attends to nothing: ours gives zeros, MLX something else
    # (neither is ever read: the padded positions are masked for every real row).
    real = mx.ones((b, 1, lq, 1), dtype=mx.bool_)
    if isinstance(mask, mx.array) and mask.dtype == mx.bool_:
        real = mx.any(mask, axis=-1, keepdims=True)
        assert mx.all(mx.where(real, 0, got) == 0).item()
    assert close(mx.where(real, got, 0), mx.where(real, want, 0), 1e-5), name
    if kind == "causal":  # masked as the softmax reads: the same bits as a boolean mask
        cols = mx.arange(length)
        boolean = mx.arange(length - lq, length)[:, None] >= cols[None]
        assert mx.array_equal(got, fast_ops.attention(q, k, v, 0.125, boolean)).item()


def _attention64(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Any) -> np.ndarray:
    """softmax(q k^T * scale + mask) v in float64 (GQA by repeating the KV heads); a row
    with nothing to attend to gives zeros."""
    q64, k64, v64 = (np.array(a, dtype=np.float64) for a in (q, k, v))
    rep = q64.shape[1] // k64.shape[1]
    k64, v64 = np.repeat(k64, rep, axis=1), np.repeat(v64, rep, axis=1)
    s = (q64 * scale) @ k64.transpose(0, 1, 3, 2)
    if mask is not None:
        m = np.broadcast_to(np.array(mask), s.shape)
        s = np.where(m, s, -np.inf) if m.dtype == bool else s + m
    top = s.max(-1, keepdims=True)
    e = np.where(np.isfinite(s), np.exp(s - np.where(np.isfinite(top), top, 0)), 0)
    total = e.sum(-1, keepdims=True)
    return np.where(total > 0, e / np.where(total > 0, total, 1), 0) @ v64


@pytest.mark.parametrize(("b", "h", "kv", "length", "kind", "d"), [
    (1, 9, 3, 1, None, 64), (1, 9, 3, 70, None, 64), (4, 8, 2, 300, "padding", 64),
    (3, 4, 4, 17, "additive", 64), (2, 6, 3, 33, "additive, broadcast", 64),
    (2, 4, 2, 9, "none seen", 64),
    # heads of 80 and 40 features: the keys one at a time, the outputs' tails
    (3, 4, 2, 37, "padding", 80), (2, 4, 2, 21, None, 40),
    (4, 8, 4, 1100, "padding", 64)])  # past ATTENTION_SPLIT: the batch on the threads
def test_decode_attention_reads_the_caches_views_in_place(b: int, h: int, kv: int, length: int,
                                                          kind: str | None, d: int) -> None:
    """A decode step's attention (one query position) in one operation, on views of bigger
    buffers as the slots hand them: within float32 rounding of float64, and a row's bits
    the same alone as in its batch."""
    keys = mx.random.split(mx.random.key(8), 4)
    q = mx.random.normal((b, h, 1, d), key=keys[0])
    k = mx.random.normal((b + 2, kv, length + 9, d), key=keys[1])[:b, :, 4:4 + length]
    v = mx.random.normal((b + 2, kv, length + 9, d), key=keys[2])[:b, :, 4:4 + length]
    mask: Any = None
    if kind == "padding":
        mask = mx.array([i * 3 for i in range(b)])[:, None, None, None] <= mx.arange(length)
    elif kind == "additive":
        mask = mx.random.normal((b, h, 1, length), key=keys[3])
    elif kind == "additive, broadcast":
        mask = mx.random.normal((length,), key=keys[3])
    elif kind == "none seen":  # row 0 sees nothing (all padding): zeros, not NaN
        mask = mx.array([[[[False] * length]], [[[True] * length]]])
    got = fast_ops.attention(q, k, v, 0.125, mask)
    assert got.shape == (b, h, 1, d)
    assert np.allclose(np.array(got), _attention64(q, k, v, 0.125, mask), rtol=1e-5, atol=1e-5)
    for i in range(b):
        row_mask = mask if mask is None or mask.ndim < 4 else mask[i:i + 1]
        alone = fast_ops.attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], 0.125, row_mask)
        assert mx.array_equal(alone, got[i:i + 1]).item()
    if kind == "none seen":
        assert not mx.any(got[0]).item()


@pytest.mark.parametrize(("b", "kv", "length", "d", "kind"), [
    (1, 3, 1, 64, None), (2, 3, 150, 64, "padding"), (3, 2, 70, 40, "additive"),
    (4, 4, 1100, 64, "padding")])  # several blocks of 64 widened, a tail of keys and features
def test_decode_attention_reads_a_float16_cache_as_its_float32_values(
        b: int, kv: int, length: int, d: int, kind: str | None) -> None:
    """A cache kept in float16 (appliance/engine/kvcache.py) is read as the float32 values
    it holds: the bits of attention over those values cast, views read in place."""
    keys = mx.random.split(mx.random.key(5), 4)
    q = mx.random.normal((b, 3 * kv, 1, d), key=keys[0])
    k = mx.random.normal((b + 1, kv, length + 5, d), key=keys[1]).astype(mx.float16)
    v = mx.random.normal((b + 1, kv, length + 5, d), key=keys[2]).astype(mx.float16)
    k, v = k[:b, :, 3:3 + length], v[:b, :, 3:3 + length]
    mask: Any = None
    if kind == "padding":
        mask = mx.array([i * 3 for i in range(b)])[:, None, None, None] <= mx.arange(length)
    elif kind == "additive":
        mask = mx.random.normal((b, 3 * kv, 1, length), key=keys[3])
    got = fast_ops.attention(q, k, v, 0.125, mask)
    want = fast_ops.attention(q, k.astype(mx.float32), v.astype(mx.float32), 0.125, mask)
    assert got.dtype == mx.float32 and mx.array_equal(got, want).item()
    # a prompt's queries (more than one position) read it through a cast
    many = mx.concatenate([q, q * 0.5], axis=2)
    assert mx.array_equal(fast_ops.attention(many, k, v, 0.125, None),
                          fast_ops.attention(many, k.astype(mx.float32), v.astype(mx.float32),
                                             0.125, None)).item()


def test_decode_attention_refuses_what_it_cannot_read() -> None:
    ext = fast_ops._extension()
    q, k = mx.zeros((1, 4, 1, 8)), mx.zeros((1, 2, 5, 8))
    with pytest.raises(ValueError, match="q \\[B, H, 1, D\\]"):
        ext.decode_attention(mx.zeros((1, 4, 2, 8)), k, k, 1.0, None)
    with pytest.raises(ValueError, match="multiple of KV"):
        ext.decode_attention(q, mx.zeros((1, 3, 5, 8)), mx.zeros((1, 3, 5, 8)), 1.0, None)
    with pytest.raises(ValueError, match="broadcast"):
        ext.decode_attention(q, k, k, 1.0, mx.zeros((1, 4, 1, 6)))
    with pytest.raises(ValueError, match="boolean or float32"):
        ext.decode_attention(q, k, k, 1.0, mx.zeros((1, 4, 1, 5), dtype=mx.int32))
    with pytest.raises(ValueError, match="float32 only"):
        ext.decode_attention(q.astype(mx.float16), k, k, 1.0, None)
    with pytest.raises(ValueError, match="both float32 or both float16"):
        ext.decode_attention(q, k.astype(mx.float16), k, 1.0, None)
    with pytest.raises(ValueError, match="both float32 or both float16"):
        ext.decode_attention(q, k.astype(mx.bfloat16), k.astype(mx.bfloat16), 1.0, None)


def test_the_model_gives_the_same_logits_and_tokens(demo_model: Path,
                                                    without_fast_ops: None) -> None:
    """A prompt read whole, in chunks, and batched with a shorter one (left padding), then
    greedy decoding: MLX's ops and ours agree to float32 rounding and pick the same tokens."""
    from mlx_lm import load

    from appliance.engine.batch import DecodeBatch, prefill, prefill_batch

    model, _ = load(str(demo_model))
    prompt = list(range(40, 140))
    short = list(range(300, 320))

    def run() -> tuple[mx.array, mx.array, list[int]]:
        from appliance.engine.batch import new_sequence_cache

        cache = new_sequence_cache(model)
        assert prefill(model, cache, prompt[:60], False) is None
        chunked = prefill(model, cache, prompt[60:], True)
        assert chunked is not None
        batched_cache, batched = prefill_batch(model, [short, prompt])
        batch = DecodeBatch(model)
        batch.join([([1, 2], batched_cache, [0, 1])])
        tokens = mx.argmax(batched, axis=-1).tolist()
        out = []
        for _ in range(6):
            logits = batch.step(tokens)
            tokens = mx.argmax(logits, axis=-1).tolist()
            out.extend(tokens)
        return chunked, batched, out

    theirs = run()
    assert fast_ops.install() is None
    ours = run()
    assert close(ours[0], theirs[0], 1e-4) and close(ours[1], theirs[1], 1e-4)
    assert ours[2] == theirs[2]


def test_appliance_run_installs_them_unless_told_not_to(demo_model: Path) -> None:
    args = [sys.executable, "-m", "appliance", "run", "-p", "Hello", "--max-tokens", "2",
            "--model", str(demo_model)]
    on = subprocess.run(args, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert on.returncode == 0, on.stderr
    assert " fast_ops=True " in on.stderr, on.stderr
    off = subprocess.run([*args, "--no-fast-cpu-ops"], capture_output=True, text=True,
                         timeout=180, cwd=ROOT)
    assert off.returncode == 0, off.stderr
    assert " fast_ops=False " in off.stderr, off.stderr
    assert on.stdout.strip() == off.stdout.strip()


def test_an_extension_built_for_another_mlx_is_refused_before_it_loads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The MLX version the build wrote beside the extension is compared first: a library
    built against another MLX is never loaded, and the engine runs MLX's own operations."""
    stamp = tmp_path / "_mlx_fast.mlx-version"
    stamp.write_text("0.0.1\n")
    monkeypatch.setattr(fast_ops, "STAMP", stamp)
    module, why = fast_ops._load_extension()
    assert module is None and why is not None
    assert "built for MLX 0.0.1" in why and fast_ops.MLX_VERSION in why
    stamp.unlink()  # no stamp at all: refused as well
    assert fast_ops._load_extension()[0] is None


SOFTMAX_BITS = """
import sys
import numpy as np
import mlx.core as mx
from appliance.backend import fast_ops
x = mx.array(np.random.default_rng(3).standard_normal((64, 301)).astype(np.float32) * 4)
y = np.array(fast_ops._extension().softmax(x, 0))
sys.stdout.write(fast_ops._extension().quant_simd() + " " + y.tobytes().hex())
"""


def test_the_fast_ops_follow_the_simd_setting() -> None:
    """The softmax's loops are chosen by the same setting as the kernels' (native/simd.h): the
    baseline (no FMA) rounds its exponentials differently from AVX2 and AVX-512, which agree
    to the bit (the same multiply-adds); a setting the loops ignored would give one answer."""
    if fast_ops.available() is not None:
        pytest.skip(fast_ops.available())
    got = {}
    for want in ("portable", "avx2", "avx512"):
        done = subprocess.run([sys.executable, "-c", SOFTMAX_BITS], cwd=ROOT, timeout=120,
                              env={**__import__("os").environ, "APPLIANCE_SIMD": want},
                              capture_output=True, text=True, check=True)
        simd, bits = done.stdout.split()
        got[simd] = np.frombuffer(bytes.fromhex(bits), dtype=np.float32)
    if "avx2" not in got:
        pytest.skip("this processor has no AVX2")
    assert not np.array_equal(got["portable"], got["avx2"])
    np.testing.assert_allclose(got["portable"], got["avx2"], rtol=1e-5, atol=1e-7)
    if "avx512" in got:
        assert np.array_equal(got["avx512"], got["avx2"])
