/* skinny_kernel.h: skinny_matmul.c's tile loops, written once and compiled once per
 * instruction set: the baseline in skinny_matmul.c, AVX2 with FMA in skinny_avx2.c, AVX-512 in
 * skinny_avx512.c (simd.h says why in files of their own). Every output is summed in one fixed
 * order (16 partial sums over k, lane_sums16's tree over them, then the tail), whatever the
 * number of rows, the tile or its neighbours. AVX-512 (tile): tiles of M rows by N columns
 * keep M * N <= 24 accumulators of 16 floats in its 32 registers. AVX2 and the baseline
 * (split_rows): the same sums on vectors of 8 and 4 floats, their registers' width. */
#pragma once

#include <stdlib.h>

#include "lane_sums.h"
#include "simd.h"

enum { LANES = 16, MAX_ROWS = 8 };

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef float uvec __attribute__((vector_size(LANES * sizeof(float)), aligned(4)));

/* C[m x n] (+)= A[m x k] . B[n x k]^T for m <= MAX_ROWS rows: one variant. */
typedef void (*rows_fn)(int, int, int, float, const float *, int, const float *, int, float,
                        float *, int);
APPLIANCE_HIDDEN void skinny_rows_avx2(int m, int n, int k, float alpha, const float *a, int lda,
                                    const float *b, int ldb, float beta, float *c, int ldc);
APPLIANCE_HIDDEN void skinny_rows_avx512(int m, int n, int k, float alpha, const float *a, int lda,
                                      const float *b, int ldb, float beta, float *c, int ldc);

static inline void store(float *c, float alpha, float beta, float dot) {
    *c = beta == 0.0f ? alpha * dot : alpha * dot + beta * *c;
}

/* Output (i, j) of a split tile (below): its vector sums[j * M + i] plus its tail, the
 * products past the last whole 16 of k in order, as tile adds them. */
static inline __attribute__((always_inline)) void tile_tails(
        const int M, const int N, int k, int kv, const float *sums, float alpha, const float *a,
        int lda, const float *b, int ldb, float beta, float *c, int ldc) {
    for (int j = 0; j < N; j++) {
        const float *w = b + (long)j * ldb;
        for (int i = 0; i < M; i++) {
            const float *x = a + (long)i * lda;
            float tail = 0.0f;
            for (int p = kv; p < k; p++) tail += x[p] * w[p];
            store(c + (long)i * ldc + j, alpha, beta, sums[j * M + i] + tail);
        }
    }
}

/* C[M x N] (+)= A[M x k] . B[N x k]^T: M rows by N columns of C, with M * N <= 24
 * accumulators in registers (AVX-512 has 32), so each column of B and each row of A loaded
 * serves several products. */
static inline __attribute__((always_inline)) void tile(
        const int M, const int N, const int pin, int k, float alpha, const float *a, int lda,
        const float *b, int ldb, float beta, float *c, int ldc) {
    const int kv = k - k % LANES;
    vec acc[32];
    for (int t = 0; t < 32; t++) acc[t] = (vec){0};
    for (int p = 0; p < kv; p += LANES) {
        vec w[8];
        for (int j = 0; j < N; j++) {
            w[j] = *(const uvec *)(b + (long)j * ldb + p);
            if (M >= 4)  /* the next tile's columns: streamed with products between, the */
                __builtin_prefetch(b + (long)(N + j) * ldb + p);  /* loads came late */
        }
        for (int i = 0; i < M; i++) {
            vec x = *(const uvec *)(a + (long)i * lda + p);
#if defined(__x86_64__)
            if (pin)  /* one load of the row for its N products, not N (AVX-512 only: */
                __asm__("" : "+v"(x));  /* a 16-lane vector is one register there) */
#endif
            for (int j = 0; j < N; j++) acc[j * M + i] += x * w[j];
        }
    }
    float sums[32] __attribute__((aligned(64)));
    for (int t = 0; t < M * N; t += 16) *(vec *)(sums + t) = lane_sums16(acc + t);
    for (int j = 0; j < N; j++) {
        const float *w = b + (long)j * ldb;
        for (int i = 0; i < M; i++) {
            const float *x = a + (long)i * lda;
            float tail = 0.0f;
            for (int p = kv; p < k; p++) tail += x[p] * w[p];
            store(c + (long)i * ldc + j, alpha, beta, sums[j * M + i] + tail);
        }
    }
}

/* C[M x n] (+)= A[M x k] . B[n x k]^T for a fixed M, N columns of C at a time (the last few
 * one at a time: every output is summed the same way in a tile of any width). */
static inline __attribute__((always_inline)) void rows_kernel(
        const int M, const int N, const int pin, int n, int k, float alpha, const float *a,
        int lda, const float *b, int ldb, float beta, float *c, int ldc) {
    int j = 0;
    for (; j + N <= n; j += N)
        tile(M, N, pin, k, alpha, a, lda, b + (long)j * ldb, ldb, beta, c + j, ldc);
    for (; j < n; j++)
        tile(M, 1, pin, k, alpha, a, lda, b + (long)j * ldb, ldb, beta, c + j, ldc);
}

/* tile on vectors of V = 8 floats (AVX2's registers) or 4 (SSE2's): there a 16-float vec is
 * not a register, and GCC kept tile's accumulators on the stack (every product a round trip
 * through memory; AVX2 ran 2-4 times slower than the baseline). Each output's 16 partial sums
 * are 16 / V accumulators of V lanes (lanes 0-7 and 8-15, or 0-3, 4-7, ...), each summed over
 * k in tile's order; lane_sums16's first steps add the parts (lane_sums.h), lane_sums8 or
 * lane_sums4 do the rest. So every output has tile's bits (FMA: the AVX-512 variant's; no
 * FMA: the baseline's before). M rows by N columns, 2 by 2 at most: 2 * M * N accumulators,
 * N weights and a row in 16 registers (V = 8: each of the 2 parts; V = 4: one at a time). */
typedef float vec8 __attribute__((vector_size(8 * sizeof(float))));
typedef float uvec8 __attribute__((vector_size(8 * sizeof(float)), aligned(4)));
typedef float vec4 __attribute__((vector_size(4 * sizeof(float))));
typedef float uvec4 __attribute__((vector_size(4 * sizeof(float)), aligned(4)));

#if defined(__x86_64__)  /* one load of each weight and row a step, not one a product */
#define PIN(v) __asm__("" : "+x"(v))  /* (GCC reloaded them, twice the loads) */
#else
#define PIN(v) (void)0
#endif

static inline __attribute__((always_inline)) void tile_halves(
        const int M, const int N, int k, float alpha, const float *a, int lda, const float *b,
        int ldb, float beta, float *c, int ldc) {
    const int kv = k - k % LANES;
    vec8 lo[8], hi[8];
    for (int t = 0; t < 8; t++) lo[t] = hi[t] = (vec8){0};
    for (int p = 0; p < kv; p += LANES) {
        vec8 wl[4], wh[4];
        for (int j = 0; j < N; j++) {
            wl[j] = *(const uvec8 *)(b + (long)j * ldb + p);
            wh[j] = *(const uvec8 *)(b + (long)j * ldb + p + 8);
            if (M > 1) { PIN(wl[j]); PIN(wh[j]); }
        }
        for (int i = 0; i < M; i++) {
            vec8 xl = *(const uvec8 *)(a + (long)i * lda + p);
            vec8 xh = *(const uvec8 *)(a + (long)i * lda + p + 8);
            if (N > 1) { PIN(xl); PIN(xh); }
            for (int j = 0; j < N; j++) {
                lo[j * M + i] += xl * wl[j];
                hi[j * M + i] += xh * wh[j];
            }
        }
    }
    vec8 halves[8];
    for (int t = 0; t < 8; t++) halves[t] = lo[t] + hi[t];
    float sums[8] __attribute__((aligned(32)));
    *(vec8 *)sums = lane_sums8(halves);
    tile_tails(M, N, k, kv, sums, alpha, a, lda, b, ldb, beta, c, ldc);
}

static inline __attribute__((always_inline)) void tile_quarters(
        const int M, const int N, int k, float alpha, const float *a, int lda, const float *b,
        int ldb, float beta, float *c, int ldc) {
    const int kv = k - k % LANES;
    vec4 acc[4][4];
    for (int q = 0; q < 4; q++)
        for (int t = 0; t < 4; t++) acc[q][t] = (vec4){0};
    for (int p = 0; p < kv; p += LANES)
        for (int q = 0; q < 4; q++) {
            vec4 w[2];
            for (int j = 0; j < N; j++) {
                w[j] = *(const uvec4 *)(b + (long)j * ldb + p + 4 * q);
                if (M > 1) PIN(w[j]);
            }
            for (int i = 0; i < M; i++) {
                vec4 x = *(const uvec4 *)(a + (long)i * lda + p + 4 * q);
                if (N > 1) PIN(x);
                for (int j = 0; j < N; j++) acc[q][j * M + i] += x * w[j];
            }
        }
    vec4 folded[4];
    for (int t = 0; t < 4; t++) folded[t] = (acc[0][t] + acc[2][t]) + (acc[1][t] + acc[3][t]);
    float sums[4] __attribute__((aligned(16)));
    *(vec4 *)sums = lane_sums4(folded);
    tile_tails(M, N, k, kv, sums, alpha, a, lda, b, ldb, beta, c, ldc);
}

/* C[M x n] (+)= A[M x k] . B[n x k]^T, M <= MAX_ROWS, on V-float vectors: tiles of 2 rows by
 * 2 columns (one row: V = 8 takes 4 columns), a column tile's row groups one after another,
 * so its weights come from memory once and from the cache for the later groups. */
static inline __attribute__((always_inline)) void split_tile(
        const int V, const int M, const int N, int k, float alpha, const float *a, int lda,
        const float *b, int ldb, float beta, float *c, int ldc) {
    if (V == 8)
        tile_halves(M, N, k, alpha, a, lda, b, ldb, beta, c, ldc);
    else
        tile_quarters(M, N, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

static inline __attribute__((always_inline)) void split_columns(
        const int V, const int M, const int N, int j0, int j1, int k, float alpha,
        const float *a, int lda, const float *b, int ldb, float beta, float *c, int ldc) {
    const int R = M < 2 ? M : 2;
    for (int j = j0; j < j1; j += N) {
        int i = 0;
        for (; i + R <= M; i += R)
            split_tile(V, R, N, k, alpha, a + (long)i * lda, lda, b + (long)j * ldb, ldb, beta,
                       c + (long)i * ldc + j, ldc);
        if (M % R)
            split_tile(V, M % R, N, k, alpha, a + (long)i * lda, lda, b + (long)j * ldb, ldb,
                       beta, c + (long)i * ldc + j, ldc);
    }
}

static inline __attribute__((always_inline)) void split_rows(
        const int V, const int M, int n, int k, float alpha, const float *a, int lda,
        const float *b, int ldb, float beta, float *c, int ldc) {
    const int N = V == 8 && M == 1 ? 4 : 2, whole = n - n % N;
    split_columns(V, M, N, 0, whole, k, alpha, a, lda, b, ldb, beta, c, ldc);
    split_columns(V, M, 1, whole, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

/* A variant on V-float vectors (skinny_avx2.c: 8; the baseline: 4). */
#define SPLIT_CASE(V, M) \
    case M: split_rows(V, M, n, k, alpha, a, lda, b, ldb, beta, c, ldc); break;
#define ROWS_VARIANT_SPLIT(NAME, V) \
    void NAME(int m, int n, int k, float alpha, const float *a, int lda, \
                     const float *b, int ldb, float beta, float *c, int ldc) { \
        switch (m) { \
            SPLIT_CASE(V, 1) SPLIT_CASE(V, 2) SPLIT_CASE(V, 3) SPLIT_CASE(V, 4) \
            SPLIT_CASE(V, 5) SPLIT_CASE(V, 6) SPLIT_CASE(V, 7) SPLIT_CASE(V, 8) \
            default: abort(); \
        } \
    }

/* One case of the AVX-512 variant: R rows in tiles of WIDE columns (IS_WIDE: 1). */
#define ROWS_CASE(R, WIDE, IS_WIDE) \
    case R: rows_kernel(R, IS_WIDE ? WIDE : 2, IS_WIDE, n, k, alpha, a, lda, b, ldb, beta, c, \
                        ldc); break;
#define ROWS_VARIANT(NAME, IS_WIDE) \
    void NAME(int m, int n, int k, float alpha, const float *a, int lda, \
                     const float *b, int ldb, float beta, float *c, int ldc) { \
        switch (m) { \
            ROWS_CASE(1, 8, IS_WIDE) ROWS_CASE(2, 8, IS_WIDE) ROWS_CASE(3, 6, IS_WIDE) \
            ROWS_CASE(4, 5, IS_WIDE) ROWS_CASE(5, 4, IS_WIDE) ROWS_CASE(6, 4, IS_WIDE) \
            ROWS_CASE(7, 3, IS_WIDE) ROWS_CASE(8, 3, IS_WIDE) \
            default: abort(); \
        } \
    }
