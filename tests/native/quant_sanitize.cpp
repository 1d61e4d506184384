// The quantized kernel's float-activation loops (appliance/backend/native/quant_kernels.h)
// under AddressSanitizer and UBSan, without MLX: scripts/sanitize-native.sh compiles this
// with quant_avx2.cpp and quant_avx512.cpp. Products of random 4- and 8-bit weights (every
// group size, float32, float16 and bfloat16 scales, K that ends inside a block, row and
// column counts that leave tails) on the baseline and on each variant the processor runs,
// each output checked against a double-precision loop over the dequantized weights.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "../../appliance/backend/native/quant_kernels.h"

using namespace quant_kernels;

namespace {

struct Portable {  // the baseline, as quant_matmul.cpp instantiates it (2 rows in registers)
  template <int BITS, int LPG, class S>
  static columns_fn get() {
    return [](const QArgs& a, int64_t n0, int64_t n1) { columns_body<BITS, LPG, S, 2>(a, n0, n1); };
  }
};

uint64_t seed = 1;
float frand() {
  seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
  return static_cast<float>((seed >> 40) & 0xffff) / 32768.0f - 1.0f;
}

// A scale or bias stored as the kernel reads it, and its value.
float stored(float v, Scales s, std::vector<uint16_t>& half, std::vector<float>& full, size_t i) {
  if (s == SCALES_F32) return full[i] = v;
  if (s == SCALES_F16) {
    const _Float16 h = static_cast<_Float16>(v);
    std::memcpy(&half[i], &h, 2);
    return static_cast<float>(h);
  }
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  half[i] = static_cast<uint16_t>(bits >> 16);  // bfloat16: the high half
  bits = static_cast<uint32_t>(half[i]) << 16;
  std::memcpy(&v, &bits, 4);
  return v;
}

// x [m, k] in block order (quant_matmul.cpp's to_block_order): block b of E = 16 * 32 / bits
// elements holds element i * (32 / bits) + j in lane i of its j-th vector; zero past k.
std::vector<float> block_order(const std::vector<float>& x, int64_t m, int64_t k, int64_t kp,
                               int bits) {
  const int per = 32 / bits, e = 16 * per;
  std::vector<float> xp(static_cast<size_t>(m * kp), 0.0f);
  for (int64_t r = 0; r < m; r++)
    for (int64_t b = 0; b * e < k; b++)
      for (int i = 0; i < 16; i++)
        for (int j = 0; j < per; j++) {
          const int64_t src = b * e + i * per + j;
          if (src < k) xp[r * kp + b * e + j * 16 + i] = x[r * k + src];
        }
  return xp;
}

int check(const char* variant, columns_fn (*pick)(int, int, Scales), int bits, int group,
          Scales s, int64_t m, int64_t n, int64_t k) {
  const int per = 32 / bits, e = 16 * per;
  const int64_t words = k / per, groups = k / group, kp = (k + e - 1) / e * e;
  const int lpg = std::min(16, group / per);
  std::vector<float> x(static_cast<size_t>(m * k)), sv(n * groups), bv(n * groups);
  std::vector<float> sf(s == SCALES_F32 ? n * groups : 0), bf(sf.size());
  std::vector<uint16_t> sh(s == SCALES_F32 ? 0 : n * groups), bh(sh.size());
  std::vector<uint32_t> w(static_cast<size_t>(n * words));
  for (auto& v : x) v = frand();
  for (auto& v : w) v = static_cast<uint32_t>(seed = seed * 6364136223846793005ULL + 1) ^
                        static_cast<uint32_t>(seed >> 32);
  for (size_t i = 0; i < sv.size(); i++) {
    sv[i] = stored(0.05f * frand(), s, sh, sf, i);
    bv[i] = stored(0.1f * frand(), s, bh, bf, i);
  }
  const std::vector<float> xp = block_order(x, m, k, kp, bits);
  std::vector<float> y(static_cast<size_t>(m * n), NAN);
  const void* scales = s == SCALES_F32 ? static_cast<const void*>(sf.data()) : sh.data();
  const void* biases = s == SCALES_F32 ? static_cast<const void*>(bf.data()) : bh.data();
  const QArgs a{xp.data(), m, kp, k, n, w.data(), words, scales, biases, groups, group,
                __builtin_ctz(group), y.data(), nullptr, nullptr, nullptr};
  pick(bits, lpg, s)(a, 0, n);
  int wrong = 0;
  for (int64_t r = 0; r < m; r++)
    for (int64_t c = 0; c < n; c++) {
      double want = 0, size = 0;
      for (int64_t i = 0; i < k; i++) {
        const uint32_t q = (w[c * words + i / per] >> (bits * (i % per))) & ((1u << bits) - 1);
        const double v = x[r * k + i] * (static_cast<double>(sv[c * groups + i / group]) * q +
                                         bv[c * groups + i / group]);
        want += v;
        size += std::fabs(v);
      }
      if (!(std::fabs(y[r * n + c] - want) <= 1e-5 * size + 1e-6)) wrong++;
    }
  if (wrong)
    std::printf("%s bits=%d group=%d scales=%d m=%ld n=%ld k=%ld: %d wrong\n", variant, bits,
                group, static_cast<int>(s), static_cast<long>(m), static_cast<long>(n),
                static_cast<long>(k), wrong);
  return wrong;
}

}  // namespace

int main() {
  struct Variant {
    const char* name;
    columns_fn (*pick)(int, int, Scales);
    bool runs;
  };
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl");
  const Variant variants[] = {
      {"portable", [](int b, int l, Scales s) { return by_bits<Portable>(b, l, s); }, true},
      {"avx2", avx2_columns, avx2},
      {"avx512", avx512_columns, avx512}};
  int wrong = 0, products = 0;
  for (const Variant& v : variants) {
    if (!v.runs) continue;
    for (int bits : {4, 8})
      for (int group : {32, 64, 128})
        for (Scales s : {SCALES_F32, SCALES_F16, SCALES_BF16})
          for (int64_t k : {int64_t{96}, int64_t{128}, int64_t{160}, int64_t{384}, int64_t{640}}) {
            if (k % group) continue;
            wrong += check(v.name, v.pick, bits, group, s, 1 + products % 9, 3 + products % 17, k);
            products++;
          }
    std::printf("quant %s: products=%d\n", v.name, products);
  }
  std::printf("quant: wrong=%d\n", wrong);
  return wrong != 0;
}
