// The fast operations' loops for the baseline (fast_loops.inc; AVX2's and AVX-512's are in
// fast_avx2.cpp and fast_avx512.cpp), and the choice among them. No MLX here, so the
// sanitizer builds (scripts/sanitize-native.sh) run them without it.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fast_loops.h"
#include "lane_sums.h"
#include "simd.h"

namespace fast_portable {
namespace {

#include "fast_loops.inc"


struct LoadHalf {  // element by element: a processor without F16C, or not x86
  typedef uint16_t T;
  static FORCE_INLINE float one(const uint16_t* p) {
    _Float16 h;
    std::memcpy(&h, p, sizeof(h));
    return static_cast<float>(h);
  }
  static FORCE_INLINE vf at(const uint16_t* p) {
    float f[LANES];
    for (int l = 0; l < LANES; l++) f[l] = one(p + l);
    return load(f);
  }
};

const fast_loops::Loops table = {softmax_rows, silu_mul_span, rms_norm_rows,
                                 attention_heads<LoadF32>, attention_heads<LoadHalf>};

}  // namespace
}  // namespace fast_portable

const fast_loops::Loops& fast_loops::portable_loops() { return fast_portable::table; }

// The variant the native code's one choice names (simd.h), read once.
const fast_loops::Loops& fast_loops::loops() {
  static const Loops& chosen = []() -> const Loops& {
#if defined(__x86_64__)
    const int level = appliance_simd_level();
    if (level == APPLIANCE_SIMD_AVX512) return avx512_loops();
    if (level == APPLIANCE_SIMD_AVX2) return avx2_loops();
#endif
    return portable_loops();
  }();
  return chosen;
}

