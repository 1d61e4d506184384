// fast_kernels.h: the loops of mlx_fast.cpp's and quant_matmul.cpp's operations, for
// decode_layer.cpp, which runs a decoder layer's decode step through the same code in one
// operation (so its numbers are those of the operations one by one, bit for bit).

#pragma once

#include <cstdint>

#include "fast_loops.h"
#include "mlx/array.h"

namespace fast_kernels {

// mlx_fast.cpp
void rms_norm_rows(const float* src, const float* pw, float* dst, int64_t rows, int64_t n,
                   float eps);
void silu_mul_span(const float* a, const float* b, float* y, int64_t n);

// RoPE of x [b_len, heads, t_len, d] into y (Rope's arithmetic): off one position per batch
// row (per_row) or one for all, inv the dims / 2 inverse frequencies.
void rope_apply(const float* x, float* y, int64_t b_len, int64_t heads, int64_t t_len, int64_t d,
                int dims, bool traditional, float scale, const int32_t* off, bool per_row,
                const float* inv);

// exp(-i * log(base) / half) for i < half, as MLX's RoPE fallback computes it (kept).
mlx::core::array rope_inv_freq(int half, float base);

// a's base and strides, an axis of size 1 read with stride 0 (broadcast), 4 axes aligned right.
Strided strided(const mlx::core::array& a);

// DecodeAttention's arithmetic and threads: q [B, H, 1, D], k and v [B, KV, L, D] by strides
// (float32, or both float16: read into float32 as they are loaded),
// the mask broadcast to [B, H, 1, L]; out [B, H, 1, D]. causal >= 0: row b attends to keys
// 0..causal + b only (a prompt chunk's queries over its sequence's keys, k and v read with
// stride 0 across rows).
void decode_attention(const Strided& q, const Strided& k, const Strided& v, const Strided& m,
                      int kind, float* out, int64_t b_len, int64_t kv_len, int64_t rep,
                      int64_t l_len, int64_t d, float scale, int64_t causal = -1);

// quant_matmul.cpp: n floats narrowed to float16 (a KV cache kept in 16 bits, its bits),
// rounded to nearest even as MLX casts, by the variant appliance_simd_level() names.
void narrow_half(const float* src, uint16_t* dst, int64_t n);

// quant_matmul.cpp: f(u0, u1) over [0, units) in pieces, on the caller and the native
// code's one pool (pool.h; each unit once).
void parallel_units(int64_t units, void (*f)(const void*, int64_t, int64_t), const void* ctx);

template <class F>
void parallel(int64_t units, const F& f) {
  parallel_units(units, [](const void* c, int64_t u0, int64_t u1) {
    (*static_cast<const F*>(c))(u0, u1);
  }, &f);
}

// quant_matmul.cpp: y[p] = x @ W[p].T (+ residual for one weight) for tile()'s 4- or 8-bit
// weights.
struct TiledWeight {
  const void* tiles;
  const void* scales;
  const void* biases;
  int64_t n;
  int bits;  // 4 or 8, each its own (a Q4_K_M layer's v is 8-bit beside a 4-bit q and k)
};
void tiled_products(const float* x, int64_t m, int64_t k, int group, mlx::core::Dtype scales,
                    const TiledWeight* weights, float* const* ys, int count,
                    const float* residual);

}  // namespace fast_kernels
