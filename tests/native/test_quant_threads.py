"""The quant kernel's pool follows the cores the process may run on (its affinity mask):
a process pinned to one core, as a machine of a distributed group is, gets no helper
spinning on the core it computes on."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers import NATIVE

PROBE = ("from appliance.backend import fast_ops; print(fast_ops._extension().quant_threads())")


@pytest.mark.skipif(not NATIVE or shutil.which("taskset") is None
                    or len(os.sched_getaffinity(0)) < 2,
                    reason="needs the native code, taskset and two cores")
def test_a_process_pinned_to_one_core_gets_a_pool_of_one() -> None:
    env = {k: v for k, v in os.environ.items() if k != "APPLIANCE_QUANT_THREADS"}
    pinned = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", PROBE], env=env,
                            capture_output=True, text=True, timeout=120, check=True)
    free = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    assert int(pinned.stdout) == 1
    assert int(free.stdout) == min(len(os.sched_getaffinity(0)), 8)
