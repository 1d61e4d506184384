// The quantized kernel's paths with x rounded to 16 bits (quant_kernels.h) under
// AddressSanitizer and UBSan, without MLX: scripts/sanitize-native.sh compiles this with
// quant_avx2.cpp and quant_avx512.cpp. On the baseline and each variant the processor runs:
// the column-wise 16-bit products (x rounded by quantize_rows), the tiled products of 4- and
// 8-bit tiles (x rounded by the variant's round_plain), dequantize_tiled's pieces
// (quant_layout.h's dequant_tiled_unit) and the dense path of more rows than the tiles take
// (block_order_rows, then a plain product with the dequantized rows). Every group size and
// scale dtype, rows 1 to 9 and 256 / 257, columns that leave part of a tile, K that leaves
// part of a quad or of a dequantized block. Each output is checked against a double-precision
// loop over MLX's layout (x rounded the same way where the kernel rounds it).
//   quant_int16 [plant-read | plant-write]: one tiled product on the widest variant with its
//   tiles one byte short, or dequantize_tiled's output one float short; ASan must stop it.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "../../appliance/backend/native/quant_layout.h"

using namespace quant_kernels;

namespace {

// The baseline's instances, as quant_matmul.cpp makes them.
template <int LPG, class S>
void i16_portable(const QArgs& a, int64_t n0, int64_t n1) {
  columns_i16_body<LPG, S, I16Portable>(a, n0, n1);
}
template <class S, int BITS>
void tiled_portable(const QArgs& a, int64_t n0, int64_t n1) {
  tiled_body<S, TPortable, BITS>(a, n0, n1);
}
template <int BITS, int LPG, class S>
void dequant_portable(const QArgs& a, int64_t n0, int64_t n1) {
  dequant_body<BITS, LPG, S>(a, n0, n1);
}
struct PortableI16 {
  template <int BITS, int LPG, class S>
  static columns_fn get() { return i16_portable<LPG, S>; }
};
struct PortableTiled {
  template <int BITS, int LPG, class S>
  static columns_fn get() { return tiled_portable<S, BITS>; }
};
struct PortableDequant {
  template <int BITS, int LPG, class S>
  static columns_fn get() { return dequant_portable<BITS, LPG, S>; }
};
void round_portable(const float* x, int64_t m, int64_t k, int group, int16_t* xq, float* xs,
                    float* xsum) {
  round_plain_body(x, m, k, group, xq, xs, xsum);
}

struct Variant {
  const char* name;
  columns_fn (*i16)(int lpg, Scales s);  // nullptr: this variant has none (AVX-512 without VNNI)
  columns_fn (*tiled)(int bits, Scales s);
  columns_fn (*dequant)(int bits, int lpg, Scales s);
  round_fn (*round)();
};

uint64_t seed = 1;
uint32_t urand() {
  seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
  return static_cast<uint32_t>(seed >> 32);
}
float frand() { return static_cast<float>(urand() & 0xffff) / 32768.0f - 1.0f; }

// A random weight in MLX's layout: w [n, k * bits / 32], scales and biases [n, k / group] as
// stored (raw) and as floats.
struct Weight {
  int bits, group;
  Scales s;
  int64_t n, k, words, groups;
  std::vector<uint32_t> w;
  std::vector<float> sv, bv;          // the values
  std::vector<uint8_t> sraw, braw;    // as stored: float32 or the 16 bits
  size_t ssize() const { return s == SCALES_F32 ? 4 : 2; }
  uint32_t q(int64_t c, int64_t i) const {
    const int per = 32 / bits;
    return (w[c * words + i / per] >> (bits * (i % per))) & ((1u << bits) - 1);
  }
  double value(int64_t c, int64_t i) const {
    return static_cast<double>(sv[c * groups + i / group]) * q(c, i) + bv[c * groups + i / group];
  }
  double size(int64_t c, int64_t i) const {
    return std::fabs(static_cast<double>(sv[c * groups + i / group]) * q(c, i)) +
           std::fabs(bv[c * groups + i / group]);
  }
};

float store(float v, Scales s, uint8_t* raw) {
  if (s == SCALES_F32) {
    std::memcpy(raw, &v, 4);
    return v;
  }
  uint16_t h;
  if (s == SCALES_F16) {
    const _Float16 f = static_cast<_Float16>(v);
    std::memcpy(&h, &f, 2);
    std::memcpy(raw, &h, 2);
    return static_cast<float>(f);
  }
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  h = static_cast<uint16_t>(bits >> 16);  // bfloat16: the high half
  std::memcpy(raw, &h, 2);
  bits = static_cast<uint32_t>(h) << 16;
  std::memcpy(&v, &bits, 4);
  return v;
}

Weight make_weight(int bits, int group, Scales s, int64_t n, int64_t k) {
  Weight w{bits, group, s, n, k, k * bits / 32, k / group, {}, {}, {}, {}, {}};
  w.w.resize(static_cast<size_t>(n * w.words));
  for (auto& v : w.w) v = urand();
  const size_t cells = static_cast<size_t>(n * w.groups);
  w.sv.resize(cells);
  w.bv.resize(cells);
  w.sraw.resize(cells * w.ssize());
  w.braw.resize(cells * w.ssize());
  for (size_t i = 0; i < cells; i++) {
    w.sv[i] = store(0.05f * frand(), s, &w.sraw[i * w.ssize()]);
    w.bv[i] = store(0.1f * frand(), s, &w.braw[i * w.ssize()]);
  }
  return w;
}

// quant.py's tile(): 16 columns side by side (zero past n), scales and biases [tiles,
// groups, 16]. `shorten`: bytes left off the tiles' end (the planted overflow).
struct Tiles {
  std::vector<uint8_t> t, s, b;
};
Tiles tile(const Weight& w, size_t shorten = 0) {
  const int64_t tiles = (w.n + TILE - 1) / TILE, blocks = w.k / IBLOCK;
  const int64_t tb = tblock(w.bits);
  Tiles out;
  out.t.resize(static_cast<size_t>(tiles * blocks * tb) - shorten);
  const size_t side = static_cast<size_t>(tiles * w.groups * TILE) * w.ssize();
  out.s.assign(side, 0);
  out.b.assign(side, 0);
  for (int64_t t = 0; t < tiles; t++)
    for (int64_t j = 0; j < TILE; j++) {
      const int64_t c = t * TILE + j;
      if (c >= w.n) continue;
      auto q = [&](int64_t i) { return static_cast<uint8_t>(w.q(c, i)); };
      for (int64_t b = 0; b < blocks; b++)  // chunk ch: elements 4ch.. (8 bits: 2ch..)
        for (int64_t ch = 0; ch < (w.bits == 8 ? 16 : 8); ch++)
          for (int h = 0; h < 2; h++) {
            const size_t at = static_cast<size_t>(t * blocks * tb + b * tb + 32 * ch + 2 * j + h);
            const int64_t e = b * IBLOCK;
            if (at < out.t.size())
              out.t[at] = w.bits == 8 ? q(e + 2 * ch + h)
                                      : static_cast<uint8_t>(q(e + 4 * ch + h) |
                                                             q(e + 4 * ch + 2 + h) << 4);
          }
      for (int64_t g = 0; g < w.groups; g++) {
        const size_t to = static_cast<size_t>((t * w.groups + g) * TILE + j) * w.ssize();
        const size_t from = static_cast<size_t>(c * w.groups + g) * w.ssize();
        std::memcpy(&out.s[to], &w.sraw[from], w.ssize());
        std::memcpy(&out.b[to], &w.braw[from], w.ssize());
      }
    }
  return out;
}

// x rounded as the kernels round it (per block of 32, to at most 32767), in double.
std::vector<double> rounded(const std::vector<float>& x, int64_t m, int64_t k) {
  std::vector<double> r(x.size());
  for (int64_t row = 0; row < m; row++)
    for (int64_t b = 0; b < k / IBLOCK; b++) {
      const float* xb = &x[static_cast<size_t>(row * k + b * IBLOCK)];
      float amax = 0.f;
      for (int i = 0; i < IBLOCK; i++) amax = std::max(amax, std::fabs(xb[i]));
      const float scale = amax / XLEVELS, inv = amax > 0.f ? XLEVELS / amax : 0.f;
      for (int i = 0; i < IBLOCK; i++) {
        const float v = std::min(XLEVELS, std::max(-XLEVELS, std::nearbyint(xb[i] * inv)));
        r[static_cast<size_t>(row * k + b * IBLOCK + i)] = static_cast<double>(scale) * v;
      }
    }
  return r;
}

// y [m, n] against x [m, k] @ w.T in double; the outputs that miss.
int compare(const char* what, const Variant& v, const Weight& w, int64_t m,
            const std::vector<double>& x, const std::vector<float>& y) {
  int wrong = 0;
  for (int64_t r = 0; r < m; r++)
    for (int64_t c = 0; c < w.n; c++) {
      double want = 0, size = 0;
      for (int64_t i = 0; i < w.k; i++) {
        want += x[r * w.k + i] * w.value(c, i);
        size += std::fabs(x[r * w.k + i]) * w.size(c, i);
      }
      if (!(std::fabs(y[r * w.n + c] - want) <= 1e-5 * size + 1e-6)) wrong++;
    }
  if (wrong)
    std::printf("%s %s bits=%d group=%d scales=%d m=%ld n=%ld k=%ld: %d wrong\n", what, v.name,
                w.bits, w.group, static_cast<int>(w.s), static_cast<long>(m),
                static_cast<long>(w.n), static_cast<long>(w.k), wrong);
  return wrong;
}

std::vector<float> random_x(int64_t m, int64_t k) {
  std::vector<float> x(static_cast<size_t>(m * k));
  for (auto& v : x) v = frand() * (urand() % 8 == 0 ? 8.f : 1.f);  // some blocks' outliers
  return x;
}

// The column-wise 16-bit path (4-bit weights): x as quantize_rows gives it, the columns in
// two calls as the pool's tasks take them.
int check_i16(const Variant& v, const Weight& w, int64_t m) {
  const std::vector<float> x = random_x(m, w.k);
  const I16Sizes z(w.k, w.groups);
  std::vector<int16_t> xq(static_cast<size_t>(m * z.xq));
  std::vector<float> xs(static_cast<size_t>(m * z.xs)), xsum(static_cast<size_t>(m * z.xsum));
  quantize_rows(x.data(), m, w.k, w.group, xq.data(), xs.data(), xsum.data());
  std::vector<float> y(static_cast<size_t>(m * w.n), NAN);
  const QArgs a{nullptr, m, w.k, w.k, w.n, w.w.data(), w.words, w.sraw.data(), w.braw.data(),
                w.groups, w.group, __builtin_ctz(w.group), y.data(), xq.data(), xs.data(),
                xsum.data()};
  const columns_fn fn = v.i16(w.group == 32 ? 4 : w.group == 64 ? 8 : 16, w.s);
  fn(a, 0, w.n / 2);
  fn(a, w.n / 2, w.n);
  return compare("int16", v, w, m, rounded(x, m, w.k), y);
}

// A tiled product: x rounded by the variant, the columns in tasks that start on a tile.
// `shorten`: the planted overflow.
int check_tiled(const Variant& v, const Weight& w, int64_t m, size_t shorten = 0) {
  const Tiles t = tile(w, shorten);
  const std::vector<float> x = random_x(m, w.k);
  std::vector<int16_t> xq(static_cast<size_t>(m * w.k));
  std::vector<float> xs(static_cast<size_t>(m * (w.k / IBLOCK)));
  std::vector<float> xsum(static_cast<size_t>(m * w.groups));
  v.round()(x.data(), m, w.k, w.group, xq.data(), xs.data(), xsum.data());
  std::vector<float> y(static_cast<size_t>(m * w.n), NAN);
  const QArgs a{nullptr, m, w.k, w.k, w.n, reinterpret_cast<const uint32_t*>(t.t.data()), 0,
                t.s.data(), t.b.data(), w.groups, w.group, __builtin_ctz(w.group), y.data(),
                xq.data(), xs.data(), xsum.data()};
  const columns_fn fn = v.tiled(w.bits, w.s);
  const int64_t cut = std::min<int64_t>(TILE, w.n);
  fn(a, 0, cut);
  fn(a, cut, w.n);
  return compare("tiled", v, w, m, rounded(x, m, w.k), y);
}

// Where dequant_body puts element i of a row of K (the kernel's block order).
int64_t dequant_at(int bits, int64_t k, int64_t i) {
  const int per = 32 / bits, e = LANES * per;
  const int64_t full = k / e, tail = (k - full * e) / per;
  if (i < full * e) return i / e * e + (i % e) % per * LANES + (i % e) / per;
  return full * e + (i - full * e) % per * tail + (i - full * e) / per;
}

// dequantize_tiled's rows [row0, row0 + rows), its tiles in two tasks as the pool takes
// them, each element against s * q + b. `shorten`: floats left off the output's end.
int check_dequant(const Variant& v, const Weight& w, const Tiles& t, int64_t row0, int64_t rows,
                  size_t shorten = 0) {
  std::vector<float> y(static_cast<size_t>(rows * w.k) - shorten, NAN);
  const int lpg = std::min(LANES, w.group / (32 / w.bits));
  const TiledDequant d{t.t.data(), t.s.data(), t.b.data(), row0, rows, w.k, w.groups, w.group,
                       w.bits, w.ssize(), v.dequant(w.bits, lpg, w.s), y.data()};
  const int64_t t0 = row0 / TILE, t1 = (row0 + rows + TILE - 1) / TILE;
  dequant_tiled_unit(&d, t0, t0 + 1);
  dequant_tiled_unit(&d, t0 + 1, t1);
  int wrong = 0;
  for (int64_t j = 0; j < rows; j++)
    for (int64_t i = 0; i < w.k; i++) {
      const double got = y[j * w.k + dequant_at(w.bits, w.k, i)];
      if (!(std::fabs(got - w.value(row0 + j, i)) <= 1e-6 * w.size(row0 + j, i))) wrong++;
    }
  if (wrong)
    std::printf("dequantize_tiled %s bits=%d group=%d scales=%d rows %ld+%ld k=%ld: %d wrong\n",
                v.name, w.bits, w.group, static_cast<int>(w.s), static_cast<long>(row0),
                static_cast<long>(rows), static_cast<long>(w.k), wrong);
  return wrong;
}

// More rows than the tiles take (quant.py's TILED_ROWS): x in the dequantized order
// (block_order_rows) times dequantize_tiled's rows, in two pieces of columns.
int check_dense(const Variant& v, const Weight& w, const Tiles& t, int64_t m) {
  const std::vector<float> x = random_x(m, w.k);
  std::vector<float> xb(x.size());
  if (w.bits == 4) block_order_rows<8>(x.data(), xb.data(), m, w.k);
  else block_order_rows<4>(x.data(), xb.data(), m, w.k);
  const int lpg = std::min(LANES, w.group / (32 / w.bits));
  std::vector<float> y(static_cast<size_t>(m * w.n));
  for (int64_t c0 = 0, step = w.n / 2 + 1; c0 < w.n; c0 += step) {
    const int64_t rows = std::min(step, w.n - c0);
    std::vector<float> dq(static_cast<size_t>(rows * w.k));
    const TiledDequant d{t.t.data(), t.s.data(), t.b.data(), c0, rows, w.k, w.groups, w.group,
                         w.bits, w.ssize(), v.dequant(w.bits, lpg, w.s), dq.data()};
    dequant_tiled_unit(&d, c0 / TILE, (c0 + rows + TILE - 1) / TILE);
    for (int64_t r = 0; r < m; r++)
      for (int64_t c = 0; c < rows; c++) {
        double s = 0;
        for (int64_t i = 0; i < w.k; i++)
          s += static_cast<double>(xb[r * w.k + i]) * dq[c * w.k + i];
        y[r * w.n + c0 + c] = static_cast<float>(s);
      }
  }
  return compare("dense", v, w, m, std::vector<double>(x.begin(), x.end()), y);
}

}  // namespace

int main(int argc, char** argv) {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl");
  const bool vnni = avx512 && __builtin_cpu_supports("avx512vnni");
  std::vector<Variant> variants = {
      {"portable", [](int l, Scales s) { return by_lpg<PortableI16, 4>(l, s); },
       [](int b, Scales s) {
         return b == 8 ? by_scales<PortableTiled, 8, 16>(s) : by_scales<PortableTiled, 4, 16>(s);
       },
       [](int b, int l, Scales s) { return by_bits<PortableDequant>(b, l, s); },
       [] { return static_cast<round_fn>(round_portable); }}};
  if (avx2)
    variants.push_back({"avx2", avx2_columns_i16, avx2_tiled, avx2_dequant, avx2_round_plain});
  if (avx512)  // the 16-bit products take VNNI's; without it quant_matmul.cpp takes AVX2's
    variants.push_back({vnni ? "avx512-vnni" : "avx512", vnni ? vnni_columns_i16 : nullptr,
                        vnni ? vnni_tiled : nullptr, avx512_dequant, avx512_round_plain});

  if (argc > 1) {  // a planted overflow on the widest variant: ASan must stop the run
    const bool read = std::strcmp(argv[1], "plant-read") == 0;
    const Variant& v = variants[variants.size() - (read && avx512 && !vnni ? 2 : 1)];
    const Weight w = make_weight(4, 32, SCALES_F16, 17, 96);
    if (read) check_tiled(v, w, 3, 1);
    else check_dequant(v, w, tile(w), 1, 16, 1);
    std::printf("quant_int16 %s %s: not reported\n", argv[1], v.name);
    return 0;
  }

  const int64_t rows[] = {1, 2, 3, 7, 8, 9};  // around the variants' rows in registers (2, 8)
  int wrong = 0;
  for (const Variant& v : variants) {
    int i16 = 0, tiled = 0, dequant = 0, dense = 0, p = 0;
    for (int group : {32, 64, 128})
      for (Scales s : {SCALES_F32, SCALES_F16, SCALES_BF16})
        // K: part of a quad (3, 5, 6 blocks), whole quads, part of a dequantized block
        for (int64_t k : {int64_t{96}, int64_t{128}, int64_t{160}, int64_t{192}, int64_t{384}})
          for (int bits : {4, 8}) {
            if (k % group) continue;
            const int64_t n = 1 + (p * 7) % 40, m = rows[p++ % 6];  // n: 1 to 40
            const Weight w = make_weight(bits, group, s, n, k);
            if (v.i16 && bits == 4) {
              wrong += check_i16(v, w, m);
              i16++;
            }
            if (v.tiled) {
              wrong += check_tiled(v, w, m);
              tiled++;
            }
            const Tiles t = tile(w);
            // the first row, the last, some in the middle (across a tile's edge), all
            wrong += check_dequant(v, w, t, 0, 1) + check_dequant(v, w, t, n - 1, 1) +
                     check_dequant(v, w, t, n / 3, n - n / 3 - n / 4) +
                     check_dequant(v, w, t, 0, n);
            dequant += 4;
          }
    for (int bits : {4, 8}) {  // the row thresholds: 256 tiled, 257 dense
      const Weight w = make_weight(bits, 64, SCALES_BF16, 19, 128);
      if (v.tiled) {
        wrong += check_tiled(v, w, 256);
        tiled++;
      }
      wrong += check_dense(v, w, tile(w), 257);
      dense++;
    }
    if (v.i16) {  // the most groups the column-wise path takes (its stack buffer's size)
      wrong += check_i16(v, make_weight(4, 32, SCALES_F32, 3, I16_MAX_GROUPS * 32), 2);
      i16++;
    }
    std::printf("quant_int16 %s: int16=%d tiled=%d dequantize_tiled=%d dense=%d\n", v.name, i16,
                tiled, dequant, dense);
  }
  std::printf("quant_int16: wrong=%d\n", wrong);
  return wrong != 0;
}
