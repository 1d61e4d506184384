// The fast operations' loops for AVX-512 (fast_loops.inc; chosen by fast_loops::loops() when
// appliance_simd_level() names AVX-512).

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

APPLIANCE_TARGET_BEGIN(APPLIANCE_AVX512_TARGET)
namespace fast_avx512 {
namespace {

#include "fast_loops.inc"

struct LoadHalf {
  typedef uint16_t T;
  static FORCE_INLINE vf at(const uint16_t* p) {
    const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    vf r;
    std::memcpy(&r, &v, sizeof(r));
    return r;
  }
  static FORCE_INLINE float one(const uint16_t* p) { return _cvtsh_ss(*p); }
};

const fast_loops::Loops table = {softmax_rows, silu_mul_span, rms_norm_rows,
                                 attention_heads<LoadF32>, attention_heads<LoadHalf>};

}  // namespace
}  // namespace fast_avx512
APPLIANCE_TARGET_END

const fast_loops::Loops& fast_loops::avx512_loops() { return fast_avx512::table; }

#endif  // __x86_64__: elsewhere only the baseline's loops are built
