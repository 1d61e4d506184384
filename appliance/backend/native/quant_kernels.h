// quant_kernels.h: the loops of appliance/backend/native/quant_matmul.cpp (see its header for
// the product, the layout and the order of the sums), as templates that each variant's file
// instantiates: quant_matmul.cpp the baseline's, quant_avx2.cpp AVX2 with FMA's and
// quant_avx512.cpp AVX-512's (VNNI's for the 16-bit path). One file held them all and took
// most of the extension's build on one core; apart, the compiler works on them side by side.
//
// No MLX or nanobind here: the variant files include only this, so their time goes to the
// loops, not to parsing MLX's headers once more. The instruction sets stay per function
// (simd.h's targets, never a file-wide -mavx2), so the baseline's code runs on any x86-64
// and the variants only where appliance_simd_level() names them.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "simd.h"

namespace quant_kernels {

// What a variant gets: named (not file-local) so every file's function pointers take one type.
struct QArgs {
  const float* xp;         // x in block order, m rows of kp floats (zero past k)
  int64_t m, kp, k, n;
  const uint32_t* w;
  int64_t words;           // words per row of w
  const void* scales;
  const void* biases;
  int64_t groups, group;   // groups per row, elements per group
  int group_log2;          // the group's size is a power of 2: no division per block
  float* y;                // [m, n]
  // The 16-bit path (4-bit weights; see "Activations in 16 bits" below)
  const int16_t* xq;       // x rounded, m rows of quads of 4 blocks of 32, reordered
  const float* xs;         // each block's scale 4 times (one a lane), m rows of quads
  const float* xsum;       // each weight group's sum of the rounded x, m rows of groups
};

typedef void (*columns_fn)(const QArgs&, int64_t, int64_t);

// How scales and biases are stored (the dtype of MLX's arrays).
enum Scales { SCALES_F32 = 0, SCALES_F16 = 1, SCALES_BF16 = 2 };

#if defined(__x86_64__)
// Each variant of a product for its bits (4 or 8), lanes per weight group (4, 8 or 16; any
// other number takes 16) and scales: x in float, x in 16 bits (4-bit weights) and the
// dequantizing for a gemm.
columns_fn avx2_columns(int bits, int lpg, Scales s);      // quant_avx2.cpp
columns_fn avx2_columns_i16(int lpg, Scales s);
columns_fn avx2_dequant(int bits, int lpg, Scales s);
columns_fn avx2_tiled(int bits, Scales s);
columns_fn avx512_columns(int bits, int lpg, Scales s);    // quant_avx512.cpp
columns_fn vnni_columns_i16(int lpg, Scales s);            // AVX-512 with VNNI
columns_fn avx512_dequant(int bits, int lpg, Scales s);
columns_fn vnni_tiled(int bits, Scales s);                 // AVX-512 with VNNI
#endif

// x [m, k] rounded for the tiled kernel (see "Tiles" below): xq [m, k], each block's scale
// xs [m, k / 32], each weight group's sum xsum [m, k / group]. Compiled per variant: the
// baseline build calls libm for each element's nearbyint, the variants round 16 at a time.
typedef void (*round_fn)(const float* x, int64_t m, int64_t k, int group, int16_t* xq,
                         float* xs, float* xsum);
round_fn avx2_round_plain();    // quant_avx2.cpp
round_fn avx512_round_plain();  // quant_avx512.cpp

// A KV cache kept in float16 (decode_layer.cpp writes it): n floats narrowed to float16,
// rounded to nearest even as MLX casts. The same bits in every variant (F16C's conversion
// where there is one, the compiler's elsewhere).
typedef void (*narrow_fn)(const float* src, uint16_t* dst, int64_t n);
narrow_fn avx2_narrow();    // quant_avx2.cpp
narrow_fn avx512_narrow();  // quant_avx512.cpp

// File-local: each file compiles its own copies into its variants, as the single file did,
// and the linker shares none between files built for different instruction sets.
namespace {

#define QINLINE inline __attribute__((always_inline))

constexpr int LANES = 16;
constexpr int64_t AHEAD = 2;  // columns prefetched ahead (docs/decisions.md)
typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef float f4 __attribute__((vector_size(4 * sizeof(float))));

QINLINE vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// A float as float16 rounded to nearest even: the variants' tails, and the portable
// variant's every element.
QINLINE uint16_t half_bits(float f) {
  const _Float16 v = static_cast<_Float16>(f);
  uint16_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits;
}

// Scales and biases as stored: float32, float16 or bfloat16 (their bits).
struct F32 { typedef float raw; };
struct F16 { typedef uint16_t raw; };
struct BF16 { typedef uint16_t raw; };

QINLINE float to_f32(float v, F32) { return v; }
QINLINE float to_f32(uint16_t v, BF16) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
QINLINE float to_f32(uint16_t h, F16) {  // F16C's conversion where the variant has it
  _Float16 v;
  std::memcpy(&v, &h, sizeof(v));
  return static_cast<float>(v);
}

// The first C (1, 2 or 4) scales from p as floats, the rest of the 4 lanes unused.
template <int C>
QINLINE f4 scales4(const float* p, F32) {
  f4 v = {};
  std::memcpy(&v, p, C * sizeof(float));
  return v;
}
template <int C>
QINLINE f4 scales4(const uint16_t* p, F16) {
  typedef _Float16 h4 __attribute__((vector_size(4 * sizeof(_Float16))));
  h4 v = {};
  std::memcpy(&v, p, C * sizeof(uint16_t));
  return __builtin_convertvector(v, f4);
}
template <int C>
QINLINE f4 scales4(const uint16_t* p, BF16) {
  typedef uint32_t u4 __attribute__((vector_size(4 * sizeof(uint32_t))));
  typedef uint16_t s4 __attribute__((vector_size(4 * sizeof(uint16_t))));
  s4 v = {};
  std::memcpy(&v, p, C * sizeof(uint16_t));
  const u4 bits = __builtin_convertvector(v, u4) << 16;
  f4 f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// The 16 lanes' values from one scale per LPG lanes (LPG 4, 8 or 16), by broadcasts and
// blends in registers (a shuffle of the 4-lane vector went through memory).
template <int LPG>
QINLINE vf spread(f4 v) {
  if constexpr (LPG == 16) {
    return vf{} + v[0];
  } else {
    const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    if constexpr (LPG == 8) {
      return lane < 8 ? vf{} + v[0] : vf{} + v[1];
    } else {
      vf r = lane < 12 ? vf{} + v[2] : vf{} + v[3];
      r = lane < 8 ? vf{} + v[1] : r;
      return lane < 4 ? vf{} + v[0] : r;
    }
  }
}

template <int BITS, int LPG, class S, int R>
QINLINE void column_rows(const QArgs& a, int64_t n, int64_t r0) {
  constexpr int PER = 32 / BITS;
  constexpr int E = LANES * PER;
  constexpr int32_t MASK = (1 << BITS) - 1;
  typedef typename S::raw raw;
  const uint32_t* wr = a.w + n * a.words;
  const raw* sr = static_cast<const raw*>(a.scales) + n * a.groups;
  const raw* br = static_cast<const raw*>(a.biases) + n * a.groups;
  const int64_t blocks = (a.k + E - 1) / E, full = a.k / E;
  vf acc[R];
  for (int r = 0; r < R; r++) acc[r] = vf{};
  for (int64_t b = 0; b < blocks; b++) {
    vi v;
    if (b < full) {
      std::memcpy(&v, wr + b * LANES, sizeof(v));
    } else {  // the last, partial block: missing words are 0, their scales and x too
      uint32_t buf[LANES] = {};
      std::memcpy(buf, wr + b * LANES, (a.k - b * E) / PER * sizeof(uint32_t));
      std::memcpy(&v, buf, sizeof(v));
    }
    const int64_t g0 = (b * E) >> a.group_log2;
    f4 s4, b4;
    if (g0 + LANES / LPG <= a.groups) {  // a vector load: element inserts stalled the loop
      s4 = scales4<LANES / LPG>(sr + g0, S{});
      b4 = scales4<LANES / LPG>(br + g0, S{});
    } else {
      s4 = f4{};
      b4 = f4{};
      for (int c = 0; g0 + c < a.groups; c++) {
        s4[c] = to_f32(sr[g0 + c], S{});
        b4[c] = to_f32(br[g0 + c], S{});
      }
    }
    const vf sv = spread<LPG>(s4), bv = spread<LPG>(b4);
    const float* xb = a.xp + r0 * a.kp + b * E;
#pragma GCC unroll 8
    for (int j = 0; j < PER; j++) {
      const vi qi = (v >> (BITS * j)) & MASK;
      const vf w = __builtin_convertvector(qi, vf) * sv + bv;
      for (int r = 0; r < R; r++) acc[r] += vload(xb + r * a.kp + j * LANES) * w;
    }
  }
  for (int r = 0; r < R; r++) {
    float s8[8];
    for (int l = 0; l < 8; l++) s8[l] = acc[r][l] + acc[r][l + 8];
    const float s = ((s8[0] + s8[4]) + (s8[2] + s8[6])) + ((s8[1] + s8[5]) + (s8[3] + s8[7]));
    a.y[(r0 + r) * a.n + n] = s;
  }
}

// column_rows for `rows` (1..R) rows, R known when compiled.
template <int BITS, int LPG, class S, int R>
QINLINE void rows_of(const QArgs& a, int64_t n, int64_t r0, int64_t rows) {
  if constexpr (R == 1) {
    column_rows<BITS, LPG, S, 1>(a, n, r0);
  } else {
    if (rows == R) column_rows<BITS, LPG, S, R>(a, n, r0);
    else rows_of<BITS, LPG, S, R - 1>(a, n, r0, rows);
  }
}

// Column n's weights, scales and biases on their way to the cache: the hardware prefetcher
// alone left the loops waiting on memory for big matrices.
template <class S>
QINLINE void prefetch_column(const QArgs& a, int64_t n) {
  typedef typename S::raw raw;
  const char* next = reinterpret_cast<const char*>(a.w + n * a.words);
  for (int64_t off = 0; off < a.words * 4; off += 64) __builtin_prefetch(next + off);
  __builtin_prefetch(static_cast<const raw*>(a.scales) + n * a.groups);
  __builtin_prefetch(static_cast<const raw*>(a.biases) + n * a.groups);
}

template <int BITS, int LPG, class S, int RMAX>
QINLINE void columns_body(const QArgs& a, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; n++) {
    if (n + AHEAD < n1) prefetch_column<S>(a, n + AHEAD);
    for (int64_t r0 = 0; r0 < a.m; r0 += RMAX) {
      const int64_t rows = std::min<int64_t>(RMAX, a.m - r0);
      rows_of<BITS, LPG, S, RMAX>(a, n, r0, rows);
    }
  }
}

// Activations in 16 bits (4-bit weights). Each row of x is rounded per block of 32 elements
// to integers of at most 32767 in magnitude, with the block's scale xs = max|x| / 32767, so
// a block's product with a column's 4-bit values q is an exact integer sum, done 32 word
// pairs an instruction (AVX-512 VNNI vpdpwssd, AVX2 pmaddwd) instead of a float multiply-add
// per element. With w = ws * q + wb per weight group:
//   y = sum over blocks of (ws * xs) * sum(q * xq)  +  sum over groups of wb * sum(xs * xq)
// the second term from the rounded x's sums, so the error is that of rounding x alone: at
// most max|x| / 65534 per element of a block, within float32's rounding of a long sum.
// (8 bits, as llama.cpp's q8_0 / q8_1, were tried first: on SmolLM2 the outlier channels of
// the normed hidden state cost up to 2 % of a layer's output and the greedy answers changed;
// docs/decisions.md.)
//
// Blocks go in quads: a quad's 64 weight bytes are 4 blocks of 16, one per 128-bit chunk.
// Split into low and high nibbles and widened to 16 bits within each chunk (unpacklo/hi),
// they give 4 vectors of 32 words whose chunk c holds 8 elements of block c:
//   t = 0: elements 0, 2, .., 14   t = 1: 16, 18, .., 30   t = 2: 1, 3, .., 15   t = 3: 17, .., 31
// and x is stored in that order. Int32 lane j (chunk j / 4) sums 2 word products of each of
// the 4 vectors: 8 products of one block, at most 8 * 15 * 32767 < 2^24, so it converts to
// float exactly. Each lane is scaled by ws * xs and accumulated by one fused multiply-add,
// and the lanes and the biases' 8 lanes are summed in a fixed tree: the integers are exact
// and every float step is the same in every variant and for any number of rows, so all
// give the same bits.
constexpr int IBLOCK = 32;
constexpr int QUAD = 4 * IBLOCK;            // elements a quad of blocks holds
constexpr float XLEVELS = 32767.f;          // the rounded x's largest magnitude
constexpr int64_t I16_MAX_GROUPS = 1024;    // groups per row the path takes (a stack buffer)
typedef float f8 __attribute__((vector_size(8 * sizeof(float))));

// 8 biases from p as floats.
QINLINE f8 load8(const float* p) {
  f8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Portable: the same lanes in plain C.
struct I16Portable {
  static constexpr int ROWS = 2;
  struct W { int16_t v[4][32]; };
  struct Acc { float l[16]; };
  static QINLINE Acc zero() { return Acc{}; }
  // The quad's first `bytes` bytes (16, 32, 48 or 64), the rest zero.
  static QINLINE W weights(const uint8_t* p, int bytes = 64) {
    W w;
    for (int c = 0; c < 4; c++)
      for (int i = 0; i < 8; i++) {
        const uint8_t lo = 16 * c < bytes ? p[16 * c + i] : 0;
        const uint8_t hi = 16 * c < bytes ? p[16 * c + 8 + i] : 0;
        w.v[0][8 * c + i] = lo & 15;
        w.v[1][8 * c + i] = hi & 15;
        w.v[2][8 * c + i] = lo >> 4;
        w.v[3][8 * c + i] = hi >> 4;
      }
    return w;
  }
  // ws: the quad's weight scales, one per lane; xs: the row's block scales, one per lane
  typedef vf Ws;
  template <int LPG>
  static QINLINE Ws scales(f4 s4) { return spread<LPG>(s4); }
  static QINLINE Acc step(Acc acc, const W& w, const int16_t* x, const float* xs, Ws ws) {
    for (int j = 0; j < 16; j++) {
      int32_t s = 0;
      for (int t = 0; t < 4; t++)
        s += w.v[t][2 * j] * x[32 * t + 2 * j] + w.v[t][2 * j + 1] * x[32 * t + 2 * j + 1];
      acc.l[j] = __builtin_fmaf(static_cast<float>(s), ws[j] * xs[j], acc.l[j]);
    }
    return acc;
  }
  static QINLINE void store(float* out, const Acc& acc) { std::memcpy(out, acc.l, sizeof(acc.l)); }
  static QINLINE f8 fma8(f8 a, f8 b, f8 c) {
    for (int l = 0; l < 8; l++) c[l] = __builtin_fmaf(a[l], b[l], c[l]);
    return c;
  }
};

#if defined(__x86_64__)
#define I16_AVX2 __attribute__((target(APPLIANCE_AVX2_TARGET))) inline
#define I16_VNNI \
  __attribute__((target(APPLIANCE_VNNI_TARGET))) inline
struct I16Avx2 {
  static constexpr int ROWS = 2;  // 8 weight vectors and 2 accumulators a row in 16 registers
  struct W { __m256i v[4][2]; };  // [t][chunks 0-1, chunks 2-3]
  struct Acc { __m256 lo, hi; };
  static I16_AVX2 Acc zero() { return Acc{_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static I16_AVX2 __m256i load(const uint8_t* p, int bytes) {  // bytes: 0, 16 or >= 32
    if (bytes >= 32) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if (bytes <= 0) return _mm256_setzero_si256();
    return _mm256_inserti128_si256(_mm256_setzero_si256(),
                                   _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), 0);
  }
  static I16_AVX2 W weights(const uint8_t* p, int bytes = 64) {
    const __m256i m4 = _mm256_set1_epi8(15), z = _mm256_setzero_si256();
    W w;
    for (int h = 0; h < 2; h++) {
      const __m256i raw = load(p + 32 * h, bytes - 32 * h);
      const __m256i lo = _mm256_and_si256(raw, m4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
      w.v[0][h] = _mm256_unpacklo_epi8(lo, z);
      w.v[1][h] = _mm256_unpackhi_epi8(lo, z);
      w.v[2][h] = _mm256_unpacklo_epi8(hi, z);
      w.v[3][h] = _mm256_unpackhi_epi8(hi, z);
    }
    return w;
  }
  static I16_AVX2 __m256 lanes(const W& w, int h, const int16_t* x) {
    __m256i s = _mm256_setzero_si256();
    for (int t = 0; t < 4; t++) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32 * t + 16 * h));
      s = _mm256_add_epi32(s, _mm256_madd_epi16(w.v[t][h], xv));
    }
    return _mm256_cvtepi32_ps(s);
  }
  // The 16 lanes' weight scales as two native vectors: a 16-lane generic vector is not a
  // register under AVX2, and GCC moved it through the stack on every quad.
  struct Ws { __m256 lo, hi; };
  template <int LPG>
  static I16_AVX2 Ws scales(f4 s4) {
    const __m256 s = _mm256_castps128_ps256(reinterpret_cast<__m128>(s4));
    if constexpr (LPG == 16) {
      const __m256 b = _mm256_permutevar8x32_ps(s, _mm256_setzero_si256());
      return Ws{b, b};
    } else if constexpr (LPG == 8) {
      return Ws{_mm256_permutevar8x32_ps(s, _mm256_set1_epi32(0)),
                _mm256_permutevar8x32_ps(s, _mm256_set1_epi32(1))};
    } else {
      return Ws{_mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)),
                _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3))};
    }
  }
  static I16_AVX2 Acc step(Acc acc, const W& w, const int16_t* x, const float* xs, Ws ws) {
    const __m256 dlo = _mm256_mul_ps(ws.lo, _mm256_loadu_ps(xs));
    const __m256 dhi = _mm256_mul_ps(ws.hi, _mm256_loadu_ps(xs + 8));
    return Acc{_mm256_fmadd_ps(lanes(w, 0, x), dlo, acc.lo),
               _mm256_fmadd_ps(lanes(w, 1, x), dhi, acc.hi)};
  }
  static I16_AVX2 void store(float* out, const Acc& acc) {
    _mm256_storeu_ps(out, acc.lo);
    _mm256_storeu_ps(out + 8, acc.hi);
  }
  static I16_AVX2 f8 fma8(f8 a, f8 b, f8 c) {
    return reinterpret_cast<f8>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a),
                                                reinterpret_cast<__m256>(b),
                                                reinterpret_cast<__m256>(c)));
  }
};
struct I16Vnni {
  static constexpr int ROWS = 8;
  struct W { __m512i v[4]; };
  typedef __m512 Acc;
  static I16_VNNI Acc zero() { return _mm512_setzero_ps(); }
  static I16_VNNI W weights(const uint8_t* p, int bytes = 64) {
    const __m512i raw = bytes >= 64 ? _mm512_loadu_si512(p)
                                    : _mm512_maskz_loadu_epi8((1ULL << bytes) - 1, p);
    const __m512i m4 = _mm512_set1_epi8(15), z = _mm512_setzero_si512();
    const __m512i lo = _mm512_and_si512(raw, m4);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
    return W{{_mm512_unpacklo_epi8(lo, z), _mm512_unpackhi_epi8(lo, z),
              _mm512_unpacklo_epi8(hi, z), _mm512_unpackhi_epi8(hi, z)}};
  }
  typedef vf Ws;
  template <int LPG>
  static I16_VNNI Ws scales(f4 s4) { return spread<LPG>(s4); }
  static I16_VNNI Acc step(Acc acc, const W& w, const int16_t* x, const float* xs, Ws ws) {
    __m512 wv;
    std::memcpy(&wv, &ws, sizeof(wv));
    const __m512 d = _mm512_mul_ps(wv, _mm512_loadu_ps(xs));
    __m512i s = _mm512_setzero_si512();
    for (int t = 0; t < 4; t++) s = _mm512_dpwssd_epi32(s, w.v[t], _mm512_loadu_si512(x + 32 * t));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), d, acc);
  }
  static I16_VNNI void store(float* out, Acc acc) { _mm512_storeu_ps(out, acc); }
  static I16_VNNI f8 fma8(f8 a, f8 b, f8 c) { return I16Avx2::fma8(a, b, c); }
};
#endif

QINLINE float tree8(const float* s8) {
  return ((s8[0] + s8[4]) + (s8[2] + s8[6])) + ((s8[1] + s8[5]) + (s8[3] + s8[7]));
}

// Plain inline: the variants (columns_i16_*) are flattened, which inlines all of it into
// them (an always_inline chain from generic code refuses the target-specific helpers). LPG:
// lanes per weight group (4, 8 or 16 for groups of 32, 64, 128).
template <int LPG, class S, class Ops, int R>
inline void column_rows_i16(const QArgs& a, int64_t n, int64_t r0) {
  constexpr int C = LANES / LPG;  // weight groups a quad spans
  typedef typename S::raw raw;
  const uint8_t* wr = reinterpret_cast<const uint8_t*>(a.w + n * a.words);
  const raw* sr = static_cast<const raw*>(a.scales) + n * a.groups;
  const raw* br = static_cast<const raw*>(a.biases) + n * a.groups;
  const int64_t blocks = a.k / IBLOCK, quads = (blocks + 3) / 4, full = blocks / 4;
  const int64_t gp = (a.groups + 7) / 8 * 8;
  const int16_t* xq = a.xq + r0 * quads * QUAD;
  const float* xs = a.xs + r0 * quads * LANES;
  // The biases as floats, zero past the groups (a partial vector load of raw values from
  // the stack stalled on store forwarding).
  alignas(32) float wb[I16_MAX_GROUPS];
  for (int64_t g = 0; g < a.groups; g++) wb[g] = to_f32(br[g], S{});
  for (int64_t g = a.groups; g < gp; g++) wb[g] = 0.f;
  typename Ops::Acc acc[R];
  for (int r = 0; r < R; r++) acc[r] = Ops::zero();
  for (int64_t q = 0; q < quads; q++) {
    const uint8_t* wp = wr + q * 64;
    const int64_t g0 = q * C;
    f4 s4;
    typename Ops::W w;
    if (q < full) {
      s4 = scales4<C>(sr + g0, S{});
      w = Ops::weights(wp);
    } else {  // the last, partial quad: missing blocks are 0, their scales and x too
      s4 = f4{};
      for (int c = 0; c < C && g0 + c < a.groups; c++) s4[c] = to_f32(sr[g0 + c], S{});
      w = Ops::weights(wp, static_cast<int>(blocks - 4 * q) * 16);
    }
    const typename Ops::Ws ws = Ops::template scales<LPG>(s4);
    for (int r = 0; r < R; r++)
      acc[r] = Ops::step(acc[r], w, xq + (r * quads + q) * QUAD, xs + (r * quads + q) * LANES, ws);
  }
  for (int r = 0; r < R; r++) {
    float l[16], s8[8];
    Ops::store(l, acc[r]);
    for (int i = 0; i < 8; i++) s8[i] = l[i] + l[i + 8];
    const float* xsum = a.xsum + (r0 + r) * gp;
    f8 bacc = {};
    for (int64_t g = 0; g < gp; g += 8) bacc = Ops::fma8(load8(wb + g), load8(xsum + g), bacc);
    float b8[8];
    std::memcpy(b8, &bacc, sizeof(b8));
    a.y[(r0 + r) * a.n + n] = tree8(s8) + tree8(b8);
  }
}

template <int LPG, class S, class Ops, int R>
inline void rows_of_i16(const QArgs& a, int64_t n, int64_t r0, int64_t rows) {
  if constexpr (R == 1) {
    column_rows_i16<LPG, S, Ops, 1>(a, n, r0);
  } else {
    if (rows == R) column_rows_i16<LPG, S, Ops, R>(a, n, r0);
    else rows_of_i16<LPG, S, Ops, R - 1>(a, n, r0, rows);
  }
}

template <int LPG, class S, class Ops>
inline void columns_i16_body(const QArgs& a, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; n++) {
    if (n + AHEAD < n1) prefetch_column<S>(a, n + AHEAD);
    for (int64_t r0 = 0; r0 < a.m; r0 += Ops::ROWS) {
      const int64_t rows = std::min<int64_t>(Ops::ROWS, a.m - r0);
      rows_of_i16<LPG, S, Ops, Ops::ROWS>(a, n, r0, rows);
    }
  }
}

// K in the kernel's block order (see quant_matmul.cpp's header): a block of 16 words is
// written as PER vectors of 16 elements, element i * PER + j at j * 16 + i, so dequantizing
// is the kernel's unpacking with a store; block_order permutes x's columns the same way, which
// leaves x @ W.T unchanged (a shuffle to the weights' own order cost more than both). In the
// last, partial block of V < 16 words, element i * PER + j goes to j * V + i, so K needs no
// padding. Every element is s * q + b, the same expression as mx.dequantize; q has at most 8
// bits, so s * q is exact for 16-bit scales and the variants (with or without FMA) give the
// same bits.
template <int BITS, int LPG, class S>
QINLINE void dequant_body(const QArgs& a, int64_t n0, int64_t n1) {
  constexpr int PER = 32 / BITS;
  constexpr int E = LANES * PER;
  constexpr int32_t MASK = (1 << BITS) - 1;
  typedef typename S::raw raw;
  const int64_t full = a.k / E, tail = (a.k - full * E) / PER;
  for (int64_t n = n0; n < n1; n++) {
    const uint32_t* wr = a.w + n * a.words;
    const raw* sr = static_cast<const raw*>(a.scales) + n * a.groups;
    const raw* br = static_cast<const raw*>(a.biases) + n * a.groups;
    float* out = a.y + n * a.k;
    for (int64_t b = 0; b < full; b++) {
      vi v;
      std::memcpy(&v, wr + b * LANES, sizeof(v));
      const int64_t g0 = (b * E) >> a.group_log2;
      const vf sv = spread<LPG>(scales4<LANES / LPG>(sr + g0, S{}));
      const vf bv = spread<LPG>(scales4<LANES / LPG>(br + g0, S{}));
#pragma GCC unroll 8
      for (int j = 0; j < PER; j++) {
        const vf q = __builtin_convertvector((v >> (BITS * j)) & MASK, vf);
        const vf w = q * sv + bv;
        std::memcpy(out + b * E + j * LANES, &w, sizeof(w));
      }
    }
    for (int64_t i = 0; i < tail; i++) {
      const uint32_t word = wr[full * LANES + i];
      for (int j = 0; j < PER; j++) {
        const int64_t g = (full * E + i * PER + j) >> a.group_log2;
        const float q = static_cast<float>((word >> (BITS * j)) & MASK);
        out[full * E + j * tail + i] = q * to_f32(sr[g], S{}) + to_f32(br[g], S{});
      }
    }
  }
}

// Tiled 4-bit weights (appliance/backend/quant.py's tile(), done once when a model loads):
// 16 columns side by side, so that a vector's 16 lanes are 16 columns and nothing is summed
// across lanes. The column-wise kernels above spend as much per column on reductions and on
// spreading scales as on the products; here those are gone, and a product of few rows
// streams the weights at the memory's pace (docs/decisions.md).
//
// A tile's block of 32 elements is 256 bytes: 8 chunks of 32, chunk c for elements 4c..4c+3,
// byte 2j + h of a chunk holding column j's element 4c + h in its low nibble and 4c + 2 + h
// in its high one. A chunk widened to 16 bits gives 32 words whose low nibbles are 16
// columns' pairs (4c, 4c + 1) and whose high nibbles their pairs (4c + 2, 4c + 3): each pair
// of words meets a broadcast pair of x's rounded values in one 16-bit multiply-add (VNNI's
// vpdpwssd, AVX2's pmaddwd). Scales and biases are [tiles, groups, 16] as stored.
//
// x is rounded as for the column-wise 16-bit path (per block of 32, at most 32767), in its
// own order: xq [m, k], xs [m, blocks], xsum [m, groups]. Each block's integer sum is exact
// (at most 32 * 15 * 32767 < 2^24), so any grouping of its products gives the same
// integer; then per column, in order, acc = fma(sum, ws * xs, acc) per block and acc =
// fma(wb, xsum, acc) per group: the same float steps in every variant, for any rows.
//
// 8-bit weights (a tied 8-bit embedding read as the output layer): a block is 512 bytes, 16
// chunks of 32, chunk c for elements 2c and 2c + 1, byte 2j + h holding column j's element
// 2c + h; widened to 16 bits, one multiply-add a chunk. A block's sum is exact in int32
// (32 * 255 * 32767 < 2^31) and rounded to float once, the same in every variant.
constexpr int TILE = 16;             // columns a tile holds
constexpr int TBLOCK = 256;          // a tile's bytes per block of 32 elements (4-bit)
// Blocks prefetched ahead: the hardware's prefetcher alone left a product whose weights were
// not in the cache 20-30 % slower than one whose were (docs/decisions.md).
constexpr int64_t TILE_AHEAD = 8;

constexpr int64_t tblock(int bits) { return bits == 8 ? 2 * TBLOCK : TBLOCK; }

// 16 scales or biases from p as floats.
QINLINE vf tile16(const float* p, F32) { return vload(p); }
QINLINE vf tile16(const uint16_t* p, F16) {
  typedef _Float16 h16 __attribute__((vector_size(16 * sizeof(_Float16))));
  h16 v;
  std::memcpy(&v, p, sizeof(v));
  return __builtin_convertvector(v, vf);
}
QINLINE vf tile16(const uint16_t* p, BF16) {
  typedef uint16_t s16 __attribute__((vector_size(16 * sizeof(uint16_t))));
  s16 v;
  std::memcpy(&v, p, sizeof(v));
  const vi bits = __builtin_convertvector(v, vi) << 16;
  vf f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// x rounded per block of 32 to at most XLEVELS in magnitude (nearbyint: ties to even, the
// same integer in every variant), in x's own order.
QINLINE void round_plain_body(const float* x, int64_t m, int64_t k, int group, int16_t* xq,
                              float* xs, float* xsum) {
  const int64_t blocks = k / IBLOCK, groups = k / group, per = group / IBLOCK;
  for (int64_t r = 0; r < m; r++) {
    for (int64_t g = 0; g < groups; g++) xsum[r * groups + g] = 0.f;
    for (int64_t b = 0; b < blocks; b++) {
      const float* xb = x + r * k + b * IBLOCK;
      float amax = 0.f;
      for (int i = 0; i < IBLOCK; i++) amax = std::max(amax, std::fabs(xb[i]));
      const float scale = amax / XLEVELS, inv = amax > 0.f ? XLEVELS / amax : 0.f;
      int16_t* qb = xq + r * k + b * IBLOCK;
      for (int i = 0; i < IBLOCK; i++)
        qb[i] = static_cast<int16_t>(
            std::min(XLEVELS, std::max(-XLEVELS, std::nearbyint(xb[i] * inv))));
      int32_t sum = 0;
      for (int i = 0; i < IBLOCK; i++) sum += qb[i];
      xs[r * blocks + b] = scale;
      // fused in every variant (a variant with FMA would contract a plain multiply-add)
      float& gsum = xsum[r * groups + b / per];
      gsum = __builtin_fmaf(scale, static_cast<float>(sum), gsum);
    }
  }
}

QINLINE int32_t pair_at(const int16_t* x) {
  int32_t v;
  std::memcpy(&v, x, sizeof(v));
  return v;
}

// Portable: the same steps in plain C, lane by lane.
struct TPortable {
  static constexpr int ROWS = 2;
  static constexpr int chains(int) { return 1; }
  struct I { int32_t l[16]; };
  struct W { int16_t v[2][32]; };
  typedef vf F;
  typedef vf Ws;
  template <class S>
  static QINLINE Ws scales(const typename S::raw* p) { return tile16(p, S{}); }
  static QINLINE I izero() { return I{}; }
  static QINLINE F fzero() { return F{}; }
  static QINLINE void store(float* out, F acc) { std::memcpy(out, &acc, sizeof(acc)); }
  static QINLINE W unpack(const uint8_t* p) {
    W w;
    for (int i = 0; i < 32; i++) {
      w.v[0][i] = p[i] & 15;
      w.v[1][i] = p[i] >> 4;
    }
    return w;
  }
  static QINLINE W unpack8(const uint8_t* p) {
    W w;
    for (int i = 0; i < 32; i++) w.v[0][i] = p[i];
    return w;
  }
  static QINLINE I dot(I s, const W& w, int t, const int16_t* x) {
    for (int j = 0; j < 16; j++) s.l[j] += w.v[t][2 * j] * x[0] + w.v[t][2 * j + 1] * x[1];
    return s;
  }
  static QINLINE I add(I a, const I& b) {
    for (int j = 0; j < 16; j++) a.l[j] += b.l[j];
    return a;
  }
  static QINLINE F block(F acc, const I& s, Ws ws, float xs) {
    for (int j = 0; j < 16; j++)
      acc[j] = __builtin_fmaf(static_cast<float>(s.l[j]), ws[j] * xs, acc[j]);
    return acc;
  }
  static QINLINE F bias(F acc, Ws wb, float xsum) {
    for (int j = 0; j < 16; j++) acc[j] = __builtin_fmaf(wb[j], xsum, acc[j]);
    return acc;
  }
};

#if defined(__x86_64__)
struct TAvx2 {
  static constexpr int ROWS = 2;  // 16 registers: 2 rows' sums and accumulators, the weights
  static constexpr int chains(int rows) { return rows == 1 ? 2 : 1; }
  struct I { __m256i lo, hi; };
  struct W { __m256i v[2][2]; };  // [low or high nibbles][columns 0-7, 8-15]
  struct F { __m256 lo, hi; };
  static I16_AVX2 I izero() { return I{_mm256_setzero_si256(), _mm256_setzero_si256()}; }
  static I16_AVX2 F fzero() { return F{_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static I16_AVX2 void store(float* out, F acc) {
    _mm256_storeu_ps(out, acc.lo);
    _mm256_storeu_ps(out + 8, acc.hi);
  }
  static I16_AVX2 W unpack(const uint8_t* p) {
    const __m256i m4 = _mm256_set1_epi16(15);
    W w;
    for (int h = 0; h < 2; h++) {
      const __m256i v =
          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h)));
      w.v[0][h] = _mm256_and_si256(v, m4);
      w.v[1][h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    }
    return w;
  }
  static I16_AVX2 W unpack8(const uint8_t* p) {
    W w;
    for (int h = 0; h < 2; h++)
      w.v[0][h] =
          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h)));
    return w;
  }
  static I16_AVX2 I dot(I s, const W& w, int t, const int16_t* x) {
    const __m256i xv = _mm256_set1_epi32(pair_at(x));
    return I{_mm256_add_epi32(s.lo, _mm256_madd_epi16(w.v[t][0], xv)),
             _mm256_add_epi32(s.hi, _mm256_madd_epi16(w.v[t][1], xv))};
  }
  static I16_AVX2 I add(I a, const I& b) {
    return I{_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)};
  }
  // A tile's 16 scales (or biases) as two native vectors, converted as tile16 converts
  // them: a 16-lane generic vector is not a register under AVX2 and went through the stack.
  typedef F Ws;
  static I16_AVX2 Ws scales_of(const float* p, F32) {
    return Ws{_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
  }
  static I16_AVX2 Ws scales_of(const uint16_t* p, F16) {
    return Ws{_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
              _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
  }
  static I16_AVX2 __m256 bf16_8(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static I16_AVX2 Ws scales_of(const uint16_t* p, BF16) { return Ws{bf16_8(p), bf16_8(p + 8)}; }
  template <class S>
  static I16_AVX2 Ws scales(const typename S::raw* p) { return scales_of(p, S{}); }
  static I16_AVX2 F block(F acc, const I& s, const Ws& ws, float xs) {
    const __m256 x = _mm256_set1_ps(xs);
    return F{_mm256_fmadd_ps(_mm256_cvtepi32_ps(s.lo), _mm256_mul_ps(ws.lo, x), acc.lo),
             _mm256_fmadd_ps(_mm256_cvtepi32_ps(s.hi), _mm256_mul_ps(ws.hi, x), acc.hi)};
  }
  static I16_AVX2 F bias(F acc, const Ws& wb, float xsum) {
    const __m256 x = _mm256_set1_ps(xsum);
    return F{_mm256_fmadd_ps(wb.lo, x, acc.lo), _mm256_fmadd_ps(wb.hi, x, acc.hi)};
  }
};
struct TVnni {
  static constexpr int ROWS = 8;  // 32 registers: 8 rows' sums and accumulators
  static constexpr int chains(int rows) { return rows == 1 ? 4 : rows == 2 ? 2 : 1; }
  typedef __m512i I;
  struct W { __m512i v[2]; };
  typedef __m512 F;
  static I16_VNNI I izero() { return _mm512_setzero_si512(); }
  static I16_VNNI F fzero() { return _mm512_setzero_ps(); }
  static I16_VNNI void store(float* out, F acc) { _mm512_storeu_ps(out, acc); }
  static I16_VNNI __m512 v512(vf v) {
    __m512 r;
    std::memcpy(&r, &v, sizeof(r));
    return r;
  }
  static I16_VNNI W unpack(const uint8_t* p) {
    const __m512i m4 = _mm512_set1_epi16(15);
    const __m512i v =
        _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return W{{_mm512_and_si512(v, m4), _mm512_and_si512(_mm512_srli_epi16(v, 4), m4)}};
  }
  static I16_VNNI W unpack8(const uint8_t* p) {
    return W{{_mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
              _mm512_setzero_si512()}};
  }
  static I16_VNNI I dot(I s, const W& w, int t, const int16_t* x) {
    return _mm512_dpwssd_epi32(s, w.v[t], _mm512_set1_epi32(pair_at(x)));
  }
  static I16_VNNI I add(I a, I b) { return _mm512_add_epi32(a, b); }
  typedef vf Ws;
  template <class S>
  static I16_VNNI Ws scales(const typename S::raw* p) { return tile16(p, S{}); }
  static I16_VNNI F block(F acc, I s, vf ws, float xs) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(v512(ws), _mm512_set1_ps(xs)),
                           acc);
  }
  static I16_VNNI F bias(F acc, vf wb, float xsum) {
    return _mm512_fmadd_ps(v512(wb), _mm512_set1_ps(xsum), acc);
  }
};
#endif

// Tile t for rows r0..r0+R-1 of x: columns 16t.. of y.
template <class S, class Ops, int R, int BITS>
inline void tile_rows(const QArgs& a, int64_t t, int64_t r0) {
  constexpr int CH = Ops::chains(R);
  constexpr int64_t BLOCK = tblock(BITS);
  typedef typename S::raw raw;
  const int64_t blocks = a.k / IBLOCK, per = a.group / IBLOCK;
  const uint8_t* wt = reinterpret_cast<const uint8_t*>(a.w) + t * blocks * BLOCK;
  const raw* st = static_cast<const raw*>(a.scales) + t * a.groups * TILE;
  const raw* bt = static_cast<const raw*>(a.biases) + t * a.groups * TILE;
  typename Ops::F acc[R];
  for (int r = 0; r < R; r++) acc[r] = Ops::fzero();
  for (int64_t g = 0; g < a.groups; g++) {
    const typename Ops::Ws ws = Ops::template scales<S>(st + g * TILE);
    for (int64_t b = g * per; b < (g + 1) * per; b++) {
      const uint8_t* wb = wt + b * BLOCK;
      for (int64_t l = 0; l < BLOCK; l += 64) __builtin_prefetch(wb + TILE_AHEAD * BLOCK + l);
      typename Ops::I sum[R][CH];
      for (int r = 0; r < R; r++)
        for (int c = 0; c < CH; c++) sum[r][c] = Ops::izero();
      if constexpr (BITS == 8) {
#pragma GCC unroll 16
        for (int c = 0; c < 16; c++) {
          const typename Ops::W w = Ops::unpack8(wb + 32 * c);
          for (int r = 0; r < R; r++) {
            const int16_t* x = a.xq + (r0 + r) * a.k + b * IBLOCK + 2 * c;
            sum[r][c % CH] = Ops::dot(sum[r][c % CH], w, 0, x);
          }
        }
      } else {
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
          const typename Ops::W w = Ops::unpack(wb + 32 * c);
          for (int r = 0; r < R; r++) {
            const int16_t* x = a.xq + (r0 + r) * a.k + b * IBLOCK + 4 * c;
            sum[r][(2 * c) % CH] = Ops::dot(sum[r][(2 * c) % CH], w, 0, x);
            sum[r][(2 * c + 1) % CH] = Ops::dot(sum[r][(2 * c + 1) % CH], w, 1, x + 2);
          }
        }
      }
      for (int r = 0; r < R; r++) {
        for (int c = 1; c < CH; c++) sum[r][0] = Ops::add(sum[r][0], sum[r][c]);
        acc[r] = Ops::block(acc[r], sum[r][0], ws, a.xs[(r0 + r) * blocks + b]);
      }
    }
    const typename Ops::Ws wb = Ops::template scales<S>(bt + g * TILE);
    for (int r = 0; r < R; r++) acc[r] = Ops::bias(acc[r], wb, a.xsum[(r0 + r) * a.groups + g]);
  }
  const int64_t cols = std::min<int64_t>(TILE, a.n - t * TILE);
  for (int r = 0; r < R; r++) {
    float out[TILE];
    Ops::store(out, acc[r]);
    std::memcpy(a.y + (r0 + r) * a.n + t * TILE, out, cols * sizeof(float));
  }
}

template <class S, class Ops, int R, int BITS>
inline void tile_rows_of(const QArgs& a, int64_t t, int64_t r0, int64_t rows) {
  if constexpr (R == 1) {
    tile_rows<S, Ops, 1, BITS>(a, t, r0);
  } else {
    if (rows == R) tile_rows<S, Ops, R, BITS>(a, t, r0);
    else tile_rows_of<S, Ops, R - 1, BITS>(a, t, r0, rows);
  }
}

// Columns [n0, n1) of a tiled product (n0 a multiple of 16).
template <class S, class Ops, int BITS>
inline void tiled_body(const QArgs& a, int64_t n0, int64_t n1) {
  for (int64_t t = n0 / TILE; t * TILE < n1; t++)
    for (int64_t r0 = 0; r0 < a.m; r0 += Ops::ROWS)
      tile_rows_of<S, Ops, Ops::ROWS, BITS>(a, t, r0, std::min<int64_t>(Ops::ROWS, a.m - r0));
}

// The instance of a variant V (a struct whose get<BITS, LPG, S>() returns it) for a
// product's bits (4, else 8), lanes per group (4, 8, else 16) and scales.
template <class V, int BITS, int LPG>
columns_fn by_scales(Scales s) {
  if (s == SCALES_F16) return V::template get<BITS, LPG, F16>();
  if (s == SCALES_BF16) return V::template get<BITS, LPG, BF16>();
  return V::template get<BITS, LPG, F32>();
}

template <class V, int BITS>
columns_fn by_lpg(int lpg, Scales s) {
  if (lpg == 4) return by_scales<V, BITS, 4>(s);
  if (lpg == 8) return by_scales<V, BITS, 8>(s);
  return by_scales<V, BITS, 16>(s);
}

template <class V>
columns_fn by_bits(int bits, int lpg, Scales s) {
  return bits == 4 ? by_lpg<V, 4>(lpg, s) : by_lpg<V, 8>(lpg, s);
}

}  // namespace
}  // namespace quant_kernels
