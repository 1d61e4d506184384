// mlx_fast: four MLX operations for the CPU whose built-in forms are slow there.
//
// MLX's CPU backend computes exp, sigmoid and every other transcendental function one
// element at a time (its SIMD types have one lane on x86): about 14 ns an element for exp,
// 18 for sigmoid, against numpy's 0.6. In a transformer that is the softmax of attention and
// the SiLU of the MLP. On the SmolLM-135M shape (2 cores, fp32) they were 1.7 s of a
// 2.3 s, 512-token prefill: attention's softmax over 9 x 512 x 512 scores a layer, and SiLU
// over 512 x 1536 activations a layer. A decode step spends less there (its scores are one
// row per head), but the softmax still grows with the context.
//
// This file defines them as MLX primitives with a vectorised exp (GCC vector extensions;
// the softmax and SwiGLU loops are compiled for AVX-512, AVX2 with FMA and the baseline,
// and the loader picks what the processor runs: see HOT):
//  - softmax(x, causal): over the last axis, float32; a row that is all -inf gives zeros
//    (the attention rows of left padding, which attend to nothing), never NaN; with causal,
//    attention's causal mask applied as it reads (no masked copy of the scores);
//  - silu_mul(a, b): a * sigmoid(a) * b, float32, same shapes (SwiGLU's gate);
//  - rope(x, ...) and rms_norm(x, w, eps): mx.fast.rope's and mx.fast.rms_norm's
//    arithmetic, which MLX has no CPU kernels for (see Rope and RmsNorm);
//  - decode_attention(q, k, v, scale, mask): a decode step's attention in one node (see
//    DecodeAttention).
// They are exact to a few float32 ulps of the built-in ones (tests/engine/test_fast_ops.py).
// appliance/backend/fast_ops.py builds attention and SwiGLU from them and installs those in
// mlx-lm's model modules when MLX runs on the CPU.
//
// It is compiled against the MLX version pyproject.toml pins (CMakeLists.txt, nanobind in the
// "mlx" domain so MLX's own array type crosses the boundary) and refuses to load into
// another MLX version (fast_ops.py compares mlx_version).

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "mlx/version.h"
// mlx/backend/cpu/encoder.h is MLX's private header: it is read only from the versions this
// file was checked with; another MLX builds the package without this extension (the pure
// path), never a library that breaks at run time.
#if !defined(MLX_VERSION_NUMERIC) || MLX_VERSION_NUMERIC < 29000 || MLX_VERSION_NUMERIC >= 33000
#error "appliance mlx_fast: checked with MLX 0.29 to 0.32 only (mlx/backend/cpu/encoder.h)"
#endif
#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/transforms.h"
#include "mlx/utils.h"
#include "fast_kernels.h"
#include "lane_sums.h"
#include "staging.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

// Function multi-versioning: one copy of a hot loop per instruction set, chosen when the
// library loads (an ifunc), so a build on one processor runs on any other x86-64. The
// helpers above are always inlined into each copy, so they too use its instructions.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HOT __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define HOT
#endif
#define FORCE_INLINE inline __attribute__((always_inline))

constexpr int LANES = 16;
typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));

FORCE_INLINE vf splat(float v) { return vf{} + v; }

FORCE_INLINE vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

FORCE_INLINE void store(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

// exp of 16 floats: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-6 polynomial
// (Cephes' expf coefficients), 2^n by building the exponent bits. Below -87.3 (the smallest
// normal) the result is 0, which is what a masked (-inf) attention score must give.
FORCE_INLINE vf vexp(vf x) {
  const vf lo = splat(-87.3365478515625f), hi = splat(88.3762626647949f);
  const vi under = x < lo;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  vf t = x * 1.44269504088896341f + magic;
  vf n = t - magic;
  vf r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  vi ti;
  std::memcpy(&ti, &t, sizeof(ti));
  vi bits = ((ti - 0x4B400000) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  vf out = p * scale;
  vi oi;
  std::memcpy(&oi, &out, sizeof(oi));
  oi = under ? 0 : oi;
  std::memcpy(&out, &oi, sizeof(out));
  return out;
}

FORCE_INLINE float sexp(float x) {  // the same arithmetic for one element (row tails)
  float buf[LANES] = {x};
  vf v = vexp(load(buf));
  return v[0];
}

// x's lanes at and past `limit` (of the 16 from j) as -inf: what a causal mask puts there.
FORCE_INLINE vf load_below(const float* p, int64_t j, int64_t limit) {
  vf v = load(p + j);
  if (j + LANES <= limit) return v;
  vi lane;
  for (int l = 0; l < LANES; l++) lane[l] = l;
  return (lane + static_cast<int32_t>(j)) < static_cast<int32_t>(limit) ? v : splat(-INFINITY);
}

// Softmax of `rows` rows of n, the first of them row `first` of the whole array. causal > 0:
// row r sees only its first n - causal + 1 + r % causal columns (the rows are queries
// causal at a time, the last causal positions of the keys; attention's causal mask), and
// the rest is 0. The numbers are those of the rest set to -inf first, bit for bit: the sums
// run over the same lanes in the same order, and a masked lane adds an exact 0.
HOT void softmax_rows(const float* x, float* y, int64_t first, int64_t rows, int64_t n,
                  int64_t causal) {
  const int64_t nv = n - n % LANES;
  for (int64_t row = 0; row < rows; row++) {
    const float* xr = x + row * n;
    float* yr = y + row * n;
    const int64_t limit = causal > 0 ? n - causal + 1 + (first + row) % causal : n;
    const int64_t seen = std::min(nv, (limit + LANES - 1) / LANES * LANES);  // vectors read
    vf mv = splat(-INFINITY);
    int64_t j = 0;
    for (; j < seen; j += LANES) {
      vf v = load_below(xr, j, limit);
      mv = v > mv ? v : mv;
    }
    float m = -INFINITY;
    for (int l = 0; l < LANES; l++) m = mv[l] > m ? mv[l] : m;
    for (j = nv; j < std::min(n, limit); j++) m = xr[j] > m ? xr[j] : m;
    if (m == -INFINITY) {  // nothing to attend to: zeros, not 0/0
      std::memset(yr, 0, n * sizeof(float));
      continue;
    }
    vf sv = splat(0.0f);
    for (j = 0; j < seen; j += LANES) {
      vf e = vexp(load_below(xr, j, limit) - m);
      store(yr + j, e);
      sv += e;
    }
    if (seen < nv) std::memset(yr + seen, 0, (nv - seen) * sizeof(float));
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += sv[l];
    for (j = nv; j < n; j++) {
      yr[j] = j < limit ? sexp(xr[j] - m) : 0.0f;
      s += yr[j];
    }
    const float inv = 1.0f / s;
    for (j = 0; j < seen; j += LANES) store(yr + j, load(yr + j) * inv);
    for (j = nv; j < n; j++) yr[j] *= inv;
  }
}

HOT void silu_mul_span(const float* a, const float* b, float* y, int64_t n) {
  const int64_t nv = n - n % LANES;
  int64_t j = 0;
  for (; j < nv; j += LANES) {
    vf av = load(a + j);
    store(y + j, av * load(b + j) / (1.0f + vexp(-av)));
  }
  for (; j < n; j++) y[j] = a[j] * b[j] / (1.0f + sexp(-a[j]));
}

HOT void rms_norm_rows(const float* src, const float* pw, float* dst, int64_t rows, int64_t n,
                       float eps) {
  const int64_t nv = n - n % LANES;
  for (int64_t r = 0; r < rows; r++) {
    const float* xr = src + r * n;
    float* yr = dst + r * n;
    vf acc = splat(0.0f);
    int64_t j = 0;
    for (; j < nv; j += LANES) {
      vf v = load(xr + j);
      acc += v * v;
    }
    float ss = 0.0f;
    for (int l = 0; l < LANES; l++) ss += acc[l];
    for (; j < n; j++) ss += xr[j] * xr[j];
    const float scale = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
    for (j = 0; j < nv; j += LANES) store(yr + j, (load(xr + j) * scale) * load(pw + j));
    for (; j < n; j++) yr[j] = (xr[j] * scale) * pw[j];
  }
}

constexpr int64_t SPLIT = 1 << 18;
// Elements above which the work is shared with the quantized products' pool (the CPU
// stream runs one operation at a time, so the other cores are otherwise idle here); the pool
// is sized from the cores this process may run on (quant_threads), not a fixed two.

template <class F>
void in_parts(int64_t units, int64_t unit_size, const F& f) {
  if (units < 2 || units * unit_size < SPLIT) {
    f(0, units);
    return;
  }
  fast_kernels::parallel(units, f);  // each unit once, whatever the split: the same bits
}

void require(const mx::array& a, const char* what) {
  if (a.dtype() != mx::float32) throw std::invalid_argument(std::string(what) + ": float32 only");
}

// Allocates `out`, registers the inputs and the output with the CPU stream's encoder, and
// runs body(inputs, out) on that stream, every input row-contiguous (staging.h).
template <class Body>
void on_cpu(mx::Stream stream, const std::vector<mx::array>& inputs, mx::array& out, Body body) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream);
  staging::Staged staged = staging::stage(enc, inputs);
  enc.set_output_array(out);
  enc.dispatch([staged = std::move(staged), out = mx::array::unsafe_weak_copy(out),
                body]() mutable {
    staged.fill();
    body(staged.ins, out);
  });
}

using Arrays = std::vector<mx::array>;

class Softmax : public mx::UnaryPrimitive {
 public:
  Softmax(mx::Stream s, int64_t causal) : mx::UnaryPrimitive(s), causal_(causal) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const int64_t causal = causal_;
    on_cpu(stream(), inputs, out, [causal](Arrays& in, mx::array& out) {
      const mx::array& x = in[0];
      const int64_t n = x.ndim() ? x.shape(-1) : 1;
      const int64_t rows = n ? static_cast<int64_t>(x.size()) / n : 0;
      const float* src = x.data<float>();
      float* dst = out.data<float>();
      in_parts(rows, n, [&](int64_t r0, int64_t r1) {
        softmax_rows(src + r0 * n, dst + r0 * n, r0, r1 - r0, n, causal);
      });
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("appliance softmax runs on the CPU only");
  }
  const char* name() const override { return "ApplianceSoftmax"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return causal_ == static_cast<const Softmax&>(other).causal_;
  }

 private:
  int64_t causal_;
};

class SiluMul : public mx::UnaryPrimitive {
 public:
  explicit SiluMul(mx::Stream s) : mx::UnaryPrimitive(s) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    on_cpu(stream(), inputs, out, [](Arrays& in, mx::array& out) {
      const int64_t n = static_cast<int64_t>(out.size());
      const int64_t block = 4096;
      const float* pa = in[0].data<float>();
      const float* pb = in[1].data<float>();
      float* py = out.data<float>();
      in_parts((n + block - 1) / block, block, [&](int64_t u0, int64_t u1) {
        const int64_t s = u0 * block, e = std::min(n, u1 * block);
        if (e > s) silu_mul_span(pa + s, pb + s, py + s, e - s);
      });
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("appliance silu_mul runs on the CPU only");
  }
  const char* name() const override { return "ApplianceSiluMul"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

// RMSNorm, as mx.fast.rms_norm computes it: y = (x * rsqrt(mean(x^2) + eps)) * w over the
// last axis. MLX has no CPU kernel for it either: its fallback is 13 operations, 67 us a
// call here, 61 calls a decode step.
class RmsNorm : public mx::UnaryPrimitive {
 public:
  RmsNorm(mx::Stream s, float eps) : mx::UnaryPrimitive(s), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    on_cpu(stream(), inputs, out, [eps = eps_](Arrays& in, mx::array& out) {
      const mx::array& x = in[0];
      const mx::array& w = in[1];
      const int64_t n = x.shape(-1);
      const int64_t rows = n ? static_cast<int64_t>(x.size()) / n : 0;
      const float* src = x.data<float>();
      const float* pw = w.data<float>();
      float* dst = out.data<float>();
      in_parts(rows, n, [&](int64_t r0, int64_t r1) {
        rms_norm_rows(src + r0 * n, pw, dst + r0 * n, r1 - r0, n, eps);
      });
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("appliance rms_norm runs on the CPU only");
  }
  const char* name() const override { return "ApplianceRmsNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RmsNorm&>(other).eps_;
  }

 private:
  float eps_;
};

// RoPE of x [b_len, heads, t_len, d] into y: see Rope.
void rope_apply(const float* src, float* dst, int64_t b_len, int64_t heads, int64_t t_len,
                int64_t d, int dims, bool traditional, float scale, const int32_t* off,
                bool per_row, const float* freq) {
  const int64_t half = dims / 2;
  // One row of cos and sin per (batch row, position), shared by every head.
  std::vector<float> cs(static_cast<size_t>(b_len * t_len * half * 2));
  for (int64_t b = 0; b < b_len; b++) {
    const int32_t o = off[per_row ? b : 0];
    for (int64_t t = 0; t < t_len; t++) {
      const float pos = static_cast<float>(o + t) * scale;
      float* row = cs.data() + (b * t_len + t) * half * 2;
      for (int64_t i = 0; i < half; i++) {
        const float theta = pos * freq[i];
        row[i] = std::cos(theta);
        row[half + i] = std::sin(theta);
      }
    }
  }
  // Vectors of D features: batch row b, head h, position t is vector (b * heads + h) * T + t.
  in_parts(b_len * heads * t_len, d, [&](int64_t v0, int64_t v1) {
    for (int64_t v = v0; v < v1; v++) {
      const int64_t t = v % t_len, b = v / (heads * t_len);
      const float* c = cs.data() + (b * t_len + t) * half * 2;
      const float* sn = c + half;
      const float* xv = src + v * d;
      float* yv = dst + v * d;
      if (traditional) {
        for (int64_t i = 0; i < half; i++) {
          const float x1 = xv[2 * i], x2 = xv[2 * i + 1];
          yv[2 * i] = x1 * c[i] - x2 * sn[i];
          yv[2 * i + 1] = x1 * sn[i] + x2 * c[i];
        }
      } else {
        for (int64_t i = 0; i < half; i++) {
          const float x1 = xv[i], x2 = xv[half + i];
          yv[i] = x1 * c[i] - x2 * sn[i];
          yv[half + i] = x1 * sn[i] + x2 * c[i];
        }
      }
      for (int64_t i = 2 * half; i < d; i++) yv[i] = xv[i];
    }
  });
}

// RoPE, as mx.fast.rope computes it (MLX has no CPU kernel for it: its fallback is some
// fifteen operations, 140 us a call here, 60 calls a decode step of the SmolLM-135M shape).
// x is [B, ..., T, D] (row-contiguous, at least 3 axes; the axes between the first and the
// last two are heads); position t of batch row b is (offset_b + t) * scale, offset a scalar
// or one per batch row; angle = position * inv_freq[i] for the first `dims` features, in
// halves (x[i], x[i + dims/2]) or, `traditional`, in pairs (x[2i], x[2i + 1]); the features
// past `dims` are copied.
class Rope : public mx::UnaryPrimitive {
 public:
  Rope(mx::Stream s, int dims, bool traditional, float scale)
      : mx::UnaryPrimitive(s), dims_(dims), traditional_(traditional), scale_(scale) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    on_cpu(stream(), inputs, out, [dims = dims_, traditional = traditional_,
                                           scale = scale_](Arrays& in, mx::array& out) {
      const mx::array& x = in[0];
      const mx::array& offsets = in[1];
      const int64_t d = x.shape(-1), t_len = x.shape(-2), b_len = x.shape(0);
      const int64_t heads = static_cast<int64_t>(x.size()) / (b_len * t_len * d);
      rope_apply(x.data<float>(), out.data<float>(), b_len, heads, t_len, d, dims, traditional,
                 scale, offsets.data<int32_t>(), offsets.size() > 1, in[2].data<float>());
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("appliance rope runs on the CPU only");
  }
  const char* name() const override { return "ApplianceRope"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Rope&>(other);
    return dims_ == o.dims_ && traditional_ == o.traditional_ && scale_ == o.scale_;
  }

 private:
  int dims_;
  bool traditional_;
  float scale_;
};

// The sum of a vector's lanes, halves folded onto halves: a fixed order in a few steps
// (a lane-by-lane sum is a chain of sixteen dependent additions, per key of the cache).
FORCE_INLINE float hsum(vf v) {
  float a[LANES];
  store(a, v);
  for (int w = LANES / 2; w > 0; w /= 2)
    for (int l = 0; l < w; l++) a[l] += a[l + w];
  return a[0];
}

constexpr int64_t ATTENTION_SPLIT = 1 << 14;  // elements of keys read (see attend)

using fast_kernels::Strided;
using fast_kernels::NO_MASK;
using fast_kernels::BOOL_MASK;
using fast_kernels::ADD_MASK;

using fast_kernels::strided;

constexpr int64_t KEY_BLOCK = 64;  // value positions a pass reads for every head (.inc)

// Keys and values are read through a loader L: L::at gives 16 elements as floats, L::one
// one (L::T: float, or float16's bits for a cache kept in 16 bits). attention_heads.inc holds
// the loop, compiled here for the fast ops' clones and, for a float16 cache, once more per
// instruction set below (F16C's conversions are intrinsics, which `target_clones` code
// cannot call).
struct LoadF32 {
  typedef float T;
  static FORCE_INLINE vf at(const float* p) { return load(p); }
  static FORCE_INLINE float one(const float* p) { return *p; }
};

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

#include "attention_heads.inc"

HOT void decode_attention_heads(const Strided& q, const Strided& k, const Strided& v,
                                const Strided& m, int kind, float* out, int64_t u0, int64_t u1,
                                int64_t kv_len, int64_t rep, int64_t keys_len, int64_t d,
                                float scale, int64_t causal) {
  heads_body<LoadF32>(q, k, v, m, kind, out, u0, u1, kv_len, rep, keys_len, d, scale, causal);
}

HOT void decode_attention_heads_half(const Strided& q, const Strided& k, const Strided& v,
                                     const Strided& m, int kind, float* out, int64_t u0,
                                     int64_t u1, int64_t kv_len, int64_t rep, int64_t keys_len,
                                     int64_t d, float scale, int64_t causal) {
  heads_body<LoadHalf>(q, k, v, m, kind, out, u0, u1, kv_len, rep, keys_len, d, scale, causal);
}

typedef void (*heads_fn)(const Strided&, const Strided&, const Strided&, const Strided&, int,
                         float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                         int64_t);

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
namespace avx512 {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma,f16c")
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
#include "attention_heads.inc"
void heads_half(const Strided& q, const Strided& k, const Strided& v, const Strided& m, int kind,
                float* out, int64_t u0, int64_t u1, int64_t kv_len, int64_t rep,
                int64_t keys_len, int64_t d, float scale, int64_t causal) {
  heads_body<LoadHalf>(q, k, v, m, kind, out, u0, u1, kv_len, rep, keys_len, d, scale, causal);
}
#pragma GCC pop_options
}  // namespace avx512

namespace avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
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
#include "attention_heads.inc"
void heads_half(const Strided& q, const Strided& k, const Strided& v, const Strided& m, int kind,
                float* out, int64_t u0, int64_t u1, int64_t kv_len, int64_t rep,
                int64_t keys_len, int64_t d, float scale, int64_t causal) {
  heads_body<LoadHalf>(q, k, v, m, kind, out, u0, u1, kv_len, rep, keys_len, d, scale, causal);
}
#pragma GCC pop_options
}  // namespace avx2
#endif

// A float16 cache's attention for the quantized kernels' instruction set (APPLIANCE_SIMD): the
// same sums in each, its elements converted as they are loaded.
heads_fn half_heads() {
  static const heads_fn chosen = []() -> heads_fn {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    const int simd = fast_kernels::simd_level();
    if (simd == 2) return avx512::heads_half;
    if (simd == 1) return avx2::heads_half;
#endif
    return decode_attention_heads_half;
  }();
  return chosen;
}

void attend(const Strided& q, const Strided& k, const Strided& v, const Strided& m, int kind,
            float* o, int64_t b_len, int64_t kv_len, int64_t rep, int64_t l_len, int64_t d,
            float scale, int64_t causal = -1) {
  // The units shared with the quantized products' threads, but for a short context's few.
  const auto heads = [&](int64_t u0, int64_t u1) {
    (k.half ? half_heads() : decode_attention_heads)(
        q, k, v, m, kind, o, u0, u1, kv_len, rep, l_len, d, scale, causal);
  };
  const int64_t units = b_len * kv_len;
  if (units < 2 || units * l_len * d < ATTENTION_SPLIT) heads(0, units);
  else fast_kernels::parallel(units, heads);
}

// Attention of one query position per row, a decode step's: softmax(q k^T * scale + mask) v
// for q [B, H, 1, D] and k, v [B, KV, L, D] (H a multiple of KV), read where they lie: the
// cache's keys and values are views of its buffers, so the composed form's scale, reshape,
// transpose, two products and softmax (seven graph nodes a layer) are one here. The mask
// (none, boolean or additive float32) is read by its own strides, broadcast to [B, H, 1, L].
// Each (row, head) is summed in one fixed order, so a row's numbers do not depend on the
// batch; a row with nothing to attend to gives zeros (as softmax_rows).
class DecodeAttention : public mx::UnaryPrimitive {
 public:
  DecodeAttention(mx::Stream s, float scale, int kind)
      : mx::UnaryPrimitive(s), scale_(scale), kind_(kind) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    // Views are read by their strides; only one whose last axis is not contiguous is copied.
    staging::Staged staged = staging::stage(enc, inputs, [](const mx::array& a) {
      return a.ndim() == 0 || a.strides().back() == 1 || a.shape(-1) == 1;
    });
    enc.set_output_array(out);
    enc.dispatch([staged = std::move(staged), out = mx::array::unsafe_weak_copy(out),
                  scale = scale_, kind = kind_]() mutable {
      staged.fill();
      const auto& direct = staged.ins;
      const mx::array &q = direct[0], &k = direct[1], &v = direct[2];
      const int64_t b_len = q.shape(0), kv_len = k.shape(1), d = q.shape(3);
      const int64_t rep = q.shape(1) / kv_len, l_len = k.shape(2);
      const Strided sq = strided(q), sk = strided(k), sv = strided(v);
      const Strided sm = kind == NO_MASK ? Strided{nullptr, {0, 0, 0, 0}} : strided(direct[3]);
      attend(sq, sk, sv, sm, kind, out.data<float>(), b_len, kv_len, rep, l_len, d, scale);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("appliance decode_attention runs on the CPU only");
  }
  const char* name() const override { return "ApplianceDecodeAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const DecodeAttention&>(other);
    return scale_ == o.scale_ && kind_ == o.kind_;
  }

 private:
  float scale_;
  int kind_;
};

mx::Stream cpu_stream() { return mx::to_stream({}, mx::Device::cpu); }

mx::array softmax(const mx::array& x, int64_t causal) {
  require(x, "softmax");
  if (causal < 0 || (causal > 0 && (x.ndim() < 2 || x.shape(-2) % causal || causal > x.shape(-1))))
    throw std::invalid_argument(
        "softmax: causal must be 0 or divide the rows of the last two axes, at most its columns");
  auto s = cpu_stream();
  return mx::array(x.shape(), mx::float32, std::make_shared<Softmax>(s, causal), {x});
}

mx::array silu_mul(const mx::array& a, const mx::array& b) {
  require(a, "silu_mul");
  require(b, "silu_mul");
  if (a.shape() != b.shape()) throw std::invalid_argument("silu_mul: shapes differ");
  auto s = cpu_stream();
  return mx::array(a.shape(), mx::float32, std::make_shared<SiluMul>(s), {a, b});
}

mx::array rms_norm(const mx::array& x, const std::optional<mx::array>& weight, float eps) {
  require(x, "rms_norm");
  if (x.ndim() < 1 || x.shape(-1) < 1) throw std::invalid_argument("rms_norm: empty last axis");
  auto s = cpu_stream();
  mx::array w = weight ? mx::astype(*weight, mx::float32, s) : mx::ones({x.shape(-1)}, mx::float32, s);
  if (w.ndim() != 1 || w.shape(0) != x.shape(-1))
    throw std::invalid_argument("rms_norm: weight must have the last axis's size");
  return mx::array(x.shape(), mx::float32, std::make_shared<RmsNorm>(s, eps), {x, w});
}

mx::array decode_attention(const mx::array& q, const mx::array& k, const mx::array& v,
                           float scale, const std::optional<mx::array>& mask) {
  require(q, "decode_attention");
  if (k.dtype() != v.dtype() || (k.dtype() != mx::float32 && k.dtype() != mx::float16))
    throw std::invalid_argument("decode_attention: k and v both float32 or both float16");
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4 || q.shape(2) != 1)
    throw std::invalid_argument("decode_attention: q [B, H, 1, D], k and v [B, KV, L, D]");
  if (k.shape() != v.shape() || k.shape(0) != q.shape(0) || k.shape(3) != q.shape(3) ||
      k.shape(1) == 0 || q.shape(1) % k.shape(1))
    throw std::invalid_argument("decode_attention: k and v [B, KV, L, D], H a multiple of KV");
  auto s = cpu_stream();
  std::vector<mx::array> ins = {q, k, v};
  int kind = NO_MASK;
  if (mask) {
    const mx::array& m = *mask;
    if (m.dtype() != mx::bool_ && m.dtype() != mx::float32)
      throw std::invalid_argument("decode_attention: the mask is boolean or float32");
    const std::vector<int> want = {q.shape(0), q.shape(1), 1, k.shape(2)};
    bool fits = m.ndim() >= 1 && m.ndim() <= 4;
    for (int i = 0; fits && i < static_cast<int>(m.ndim()); i++) {
      const int n = m.shape(i), w = want[4 - m.ndim() + i];
      fits = n == w || n == 1;
    }
    if (!fits || m.shape(-1) != k.shape(2))
      throw std::invalid_argument("decode_attention: the mask must broadcast to [B, H, 1, L]");
    kind = m.dtype() == mx::bool_ ? BOOL_MASK : ADD_MASK;
    ins.push_back(m);
  }
  return mx::array(q.shape(), mx::float32, std::make_shared<DecodeAttention>(s, scale, kind), ins);
}

// exp(-i * log(base) / half) for i < half, computed by MLX's own operations (as its
// fallback does, so the bits agree) once per (half, base) and kept.
mx::array base_inv_freq(int half, float base) {
  static std::mutex lock;
  // Never freed: a static's destructor would run after MLX's allocator is gone.
  static auto& made = *new std::map<std::pair<int, float>, mx::array>();
  std::lock_guard<std::mutex> hold(lock);
  auto it = made.find({half, base});
  if (it != made.end()) return it->second;
  auto s = cpu_stream();
  const float step = static_cast<float>(std::log(static_cast<double>(base)) / half);
  auto inv = mx::exp(mx::multiply(mx::arange(0.0, -half, -1.0, mx::float32, s),
                                  mx::array(step, mx::float32), s), s);
  mx::eval(inv);
  made.emplace(std::make_pair(half, base), inv);
  return inv;
}

// inv_freq as MLX's fallback computes it: exp(-i * log(base) / (dims / 2)), or 1 / freqs.
mx::array rope(const mx::array& x, int dims, bool traditional, std::optional<float> base,
               float scale, const mx::array& offset, const std::optional<mx::array>& freqs) {
  require(x, "rope");
  if (x.ndim() < 3) throw std::invalid_argument("rope: at least 3 axes");
  if (dims <= 0 || dims % 2 || dims > x.shape(-1))
    throw std::invalid_argument("rope: dims must be even and at most the last axis");
  if (base.has_value() == freqs.has_value())
    throw std::invalid_argument("rope: exactly one of base and freqs");
  if (offset.size() != 1 && (offset.ndim() != 1 || offset.shape(0) != x.shape(0)))
    throw std::invalid_argument("rope: offset is a scalar or one per batch row");
  auto s = cpu_stream();
  const int half = dims / 2;
  mx::array inv = mx::array(0.0f);
  if (freqs) {
    if (freqs->ndim() != 1 || freqs->shape(0) != half)
      throw std::invalid_argument("rope: freqs must have dims / 2 elements");
    inv = mx::reciprocal(mx::astype(*freqs, mx::float32, s), s);
  } else {
    inv = base_inv_freq(half, *base);
  }
  auto off = offset.is_available() && offset.ndim() <= 1 && offset.dtype() == mx::int32
                 ? offset
                 : mx::astype(mx::reshape(offset, {-1}, s), mx::int32, s);
  return mx::array(x.shape(), mx::float32, std::make_shared<Rope>(s, dims, traditional, scale),
                   {x, off, inv});
}

}  // namespace

namespace fast_kernels {

void rms_norm_rows(const float* src, const float* pw, float* dst, int64_t rows, int64_t n,
                   float eps) {
  ::rms_norm_rows(src, pw, dst, rows, n, eps);
}

void silu_mul_span(const float* a, const float* b, float* y, int64_t n) {
  ::silu_mul_span(a, b, y, n);
}

void rope_apply(const float* x, float* y, int64_t b_len, int64_t heads, int64_t t_len, int64_t d,
                int dims, bool traditional, float scale, const int32_t* off, bool per_row,
                const float* inv) {
  ::rope_apply(x, y, b_len, heads, t_len, d, dims, traditional, scale, off, per_row, inv);
}

void decode_attention(const Strided& q, const Strided& k, const Strided& v, const Strided& m,
                      int kind, float* out, int64_t b_len, int64_t kv_len, int64_t rep,
                      int64_t l_len, int64_t d, float scale, int64_t causal) {
  ::attend(q, k, v, m, kind, out, b_len, kv_len, rep, l_len, d, scale, causal);
}

mx::array rope_inv_freq(int half, float base) { return ::base_inv_freq(half, base); }

Strided strided(const mx::array& a) {
  Strided s{a.data<char>(), {0, 0, 0, 0}, a.dtype() == mx::float16};
  const int nd = static_cast<int>(a.ndim());
  for (int i = 0; i < nd; i++)
    s.st[4 - nd + i] = a.shape(i) == 1 ? 0 : static_cast<int64_t>(a.strides()[i]);
  return s;
}

}  // namespace fast_kernels

void define_quant(nb::module_& m);  // quant_matmul.cpp
void define_layer(nb::module_& m);  // decode_layer.cpp

NB_MODULE(_mlx_fast, m) {
  m.doc() = "Vectorised softmax, SwiGLU gate, RoPE and RMSNorm for MLX on the CPU (appliance/backend/native/mlx_fast.cpp)";
  m.def("softmax", &softmax, nb::arg("x"), nb::arg("causal") = 0,
        "Softmax over the last axis (float32; all -inf rows give 0). causal > 0: row r sees its "
        "first n - causal + 1 + r % causal columns only (attention's causal mask; the rest 0).");
  m.def("silu_mul", &silu_mul, nb::arg("a"), nb::arg("b"), "a * sigmoid(a) * b (float32).");
  m.def("rope", &rope, nb::arg("x"), nb::arg("dims"), nb::arg("traditional"), nb::arg("base").none(),
        nb::arg("scale"), nb::arg("offset"), nb::arg("freqs").none(),
        "mx.fast.rope's arithmetic (float32; offset an int32 array: one, or one per batch row).");
  m.def("decode_attention", &decode_attention, nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("scale"), nb::arg("mask").none(),
        "softmax(q k^T * scale + mask) v for one query position: q [B, H, 1, D], k and v "
        "[B, KV, L, D] (views read in place; float32, or both float16), mask None, boolean "
        "or float32 broadcast to [B, H, 1, L] (float32).");
  m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("weight").none(), nb::arg("eps"),
        "mx.fast.rms_norm's arithmetic over the last axis (float32).");
  define_quant(m);
  define_layer(m);
  m.attr("mlx_version") = std::string(mx::version());
}
