// The fast operations' loops for AVX2 with FMA and F16C (fast_loops.inc; chosen by
// fast_loops::loops() when appliance_simd_level() names AVX2).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fast_loops.h"
#include "lane_sums.h"
#include "simd.h"

#if defined(__x86_64__)
#include <immintrin.h>

APPLIANCE_TARGET_BEGIN(APPLIANCE_AVX2_TARGET)
namespace fast_avx2 {
namespace {

#include "fast_loops.inc"

struct LoadHalf {
  typedef uint16_t T;
  static FORCE_INLINE vf at(const uint16_t* p) {
    const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
    vf r;
    std::memcpy(&r, &lo, sizeof(lo));
    std::memcpy(reinterpret_cast<char*>(&r) + sizeof(lo), &hi, sizeof(hi));
    return r;
  }
  static FORCE_INLINE float one(const uint16_t* p) { return _cvtsh_ss(*p); }
};

const fast_loops::Loops table = {softmax_rows, silu_mul_span, rms_norm_rows,
                                 attention_heads<LoadF32>, attention_heads<LoadHalf>};

}  // namespace
}  // namespace fast_avx2
APPLIANCE_TARGET_END

const fast_loops::Loops& fast_loops::avx2_loops() { return fast_avx2::table; }

#endif  // __x86_64__: elsewhere only the baseline's loops are built
