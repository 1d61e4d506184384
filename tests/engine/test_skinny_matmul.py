"""skinny_matmul (appliance/backend/native/skinny_matmul.c): MLX's products of a few rows run our
kernel (up to 32 rows), give gemm's results and the same bits for a row alone and in a batch; one-row and
one-column products of other layouts go to OpenBLAS's gemv; the rest is untouched; and
`appliance run` preloads it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from appliance.backend.blas import (
    _BEFORE_AVX2,
    SPIN_EXPONENT,
    cpu_flags,
    openblas_lib,
    skinny_matmul_lib,
    wanted_preload,
)

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="skinny_matmul is Linux-only")

PRODUCTS = textwrap.dedent("""
    import ctypes, json, sys
    import numpy as np
    import mlx.core as mx

    lib = ctypes.CDLL(sys.argv[1])  # already loaded: the preloaded copy's counters
    for name in ("appliance_skinny_kernel_calls", "appliance_skinny_gemv_calls"):
        getattr(lib, name).restype = ctypes.c_ulong
    lib.appliance_skinny_simd.restype = ctypes.c_char_p
    assert lib.appliance_skinny_active() == 1
    rng = np.random.default_rng(0)

    def draw(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    w, c, r = draw(301, 70), draw(8, 301), draw(1, 301)  # odd columns, k = 4 x 16 + 6
    x8 = draw(8, 70)
    W, X8 = mx.array(w), mx.array(x8)
    f64 = np.float64
    cases = {  # name: (MLX product, float64 reference, "kernel" | "gemv" | "gemm")
        "a linear layer, one row": (X8[:1] @ W.T, x8[:1].astype(f64) @ w.T, "kernel"),
        "a decode step's (1 x 1 x 70) @ W.T": (X8[None, :1] @ W.T, x8[:1].astype(f64) @ w.T,
                                               "kernel"),
        "eight rows": (X8 @ W.T, x8.astype(f64) @ w.T, "kernel"),
        "addmm, alpha 2, beta 0.5": (mx.addmm(mx.array(c), X8, W.T, alpha=2.0, beta=0.5),
                                     0.5 * c + 2.0 * (x8.astype(f64) @ w.T), "kernel"),
        "row @ W (not transposed)": (mx.array(r) @ W, r.astype(f64) @ w, "gemv"),
        "W @ column": (W @ X8[:1].T, w.astype(f64) @ x8[:1].T, "gemv"),
        "nine rows": (mx.array(x9 := draw(9, 70)) @ W.T, x9.astype(f64) @ w.T, "kernel"),
        "sixteen rows": (mx.array(x16 := draw(16, 70)) @ W.T, x16.astype(f64) @ w.T,
                         "kernel"),
        "seventeen rows": (mx.array(x17 := draw(17, 70)) @ W.T, x17.astype(f64) @ w.T,
                           "kernel"),
        "thirty-two rows": (mx.array(x32 := draw(32, 70)) @ W.T, x32.astype(f64) @ w.T,
                            "kernel"),
        "thirty-three rows": (mx.array(x33 := draw(33, 70)) @ W.T, x33.astype(f64) @ w.T,
                              "gemm"),
    }
    out = {}
    for name, (product, want, path) in cases.items():
        k0, g0 = lib.appliance_skinny_kernel_calls(), lib.appliance_skinny_gemv_calls()
        got = np.array(product, dtype=f64)  # evaluated here
        dk = lib.appliance_skinny_kernel_calls() - k0
        dg = lib.appliance_skinny_gemv_calls() - g0
        out[name] = {"path": "kernel" if dk else "gemv" if dg else "gemm", "expect": path,
                     "err": float(np.abs(got - want).max() / np.abs(want).max()),
                     "finite": bool(np.isfinite(got).all())}
    # a row alone and in every batch of up to thirty-two: the same bits
    X32 = mx.array(x32)
    alone = np.array(X32[:1] @ W.T)[0]
    out["same bits"] = [bool((np.array(X32[:m] @ W.T)[0] == alone).all())
                        for m in range(1, 33)]
    for i in (7, 15, 20, 31):  # and rows in later groups of eight, at other places in a tile
        row = np.array(X32[i:i + 1] @ W.T)[0]
        out["same bits"].append(bool((np.array(X32 @ W.T)[i] == row).all()))
    out["simd"] = lib.appliance_skinny_simd().decode()
    print(json.dumps(out))
""")




@pytest.fixture(scope="module")
def preload() -> list[str]:
    if openblas_lib() is None:
        pytest.fail("Debian's libopenblas0-pthread is not installed (scripts/test.sh installs it)")
    if skinny_matmul_lib() is None:
        pytest.fail("appliance/backend/_skinny_matmul*.so was not built: pip install -e . with gcc "
                    "(scripts/test.sh installs gcc)")
    return wanted_preload("auto", True)


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "APPLIANCE_BLAS_REEXEC", "OPENBLAS_THREAD_TIMEOUT",
                        "OPENBLAS_CORETYPE")}
    return {**env, **extra}


def simd_expected(asked: str) -> str:
    """The variant the kernel must run when ``asked`` is forced (APPLIANCE_SIMD): that one
    where this processor has it, else the portable code."""
    flags = cpu_flags()
    needs = {"avx512": {"avx512f", "avx512dq", "avx512bw", "avx512vl"}, "avx2": {"avx2", "fma"},
             "portable": set()}
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        return "portable"
    return asked if needs[asked] <= flags else "portable"


@pytest.mark.parametrize("simd", ["avx512", "avx2", "portable"])
def test_few_row_products_run_the_kernel_and_equal_gemm(preload: list[str], simd: str) -> None:
    """Each instruction set's kernel (forced by APPLIANCE_SIMD; one this processor lacks
    falls back to the portable code) against float64, with the same bits for a row alone
    and in every batch."""
    import json

    assert preload[0] == skinny_matmul_lib()  # before OpenBLAS, so MLX finds it first
    run = subprocess.run([sys.executable, "-c", PRODUCTS, preload[0]], capture_output=True,
                         text=True, timeout=120,
                         env=_clean_env(LD_PRELOAD=":".join(preload), APPLIANCE_SIMD=simd))
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result.pop("simd") == simd_expected(simd)
    assert result.pop("same bits") == [True] * 36
    for name, r in result.items():
        assert r["finite"] and r["err"] < 1e-5, (name, r)
        assert r["path"] == r["expect"], (name, r)


def test_appliance_run_preloads_skinny_matmul_before_openblas(preload: list[str],
                                                             demo_model: Path) -> None:
    """The real entry point, started without LD_PRELOAD, restarts itself with both, and
    with OpenBLAS's workers spinning briefly (appliance.backend.blas.SPIN_EXPONENT)."""
    args = [sys.executable, "-m", "appliance", "run", "-p", "Hello", "--max-tokens", "2",
            "--model", str(demo_model)]
    on = subprocess.run(args, capture_output=True, text=True, timeout=180, cwd=ROOT,
                        env=_clean_env(HF_HUB_OFFLINE="1"))
    assert on.returncode == 0, on.stderr
    spin = f" (OPENBLAS_THREAD_TIMEOUT={SPIN_EXPONENT})"
    assert f"BLAS: Debian's OpenBLAS, with skinny_matmul{spin}\n" in on.stderr, on.stderr
    # the kernels OpenBLAS runs, chosen by the daemon itself (the environment is cleared)
    core = re.search(r"BLAS: OpenBLAS runs its (\w+) kernels", on.stderr)
    assert core is not None, on.stderr
    if {"avx2", "fma"} <= cpu_flags():
        assert core.group(1).lower() not in _BEFORE_AVX2, on.stderr
    off = subprocess.run([*args, "--no-skinny-matmul"], capture_output=True, text=True,
                         timeout=180, cwd=ROOT,
                         env=_clean_env(HF_HUB_OFFLINE="1", LD_PRELOAD=":".join(preload)))
    assert off.returncode == 0, off.stderr
    assert f"BLAS: Debian's OpenBLAS{spin}\n" in off.stderr, off.stderr
    assert on.stdout.strip() and off.stdout.strip()
    assert "backend: kind=cpu device=Device(cpu, 0) native=True kernel=" in on.stderr
    assert "kernel=none" in off.stderr
    # the native code off: OpenBLAS alone, no fast ops, malloc as it is
    pure = subprocess.run(args, capture_output=True, text=True, timeout=180, cwd=ROOT,
                          env=_clean_env(HF_HUB_OFFLINE="1", APPLIANCE_NATIVE="off"))
    assert pure.returncode == 0, pure.stderr
    assert f"BLAS: Debian's OpenBLAS{spin}\n" in pure.stderr, pure.stderr
    assert ("native=False kernel=none fast_ops=False quant=none fused_layer=False heap=not tuned (native code off or not "
            "the CPU) profile=plain") in pure.stderr
    assert pure.stdout.strip() == off.stdout.strip()  # greedy: the same words


def test_the_preload_puts_ours_first_and_keeps_the_rest(preload: list[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """What `appliance serve` and the dashboards benchmark restart with (appliance.backend.blas)."""
    from appliance.backend.blas import (
        CORETYPE,
        THREAD_TIMEOUT,
        blas_env,
        preload_env,
        wanted_coretype,
    )

    monkeypatch.setenv("LD_PRELOAD", f"/opt/other.so:{preload[1]}")
    monkeypatch.delenv(THREAD_TIMEOUT, raising=False)
    monkeypatch.delenv(CORETYPE, raising=False)
    env = preload_env("auto", True)
    assert env is not None and env["LD_PRELOAD"] == ":".join([*preload, "/opt/other.so"])
    assert env[THREAD_TIMEOUT] == SPIN_EXPONENT  # OpenBLAS's workers spin briefly
    assert env.get(CORETYPE) == wanted_coretype(preload[1])  # its kernels for this processor
    monkeypatch.setenv("LD_PRELOAD", env["LD_PRELOAD"])
    if CORETYPE in env:
        monkeypatch.setenv(CORETYPE, env[CORETYPE])
    assert preload_env("auto", True) is not None  # the spin is not set yet: restart
    monkeypatch.setenv(THREAD_TIMEOUT, SPIN_EXPONENT)
    assert preload_env("auto", True) is None  # already as wanted: no restart
    off = preload_env("auto", False)
    assert off is not None and off["LD_PRELOAD"] == f"{preload[1]}:/opt/other.so"
    bundled = preload_env("bundled", True)
    assert bundled is not None and bundled["LD_PRELOAD"] == "/opt/other.so"
    monkeypatch.setenv(THREAD_TIMEOUT, "26")  # the operator's own choice is kept
    assert preload_env("auto", True) is None
    assert blas_env(preload)[THREAD_TIMEOUT] == "26"
    monkeypatch.delenv(THREAD_TIMEOUT)
    assert THREAD_TIMEOUT not in blas_env(["/opt/other.so"])  # no OpenBLAS, nothing to set


def test_openblas_runs_kernels_as_wide_as_the_processor_takes(preload: list[str]) -> None:
    """OpenBLAS falls back to SSE kernels on a processor model newer than it knows
    (appliance.backend.blas.coretype_for); the environment the daemon restarts with runs
    AVX2 or wider ones wherever the processor has AVX2 and FMA."""
    from appliance.backend.blas import blas_env

    if not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("a processor without AVX2 and FMA")
    code = ("import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); "
            "lib.openblas_get_corename.restype = ctypes.c_char_p; "
            "print(lib.openblas_get_corename().decode())")
    env = blas_env(preload)
    env.pop("LD_PRELOAD")
    core = subprocess.run([sys.executable, "-c", code, preload[1]], env=env, check=True,
                          capture_output=True, text=True).stdout.strip()
    assert core and core.lower() not in _BEFORE_AVX2, core


def test_a_kernel_asked_for_but_never_built_is_a_warning(
        preload: list[str], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from appliance.backend import process

    monkeypatch.setattr(process, "loaded_libraries", lambda: f"7f00 r-xp {preload[1]}\n")
    monkeypatch.setattr(process, "skinny_matmul_lib", lambda: None)
    with caplog.at_level("INFO", logger="appliance"):
        process.log_blas(True)
        process.log_blas(False)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "skinny_matmul is on but was not built" in warnings[0]


STRESS = textwrap.dedent("""
    import sys
    import numpy as np
    import mlx.core as mx

    rng = np.random.default_rng(1)
    w = {n: mx.array(rng.standard_normal((n, 576)).astype(np.float32)) for n in (192, 576, 1536)}
    x = mx.array(rng.standard_normal((8, 576)).astype(np.float32))
    want = {n: np.array(x) @ np.array(w[n]).T for n in w}
    for i in range(int(sys.argv[1])):  # back to back, as a decode step's products come
        n = (192, 576, 1536)[i % 3]
        m = 1 + i % 8
        got = np.array(x[:m] @ w[n].T)
        if i % 97 == 0:
            assert np.abs(got - want[n][:m]).max() < 1e-3, (i, n, m)
    print("ok")
""")


def test_products_back_to_back_never_hang(preload: list[str]) -> None:
    """Thousands of shared products in a row: the caller and the helper hand jobs over
    without losing or double-counting a block (a late helper once made the caller wait
    forever, and the engine stalled)."""
    run = subprocess.run([sys.executable, "-c", STRESS, "20000"], capture_output=True,
                         text=True, timeout=240, env=_clean_env(LD_PRELOAD=":".join(preload)))
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().endswith("ok")
