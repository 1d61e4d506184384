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
// AVX-512, AVX2 with FMA and the baseline; the one the native code's choice names runs
// (simd.h: the processor's widest, or the `simd` setting's). FMA makes the variants agree to
// rounding, not to the bit.
//
// Big products are split by output columns across the native code's one pool (pool.h),
// whose threads claim blocks of columns from a shared counter.
//
// Products of many rows (a prompt's) are better done by a gemm: dequantize_blocked (below)
// writes the weights out in float32 for one, and appliance/backend/quant.py chooses.
//
// The loops themselves are in quant_kernels.h, compiled for each instruction set in a file of
// its own (quant_avx2.cpp, quant_avx512.cpp; the baseline's here), so the build compiles
// them side by side; this file chooses among them (simd.h) and holds MLX's primitives. The
// layouts made for them (x rounded, tiles untiled) are in quant_layout.h, free of MLX, so
// tests/native/quant_int16_sanitize.cpp runs them under the sanitizers too.

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "fast_kernels.h"
#include "pool.h"
#include "quant_kernels.h"
#include "quant_layout.h"
#include "simd.h"
#include "staging.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace quant_kernels;

namespace {

// The baseline's variants (2 rows in registers; the others' counts are in their files).
template <int BITS, int LPG, class S>
void columns_portable(const QArgs& a, int64_t n0, int64_t n1) {
  columns_body<BITS, LPG, S, 2>(a, n0, n1);
}

template <int LPG, class S>
__attribute__((flatten)) void columns_i16_portable(const QArgs& a, int64_t n0, int64_t n1) {
  columns_i16_body<LPG, S, I16Portable>(a, n0, n1);
}

template <int BITS, int LPG, class S>
void dequant_portable(const QArgs& a, int64_t n0, int64_t n1) {
  dequant_body<BITS, LPG, S>(a, n0, n1);
}

struct PortableColumns {
  template <int BITS, int LPG, class S>
  static columns_fn get() { return columns_portable<BITS, LPG, S>; }
};
struct PortableColumnsI16 {
  template <int BITS, int LPG, class S>
  static columns_fn get() { return columns_i16_portable<LPG, S>; }
};
template <class S, int BITS>
__attribute__((flatten)) void tiled_portable(const QArgs& a, int64_t n0, int64_t n1) {
  tiled_body<S, TPortable, BITS>(a, n0, n1);
}

struct PortableTiled {
  template <int BITS, int LPG, class S>
  static columns_fn get() { return tiled_portable<S, BITS>; }
};
struct PortableDequant {
  template <int BITS, int LPG, class S>
  static columns_fn get() { return dequant_portable<BITS, LPG, S>; }
};

enum Simd {
  PORTABLE = APPLIANCE_SIMD_PORTABLE,
  AVX2 = APPLIANCE_SIMD_AVX2,
  AVX512 = APPLIANCE_SIMD_AVX512
};

// The native code's one choice (simd.h): the processor's widest, or the `simd` setting's.
Simd simd() { return static_cast<Simd>(appliance_simd_level()); }

Scales scales_of(mx::Dtype dtype) {
  if (dtype == mx::float16) return SCALES_F16;
  if (dtype == mx::bfloat16) return SCALES_BF16;
  return SCALES_F32;
}

// Lanes of a block that share a weight group's scale (a block has 16 lanes).
int lanes_per_group(int bits, int group) { return std::min(LANES, group / (32 / bits)); }

columns_fn pick(int bits, int group, mx::Dtype dtype) {
  const int lpg = lanes_per_group(bits, group);
  const Scales s = scales_of(dtype);
#if defined(__x86_64__)
  if (simd() == AVX512) return avx512_columns(bits, lpg, s);
  if (simd() == AVX2) return avx2_columns(bits, lpg, s);
#endif
  return by_bits<PortableColumns>(bits, lpg, s);
}

columns_fn pick_i16(int group, mx::Dtype dtype) {
  const int lpg = group == 32 ? 4 : group == 64 ? 8 : 16;
  const Scales s = scales_of(dtype);
#if defined(__x86_64__)
  if (appliance_simd_vnni()) return vnni_columns_i16(lpg, s);
  if (simd() != PORTABLE) return avx2_columns_i16(lpg, s);
#endif
  return by_lpg<PortableColumnsI16, 4>(lpg, s);
}

// The tiled kernel (quant_kernels.h, "Tiled 4-bit weights"; 8-bit too) for the processor.
columns_fn pick_tiled(int bits, mx::Dtype dtype) {
  const Scales s = scales_of(dtype);
#if defined(__x86_64__)
  if (appliance_simd_vnni()) return vnni_tiled(bits, s);
  if (simd() != PORTABLE) return avx2_tiled(bits, s);
#endif
  return bits == 8 ? by_scales<PortableTiled, 8, 16>(s) : by_scales<PortableTiled, 4, 16>(s);
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


// Columns [n0, n1) of one product: a piece of work for the pool.
struct Task {
  columns_fn fn;
  const QArgs* args;
  int64_t n0, n1;
  void (*unit_fn)(const void*, int64_t, int64_t) = nullptr;  // else: unit_fn(ctx, n0, n1)
  const void* ctx = nullptr;
  void run() const {
    if (unit_fn != nullptr) unit_fn(ctx, n0, n1);
    else fn(*args, n0, n1);
  }
};

// x [m, k] rounded as quantize_rows rounds it, in x's own order (the tiled kernel's): xq
// [m, k], each block's scale xs [m, k / 32], each weight group's sum xsum [m, k / group].
void round_plain_portable(const float* x, int64_t m, int64_t k, int group, int16_t* xq,
                          float* xs, float* xsum) {
  round_plain_body(x, m, k, group, xq, xs, xsum);
}

void quantize_plain(const float* x, int64_t m, int64_t k, int group, int16_t* xq, float* xs,
                    float* xsum) {
  static const round_fn variant = []() -> round_fn {
#if defined(__x86_64__)
    if (simd() == AVX512) return avx512_round_plain();
    if (simd() == AVX2) return avx2_round_plain();
#endif
    return round_plain_portable;
  }();
  variant(x, m, k, group, xq, xs, xsum);
}

void narrow_portable(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; i++) dst[i] = half_bits(src[i]);
}

// Big products are shared with the native code's one pool (pool.h): the caller and its
// helpers claim the tasks from one counter.
void run_tasks(const std::vector<Task>& tasks) {
  appliance_pool_run([](const void* c, long i) { static_cast<const Task*>(c)[i].run(); },
                     tasks.data(), static_cast<long>(tasks.size()), APPLIANCE_POOL_SHORT);
}

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
// matmul (OpenBLAS's sgemm where the daemon preloads it) to multiply. The kernel reads
// the packed weights once per few rows and blocks nothing for the cache; a gemm does, and
// the dequantizing costs one write of N * K floats (docs/decisions.md). The layout of the
// weights it writes is dequant_body's (quant_kernels.h).
columns_fn pick_dequant(int bits, int group, mx::Dtype dtype) {
  const int lpg = lanes_per_group(bits, group);
  const Scales s = scales_of(dtype);
#if defined(__x86_64__)
  if (simd() == AVX512) return avx512_dequant(bits, lpg, s);
  if (simd() == AVX2) return avx2_dequant(bits, lpg, s);
#endif
  return by_bits<PortableDequant>(bits, lpg, s);
}

// The columns of every part (products of one x, or one product) cut into tasks for the
// pool: several a thread, so a helper that is not running delays little; one thread for
// products of less than SPLIT_MIN weights in all.
// ``align``: a task's first column is a multiple of it (the tiled kernel's 16).
// Each part with its own loop (fns[p]: a tiled product's parts may differ in bits).
void run_columns(const std::vector<columns_fn>& fns, const std::vector<QArgs>& parts,
                 int64_t k, int64_t align = 1) {
  const int threads = appliance_pool_threads();
  int64_t n = 0;
  for (const auto& a : parts) n += a.n;
  if (n * k < SPLIT_MIN || threads < 2) {
    for (size_t p = 0; p < parts.size(); p++) fns[p](parts[p], 0, parts[p].n);
    return;
  }
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(n / 16, 8 * threads));
  const int64_t width = ((n + blocks - 1) / blocks + align - 1) / align * align;
  std::vector<Task> tasks;
  for (size_t p = 0; p < parts.size(); p++) {
    const QArgs& a = parts[p];
    for (int64_t n0 = 0; n0 < a.n; n0 += width)
      tasks.push_back({fns[p], &a, n0, std::min(a.n, n0 + width)});
  }
  run_tasks(tasks);
}

void run_columns(columns_fn fn, const std::vector<QArgs>& parts, int64_t k, int64_t align = 1) {
  run_columns(std::vector<columns_fn>(parts.size(), fn), parts, k, align);
}


// A CPU primitive's common start: the inputs staged (staging.h: the task calls fill()
// first), the outputs allocated, and both registered with the command encoder; ``outs``
// gets the outputs' weak copies for the task the caller dispatches.
mx::cpu::CommandEncoder& prepare(mx::Stream stream, const std::vector<mx::array>& inputs,
                                 std::vector<mx::array> outputs, staging::Staged& ins,
                                 std::vector<mx::array>& outs) {
  auto& enc = mx::cpu::get_command_encoder(stream);
  ins = staging::stage(enc, inputs);
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
    enc.set_output_array(o);
    outs.push_back(mx::array::unsafe_weak_copy(o));
  }
  return enc;
}

class BlockOrder : public mx::UnaryPrimitive {
 public:
  BlockOrder(mx::Stream s, int bits) : mx::UnaryPrimitive(s), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    staging::Staged staged;
    std::vector<mx::array> outs;
    auto& enc = prepare(stream(), inputs, {out}, staged, outs);
    enc.dispatch([staged = std::move(staged), out = outs[0], bits = bits_]() mutable {
      staged.fill();
      const mx::array& x = staged.ins[0];
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

class QuantDequant : public mx::UnaryPrimitive {
 public:
  QuantDequant(mx::Stream s, int group, int bits)
      : mx::UnaryPrimitive(s), group_(group), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    staging::Staged staged;
    std::vector<mx::array> outs;
    auto& enc = prepare(stream(), inputs, {out}, staged, outs);
    enc.dispatch([staged = std::move(staged), out = outs[0], group = group_,
                  bits = bits_]() mutable {
      staged.fill();
      const auto& ins = staged.ins;
      const int64_t n = ins[0].shape(0), words = ins[0].shape(1), k = words * 32 / bits;
      QArgs a{nullptr, 0, k, k, n, ins[0].data<uint32_t>(), words, ins[1].data<void>(),
              ins[2].data<void>(), ins[1].shape(1), group, __builtin_ctz(group),
              out.data<float>(), nullptr, nullptr, nullptr};
      run_columns(pick_dequant(bits, group, ins[1].dtype()), {a}, k);
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


class TiledDequantize : public mx::UnaryPrimitive {
 public:
  TiledDequantize(mx::Stream s, int64_t row0, int group, int bits)
      : mx::UnaryPrimitive(s), row0_(row0), group_(group), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    staging::Staged staged;
    std::vector<mx::array> outs;
    auto& enc = prepare(stream(), inputs, {out}, staged, outs);
    enc.dispatch([staged = std::move(staged), out = outs[0], row0 = row0_, group = group_,
                  bits = bits_]() mutable {
      staged.fill();
      const auto& ins = staged.ins;
      const int64_t rows = out.shape(0), k = out.shape(1);
      TiledDequant d{ins[0].data<uint8_t>(), ins[1].data<uint8_t>(), ins[2].data<uint8_t>(),
                     row0, rows, k, ins[1].shape(1), group, bits, ins[1].itemsize(),
                     pick_dequant(bits, group, ins[1].dtype()), out.data<float>()};
      const int64_t t0 = row0 / TILE, t1 = (row0 + rows + TILE - 1) / TILE;
      const int threads = appliance_pool_threads();
      if (rows * k < SPLIT_MIN || threads < 2 || t1 - t0 < 2) {
        dequant_tiled_unit(&d, t0, t1);
        return;
      }
      const int64_t per = std::max<int64_t>(1, (t1 - t0) / (8 * threads));
      std::vector<Task> tasks;
      for (int64_t t = t0; t < t1; t += per)
        tasks.push_back({nullptr, nullptr, t, std::min(t1, t + per), dequant_tiled_unit, &d});
      run_tasks(tasks);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("appliance dequantize_tiled runs on the CPU only");
  }
  const char* name() const override { return "ApplianceDequantizeTiled"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const TiledDequantize&>(other);
    return row0_ == o.row0_ && group_ == o.group_ && bits_ == o.bits_;
  }

 private:
  int64_t row0_;
  int group_, bits_;
};

// x @ W.T for one or more weights W of the same K, group and bits (q/k/v, gate/up): x is
// rounded once and the parts' columns go to the pool as one job, each part to its output.
class QuantMatmul : public mx::Primitive {
 public:
  // tiled: the parts' weights are tile()'s (4-bit, x in 16 bits), not MLX's; residual: the
  // last input is added to the (one) output once its sums are done (a layer's residual add).
  QuantMatmul(mx::Stream s, int group, int bits, int act, bool tiled = false,
              bool residual = false)
      : mx::Primitive(s), group_(group), bits_(bits), act_(act), tiled_(tiled),
        residual_(residual) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    staging::Staged staged;
    std::vector<mx::array> outs;
    auto& enc = prepare(stream(), inputs, outputs, staged, outs);
    enc.dispatch([staged = std::move(staged), outs = std::move(outs), group = group_,
                  bits = bits_, act = act_, tiled = tiled_, residual = residual_]() mutable {
      staged.fill();
      if (tiled) compute_tiled(staged.ins, outs, group, bits, residual);
      else compute(staged.ins, outs, group, bits, act);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("appliance quantized_matmul runs on the CPU only");
  }
  const char* name() const override { return "ApplianceQuantizedMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantMatmul&>(other);
    return group_ == o.group_ && bits_ == o.bits_ && act_ == o.act_ && tiled_ == o.tiled_ &&
           residual_ == o.residual_;
  }

 private:
  // in: x, then each part's tiles, scales and biases (then the residual); out: each part's
  // y [.., n].
  static void compute_tiled(std::vector<mx::array>& in, std::vector<mx::array>& out, int group,
                            int bits, bool residual) {
    const mx::array& x = in[0];
    const int64_t k = x.shape(-1);
    const int64_t m = k ? static_cast<int64_t>(x.size()) / k : 0;
    std::vector<fast_kernels::TiledWeight> ws(out.size());
    std::vector<float*> ys(out.size());
    for (size_t p = 0; p < out.size(); p++) {
      ws[p] = {in[1 + 3 * p].data<void>(), in[2 + 3 * p].data<void>(),
               in[3 + 3 * p].data<void>(), out[p].shape(-1), bits};
      ys[p] = out[p].data<float>();
    }
    fast_kernels::tiled_products(x.data<float>(), m, k, group, in[2].dtype(), ws.data(),
                                 ys.data(), static_cast<int>(out.size()),
                                 residual ? in.back().data<float>() : nullptr);
  }

  // in: x, then each part's w, scales and biases; out: each part's y.
  static void compute(std::vector<mx::array>& in, std::vector<mx::array>& out, int group,
                      int bits, int act) {
    const mx::array& x = in[0];
    const int64_t words = in[1].shape(1), groups = in[2].shape(1);
    const int64_t k = words * 32 / bits;
    const int64_t m = k ? static_cast<int64_t>(x.size()) / k : 0;
    QArgs a{nullptr, m, k, k, 0, nullptr, words, nullptr, nullptr, groups, group,
            __builtin_ctz(group), nullptr, nullptr, nullptr, nullptr};
    const I16Sizes z(k, groups);
    std::vector<float> xp, xs, xsum;
    std::vector<int16_t> xq;
    columns_fn fn;
    if (uses_int16(bits, groups, act)) {
      xq.resize(static_cast<size_t>(m * z.xq));
      xs.resize(static_cast<size_t>(m * z.xs));
      xsum.resize(static_cast<size_t>(m * z.xsum));
      quantize_rows(x.data<float>(), m, k, group, xq.data(), xs.data(), xsum.data());
      fn = pick_i16(group, in[2].dtype());
    } else {
      const int64_t e = LANES * 32 / bits;
      a.kp = (k + e - 1) / e * e;
      xp.resize(static_cast<size_t>(m * a.kp));
      to_block_order(x.data<float>(), xp.data(), m, k, a.kp, bits);
      fn = pick(bits, group, in[2].dtype());
    }
    // Rows in slices that stay in the cache while every column passes them (a prefill's
    // rows would otherwise be read from memory once per column).
    std::vector<QArgs> parts(out.size(), a);
    for (int64_t r0 = 0; r0 < m; r0 += SLICE_ROWS) {
      for (size_t p = 0; p < parts.size(); p++) {
        QArgs& part = parts[p];
        const mx::array& w = in[1 + 3 * p];
        part.m = std::min(SLICE_ROWS, m - r0);
        part.n = w.shape(0);
        part.w = w.data<uint32_t>();
        part.scales = in[2 + 3 * p].data<void>();
        part.biases = in[3 + 3 * p].data<void>();
        part.y = out[p].data<float>() + r0 * part.n;
        if (!xq.empty()) {
          part.xq = xq.data() + r0 * z.xq;
          part.xs = xs.data() + r0 * z.xs;
          part.xsum = xsum.data() + r0 * z.xsum;
        } else {
          part.xp = xp.data() + r0 * a.kp;
        }
      }
      run_columns(fn, parts, k);
    }
  }

  int group_, bits_, act_;
  bool tiled_, residual_;
};

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
  std::vector<mx::array> ins = {w, scales, biases};
  return mx::array({w.shape(0), static_cast<int32_t>(k)}, mx::float32,
                   std::make_shared<QuantDequant>(s, group, bits), std::move(ins));
}

mx::array dequantize_tiled(const mx::array& tiles, const mx::array& scales,
                           const mx::array& biases, int64_t row0, int64_t rows, int group,
                           int bits) {
  if (bits != 4 && bits != 8) throw std::invalid_argument("dequantize_tiled: bits must be 4 or 8");
  if (group != 32 && group != 64 && group != 128)
    throw std::invalid_argument("dequantize_tiled: group_size must be 32, 64 or 128");
  if (tiles.dtype() != mx::uint8 || tiles.ndim() != 2 || tiles.shape(1) % tblock(bits))
    throw std::invalid_argument("dequantize_tiled: tiles must be uint8 [tiles, K * 8] (K * 16 for 8 bits)");
  const int64_t k = tiles.shape(1) / tblock(bits) * IBLOCK;
  const mx::Shape sshape = {tiles.shape(0), static_cast<int32_t>(k / group), TILE};
  if (k % group || scales.shape() != sshape || biases.shape() != sshape ||
      scales.dtype() != biases.dtype() ||
      (scales.dtype() != mx::float32 && scales.dtype() != mx::float16 &&
       scales.dtype() != mx::bfloat16))
    throw std::invalid_argument("dequantize_tiled: scales and biases must be [tiles, K / group_size, 16]");
  if (row0 < 0 || rows < 1 || row0 + rows > static_cast<int64_t>(tiles.shape(0)) * TILE)
    throw std::invalid_argument("dequantize_tiled: rows outside the tiles");
  auto s = mx::to_stream({}, mx::Device::cpu);
  return mx::array({static_cast<int32_t>(rows), static_cast<int32_t>(k)}, mx::float32,
                   std::make_shared<TiledDequantize>(s, row0, group, bits),
                   {tiles, scales, biases});
}

mx::array block_order(const mx::array& x, int bits) {
  if (x.dtype() != mx::float32 || x.ndim() < 1)
    throw std::invalid_argument("block_order: x must be float32");
  if (bits != 4 && bits != 8) throw std::invalid_argument("block_order: bits must be 4 or 8");
  if (x.shape(-1) % 32)
    throw std::invalid_argument("block_order: x's last axis must be a multiple of 32");
  auto s = mx::to_stream({}, mx::Device::cpu);
  return mx::array(x.shape(), mx::float32, std::make_shared<BlockOrder>(s, bits),
                   {x});
}

std::vector<mx::array> quantized_matmul_many(const mx::array& x, const std::vector<mx::array>& ws,
                                             const std::vector<mx::array>& scales,
                                             const std::vector<mx::array>& biases, int group,
                                             int bits, int act) {
  if (x.dtype() != mx::float32) throw std::invalid_argument("quantized_matmul: x must be float32");
  if (ws.empty() || scales.size() != ws.size() || biases.size() != ws.size())
    throw std::invalid_argument("quantized_matmul: one scales and biases for each w");
  if (act != ACT_DEFAULT && act != ACT_FLOAT && act != ACT_INT16)
    throw std::invalid_argument("quantized_matmul: activations must be -1, 0 or 1");
  auto s = mx::to_stream({}, mx::Device::cpu);
  std::vector<mx::array> ins = {x};
  std::vector<mx::Shape> shapes;
  for (size_t p = 0; p < ws.size(); p++) {
    const int64_t k = check_weights(ws[p], scales[p], biases[p], group, bits);
    if (x.ndim() < 1 || x.shape(-1) != k)
      throw std::invalid_argument("quantized_matmul: x's last axis must be K");
    if (scales[p].dtype() != scales[0].dtype())
      throw std::invalid_argument("quantized_matmul: the parts' scales must share a dtype");
    mx::Shape shape = x.shape();
    shape.back() = ws[p].shape(0);
    shapes.push_back(std::move(shape));
    for (const mx::array* a : {&ws[p], &scales[p], &biases[p]}) ins.push_back(*a);
  }
  const std::vector<mx::Dtype> dtypes(ws.size(), mx::float32);
  return mx::array::make_arrays(std::move(shapes), dtypes,
                                std::make_shared<QuantMatmul>(s, group, bits, act), ins);
}

// The products of x with tile()'s 4- or 8-bit weights (quant_kernels.h, "Tiled 4-bit
// weights"): part p's tiles uint8 [ceil(n / 16), k / 32 * 256 (512 for 8 bits)], scales and
// biases [ceil(n / 16), k / group, 16], n[p] columns.
std::vector<mx::array> tiled_matmul(const mx::array& x, const std::vector<mx::array>& tiles,
                                    const std::vector<mx::array>& scales,
                                    const std::vector<mx::array>& biases,
                                    const std::vector<int64_t>& ns, int group,
                                    const std::optional<mx::array>& residual, int bits) {
  if (x.dtype() != mx::float32 || x.ndim() < 1)
    throw std::invalid_argument("tiled_matmul: x must be float32");
  if (tiles.empty() || scales.size() != tiles.size() || biases.size() != tiles.size() ||
      ns.size() != tiles.size())
    throw std::invalid_argument("tiled_matmul: one scales, biases and n for each tiles");
  if (group != 32 && group != 64 && group != 128)
    throw std::invalid_argument("tiled_matmul: group_size must be 32, 64 or 128");
  if (bits != 4 && bits != 8) throw std::invalid_argument("tiled_matmul: bits must be 4 or 8");
  const int64_t k = x.shape(-1);
  if (k % group) throw std::invalid_argument("tiled_matmul: K must be a multiple of group_size");
  auto s = mx::to_stream({}, mx::Device::cpu);
  std::vector<mx::array> ins = {x};
  std::vector<mx::Shape> shapes;
  for (size_t p = 0; p < tiles.size(); p++) {
    const int32_t t = static_cast<int32_t>((ns[p] + TILE - 1) / TILE);
    const mx::Shape tshape = {t, static_cast<int32_t>(k / IBLOCK * tblock(bits))};
    const mx::Shape sshape = {t, static_cast<int32_t>(k / group), TILE};
    if (tiles[p].dtype() != mx::uint8 || tiles[p].shape() != tshape)
      throw std::invalid_argument(
          "tiled_matmul: tiles must be uint8 [ceil(n / 16), K * 8] (K * 16 for 8 bits)");
    if (scales[p].shape() != sshape || biases[p].shape() != sshape ||
        scales[p].dtype() != scales[0].dtype() || biases[p].dtype() != scales[0].dtype())
      throw std::invalid_argument(
          "tiled_matmul: scales and biases must be [ceil(n / 16), K / group_size, 16], one dtype");
    mx::Shape shape = x.shape();
    shape.back() = static_cast<int32_t>(ns[p]);
    shapes.push_back(std::move(shape));
    for (const mx::array* a : {&tiles[p], &scales[p], &biases[p]}) ins.push_back(*a);
  }
  if (residual) {
    if (tiles.size() != 1 || residual->dtype() != mx::float32 || residual->shape() != shapes[0])
      throw std::invalid_argument(
          "tiled_matmul: a residual takes one weight and is float32 of the output's shape");
    ins.push_back(*residual);
  }
  const std::vector<mx::Dtype> dtypes(tiles.size(), mx::float32);
  return mx::array::make_arrays(
      std::move(shapes), dtypes,
      std::make_shared<QuantMatmul>(s, group, bits, ACT_INT16, true, residual.has_value()), ins);
}

mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const mx::array& biases, int group, int bits, int act) {
  return quantized_matmul_many(x, {w}, {scales}, {biases}, group, bits, act)[0];
}

}  // namespace

namespace fast_kernels {

void narrow_half(const float* src, uint16_t* dst, int64_t n) {
  static const narrow_fn variant = []() -> narrow_fn {
#if defined(__x86_64__)
    if (simd() == AVX512) return avx512_narrow();
    if (simd() == AVX2) return avx2_narrow();
#endif
    return narrow_portable;
  }();
  variant(src, dst, n);
}

void parallel_units(int64_t units, void (*f)(const void*, int64_t, int64_t), const void* ctx) {
  const int64_t pieces = std::min<int64_t>(units, 4 * appliance_pool_threads());
  std::vector<Task> tasks;
  for (int64_t i = 0; i < pieces; i++)
    tasks.push_back({nullptr, nullptr, units * i / pieces, units * (i + 1) / pieces, f, ctx});
  run_tasks(tasks);
}

void tiled_products(const float* x, int64_t m, int64_t k, int group, mx::Dtype scales,
                    const TiledWeight* weights, float* const* ys, int count,
                    const float* residual) {
  const int64_t groups = k / group;
  std::vector<int16_t> xq(static_cast<size_t>(m * k));
  std::vector<float> xs(static_cast<size_t>(m * (k / IBLOCK))), xsum(static_cast<size_t>(m * groups));
  quantize_plain(x, m, k, group, xq.data(), xs.data(), xsum.data());
  const QArgs a{nullptr, m, k, k, 0, nullptr, 0, nullptr, nullptr, groups, group,
                __builtin_ctz(group), nullptr, xq.data(), xs.data(), xsum.data()};
  std::vector<QArgs> parts(static_cast<size_t>(count), a);
  std::vector<columns_fn> fns(static_cast<size_t>(count));
  for (int p = 0; p < count; p++) {
    parts[p].n = weights[p].n;
    parts[p].w = static_cast<const uint32_t*>(weights[p].tiles);
    parts[p].scales = weights[p].scales;
    parts[p].biases = weights[p].biases;
    parts[p].y = ys[p];
    fns[p] = pick_tiled(weights[p].bits, scales);
  }
  run_columns(fns, parts, k, TILE);
  if (residual != nullptr) {  // y + r per element, as MLX's add of the two gives it
    float* y = ys[0];
    for (int64_t i = 0, n = m * weights[0].n; i < n; i++) y[i] += residual[i];
  }
}

}  // namespace fast_kernels

void define_quant(nb::module_& m) {
  m.def("quantized_matmul", &quantized_matmul, nb::arg("x"), nb::arg("w"), nb::arg("scales"),
        nb::arg("biases"), nb::arg("group_size"), nb::arg("bits"), nb::arg("activations") = -1,
        "x @ dequantize(w, scales, biases).T for MLX's affine 4- or 8-bit weights (x float32; "
        "group_size 32, 64 or 128), the weights read once for all rows. activations: how a "
        "4-bit product takes x: 1 rounded to 16 bits per block of 32, 0 in float, -1 the "
        "process's choice (APPLIANCE_QUANT_ACT).");
  m.def("quantized_matmul_many", &quantized_matmul_many, nb::arg("x"), nb::arg("ws"),
        nb::arg("scales"), nb::arg("biases"), nb::arg("group_size"), nb::arg("bits"),
        nb::arg("activations") = -1,
        "quantized_matmul of x with each of several weights of the same K, group and bits, "
        "as one operation: x is rounded once and the columns of all go to the threads as one "
        "job. A list of outputs, one per weight.");
  m.def("tiled_matmul", &tiled_matmul, nb::arg("x"), nb::arg("tiles"), nb::arg("scales"),
        nb::arg("biases"), nb::arg("n"), nb::arg("group_size"),
        nb::arg("residual") = nb::none(), nb::arg("bits") = 4,
        "x @ W.T for each of several 4- (or 8-) bit weights W in appliance/backend/quant.py's tiles "
        "(16 columns side by side), x rounded to 16 bits once; a list of outputs. residual "
        "(one weight only): added to the output, as residual + x @ W.T in MLX.");
  m.def("dequantize_blocked", &dequantize_blocked, nb::arg("w"), nb::arg("scales"),
        nb::arg("biases"), nb::arg("group_size"), nb::arg("bits"),
        "dequantize(w, scales, biases) as float32 [N, K], each row's K in the kernel's block "
        "order (block_order permutes x to match); the pool's "
        "threads share the rows.");
  m.def("dequantize_tiled", &dequantize_tiled, nb::arg("tiles"), nb::arg("scales"),
        nb::arg("biases"), nb::arg("row0"), nb::arg("rows"), nb::arg("group_size"),
        nb::arg("bits"),
        "Rows [row0, row0 + rows) of a tiled weight (appliance/backend/quant.py's tile()) "
        "as dequantize_blocked gives them from MLX's arrays, bit for bit: the tiles are the "
        "only copy of an adopted layer's weights.");
  m.def("block_order", &block_order, nb::arg("x"), nb::arg("bits"),
        "x with its last axis in dequantize_blocked's order for bits-wide weights.");
  m.def("quant_simd", [] { return std::string(appliance_simd_name()); },
        "The instruction set the quantized kernel runs: avx512, avx2 or portable.");
  m.def("quant_activations", [] { return std::string(act_name(4)); },
        "How 4-bit products take x by default: int16 (rounded per block of 32; AVX2 and "
        "AVX-512) or float (portable, or APPLIANCE_QUANT_ACT=float); 8-bit products always "
        "take it in float.");
  m.def("quant_threads", [] { return appliance_pool_threads(); },
        "Threads of the native code's one pool, the caller included (APPLIANCE_QUANT_THREADS).");
  m.def("pool_shared", [] { return appliance_pool_shared() != 0; },
        "Whether the pool is the preloaded skinny_matmul's (one pool for all the native code).");
}
