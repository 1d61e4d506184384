"""Big buffers kept by malloc (appliance/backend/heap.py): an environment that tunes malloc
itself is left alone. The buffers themselves: tests/engine/test_heap_buffers.py."""

from __future__ import annotations

import pytest

from appliance.backend import heap


@pytest.mark.parametrize("env", [
    {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"},
    {"MALLOC_MMAP_THRESHOLD_": "65536"},
    {"MALLOC_TRIM_THRESHOLD_": "0"},
])
def test_an_environment_that_tunes_malloc_is_left_alone(env: dict[str, str]) -> None:
    assert heap.keep_big_buffers(env) == "malloc tuned by the environment"


def test_other_tunables_do_not_count_as_tuning_malloc() -> None:
    assert not heap.tuned_by_environment({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2"})
