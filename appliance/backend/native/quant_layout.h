// quant_layout.h: the layouts the quantized kernel's loops read (quant_kernels.h), made
// from x and from the tiles without MLX: x rounded for the 16-bit column-wise path, x in the
// dequantized weights' order, and tiles back to MLX's layout for dequantize_tiled.
// quant_matmul.cpp calls them; tests/native/quant_int16_sanitize.cpp runs them under
// AddressSanitizer and UBSan with the loops.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_kernels.h"

namespace quant_kernels {
namespace {

// Sizes of the path's per-row buffers: xq and xs per quad of blocks, xsum per 8 groups.
struct I16Sizes {
  int64_t quads, xq, xs, xsum;
  I16Sizes(int64_t k, int64_t groups)
      : quads((k / IBLOCK + 3) / 4), xq(quads * QUAD), xs(quads * LANES),
        xsum((groups + 7) / 8 * 8) {}
};

// x [m, k] rounded per block of 32 in the kernel's order (quant_kernels.h, "Activations in
// 16 bits"; zero past k), with the blocks' scales as the lanes use them and each weight
// group's sum of the rounded values (xs * sum(xq), blocks in order; zero past the groups).
inline void quantize_rows(const float* x, int64_t m, int64_t k, int group, int16_t* xq,
                          float* xs, float* xsum) {
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
        const int e = i / 2, t = (i & 1) * 2 + e / 8;  // quant_kernels.h's layout
        qp[32 * t + 8 * c + e % 8] = iv;
        sum += iv;
      }
      float* sp = xs + r * z.xs + q * LANES;
      for (int j = 0; j < 4; j++) sp[4 * c + j] = scale;
      xsum[r * z.xsum + b / per] += scale * static_cast<float>(sum);
    }
  }
}

// x's columns in the dequantized weights' order (each row as dequant_body writes one).
template <int PER>
inline void block_order_rows(const float* x, float* xp, int64_t m, int64_t k) {
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

// Tiles back to MLX's layout: rows [0, rows) of one tile (16 columns side by side; see
// quant_kernels.h, "Tiled 4-bit weights") as MLX's packed words, element 2i of a row in the
// low nibble of its byte i (8 bits: byte i is element i), and their scales and biases
// [rows, groups]. A 4-bit chunk's bytes for column j are element 4c + h low and 4c + 2 + h
// high (h = 0, 1); MLX's bytes 2c and 2c + 1 hold the pairs (4c, 4c + 1), (4c + 2, 4c + 3).
inline void untile_one(const uint8_t* tile, const uint8_t* ts, const uint8_t* tb,
                       int64_t rows, int64_t k, int64_t groups, int bits, size_t ssize,
                       uint8_t* w, uint8_t* s, uint8_t* b) {
  const int64_t row_bytes = k * bits / 8, chunks = k * bits / 16;
  for (int64_t j = 0; j < rows; j++) {
    const uint8_t* p = tile + 2 * j;
    uint8_t* out = w + j * row_bytes;
    if (bits == 8) {
      for (int64_t c = 0; c < chunks; c++) {
        out[2 * c] = p[32 * c];
        out[2 * c + 1] = p[32 * c + 1];
      }
    } else {
      for (int64_t c = 0; c < chunks; c++) {
        const uint8_t b0 = p[32 * c], b1 = p[32 * c + 1];
        out[2 * c] = static_cast<uint8_t>((b0 & 15) | ((b1 & 15) << 4));
        out[2 * c + 1] = static_cast<uint8_t>((b0 >> 4) | (b1 & 0xF0));
      }
    }
    for (int64_t g = 0; g < groups; g++) {
      const size_t from = static_cast<size_t>((g * TILE + j)) * ssize;
      std::memcpy(s + static_cast<size_t>(j * groups + g) * ssize, ts + from, ssize);
      std::memcpy(b + static_cast<size_t>(j * groups + g) * ssize, tb + from, ssize);
    }
  }
}

// dequantize_tiled's work: rows [row0, row0 + rows) of a tiled weight, a tile at a time
// back in MLX's layout (in a buffer the cache keeps), then dequantize_blocked's own loop on
// it, so the floats are dequantize_blocked's of MLX's arrays, bit for bit.
struct TiledDequant {
  const uint8_t* tiles;
  const uint8_t* scales;
  const uint8_t* biases;
  int64_t row0, rows, k, groups;
  int group, bits;
  size_t ssize;
  columns_fn fn;
  float* y;
};

inline void dequant_tiled_unit(const void* ctx, int64_t t0, int64_t t1) {
  const auto& d = *static_cast<const TiledDequant*>(ctx);
  const int64_t row_bytes = d.k * d.bits / 8, tile_bytes = TILE * row_bytes;
  const int64_t side = d.groups * TILE * static_cast<int64_t>(d.ssize);
  std::vector<uint32_t> w(static_cast<size_t>(tile_bytes / 4));
  std::vector<uint8_t> s(static_cast<size_t>(side)), b(static_cast<size_t>(side));
  for (int64_t t = t0; t < t1; t++) {
    const int64_t first = std::max(d.row0, t * TILE);
    const int64_t last = std::min(d.row0 + d.rows, (t + 1) * TILE);
    untile_one(d.tiles + t * tile_bytes, d.scales + t * side, d.biases + t * side,
               last - t * TILE, d.k, d.groups, d.bits, d.ssize,
               reinterpret_cast<uint8_t*>(w.data()), s.data(), b.data());
    const int64_t skip = first - t * TILE;
    QArgs a{nullptr, 0, d.k, d.k, last - t * TILE, w.data(), row_bytes / 4, s.data(), b.data(),
            d.groups, d.group, __builtin_ctz(d.group), d.y + (t * TILE - d.row0) * d.k,
            nullptr, nullptr, nullptr};
    d.fn(a, skip, last - t * TILE);
  }
}

}  // namespace
}  // namespace quant_kernels
