// quant_matmul: MLX's affine-quantized matrix product, x @ dequantize(w).T, for few rows on
// the CPU (the products of a decode step of a 4- or 8-bit model).
//
// MLX's CPU quantized_matmul unpacks the weights once for every row of x, so its cost grows
// with the rows as if each were a separate product: a decode step of 8 rows cost 8 of one.
// Here the packed weights are streamed once per call: each block of 16 words (one cache
// line) is unpacked in registers, dequantized (w = s * q + b per group) and multiplied into
// up to 8 rows' accumulators at once, so more rows add only their multiply-adds.
//
// Layout (MLX's): w is uint32 [N, K * bits / 32], element k of a row in word k / (32 / bits)
// at bit bits * (k % (32 / bits)); scales and biases are [N, K / group]. A block of 16 words
// holds E = 16 * 32 / bits elements; shifting the block's 16 words by bits * j gives, in
// lane i, element i * (32 / bits) + j. x is copied once per call into that order (xp), so
// each shifted vector meets a plain vector load of x.
//
// Every output is summed in one fixed order (16 lanes over the blocks and shifts in order,
// then the same tree over the lanes), whatever the number of rows, the thread or the
// neighbours: a row gets the same bits alone and in a batch. The loops are compiled for
// AVX-512, AVX2 with FMA and the baseline; the first call takes what the processor runs, or
// the one APPLIANCE_SIMD names (avx512, avx2, portable). FMA makes the variants agree to
// rounding, not to the bit.
//
// Big products are split by output columns between the calling thread and a small pool of
// persistent helpers (QuantPool), which claim blocks of columns from a shared counter.

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
namespace mx = mlx::core;

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
  // The int8 path (4-bit weights; see "Activations in int8" below)
  const int8_t* xq;        // x rounded to int8, m rows of k, each block of 32 reordered
  const float* xs;         // each block's scale, m rows of k / 32
  const float* xsum;       // each weight group's sum of the rounded x, m rows of groups
};

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

template <int BITS, int LPG, class S, int RMAX>
QINLINE void columns_body(const QArgs& a, int64_t n0, int64_t n1) {
  typedef typename S::raw raw;
  for (int64_t n = n0; n < n1; n++) {
    // The hardware prefetcher alone left the loop waiting on memory for big matrices.
    if (n + AHEAD < n1) {
      const char* next = reinterpret_cast<const char*>(a.w + (n + AHEAD) * a.words);
      for (int64_t off = 0; off < a.words * 4; off += 64) __builtin_prefetch(next + off);
      __builtin_prefetch(static_cast<const raw*>(a.scales) + (n + AHEAD) * a.groups);
      __builtin_prefetch(static_cast<const raw*>(a.biases) + (n + AHEAD) * a.groups);
    }
    for (int64_t r0 = 0; r0 < a.m; r0 += RMAX) {
      const int64_t rows = std::min<int64_t>(RMAX, a.m - r0);
      rows_of<BITS, LPG, S, RMAX>(a, n, r0, rows);
    }
  }
}

typedef void (*columns_fn)(const QArgs&, int64_t, int64_t);

// Rows held in registers at once: AVX-512's 32 registers hold 8 rows' accumulators beside
// the weights; AVX2's 16 (two per 16-lane vector) hold 4 with a little spilling.
template <int BITS, int LPG, class S>
void columns_portable(const QArgs& a, int64_t n0, int64_t n1) {
  columns_body<BITS, LPG, S, 2>(a, n0, n1);
}
#if defined(__x86_64__)
template <int BITS, int LPG, class S>
__attribute__((target("avx2,fma,f16c"))) void columns_avx2(const QArgs& a, int64_t n0, int64_t n1) {
  columns_body<BITS, LPG, S, 4>(a, n0, n1);
}
template <int BITS, int LPG, class S>
__attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma,f16c")))
void columns_avx512(const QArgs& a, int64_t n0, int64_t n1) {
  columns_body<BITS, LPG, S, 8>(a, n0, n1);
}
#endif

enum Simd { PORTABLE = 0, AVX2 = 1, AVX512 = 2 };

Simd choose_simd() {
  const char* want = std::getenv("APPLIANCE_SIMD");
  Simd best = PORTABLE;
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("f16c");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (avx512) best = AVX512;
  else if (avx2) best = AVX2;
  if (want != nullptr && *want != '\0') {
    if (std::strcmp(want, "avx2") == 0 && avx2) best = AVX2;
    else if (std::strcmp(want, "avx512") == 0 && avx512) best = AVX512;
    else best = PORTABLE;
  }
#else
  (void)want;
#endif
  return best;
}

Simd simd() {
  static const Simd chosen = choose_simd();
  return chosen;
}

const char* simd_name() {
  switch (simd()) {
    case AVX512: return "avx512";
    case AVX2: return "avx2";
    default: return "portable";
  }
}

template <int BITS, int LPG, class S>
columns_fn pick_variant() {
#if defined(__x86_64__)
  if (simd() == AVX512) return columns_avx512<BITS, LPG, S>;
  if (simd() == AVX2) return columns_avx2<BITS, LPG, S>;
#endif
  return columns_portable<BITS, LPG, S>;
}

template <int BITS, class S>
columns_fn pick_lpg(int group) {
  constexpr int PER = 32 / BITS;
  const int lpg = std::min(LANES, group / PER);
  if (lpg == 4) return pick_variant<BITS, 4, S>();
  if (lpg == 8) return pick_variant<BITS, 8, S>();
  return pick_variant<BITS, 16, S>();
}

template <class S>
columns_fn pick_bits(int bits, int group) {
  return bits == 4 ? pick_lpg<4, S>(group) : pick_lpg<8, S>(group);
}

columns_fn pick(int bits, int group, mx::Dtype dtype) {
  if (dtype == mx::float16) return pick_bits<F16>(bits, group);
  if (dtype == mx::bfloat16) return pick_bits<BF16>(bits, group);
  return pick_bits<F32>(bits, group);
}

// Activations in int8 (4-bit weights). Each row of x is rounded to int8 per block of 32
// elements with its own scale xs = max|x| / 127 (as llama.cpp's q8_0), so a block's product
// with a column's 4-bit values q is an exact integer sum, done 32 or 64 byte pairs an
// instruction (AVX2 maddubs + madd, AVX-512 VNNI dpbusd) instead of a float multiply-add
// per element. With w = ws * q + wb per weight group:
//   y = sum over blocks of (ws * xs) * sum(q * xq)  +  sum over groups of wb * sum(xs * xq)
// the second term from the rounded x's sums, so the error is that of rounding x alone.
//
// Blocks go in pairs: a pair's 32 weight bytes are laid out as 64 nibbles [low of block 0,
// low of block 1, high of block 0, high of block 1] (element 2i is byte i's low nibble) and
// x is stored in that order, so 16 int32 lanes each sum 4 byte products: lanes 0-3 and 8-11
// belong to the pair's first block, 4-7 and 12-15 to its second. Each lane is scaled and
// accumulated in float by one fused multiply-add, and the lanes and the biases' 8 lanes are
// summed in a fixed tree: the integers are exact and every float step is the same in every
// variant and for any number of rows, so all give the same bits.
constexpr int IBLOCK = 32;
constexpr int64_t I8_MAX_GROUPS = 1024;  // groups per row the int8 path takes (a stack buffer)
typedef float f8 __attribute__((vector_size(8 * sizeof(float))));

// 8 scales or biases from p as floats.
QINLINE f8 load8(const float* p, F32) {
  f8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
QINLINE f8 load8(const uint16_t* p, F16) {
  typedef _Float16 h8 __attribute__((vector_size(8 * sizeof(_Float16))));
  h8 v;
  std::memcpy(&v, p, sizeof(v));
  return __builtin_convertvector(v, f8);
}
QINLINE f8 load8(const uint16_t* p, BF16) {
  typedef uint16_t s8 __attribute__((vector_size(8 * sizeof(uint16_t))));
  typedef uint32_t u8 __attribute__((vector_size(8 * sizeof(uint32_t))));
  s8 v;
  std::memcpy(&v, p, sizeof(v));
  const u8 bits = __builtin_convertvector(v, u8) << 16;
  f8 f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Portable: the same lanes in plain C.
struct I8Portable {
  static constexpr int ROWS = 2;
  struct W { uint8_t b[64]; };
  struct Acc { float l[16]; };
  static QINLINE Acc zero() { return Acc{}; }
  static QINLINE W weights(const uint8_t* p) {
    W w;
    for (int i = 0; i < 32; i++) {
      w.b[i] = p[i] & 15;
      w.b[32 + i] = p[i] >> 4;
    }
    return w;
  }
  // ws8: the pair's weight scales [block 0 x4, block 1 x4]; xs: the row's [16] block scales
  static QINLINE Acc step(Acc acc, const W& w, const int8_t* x, const float* xs, f8 ws8) {
    for (int j = 0; j < 16; j++) {
      int32_t s = 0;
      for (int t = 0; t < 4; t++) s += w.b[4 * j + t] * x[4 * j + t];
      acc.l[j] = __builtin_fmaf(static_cast<float>(s), ws8[j & 7] * xs[j], acc.l[j]);
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
#define I8_AVX2 __attribute__((target("avx2,fma,f16c"))) inline
#define I8_VNNI \
  __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"))) inline
struct I8Avx2 {
  static constexpr int ROWS = 4;
  struct W { __m256i lo, hi; };
  struct Acc { __m256 lo, hi; };
  static I8_AVX2 Acc zero() { return Acc{_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static I8_AVX2 W weights(const uint8_t* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i m4 = _mm256_set1_epi8(15);
    return W{_mm256_and_si256(raw, m4), _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4)};
  }
  static I8_AVX2 __m256 lanes(__m256i w, const int8_t* x) {
    // u4 * s8 pairs sum to at most 2 * 15 * 127: maddubs cannot saturate
    const __m256i x8 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    return _mm256_cvtepi32_ps(
        _mm256_madd_epi16(_mm256_maddubs_epi16(w, x8), _mm256_set1_epi16(1)));
  }
  static I8_AVX2 Acc step(Acc acc, const W& w, const int8_t* x, const float* xs, f8 ws8) {
    const __m256 d = _mm256_mul_ps(reinterpret_cast<__m256>(ws8), _mm256_loadu_ps(xs));
    return Acc{_mm256_fmadd_ps(lanes(w.lo, x), d, acc.lo),
               _mm256_fmadd_ps(lanes(w.hi, x + 32), d, acc.hi)};
  }
  static I8_AVX2 void store(float* out, const Acc& acc) {
    _mm256_storeu_ps(out, acc.lo);
    _mm256_storeu_ps(out + 8, acc.hi);
  }
  static I8_AVX2 f8 fma8(f8 a, f8 b, f8 c) {
    return reinterpret_cast<f8>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a),
                                                reinterpret_cast<__m256>(b),
                                                reinterpret_cast<__m256>(c)));
  }
};
struct I8Vnni {
  static constexpr int ROWS = 8;
  typedef __m512i W;
  typedef __m512 Acc;
  static I8_VNNI Acc zero() { return _mm512_setzero_ps(); }
  static I8_VNNI W weights(const uint8_t* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i m4 = _mm256_set1_epi8(15);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(raw, m4)),
                              _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4), 1);
  }
  static I8_VNNI Acc step(Acc acc, W w, const int8_t* x, const float* xs, f8 ws8) {
    const __m512 ws = _mm512_broadcast_f32x8(reinterpret_cast<__m256>(ws8));
    const __m512 d = _mm512_mul_ps(ws, _mm512_loadu_ps(xs));
    const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(x));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), d, acc);
  }
  static I8_VNNI void store(float* out, Acc acc) { _mm512_storeu_ps(out, acc); }
  static I8_VNNI f8 fma8(f8 a, f8 b, f8 c) { return I8Avx2::fma8(a, b, c); }
};
#endif

QINLINE float tree8(const float* s8) {
  return ((s8[0] + s8[4]) + (s8[2] + s8[6])) + ((s8[1] + s8[5]) + (s8[3] + s8[7]));
}

// Plain inline: the variants below are flattened, which inlines all of it into them (an
// always_inline chain from generic code refuses the target-specific helpers).
template <class S, class Ops, int R>
inline void column_rows_i8(const QArgs& a, int64_t n, int64_t r0) {
  typedef typename S::raw raw;
  const uint8_t* wr = reinterpret_cast<const uint8_t*>(a.w + n * a.words);
  const raw* sr = static_cast<const raw*>(a.scales) + n * a.groups;
  const raw* br = static_cast<const raw*>(a.biases) + n * a.groups;
  const int64_t blocks = a.k / IBLOCK, pairs = (blocks + 1) / 2, full = blocks / 2;
  const int64_t gp = (a.groups + 7) / 8 * 8;
  const int shift = a.group_log2 - 5;
  const int8_t* xq = a.xq + r0 * pairs * 64;
  const float* xs = a.xs + r0 * pairs * 16;
  // The biases as floats, zero past the groups (a partial vector load of raw values from
  // the stack stalled on store forwarding).
  alignas(32) float wb[I8_MAX_GROUPS];
  for (int64_t g = 0; g < a.groups; g++) wb[g] = to_f32(br[g], S{});
  for (int64_t g = a.groups; g < gp; g++) wb[g] = 0.f;
  typename Ops::Acc acc[R];
  for (int r = 0; r < R; r++) acc[r] = Ops::zero();
  for (int64_t p = 0; p < pairs; p++) {
    const int64_t b0 = 2 * p, b1 = b0 + 1;
    uint8_t tail[32] = {};
    const uint8_t* wp = wr + p * IBLOCK;
    float ws1 = 0.f;
    if (p < full) {
      ws1 = to_f32(sr[b1 >> shift], S{});
    } else {  // an odd last block: its pair's second half is zero
      std::memcpy(tail, wp, IBLOCK / 2);
      wp = tail;
    }
    const float ws0 = to_f32(sr[b0 >> shift], S{});
    const f8 ws8 = {ws0, ws0, ws0, ws0, ws1, ws1, ws1, ws1};
    const typename Ops::W w = Ops::weights(wp);
    for (int r = 0; r < R; r++)
      acc[r] = Ops::step(acc[r], w, xq + (r * pairs + p) * 64, xs + (r * pairs + p) * 16, ws8);
  }
  for (int r = 0; r < R; r++) {
    float l[16], s8[8];
    Ops::store(l, acc[r]);
    for (int i = 0; i < 8; i++) s8[i] = l[i] + l[i + 8];
    const float* xsum = a.xsum + (r0 + r) * gp;
    f8 bacc = {};
    for (int64_t g = 0; g < gp; g += 8)
      bacc = Ops::fma8(load8(wb + g, F32{}), load8(xsum + g, F32{}), bacc);
    float b8[8];
    std::memcpy(b8, &bacc, sizeof(b8));
    a.y[(r0 + r) * a.n + n] = tree8(s8) + tree8(b8);
  }
}

template <class S, class Ops, int R>
inline void rows_of_i8(const QArgs& a, int64_t n, int64_t r0, int64_t rows) {
  if constexpr (R == 1) {
    column_rows_i8<S, Ops, 1>(a, n, r0);
  } else {
    if (rows == R) column_rows_i8<S, Ops, R>(a, n, r0);
    else rows_of_i8<S, Ops, R - 1>(a, n, r0, rows);
  }
}

template <class S, class Ops>
inline void columns_i8_body(const QArgs& a, int64_t n0, int64_t n1) {
  typedef typename S::raw raw;
  for (int64_t n = n0; n < n1; n++) {
    if (n + AHEAD < n1) {
      const char* next = reinterpret_cast<const char*>(a.w + (n + AHEAD) * a.words);
      for (int64_t off = 0; off < a.words * 4; off += 64) __builtin_prefetch(next + off);
      __builtin_prefetch(static_cast<const raw*>(a.scales) + (n + AHEAD) * a.groups);
      __builtin_prefetch(static_cast<const raw*>(a.biases) + (n + AHEAD) * a.groups);
    }
    for (int64_t r0 = 0; r0 < a.m; r0 += Ops::ROWS) {
      const int64_t rows = std::min<int64_t>(Ops::ROWS, a.m - r0);
      rows_of_i8<S, Ops, Ops::ROWS>(a, n, r0, rows);
    }
  }
}

template <class S>
__attribute__((flatten)) void columns_i8_portable(const QArgs& a, int64_t n0, int64_t n1) {
  columns_i8_body<S, I8Portable>(a, n0, n1);
}
#if defined(__x86_64__)
template <class S>
__attribute__((target("avx2,fma,f16c"), flatten))
void columns_i8_avx2(const QArgs& a, int64_t n0, int64_t n1) {
  columns_i8_body<S, I8Avx2>(a, n0, n1);
}
template <class S>
__attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"), flatten))
void columns_i8_vnni(const QArgs& a, int64_t n0, int64_t n1) {
  columns_i8_body<S, I8Vnni>(a, n0, n1);
}
#endif

bool has_vnni() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

template <class S>
columns_fn pick_i8_variant() {
#if defined(__x86_64__)
  static const bool vnni = has_vnni();
  if (simd() == AVX512 && vnni) return columns_i8_vnni<S>;
  if (simd() != PORTABLE) return columns_i8_avx2<S>;
#endif
  return columns_i8_portable<S>;
}

columns_fn pick_i8(mx::Dtype dtype) {
  if (dtype == mx::float16) return pick_i8_variant<F16>();
  if (dtype == mx::bfloat16) return pick_i8_variant<BF16>();
  return pick_i8_variant<F32>();
}

// Activations in int8 only with APPLIANCE_QUANT_ACT=int8 (read once, like APPLIANCE_SIMD):
// off by default until the tests' tolerances and the model checks are settled for it.
bool int8_activations() {
  static const bool on = [] {
    const char* want = std::getenv("APPLIANCE_QUANT_ACT");
    return want != nullptr && std::strcmp(want, "int8") == 0;
  }();
  return on;
}

bool uses_int8(int bits, int64_t groups) {
  return bits == 4 && groups <= I8_MAX_GROUPS && int8_activations();
}

const char* act_name(int bits) { return uses_int8(bits, 1) ? "int8" : "float"; }

// Sizes of the int8 path's per-row buffers: xq and xs per pair of blocks, xsum per 8 groups.
struct I8Sizes {
  int64_t pairs, xq, xs, xsum;
  I8Sizes(int64_t k, int64_t groups)
      : pairs((k / IBLOCK + 1) / 2), xq(pairs * 64), xs(pairs * 16), xsum((groups + 7) / 8 * 8) {}
};

// x [m, k] rounded to int8 per block of 32 in the kernel's order (zero past k), with the
// blocks' scales as the lanes use them and each weight group's sum of the rounded values
// (xs * sum(xq), blocks in order; zero past the groups).
void quantize_rows(const float* x, int64_t m, int64_t k, int group, int8_t* xq, float* xs,
                   float* xsum) {
  const int64_t blocks = k / IBLOCK, groups = k / group, per = group / IBLOCK;
  const I8Sizes z(k, groups);
  std::memset(xq, 0, static_cast<size_t>(m * z.xq));
  std::memset(xs, 0, static_cast<size_t>(m * z.xs) * sizeof(float));
  std::memset(xsum, 0, static_cast<size_t>(m * z.xsum) * sizeof(float));
  for (int64_t r = 0; r < m; r++) {
    for (int64_t b = 0; b < blocks; b++) {
      const float* xb = x + r * k + b * IBLOCK;
      float amax = 0.f;
      for (int i = 0; i < IBLOCK; i++) amax = std::max(amax, std::fabs(xb[i]));
      const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      const int64_t p = b / 2, half = b % 2;
      int8_t* qp = xq + r * z.xq + p * 64;
      int32_t sum = 0;
      for (int i = 0; i < IBLOCK; i++) {
        const float v = std::min(127.f, std::max(-127.f, std::nearbyint(xb[i] * inv)));
        const int8_t q = static_cast<int8_t>(v);
        qp[(i & 1) * 32 + half * 16 + i / 2] = q;
        sum += q;
      }
      float* sp = xs + r * z.xs + p * 16;
      for (int j = 0; j < 4; j++) sp[half * 4 + j] = sp[8 + half * 4 + j] = scale;
      xsum[r * z.xsum + b / per] += scale * static_cast<float>(sum);
    }
  }
}

// A small pool of persistent helpers sharing a product's columns with the caller. The
// columns are cut into blocks claimed from one counter, so a helper that is not running
// (another process has the core) delays nothing: the caller takes its blocks. Between
// products a helper spins a while (a decode step's products come microseconds apart), then
// yields, then sleeps, so an idle daemon uses no CPU for it. A job is identified by its
// number in the claim counter's high half; the caller closes the counter before it posts
// the next job, so a late helper's claim on an old job fails and it never reads a job that
// is gone.
class QuantPool {
 public:
  static QuantPool& get() {
    static QuantPool* pool = new QuantPool();  // never destroyed: helpers outlive main()
    return *pool;
  }

  int threads() const { return threads_; }

  void run(columns_fn fn, const QArgs& a, int64_t blocks, int64_t width) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (threads_ < 2 || blocks < 2 || !busy.owns_lock()) {
      fn(a, 0, a.n);
      return;
    }
    start_helpers();
    Job job{fn, &a, blocks, width};
    const uint32_t number = posted_.load() + 1;
    job_.store(&job);
    done_.store(0);
    claim_.store(static_cast<uint64_t>(number) << 32);
    posted_.store(number);
    wake();
    work(number, job);
    for (long spin = 1; done_.load() < blocks; spin++) {
      relax();
      if (spin % 4096 == 0) wake();  // never wait on a helper that sleeps
    }
    claim_.store((static_cast<uint64_t>(number) << 32) | CLOSED);
  }

 private:
  struct Job {
    columns_fn fn;
    const QArgs* args;
    int64_t blocks, width;
  };
  static constexpr uint32_t CLOSED = 0x7fffffff;
  static constexpr long PAUSES = 20000, YIELDS = 20000;

  QuantPool() {
    const char* env = std::getenv("APPLIANCE_QUANT_THREADS");
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    threads_ = env != nullptr && *env != '\0' ? std::atoi(env) : std::min(cores, 8);
    threads_ = std::max(1, std::min(threads_, 64));
  }

  static void relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
  }

  int64_t take(uint32_t number, int64_t blocks) {
    uint64_t seen = claim_.load();
    for (;;) {
      const uint32_t index = static_cast<uint32_t>(seen);
      if (static_cast<uint32_t>(seen >> 32) != number || index >= CLOSED || index >= blocks)
        return -1;
      if (claim_.compare_exchange_weak(seen, seen + 1)) return index;
    }
  }

  void work(uint32_t number, const Job& job) {
    for (int64_t block; (block = take(number, job.blocks)) >= 0;) {
      const int64_t n0 = block * job.width;
      const int64_t n1 = std::min(job.args->n, n0 + job.width);
      if (n1 > n0) job.fn(*job.args, n0, n1);
      done_.fetch_add(1);
    }
  }

  void helper() {
    uint32_t seen = 0;
    for (;;) {
      for (long spin = 0; posted_.load() == seen; spin++) {
        if (spin < PAUSES) {
          relax();
        } else if (spin < PAUSES + YIELDS) {
          std::this_thread::yield();
        } else {
          std::unique_lock<std::mutex> hold(sleep_);
          asleep_.fetch_add(1);
          wake_.wait(hold, [&] { return posted_.load() != seen; });
          asleep_.fetch_sub(1);
        }
      }
      seen = posted_.load();
      // A claim on job `seen` succeeds only while that job is live (its caller waits for
      // every block), so the pointer is read only after one succeeds.
      const Job* job = job_.load();
      for (int64_t block; (block = take(seen, job->blocks)) >= 0;) {
        const int64_t n0 = block * job->width;
        const int64_t n1 = std::min(job->args->n, n0 + job->width);
        if (n1 > n0) job->fn(*job->args, n0, n1);
        done_.fetch_add(1);
      }
    }
  }

  void start_helpers() {
    if (started_) return;
    started_ = true;
    for (int t = 1; t < threads_; t++) std::thread([this] { helper(); }).detach();
  }

  void wake() {
    if (asleep_.load() > 0) {
      std::lock_guard<std::mutex> hold(sleep_);
      wake_.notify_all();
    }
  }

  int threads_ = 1;
  bool started_ = false;
  std::mutex busy_, sleep_;
  std::condition_variable wake_;
  std::atomic<uint32_t> posted_{0};
  std::atomic<uint64_t> claim_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> asleep_{0};
  std::atomic<const Job*> job_{nullptr};
};

constexpr int64_t SPLIT_MIN = 1 << 16;  // weights below which one thread does it all
constexpr int64_t SLICE_ROWS = 32;

// x [m, k] copied into block order (see the header), zero past k.
void to_block_order(const float* x, float* xp, int64_t m, int64_t k, int64_t kp, int bits) {
  const int per = 32 / bits, e = LANES * per;
  std::memset(xp, 0, static_cast<size_t>(m * kp) * sizeof(float));
  for (int64_t r = 0; r < m; r++) {
    const float* xr = x + r * k;
    float* pr = xp + r * kp;
    for (int64_t b = 0; b * e < k; b++)
      for (int i = 0; i < LANES; i++)
        for (int j = 0; j < per; j++) {
          const int64_t src = b * e + i * per + j;
          if (src < k) pr[b * e + j * LANES + i] = xr[src];
        }
  }
}

class QuantMatmul : public mx::UnaryPrimitive {
 public:
  QuantMatmul(mx::Stream s, int group, int bits) : mx::UnaryPrimitive(s), group_(group), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    for (const auto& a : inputs)
      if (!a.flags().row_contiguous)
        throw std::runtime_error("appliance quantized_matmul: inputs not contiguous");
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    std::vector<mx::array> ins;
    for (const auto& a : inputs) {
      enc.set_input_array(a);
      ins.push_back(mx::array::unsafe_weak_copy(a));
    }
    enc.set_output_array(out);
    enc.dispatch([ins = std::move(ins), out = mx::array::unsafe_weak_copy(out), group = group_,
                  bits = bits_]() mutable { compute(ins, out, group, bits); });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("appliance quantized_matmul runs on the CPU only");
  }
  const char* name() const override { return "ApplianceQuantizedMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantMatmul&>(other);
    return group_ == o.group_ && bits_ == o.bits_;
  }

 private:
  static void compute(std::vector<mx::array>& in, mx::array& out, int group, int bits) {
    const mx::array& x = in[0];
    const mx::array& w = in[1];
    const int64_t n = w.shape(0), words = w.shape(1);
    const int64_t k = words * 32 / bits;
    const int64_t m = k ? static_cast<int64_t>(x.size()) / k : 0;
    const int64_t groups = in[2].shape(1);
    QArgs a{nullptr, m, k, k, n, w.data<uint32_t>(), words, in[2].data<void>(),
            in[3].data<void>(), groups, group, __builtin_ctz(group), out.data<float>(),
            nullptr, nullptr, nullptr};
    const I8Sizes z(k, groups);
    std::vector<float> xp, xs, xsum;
    std::vector<int8_t> xq;
    columns_fn fn;
    if (uses_int8(bits, groups)) {
      xq.resize(static_cast<size_t>(m * z.xq));
      xs.resize(static_cast<size_t>(m * z.xs));
      xsum.resize(static_cast<size_t>(m * z.xsum));
      quantize_rows(x.data<float>(), m, k, group, xq.data(), xs.data(), xsum.data());
      a.xq = xq.data();
      a.xs = xs.data();
      a.xsum = xsum.data();
      fn = pick_i8(in[2].dtype());
    } else {
      const int64_t e = LANES * 32 / bits;
      a.kp = (k + e - 1) / e * e;
      xp.resize(static_cast<size_t>(m * a.kp));
      to_block_order(x.data<float>(), xp.data(), m, k, a.kp, bits);
      a.xp = xp.data();
      fn = pick(bits, group, in[2].dtype());
    }
    const int64_t kp = a.kp;
    auto& pool = QuantPool::get();
    // Rows in slices that stay in the cache while every column passes them (a prefill's
    // rows would otherwise be read from memory once per column).
    for (int64_t r0 = 0; r0 < m; r0 += SLICE_ROWS) {
      QArgs slice = a;
      slice.m = std::min(SLICE_ROWS, m - r0);
      if (a.xq != nullptr) {
        slice.xq = a.xq + r0 * z.xq;
        slice.xs = a.xs + r0 * z.xs;
        slice.xsum = a.xsum + r0 * z.xsum;
      } else {
        slice.xp = a.xp + r0 * kp;
      }
      slice.y = a.y + r0 * n;
      if (n * k < SPLIT_MIN || pool.threads() < 2) {
        fn(slice, 0, n);
        continue;
      }
      // Several blocks per thread, so a helper that is not running delays little.
      const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(n / 16, 8 * pool.threads()));
      const int64_t width = (n + blocks - 1) / blocks;
      pool.run(fn, slice, (n + width - 1) / width, width);
    }
  }

  int group_, bits_;
};

mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const mx::array& biases, int group, int bits) {
  if (x.dtype() != mx::float32) throw std::invalid_argument("quantized_matmul: x must be float32");
  if (w.dtype() != mx::uint32 || w.ndim() != 2)
    throw std::invalid_argument("quantized_matmul: w must be uint32 [N, K * bits / 32]");
  if (bits != 4 && bits != 8) throw std::invalid_argument("quantized_matmul: bits must be 4 or 8");
  if (group != 32 && group != 64 && group != 128)
    throw std::invalid_argument("quantized_matmul: group_size must be 32, 64 or 128");
  const int64_t k = w.shape(1) * 32 / bits;
  if (x.ndim() < 1 || x.shape(-1) != k)
    throw std::invalid_argument("quantized_matmul: x's last axis must be K");
  if (k % group)
    throw std::invalid_argument("quantized_matmul: K must be a multiple of group_size");
  const mx::Shape sshape = {w.shape(0), static_cast<int32_t>(k / group)};
  if (scales.shape() != sshape || biases.shape() != sshape || scales.dtype() != biases.dtype())
    throw std::invalid_argument("quantized_matmul: scales and biases must be [N, K / group_size]");
  if (scales.dtype() != mx::float32 && scales.dtype() != mx::float16 &&
      scales.dtype() != mx::bfloat16)
    throw std::invalid_argument("quantized_matmul: scales must be float32, float16 or bfloat16");
  auto s = mx::to_stream({}, mx::Device::cpu);
  mx::Shape shape = x.shape();
  shape.back() = w.shape(0);
  std::vector<mx::array> ins = {mx::contiguous(x, false, s), mx::contiguous(w, false, s),
                                mx::contiguous(scales, false, s), mx::contiguous(biases, false, s)};
  return mx::array(shape, mx::float32, std::make_shared<QuantMatmul>(s, group, bits), std::move(ins));
}

}  // namespace

void define_quant(nb::module_& m) {
  m.def("quantized_matmul", &quantized_matmul, nb::arg("x"), nb::arg("w"), nb::arg("scales"),
        nb::arg("biases"), nb::arg("group_size"), nb::arg("bits"),
        "x @ dequantize(w, scales, biases).T for MLX's affine 4- or 8-bit weights (x float32; "
        "group_size 32, 64 or 128), the weights read once for all rows.");
  m.def("quant_simd", [] { return std::string(simd_name()); },
        "The instruction set the quantized kernel runs: avx512, avx2 or portable.");
  m.def("quant_activations", [] { return std::string(act_name(4)); },
        "How 4-bit products take x: int8 (rounded per block of 32) or float "
        "(APPLIANCE_QUANT_ACT); 8-bit products always take it in float.");
  m.def("quant_threads", [] { return QuantPool::get().threads(); },
        "Threads a big quantized product is split across (APPLIANCE_QUANT_THREADS).");
}
