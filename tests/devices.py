"""What this machine's MLX backend guarantees, as marks for the tests that rely on it. The
CPU's are the appliance's own (fixed summation orders, malloc tuning); on CUDA, run on an
H200 (docs/backends.md), a row's logits differed from its logits alone by up to about 1e-4
and greedy tokens parted at near-ties, because the GPU's products depend on the batch."""

from __future__ import annotations

import pytest

from appliance.backend import installed_kind

KIND = installed_kind()

EXACT_BATCHES = pytest.mark.skipif(
    KIND != "cpu", reason=f"a row's numbers alone and in a batch are the same on the CPU "
    f"only, not on {KIND} (docs/backends.md)")
CPU_TUNING = pytest.mark.skipif(
    KIND != "cpu", reason=f"the CPU backend's own tuning, not used on {KIND}")
