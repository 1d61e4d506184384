/* skinny_kernel.h: skinny_matmul.c's tile loops, written once and compiled once per
 * instruction set: the baseline in skinny_matmul.c, AVX2 with FMA in skinny_avx2.c, AVX-512 in
 * skinny_avx512.c (simd.h says why in files of their own). Every output is summed in one fixed
 * order (16 partial sums over k, lane_sums16's tree over them, then the tail), whatever the
 * number of rows, the tile or its neighbours. Tiles of M rows by N columns keep M * N <= 24
 * accumulators in AVX-512's 32 registers; the other variants take 2 columns. */
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

/* One case of a variant: R rows in tiles of WIDE columns (AVX-512) or 2 (the others). */
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
