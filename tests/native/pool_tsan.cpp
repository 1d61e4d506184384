// The native code's one pool (appliance/backend/native/pool.c) under ThreadSanitizer, built
// by scripts/sanitize-native.sh with APPLIANCE_QUANT_THREADS=4 (three helpers): skinny_matmul's
// products (through cblas_sgemm, as MLX calls it), the fast operations' softmax and a decode
// step's attention (the variant appliance_simd_level() names, units shared by the pool), from
// two caller threads at once, so one of them finds the pool busy and works alone. Every
// output is checked: the kernel's against a double-precision loop, the others bit for bit
// against the same loop run on one thread. TSan sees the hand-off: the helpers write the
// outputs and the caller reads them once the pool returns.
//   pool_tsan [rounds] [plant]   plant: every task also bumps one plain counter, a data race
//                                TSan must report (the script checks that it does)
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <atomic>
#include <thread>
#include <vector>

#include "../../appliance/backend/native/fast_loops.h"
#include "../../appliance/backend/native/pool.h"
#include "../../appliance/backend/native/simd.h"

extern "C" void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k,
                            float alpha, const float* a, int lda, const float* b, int ldb,
                            float beta, float* c, int ldc);

namespace {

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };
bool plant = false;
long planted = 0;  // plant: written by every task without synchronisation
std::atomic<long> by_helpers{0};  // tasks a helper ran (none: the pool was never shared)
thread_local bool caller = false;

void ran() {
  if (!caller) by_helpers++;
  if (plant) planted++;
}

float frand(uint32_t& s) {
  s = s * 1103515245u + 12345u;
  return static_cast<float>((s >> 8) & 0xffff) / 32768.0f - 1.0f;
}

// Products of 1-32 rows by 512-1024 columns (K = 160: big enough to be shared).
int products(uint32_t seed, int rounds) {
  const int K = 160, widths[] = {512, 700, 1024};
  std::vector<float> a(32 * K), b(1024 * K), c(32 * 1024);
  for (auto& v : a) v = frand(seed);
  for (auto& v : b) v = frand(seed);
  int bad = 0;
  for (int r = 0; r < rounds; r++) {
    const int m = 1 + r % 32, n = widths[r % 3];
    cblas_sgemm(ROW_MAJOR, NO_TRANS, TRANS, m, n, K, 1.0f, a.data(), K, b.data(), K, 0.0f,
                c.data(), n);
    if (r % 17) continue;
    for (int i = 0; i < m; i++)
      for (int j = 0; j < n; j++) {
        double want = 0;
        for (int p = 0; p < K; p++) want += static_cast<double>(a[i * K + p]) * b[j * K + p];
        if (std::fabs(c[i * n + j] - want) > 1e-3) bad++;
      }
  }
  return bad;
}

struct Softmax {
  const float* x;
  float* y;
  int64_t n, per;
};

void softmax_task(const void* ctx, long t) {
  const auto& s = *static_cast<const Softmax*>(ctx);
  fast_loops::loops().softmax_rows(s.x + t * s.per * s.n, s.y + t * s.per * s.n, t * s.per, s.per,
                                   s.n, 0);
  ran();
}

struct Attention {
  fast_kernels::Strided q, k, v, m;
  float* out;
  int64_t kv, rep, len, d;
};

void attention_task(const void* ctx, long u) {
  const auto& a = *static_cast<const Attention*>(ctx);
  fast_loops::loops().heads(a.q, a.k, a.v, a.m, fast_kernels::NO_MASK, a.out, u, u + 1, a.kv,
                            a.rep, a.len, a.d, 0.125f, -1);
  ran();
}

// Softmax of 64 rows and a decode step's attention (4 rows, 3 KV heads of 3 query heads each,
// 200 keys of 64), through the pool and on one thread: the same bits.
int fast_ops(uint32_t seed, int rounds) {
  const int64_t rows = 64, n = 300, B = 4, KV = 3, REP = 3, L = 200, D = 64;
  std::vector<float> x(rows * n), y(rows * n), y1(rows * n);
  std::vector<float> q(B * KV * REP * D), k(B * KV * L * D), v(k.size());
  std::vector<float> o(B * KV * REP * D), o1(o.size());
  int bad = 0;
  for (int r = 0; r < rounds; r++) {
    for (auto& e : x) e = 8.0f * frand(seed);
    for (auto* w : {&q, &k, &v})
      for (auto& e : *w) e = frand(seed);
    const Softmax s{x.data(), y.data(), n, 4};
    appliance_pool_run(softmax_task, &s, rows / s.per, APPLIANCE_POOL_SHORT);
    fast_loops::loops().softmax_rows(x.data(), y1.data(), 0, rows, n, 0);
    bad += std::memcmp(y.data(), y1.data(), y.size() * sizeof(float)) != 0;
    const auto view = [](const std::vector<float>& e, int64_t s0, int64_t s1, int64_t s2) {
      return fast_kernels::Strided{reinterpret_cast<const char*>(e.data()), {s0, s1, s2, 1}};
    };
    const Attention a{view(q, KV * REP * D, D, 0), view(k, KV * L * D, L * D, D),
                      view(v, KV * L * D, L * D, D), {nullptr, {0, 0, 0, 0}}, o.data(),
                      KV, REP, L, D};
    appliance_pool_run(attention_task, &a, B * KV, APPLIANCE_POOL_LONG);
    fast_loops::loops().heads(a.q, a.k, a.v, a.m, fast_kernels::NO_MASK, o1.data(), 0, B * KV, KV,
                              REP, L, D, 0.125f, -1);
    bad += std::memcmp(o.data(), o1.data(), o.size() * sizeof(float)) != 0;
  }
  return bad;
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 300;
  plant = argc > 2 && std::strcmp(argv[2], "plant") == 0;
  int bad_a = 0, bad_b = 0;
  std::thread other([&] {
    caller = true;
    bad_b = fast_ops(7, rounds / 4) + products(9, rounds);
  });
  caller = true;
  bad_a = products(1, rounds) + fast_ops(3, rounds / 4);
  other.join();
  const long shared = by_helpers.load();
  std::printf("pool_tsan: %s, %d threads, %d rounds: %d wrong, %ld tasks on helpers\n",
              appliance_simd_name(), appliance_pool_threads(), rounds, bad_a + bad_b, shared);
  return bad_a + bad_b || shared == 0 ? 1 : 0;
}
