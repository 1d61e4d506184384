// The quantized kernel's AVX-512 variants (F, DQ, BW, VL; VNNI for the 16-bit path):
// quant_kernels.h's loops compiled for them, per function, in a file of their own so they
// build beside the others. Chosen by quant_matmul.cpp when
// appliance_simd_level() (simd.h) names them.

#include "quant_kernels.h"

#if defined(__x86_64__)

namespace quant_kernels {
namespace {

// 8 rows in registers: AVX-512's 32 registers hold 8 rows' accumulators beside the weights.
template <int BITS, int LPG, class S>
__attribute__((target(APPLIANCE_AVX512_TARGET)))
void columns_avx512(const QArgs& a, int64_t n0, int64_t n1) {
  columns_body<BITS, LPG, S, 8>(a, n0, n1);
}

template <int LPG, class S>
__attribute__((target(APPLIANCE_VNNI_TARGET), flatten))
void columns_i16_vnni(const QArgs& a, int64_t n0, int64_t n1) {
  columns_i16_body<LPG, S, I16Vnni>(a, n0, n1);
}

template <int BITS, int LPG, class S>
__attribute__((target(APPLIANCE_AVX512_TARGET)))
void dequant_avx512(const QArgs& a, int64_t n0, int64_t n1) {
  dequant_body<BITS, LPG, S>(a, n0, n1);
}

template <class S, int BITS>
__attribute__((target(APPLIANCE_VNNI_TARGET), flatten))
void tiled_vnni(const QArgs& a, int64_t n0, int64_t n1) {
  tiled_body<S, TVnni, BITS>(a, n0, n1);
}

struct Columns {
  template <int BITS, int LPG, class S>
  static columns_fn get() { return columns_avx512<BITS, LPG, S>; }
};
struct ColumnsI16 {
  template <int BITS, int LPG, class S>
  static columns_fn get() { return columns_i16_vnni<LPG, S>; }
};
struct Tiled {
  template <int BITS, int LPG, class S>
  static columns_fn get() { return tiled_vnni<S, BITS>; }
};
struct Dequant {
  template <int BITS, int LPG, class S>
  static columns_fn get() { return dequant_avx512<BITS, LPG, S>; }
};

__attribute__((target(APPLIANCE_AVX512_TARGET)))
void round_plain_avx512(const float* x, int64_t m, int64_t k, int group, int16_t* xq, float* xs,
                      float* xsum) {
  round_plain_body(x, m, k, group, xq, xs, xsum);
}

__attribute__((target(APPLIANCE_AVX512_TARGET)))
void narrow_avx512(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; i++) dst[i] = half_bits(src[i]);
}

}  // namespace

columns_fn vnni_tiled(int bits, Scales s) {
  return bits == 8 ? by_scales<Tiled, 8, 16>(s) : by_scales<Tiled, 4, 16>(s);
}
columns_fn avx512_columns(int bits, int lpg, Scales s) { return by_bits<Columns>(bits, lpg, s); }
columns_fn vnni_columns_i16(int lpg, Scales s) { return by_lpg<ColumnsI16, 4>(lpg, s); }
columns_fn avx512_dequant(int bits, int lpg, Scales s) { return by_bits<Dequant>(bits, lpg, s); }

round_fn avx512_round_plain() { return round_plain_avx512; }
narrow_fn avx512_narrow() { return narrow_avx512; }

}  // namespace quant_kernels

#endif  // __x86_64__: elsewhere only the baseline's variants are built
