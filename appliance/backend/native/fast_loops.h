// fast_loops.h: the fast operations' loops (softmax, the SwiGLU gate, RMSNorm, a decode
// step's attention), written once in fast_loops.inc and compiled once per instruction set:
// the baseline in fast_loops.cpp, AVX2 with FMA and F16C in fast_avx2.cpp, AVX-512 in
// fast_avx512.cpp (simd.h says why in files of their own). loops() is the variant
// appliance_simd_level() names, for mlx_fast.cpp's operations and decode_layer.cpp alike, so
// a fused layer and the operations one by one get the same bits. No MLX here: the variant
// files compile the loops without parsing MLX's headers.

#pragma once

#include <cstdint>

namespace fast_kernels {

struct Strided {  // an input's base and element strides of its four axes (0: broadcast)
  const char* base;
  int64_t st[4];
  bool half = false;  // float16 elements (a KV cache's), else float32 (or a mask's own type)
};

enum MaskKind : int { NO_MASK = 0, BOOL_MASK = 1, ADD_MASK = 2 };

}  // namespace fast_kernels

namespace fast_loops {

using fast_kernels::Strided;

// Softmax of `rows` rows of n, the first of them row `first` of the whole array (causal: see
// fast_loops.inc); the SwiGLU gate a * sigmoid(a) * b over n; RMSNorm of `rows` rows of n.
typedef void (*softmax_fn)(const float* x, float* y, int64_t first, int64_t rows, int64_t n,
                           int64_t causal);
typedef void (*silu_fn)(const float* a, const float* b, float* y, int64_t n);
typedef void (*rms_fn)(const float* src, const float* pw, float* dst, int64_t rows, int64_t n,
                       float eps);
// Attention over units [u0, u1) of (batch row, KV head) (attention_heads.inc).
typedef void (*heads_fn)(const Strided& q, const Strided& k, const Strided& v, const Strided& m,
                         int kind, float* out, int64_t u0, int64_t u1, int64_t kv_len,
                         int64_t rep, int64_t keys_len, int64_t d, float scale, int64_t causal);

struct Loops {
  softmax_fn softmax_rows;
  silu_fn silu_mul_span;
  rms_fn rms_norm_rows;
  heads_fn heads;       // keys and values in float32
  heads_fn heads_half;  // in float16 (a KV cache kept in 16 bits), converted as they load
};

const Loops& portable_loops();  // fast_loops.cpp
const Loops& avx2_loops();      // fast_avx2.cpp (x86-64)
const Loops& avx512_loops();    // fast_avx512.cpp (x86-64)
const Loops& loops();           // the one appliance_simd_level() names (fast_loops.cpp)

}  // namespace fast_loops
