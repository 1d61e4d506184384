"""Big buffers kept by malloc (appliance/backend/heap.py): with it, a 40 MiB MLX array's
buffer comes from the heap; without it, from a fresh mmap (what costs a page fault per page
each time). Each case runs in a fresh interpreter, since malloc's thresholds are set once."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.devices import CPU_TUNING

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")

MMAPPED = """
import ctypes, sys
import mlx.core as mx
from appliance.backend import heap
if sys.argv[1] == "keep":
    print(heap.keep_big_buffers({}), file=sys.stderr)

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2
before = libc.mallinfo2().hblkhd
a = mx.zeros((10 * 1024 * 1024,), dtype=mx.float32)  # 40 MiB, above glibc's 32 MiB cap
mx.eval(a)
print(libc.mallinfo2().hblkhd - before)
"""


def mmapped_growth(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", MMAPPED, mode], capture_output=True,
                         text=True, timeout=120, check=True)
    if mode == "keep":
        assert out.stderr.strip().endswith("kept"), out.stderr
    return int(out.stdout.strip())


@CPU_TUNING
def test_a_big_buffer_comes_from_the_heap_once_kept() -> None:
    size = 40 * 1024 * 1024
    assert mmapped_growth("plain") >= size  # glibc's default: a fresh mapping
    assert mmapped_growth("keep") < size


GIVEN_BACK = """
import sys
from pathlib import Path
import mlx.core as mx
from appliance.backend import heap
heap.keep_big_buffers({})

def rss():
    line = next(x for x in Path("/proc/self/status").read_text().splitlines()
                if x.startswith("VmRSS"))
    return int(line.split()[1]) * 1024

arrays = [mx.ones((1024 * 1024,), dtype=mx.float32) for _ in range(64)]  # 4 MiB each
mx.eval(arrays)
held = rss()
keep = mx.ones((16,))  # above the freed ones: the heap's top is not free, no plain trim
mx.eval(keep)
del arrays
mx.clear_cache()
freed = rss()
heap.give_back()
print(held, freed, rss())
"""


@CPU_TUNING
def test_arrays_freed_after_a_load_leave_the_resident_memory_once_given_back() -> None:
    """A model's arrays freed once its tiles hold it (quant.hold_once) stay resident under
    the kept-buffer thresholds until ``give_back``: the KV budget would not count them."""
    out = subprocess.run([sys.executable, "-c", GIVEN_BACK], capture_output=True, text=True,
                         timeout=120, check=True)
    held, freed, given = (int(x) for x in out.stdout.split())
    size = 256 * 1024 * 1024
    assert freed > held - size // 2, "kept by malloc until given back"
    assert given < freed - size // 2
