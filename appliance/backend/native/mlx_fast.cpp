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
// This file defines them as MLX primitives with a vectorised exp (GCC vector extensions).
// Their loops are in fast_loops.inc, compiled for the baseline in fast_loops.cpp and for AVX2
// and AVX-512 in fast_avx2.cpp and fast_avx512.cpp; fast_loops::loops() is the variant the
// native code's one choice names (simd.h: the processor's widest, or the `simd` setting's):
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

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

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
#include "fast_loops.h"
#include "staging.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

using fast_loops::loops;

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
        loops().softmax_rows(src + r0 * n, dst + r0 * n, r0, r1 - r0, n, causal);
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
        if (e > s) loops().silu_mul_span(pa + s, pb + s, py + s, e - s);
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
        loops().rms_norm_rows(src + r0 * n, pw, dst + r0 * n, r1 - r0, n, eps);
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

constexpr int64_t ATTENTION_SPLIT = 1 << 14;  // elements of keys read (see attend)

using fast_kernels::Strided;
using fast_kernels::NO_MASK;
using fast_kernels::BOOL_MASK;
using fast_kernels::ADD_MASK;

using fast_kernels::strided;

void attend(const Strided& q, const Strided& k, const Strided& v, const Strided& m, int kind,
            float* o, int64_t b_len, int64_t kv_len, int64_t rep, int64_t l_len, int64_t d,
            float scale, int64_t causal = -1) {
  // The units shared with the quantized products' threads, but for a short context's few.
  const auto heads = [&](int64_t u0, int64_t u1) {
    (k.half ? loops().heads_half : loops().heads)(
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
  loops().rms_norm_rows(src, pw, dst, rows, n, eps);
}

void silu_mul_span(const float* a, const float* b, float* y, int64_t n) {
  loops().silu_mul_span(a, b, y, n);
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
