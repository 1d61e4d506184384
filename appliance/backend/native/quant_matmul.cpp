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
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

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
    const int64_t e = LANES * 32 / bits;
    const int64_t kp = (k + e - 1) / e * e;
    std::vector<float> xp(static_cast<size_t>(m * kp));
    to_block_order(x.data<float>(), xp.data(), m, k, kp, bits);
    QArgs a{xp.data(), m, kp, k, n, w.data<uint32_t>(), words, in[2].data<void>(),
            in[3].data<void>(), in[2].shape(1), group, __builtin_ctz(group), out.data<float>()};
    columns_fn fn = pick(bits, group, in[2].dtype());
    auto& pool = QuantPool::get();
    // Rows in slices that stay in the cache while every column passes them (a prefill's
    // rows would otherwise be read from memory once per column).
    for (int64_t r0 = 0; r0 < m; r0 += SLICE_ROWS) {
      QArgs slice = a;
      slice.m = std::min(SLICE_ROWS, m - r0);
      slice.xp = a.xp + r0 * kp;
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
  m.def("quant_threads", [] { return QuantPool::get().threads(); },
        "Threads a big quantized product is split across (APPLIANCE_QUANT_THREADS).");
}
