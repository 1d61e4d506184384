"""Which OpenBLAS kernels the daemon asks for (appliance.backend.blas.coretype_for)."""

from __future__ import annotations

from appliance.backend.blas import coretype_for

AVX512 = frozenset({"sse3", "avx", "avx2", "fma", "avx512f", "avx512cd", "avx512bw",
                    "avx512dq", "avx512vl"})
AVX2 = frozenset({"sse3", "avx", "avx2", "fma"})


def test_a_fallback_to_sse_kernels_is_replaced_by_what_the_processor_runs() -> None:
    # Debian 12's OpenBLAS took a 2023 Xeon (model 207) for a Prescott
    assert coretype_for(AVX512, "Prescott") == "SkylakeX"
    assert coretype_for(AVX2, "Prescott") == "Haswell"
    assert coretype_for(AVX2 | {"avx512f"}, "Sandybridge") == "Haswell"  # not all of AVX-512
    assert coretype_for(AVX512, "unknown") == "SkylakeX"


def test_a_detection_that_found_avx2_or_better_is_left_alone() -> None:
    for core in ("Haswell", "SkylakeX", "Cooperlake", "Zen", "SapphireRapids"):
        assert coretype_for(AVX512, core) is None
    assert coretype_for(frozenset({"sse3", "avx"}), "Sandybridge") is None  # nothing wider
