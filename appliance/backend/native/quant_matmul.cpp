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
//
// Products of many rows (a prompt's) are better done by a gemm: dequantize_blocked (below)
// writes the weights out in float32 for one, and appliance/backend/quant.py chooses.

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#if defined(__linux__)
#include <sched.h>
#endif
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
  // The 16-bit path (4-bit weights; see "Activations in 16 bits" below)
  const int16_t* xq;       // x rounded, m rows of quads of 4 blocks of 32, reordered
  const float* xs;         // each block's scale 4 times (one a lane), m rows of quads
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
  static QINLINE Acc step(Acc acc, const W& w, const int16_t* x, const float* xs, vf ws) {
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
#define I16_AVX2 __attribute__((target("avx2,fma,f16c"))) inline
#define I16_VNNI \
  __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"))) inline
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
  static I16_AVX2 Acc step(Acc acc, const W& w, const int16_t* x, const float* xs, vf ws) {
    __m256 wlo, whi;
    std::memcpy(&wlo, &ws, sizeof(wlo));
    std::memcpy(&whi, reinterpret_cast<const float*>(&ws) + 8, sizeof(whi));
    const __m256 dlo = _mm256_mul_ps(wlo, _mm256_loadu_ps(xs));
    const __m256 dhi = _mm256_mul_ps(whi, _mm256_loadu_ps(xs + 8));
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
  static I16_VNNI Acc step(Acc acc, const W& w, const int16_t* x, const float* xs, vf ws) {
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

// Plain inline: the variants below are flattened, which inlines all of it into them (an
// always_inline chain from generic code refuses the target-specific helpers). LPG: lanes per
// weight group (4, 8 or 16 for groups of 32, 64, 128).
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
    const vf ws = spread<LPG>(s4);
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
      rows_of_i16<LPG, S, Ops, Ops::ROWS>(a, n, r0, rows);
    }
  }
}

template <int LPG, class S>
__attribute__((flatten)) void columns_i16_portable(const QArgs& a, int64_t n0, int64_t n1) {
  columns_i16_body<LPG, S, I16Portable>(a, n0, n1);
}
#if defined(__x86_64__)
template <int LPG, class S>
__attribute__((target("avx2,fma,f16c"), flatten))
void columns_i16_avx2(const QArgs& a, int64_t n0, int64_t n1) {
  columns_i16_body<LPG, S, I16Avx2>(a, n0, n1);
}
template <int LPG, class S>
__attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"), flatten))
void columns_i16_vnni(const QArgs& a, int64_t n0, int64_t n1) {
  columns_i16_body<LPG, S, I16Vnni>(a, n0, n1);
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

template <int LPG, class S>
columns_fn pick_i16_variant() {
#if defined(__x86_64__)
  static const bool vnni = has_vnni();
  if (simd() == AVX512 && vnni) return columns_i16_vnni<LPG, S>;
  if (simd() != PORTABLE) return columns_i16_avx2<LPG, S>;
#endif
  return columns_i16_portable<LPG, S>;
}

template <class S>
columns_fn pick_i16_group(int group) {
  if (group == 32) return pick_i16_variant<4, S>();
  if (group == 64) return pick_i16_variant<8, S>();
  return pick_i16_variant<16, S>();
}

columns_fn pick_i16(int group, mx::Dtype dtype) {
  if (dtype == mx::float16) return pick_i16_group<F16>(group);
  if (dtype == mx::bfloat16) return pick_i16_group<BF16>(group);
  return pick_i16_group<F32>(group);
}

// How 4-bit products take x: in 16 bits where an AVX2 or AVX-512 variant runs (faster than
// float at every row count measured), in float on the portable variant (slower there from 4
// rows: its compiler does not find the baseline's pmaddwd); APPLIANCE_QUANT_ACT=float or
// int16 says which (read once, like APPLIANCE_SIMD). A call may ask for either (ACT_DEFAULT:
// this choice).
enum Act { ACT_DEFAULT = -1, ACT_FLOAT = 0, ACT_INT16 = 1 };

Act default_act() {
  static const Act chosen = [] {
    const char* want = std::getenv("APPLIANCE_QUANT_ACT");
    if (want != nullptr && std::strcmp(want, "float") == 0) return ACT_FLOAT;
    if (want != nullptr && std::strcmp(want, "int16") == 0) return ACT_INT16;
    return simd() == PORTABLE ? ACT_FLOAT : ACT_INT16;
  }();
  return chosen;
}

bool uses_int16(int bits, int64_t groups, int act) {
  const int chosen = act == ACT_DEFAULT ? default_act() : act;
  return bits == 4 && groups <= I16_MAX_GROUPS && chosen == ACT_INT16;
}

const char* act_name(int bits) { return uses_int16(bits, 1, ACT_DEFAULT) ? "int16" : "float"; }

// Sizes of the path's per-row buffers: xq and xs per quad of blocks, xsum per 8 groups.
struct I16Sizes {
  int64_t quads, xq, xs, xsum;
  I16Sizes(int64_t k, int64_t groups)
      : quads((k / IBLOCK + 3) / 4), xq(quads * QUAD), xs(quads * LANES),
        xsum((groups + 7) / 8 * 8) {}
};

// x [m, k] rounded per block of 32 in the kernel's order (zero past k), with the blocks'
// scales as the lanes use them and each weight group's sum of the rounded values
// (xs * sum(xq), blocks in order; zero past the groups).
void quantize_rows(const float* x, int64_t m, int64_t k, int group, int16_t* xq, float* xs,
                   float* xsum) {
  const int64_t blocks = k / IBLOCK, groups = k / group, per = group / IBLOCK;
  const I16Sizes z(k, groups);
  std::memset(xq, 0, static_cast<size_t>(m * z.xq) * sizeof(int16_t));
  std::memset(xs, 0, static_cast<size_t>(m * z.xs) * sizeof(float));
  std::memset(xsum, 0, static_cast<size_t>(m * z.xsum) * sizeof(float));
  for (int64_t r = 0; r < m; r++) {
    for (int64_t b = 0; b < blocks; b++) {
      const float* xb = x + r * k + b * IBLOCK;
      float amax = 0.f;
      for (int i = 0; i < IBLOCK; i++) amax = std::max(amax, std::fabs(xb[i]));
      const float scale = amax / XLEVELS, inv = amax > 0.f ? XLEVELS / amax : 0.f;
      const int64_t q = b / 4, c = b % 4;
      int16_t* qp = xq + r * z.xq + q * QUAD;
      int32_t sum = 0;
      for (int i = 0; i < IBLOCK; i++) {
        const float v = std::min(XLEVELS, std::max(-XLEVELS, std::nearbyint(xb[i] * inv)));
        const int16_t iv = static_cast<int16_t>(v);
        const int e = i / 2, t = (i & 1) * 2 + e / 8;  // see the layout above
        qp[32 * t + 8 * c + e % 8] = iv;
        sum += iv;
      }
      float* sp = xs + r * z.xs + q * LANES;
      for (int j = 0; j < 4; j++) sp[4 * c + j] = scale;
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
// The cores this process may run on: its affinity mask where there is one (a process pinned
// to one core, as a machine of a distributed group is, gets no helper spinning beside it).
int usable_cores() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

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
    threads_ = env != nullptr && *env != '\0' ? std::atoi(env) : std::min(usable_cores(), 8);
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

// Prefill-sized products (appliance/backend/quant.py sends those of more than 32 rows here):
// the weights dequantized into float32 once per call, by the pool's threads, for MLX's
// matmul (OpenBLAS's sgemm where the daemon preloads it) to multiply. The kernel above reads
// the packed weights once per few rows and blocks nothing for the cache; a gemm does, and
// the dequantizing costs one write of N * K floats (docs/decisions.md).
//
// K goes in the kernel's block order (see the header): a block of 16 words is written as
// PER vectors of 16 elements, element i * PER + j at j * 16 + i, so dequantizing is the
// kernel's unpacking with a store; block_order permutes x's columns the same way, which
// leaves x @ W.T unchanged (a shuffle to the weights' own order cost more than both). In the last, partial block of V < 16 words, element i * PER + j goes to
// j * V + i, so K needs no padding. Every element is s * q + b, the same expression as
// mx.dequantize; q has at most 8 bits, so s * q is exact for 16-bit scales and the variants
// (with or without FMA) give the same bits.
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

template <int BITS, int LPG, class S>
void dequant_portable(const QArgs& a, int64_t n0, int64_t n1) {
  dequant_body<BITS, LPG, S>(a, n0, n1);
}
#if defined(__x86_64__)
template <int BITS, int LPG, class S>
__attribute__((target("avx2,fma,f16c"))) void dequant_avx2(const QArgs& a, int64_t n0, int64_t n1) {
  dequant_body<BITS, LPG, S>(a, n0, n1);
}
template <int BITS, int LPG, class S>
__attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma,f16c")))
void dequant_avx512(const QArgs& a, int64_t n0, int64_t n1) {
  dequant_body<BITS, LPG, S>(a, n0, n1);
}
#endif

template <int BITS, class S>
columns_fn pick_dequant_bits(int group) {
  constexpr int PER = 32 / BITS;
  const int lpg = std::min(LANES, group / PER);
#if defined(__x86_64__)
#define APPLIANCE_DEQUANT(LPG)                                        \
  if (simd() == AVX512) return dequant_avx512<BITS, LPG, S>;          \
  if (simd() == AVX2) return dequant_avx2<BITS, LPG, S>;              \
  return dequant_portable<BITS, LPG, S>;
#else
#define APPLIANCE_DEQUANT(LPG) return dequant_portable<BITS, LPG, S>;
#endif
  if (lpg == 4) { APPLIANCE_DEQUANT(4) }
  if (lpg == 8) { APPLIANCE_DEQUANT(8) }
  APPLIANCE_DEQUANT(16)
#undef APPLIANCE_DEQUANT
}

template <class S>
columns_fn pick_dequant_dtype(int bits, int group) {
  return bits == 4 ? pick_dequant_bits<4, S>(group) : pick_dequant_bits<8, S>(group);
}

columns_fn pick_dequant(int bits, int group, mx::Dtype dtype) {
  if (dtype == mx::float16) return pick_dequant_dtype<F16>(bits, group);
  if (dtype == mx::bfloat16) return pick_dequant_dtype<BF16>(bits, group);
  return pick_dequant_dtype<F32>(bits, group);
}

// The rows of w cut into blocks for the pool, as compute() cuts a product's columns.
void run_split(columns_fn fn, const QArgs& a, int64_t cost) {
  auto& pool = QuantPool::get();
  if (cost < SPLIT_MIN || pool.threads() < 2) {
    fn(a, 0, a.n);
    return;
  }
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(a.n / 16, 8 * pool.threads()));
  const int64_t width = (a.n + blocks - 1) / blocks;
  pool.run(fn, a, (a.n + width - 1) / width, width);
}

// x's columns in the dequantized weights' order (each row as dequant_body writes one).
template <int PER>
void block_order_rows(const float* x, float* xp, int64_t m, int64_t k) {
  constexpr int E = LANES * PER;
  const int64_t full = k / E, tail = (k - full * E) / PER;
  for (int64_t r = 0; r < m; r++) {
    const float* xr = x + r * k;
    float* pr = xp + r * k;
    for (int64_t b = 0; b < full; b++)
      for (int i = 0; i < LANES; i++)
        for (int j = 0; j < PER; j++) pr[b * E + j * LANES + i] = xr[b * E + i * PER + j];
    for (int64_t i = 0; i < tail; i++)
      for (int j = 0; j < PER; j++) pr[full * E + j * tail + i] = xr[full * E + i * PER + j];
  }
}

class BlockOrder : public mx::UnaryPrimitive {
 public:
  BlockOrder(mx::Stream s, int bits) : mx::UnaryPrimitive(s), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    if (!inputs[0].flags().row_contiguous)
      throw std::runtime_error("appliance block_order: input not contiguous");
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.set_input_array(inputs[0]);
    enc.set_output_array(out);
    enc.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]),
                  out = mx::array::unsafe_weak_copy(out), bits = bits_]() mutable {
      const int64_t k = x.shape(-1), m = k ? static_cast<int64_t>(x.size()) / k : 0;
      if (bits == 4) block_order_rows<8>(x.data<float>(), out.data<float>(), m, k);
      else block_order_rows<4>(x.data<float>(), out.data<float>(), m, k);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("appliance block_order runs on the CPU only");
  }
  const char* name() const override { return "ApplianceBlockOrder"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return bits_ == static_cast<const BlockOrder&>(other).bits_;
  }

 private:
  int bits_;
};

// A CPU primitive's common start: contiguous inputs (else an error naming ``what``), the
// output allocated, and the inputs and output registered with the command encoder; ``ins``
// gets the inputs' weak copies for the task the caller dispatches.
mx::cpu::CommandEncoder& prepare(mx::Stream stream, const std::vector<mx::array>& inputs,
                                 mx::array& out, std::vector<mx::array>& ins, const char* what) {
  for (const auto& a : inputs)
    if (!a.flags().row_contiguous)
      throw std::runtime_error(std::string(what) + ": inputs not contiguous");
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream);
  for (const auto& a : inputs) {
    enc.set_input_array(a);
    ins.push_back(mx::array::unsafe_weak_copy(a));
  }
  enc.set_output_array(out);
  return enc;
}

class QuantDequant : public mx::UnaryPrimitive {
 public:
  QuantDequant(mx::Stream s, int group, int bits)
      : mx::UnaryPrimitive(s), group_(group), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    std::vector<mx::array> ins;
    auto& enc = prepare(stream(), inputs, out, ins, "appliance dequantize");
    enc.dispatch([ins = std::move(ins), out = mx::array::unsafe_weak_copy(out), group = group_,
                  bits = bits_]() mutable {
      const int64_t n = ins[0].shape(0), words = ins[0].shape(1), k = words * 32 / bits;
      QArgs a{nullptr, 0, k, k, n, ins[0].data<uint32_t>(), words, ins[1].data<void>(),
              ins[2].data<void>(), ins[1].shape(1), group, __builtin_ctz(group),
              out.data<float>(), nullptr, nullptr, nullptr};
      run_split(pick_dequant(bits, group, ins[1].dtype()), a, n * k);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("appliance dequantize runs on the CPU only");
  }
  const char* name() const override { return "ApplianceDequantize"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantDequant&>(other);
    return group_ == o.group_ && bits_ == o.bits_;
  }

 private:
  int group_, bits_;
};

class QuantMatmul : public mx::UnaryPrimitive {
 public:
  QuantMatmul(mx::Stream s, int group, int bits, int act)
      : mx::UnaryPrimitive(s), group_(group), bits_(bits), act_(act) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    std::vector<mx::array> ins;
    auto& enc = prepare(stream(), inputs, out, ins, "appliance quantized_matmul");
    enc.dispatch([ins = std::move(ins), out = mx::array::unsafe_weak_copy(out), group = group_,
                  bits = bits_, act = act_]() mutable { compute(ins, out, group, bits, act); });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("appliance quantized_matmul runs on the CPU only");
  }
  const char* name() const override { return "ApplianceQuantizedMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantMatmul&>(other);
    return group_ == o.group_ && bits_ == o.bits_ && act_ == o.act_;
  }

 private:
  static void compute(std::vector<mx::array>& in, mx::array& out, int group, int bits, int act) {
    const mx::array& x = in[0];
    const mx::array& w = in[1];
    const int64_t n = w.shape(0), words = w.shape(1);
    const int64_t k = words * 32 / bits;
    const int64_t m = k ? static_cast<int64_t>(x.size()) / k : 0;
    const int64_t groups = in[2].shape(1);
    QArgs a{nullptr, m, k, k, n, w.data<uint32_t>(), words, in[2].data<void>(),
            in[3].data<void>(), groups, group, __builtin_ctz(group), out.data<float>(),
            nullptr, nullptr, nullptr};
    const I16Sizes z(k, groups);
    std::vector<float> xp, xs, xsum;
    std::vector<int16_t> xq;
    columns_fn fn;
    if (uses_int16(bits, groups, act)) {
      xq.resize(static_cast<size_t>(m * z.xq));
      xs.resize(static_cast<size_t>(m * z.xs));
      xsum.resize(static_cast<size_t>(m * z.xsum));
      quantize_rows(x.data<float>(), m, k, group, xq.data(), xs.data(), xsum.data());
      a.xq = xq.data();
      a.xs = xs.data();
      a.xsum = xsum.data();
      fn = pick_i16(group, in[2].dtype());
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

  int group_, bits_, act_;
};

// a itself where it is evaluated and row-contiguous already (weights, scales, biases): a
// contiguous node costs the step a scheduled operation even when it copies nothing.
mx::array contiguous(const mx::array& a, mx::Stream s) {
  if (a.is_available() && a.flags().row_contiguous) return a;
  return mx::contiguous(a, false, s);
}

// The checks both entry points make of w, scales and biases; K.
int64_t check_weights(const mx::array& w, const mx::array& scales, const mx::array& biases,
                      int group, int bits) {
  if (w.dtype() != mx::uint32 || w.ndim() != 2)
    throw std::invalid_argument("quantized_matmul: w must be uint32 [N, K * bits / 32]");
  if (bits != 4 && bits != 8) throw std::invalid_argument("quantized_matmul: bits must be 4 or 8");
  if (group != 32 && group != 64 && group != 128)
    throw std::invalid_argument("quantized_matmul: group_size must be 32, 64 or 128");
  const int64_t k = w.shape(1) * 32 / bits;
  if (k % group)
    throw std::invalid_argument("quantized_matmul: K must be a multiple of group_size");
  const mx::Shape sshape = {w.shape(0), static_cast<int32_t>(k / group)};
  if (scales.shape() != sshape || biases.shape() != sshape || scales.dtype() != biases.dtype())
    throw std::invalid_argument("quantized_matmul: scales and biases must be [N, K / group_size]");
  if (scales.dtype() != mx::float32 && scales.dtype() != mx::float16 &&
      scales.dtype() != mx::bfloat16)
    throw std::invalid_argument("quantized_matmul: scales must be float32, float16 or bfloat16");
  return k;
}

mx::array dequantize_blocked(const mx::array& w, const mx::array& scales,
                             const mx::array& biases, int group, int bits) {
  const int64_t k = check_weights(w, scales, biases, group, bits);
  auto s = mx::to_stream({}, mx::Device::cpu);
  std::vector<mx::array> ins = {contiguous(w, s), contiguous(scales, s), contiguous(biases, s)};
  return mx::array({w.shape(0), static_cast<int32_t>(k)}, mx::float32,
                   std::make_shared<QuantDequant>(s, group, bits), std::move(ins));
}

mx::array block_order(const mx::array& x, int bits) {
  if (x.dtype() != mx::float32 || x.ndim() < 1)
    throw std::invalid_argument("block_order: x must be float32");
  if (bits != 4 && bits != 8) throw std::invalid_argument("block_order: bits must be 4 or 8");
  if (x.shape(-1) % 32)
    throw std::invalid_argument("block_order: x's last axis must be a multiple of 32");
  auto s = mx::to_stream({}, mx::Device::cpu);
  return mx::array(x.shape(), mx::float32, std::make_shared<BlockOrder>(s, bits),
                   {mx::contiguous(x, false, s)});
}

mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const mx::array& biases, int group, int bits, int act) {
  if (x.dtype() != mx::float32) throw std::invalid_argument("quantized_matmul: x must be float32");
  const int64_t k = check_weights(w, scales, biases, group, bits);
  if (x.ndim() < 1 || x.shape(-1) != k)
    throw std::invalid_argument("quantized_matmul: x's last axis must be K");
  auto s = mx::to_stream({}, mx::Device::cpu);
  mx::Shape shape = x.shape();
  shape.back() = w.shape(0);
  std::vector<mx::array> ins = {contiguous(x, s), contiguous(w, s), contiguous(scales, s),
                                contiguous(biases, s)};
  if (act != ACT_DEFAULT && act != ACT_FLOAT && act != ACT_INT16)
    throw std::invalid_argument("quantized_matmul: activations must be -1, 0 or 1");
  return mx::array(shape, mx::float32, std::make_shared<QuantMatmul>(s, group, bits, act),
                   std::move(ins));
}

}  // namespace

void define_quant(nb::module_& m) {
  m.def("quantized_matmul", &quantized_matmul, nb::arg("x"), nb::arg("w"), nb::arg("scales"),
        nb::arg("biases"), nb::arg("group_size"), nb::arg("bits"), nb::arg("activations") = -1,
        "x @ dequantize(w, scales, biases).T for MLX's affine 4- or 8-bit weights (x float32; "
        "group_size 32, 64 or 128), the weights read once for all rows. activations: how a "
        "4-bit product takes x: 1 rounded to 16 bits per block of 32, 0 in float, -1 the "
        "process's choice (APPLIANCE_QUANT_ACT).");
  m.def("dequantize_blocked", &dequantize_blocked, nb::arg("w"), nb::arg("scales"),
        nb::arg("biases"), nb::arg("group_size"), nb::arg("bits"),
        "dequantize(w, scales, biases) as float32 [N, K], each row's K in the kernel's block "
        "order (block_order permutes x to match); the pool's "
        "threads share the rows.");
  m.def("block_order", &block_order, nb::arg("x"), nb::arg("bits"),
        "x with its last axis in dequantize_blocked's order for bits-wide weights.");
  m.def("quant_simd", [] { return std::string(simd_name()); },
        "The instruction set the quantized kernel runs: avx512, avx2 or portable.");
  m.def("quant_activations", [] { return std::string(act_name(4)); },
        "How 4-bit products take x by default: int16 (rounded per block of 32; AVX2 and "
        "AVX-512) or float (portable, or APPLIANCE_QUANT_ACT=float); 8-bit products always "
        "take it in float.");
  m.def("quant_threads", [] { return QuantPool::get().threads(); },
        "Threads a big quantized product is split across (APPLIANCE_QUANT_THREADS).");
}
