"""All the native code shares one pool of threads (appliance/backend/native/pool.c), sized by
the ``quant_threads`` setting: skinny_matmul's float products (preloaded, through MLX's
cblas_sgemm) and the MLX extension's quantized products and fast operations run on the same
helpers, which are named ``appliance-pool`` so that they can be counted from outside. Two
pools would be twice the helpers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from appliance.backend.blas import openblas_lib, skinny_matmul_lib
from tests.daemon import make_household, start_daemon
from tests.helpers import NATIVE

ROOT = Path(__file__).resolve().parents[2]

# Both kinds of work, big enough to be shared: a float product of 4 rows (skinny_matmul's) and
# a 4-bit one (the extension's); then the helper threads this process has.
BOTH = textwrap.dedent("""
    import os
    import mlx.core as mx
    from appliance.backend import fast_ops
    ext = fast_ops._extension()
    x, w = mx.random.normal((4, 1024)), mx.random.normal((2048, 1024))
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    for _ in range(20):
        mx.eval(x @ w.T, ext.quantized_matmul(x, wq, s, b, 64, 4))
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    print(ext.pool_shared(), ext.quant_threads(), names.count("appliance-pool"))
""")

needs_native = pytest.mark.skipif(
    not NATIVE or sys.platform != "linux" or openblas_lib() is None or skinny_matmul_lib() is None,
    reason="needs the native code and Debian's OpenBLAS (Linux)")


def _pool_threads(pid: int) -> int:
    tasks = Path(f"/proc/{pid}/task")
    return sum((t / "comm").read_text().strip() == "appliance-pool" for t in tasks.iterdir())


@needs_native
def test_the_kernel_and_the_extension_share_one_pool_of_the_setting_size() -> None:
    env = {**os.environ, "APPLIANCE_QUANT_THREADS": "3", "PYTHONPATH": str(ROOT),
           "LD_PRELOAD": f"{skinny_matmul_lib()} {openblas_lib()}"}
    done = subprocess.run([sys.executable, "-c", BOTH], env=env, capture_output=True,
                          text=True, timeout=300, check=True)
    shared, threads, helpers = done.stdout.split()
    assert (shared, threads, helpers) == ("True", "3", "2")  # the caller and two helpers


@needs_native
def test_without_the_preloaded_kernel_the_extension_keeps_a_pool_of_its_own() -> None:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env.update(APPLIANCE_QUANT_THREADS="3", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", BOTH], env=env, capture_output=True,
                          text=True, timeout=300, check=True)
    assert done.stdout.split() == ["False", "3", "2"]


@needs_native
def test_a_serving_daemon_runs_the_pool_the_setting_asks_for(demo_model: Path,
                                                             tmp_path: Path) -> None:
    """``appliance serve --quant-threads 3`` on the float32 demo model: skinny_matmul's products
    go to the one pool, so the daemon has two helpers after a chat (its kernel's own helper
    was one, whatever the setting)."""
    keys = make_household(tmp_path)
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "APPLIANCE_BLAS_REEXEC", "APPLIANCE_QUANT_THREADS")}
    d = start_daemon(demo_model, tmp_path, "--quant-threads", "3", env=env)
    try:
        with d.client(keys["bob"]) as c:
            for _ in range(2):
                reply = c.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "Hello there " * 40}],
                    "max_tokens": 8})
                assert reply.status_code == 200, reply.text
        deadline = time.monotonic() + 10
        while _pool_threads(d.proc.pid) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        helpers = _pool_threads(d.proc.pid)
    finally:
        assert d.terminate() == 0
    assert helpers == 2
