/* skinny_matmul: the appliance's own kernel for matrix products with few rows.
 *
 * MLX's CPU backend computes every matrix product with cblas_sgemm. A decode step of a
 * batch of B sequences multiplies B rows (B = 1..8) by every weight matrix of the model.
 * OpenBLAS's gemm is built for big products: it first packs the whole weight matrix into a
 * scratch buffer (reading and writing the weights once more than needed) and wakes its
 * threads for every call. On a quiet 2-core x86 machine one row by the SmolLM-135M shape's
 * 49152 x 576 vocabulary matrix took 15 ms (7.6 GB/s of weights); streaming the matrix once
 * on two threads, as below, takes 4.9 ms (`python -m bench.matmul`). Debian 12 ships OpenBLAS
 * 0.3.21 (0.3.27 added a gemm-to-gemv forward for one row, nothing for a few).
 *
 * This library is preloaded (LD_PRELOAD) before OpenBLAS by `appliance serve`/`run` on
 * Linux and defines cblas_sgemm, so MLX's calls land here:
 *  - row-major C = alpha * A * B^T + beta * C with at most GROUP_ROWS (32) rows (a
 *    linear layer: x @ W.T, and attention's q @ k^T) runs the kernel below, which reads B
 *    from memory once: up to MAX_ROWS rows in registers, in tiles of several columns (each
 *    load of a row of A or B serves several products), more rows in groups of MAX_ROWS over
 *    a block of columns that stays in the cache (a decode step of 8 rows with a prompt
 *    chunk of 20 tokens read in its forward is 28 rows). Above 16 rows OpenBLAS's gemm,
 *    which copies the weights first, took a step longer: a decode step of 7 rows with a
 *    16-token chunk riding 113-142 ms, through this kernel 85-104 ms
 *    (`python -m bench.mixed --rows 4,7 --chunks 8,12,16,20,24,28`);
 *  - any other product with one row or one column goes to the next library's cblas_sgemv;
 *  - everything else (prefill's big products) goes to the next library's cblas_sgemm.
 *
 * The kernel sums every output in one fixed order (16 partial sums over k, the same tree
 * over them, then the tail), whatever the number of rows, the tile or its neighbours: a row
 * gets the same bits alone and in a batch, so greedy decoding does not depend on batching.
 * Tiles of M rows by N columns keep M * N <= 24 accumulators in AVX-512's 32 registers;
 * AVX2 and the baseline hold the same sums in vectors of 8 and 4 floats, in tiles of 2 rows
 * by 2 columns (skinny_kernel.h; docs/decisions/skinny-avx2-tile.md).
 *
 * Instruction sets are chosen at run time, not at build time (a package built on one
 * processor must not die with SIGILL on another): the tile loops are compiled for AVX-512
 * (skinny_avx512.c), AVX2 with FMA (skinny_avx2.c) and the baseline (here), and the first
 * product takes the variant that appliance_simd_level() names (simd.h: the one choice for
 * all the native code, the processor's widest or the `simd` setting's). A width of
 * tile never changes a sum, but FMA does: the variants agree to rounding, not to the bit.
 *
 * Big enough products are split by columns across the native code's one pool (pool.h; see
 * skinny_shared), which this library exports to the MLX extension.
 *
 * It is built as a Python extension module only so that pip compiles it with the package;
 * Python never imports it (it defines no module init function).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"
#include "simd.h"
#include "skinny_kernel.h"

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };
enum { GROUP_ROWS = 32, GROUP_COLUMNS = 64 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int,
                         float, float *, int);

static sgemm_fn next_sgemm;
static sgemv_fn next_sgemv;
static unsigned long n_kernel, n_gemv;

__attribute__((constructor)) static void resolve(void) {
    next_sgemm = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
    next_sgemv = (sgemv_fn)dlsym(RTLD_NEXT, "cblas_sgemv");
}

/* Products that ran the kernel, and that went to gemv (the tests read them via ctypes). */
unsigned long appliance_skinny_kernel_calls(void) { return __atomic_load_n(&n_kernel, __ATOMIC_RELAXED); }
unsigned long appliance_skinny_gemv_calls(void) { return __atomic_load_n(&n_gemv, __ATOMIC_RELAXED); }

/* 1 when OpenBLAS's gemm and gemv were found after this library, else 0. */
int appliance_skinny_active(void) { return next_sgemm != NULL && next_sgemv != NULL; }

static ROWS_VARIANT_SPLIT(rows_portable, 4)
/* The variant appliance_simd_level() names (simd.h: the processor's widest, or the `simd`
 * setting's), asked at the first product rather than when the library loads: a library
 * preloaded by a parent process is loaded before the CLI exports the setting. */
static rows_fn rows_variant(void) {
#if defined(__x86_64__)
    switch (appliance_simd_level()) {
        case APPLIANCE_SIMD_AVX512: return skinny_rows_avx512;
        case APPLIANCE_SIMD_AVX2: return skinny_rows_avx2;
    }
#endif
    return rows_portable;
}

/* The variant in use: "avx512", "avx2" or "portable" (the tests and the log read it). */
const char *appliance_skinny_simd(void) { return appliance_simd_name(); }

/* Up to MAX_ROWS rows at once; more (up to GROUP_ROWS) in groups of MAX_ROWS over blocks of
 * GROUP_COLUMNS columns of B, so each block is read from memory once and from the cache by
 * the later groups. Every output is summed as rows_kernel sums it, whatever its group. */
static void skinny(int m, int n, int k, float alpha, const float *a, int lda, const float *b,
                   int ldb, float beta, float *c, int ldc) {
    const rows_fn rows_up_to_8 = rows_variant();
    if (m <= MAX_ROWS) {
        rows_up_to_8(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        return;
    }
    for (int j = 0; j < n; j += GROUP_COLUMNS) {
        int w = n - j < GROUP_COLUMNS ? n - j : GROUP_COLUMNS;
        for (int i = 0; i < m; i += MAX_ROWS)
            rows_up_to_8(m - i < MAX_ROWS ? m - i : MAX_ROWS, w, k, alpha, a + (long)i * lda,
                         lda, b + (long)j * ldb, ldb, beta, c + (long)i * ldc + j, ldc);
    }
}

/* Big enough products are shared with the native code's one pool (pool.h): the columns are
 * cut into blocks that the caller and the pool's helpers claim from a shared counter, so
 * when a helper is not running (another process has the core) the caller computes its
 * blocks instead of waiting a time slice for it (a fixed half-and-half split made some
 * decode steps eight times slower on a busy 2-core machine). A column is summed the same way
 * on any thread. This library is preloaded before the MLX extension, so its pool is the one
 * the extension finds and uses too (pool.c). */
typedef struct {
    int m, n, k, lda, ldb, ldc, width;
    float alpha, beta;
    const float *a, *b;
    float *c;
} job_t;

enum { SPLIT_MIN = 1 << 16, BLOCK_MIN = 32, BLOCKS_PER_THREAD = 8 };

static void run_block(const void *ctx, long block) {
    const job_t *j = (const job_t *)ctx;
    int n0 = (int)block * j->width, n1 = n0 + j->width < j->n ? n0 + j->width : j->n;
    if (n1 > n0)
        skinny(j->m, n1 - n0, j->k, j->alpha, j->a, j->lda, j->b + (long)n0 * j->ldb, j->ldb,
               j->beta, j->c + n0, j->ldc);
}

/* skinny() on the pool's threads when the product is big enough. */
static void skinny_shared(int m, int n, int k, float alpha, const float *a, int lda,
                          const float *b, int ldb, float beta, float *c, int ldc) {
    const int threads = (long)n * k < SPLIT_MIN || n < 2 * BLOCK_MIN ? 1 : appliance_pool_threads();
    if (threads < 2) {
        skinny(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        return;
    }
    const int most = BLOCKS_PER_THREAD * threads;
    const int blocks = n / BLOCK_MIN < most ? n / BLOCK_MIN : most;
    const job_t job = {m, n, k, lda, ldb, ldc, ((n + blocks - 1) / blocks + 1) & ~1, alpha, beta,
                       a, b, c};
    appliance_pool_run(run_block, &job, (n + job.width - 1) / job.width, APPLIANCE_POOL_LONG);
}

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta, float *c,
                 int ldc) {
    if (next_sgemm == NULL) {
        fputs("skinny_matmul: no cblas_sgemm after this library (preload OpenBLAS)\n", stderr);
        abort();
    }
    if (order != ROW_MAJOR || k <= 0 || m <= 0 || n <= 0 || next_sgemv == NULL) {
        next_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        return;
    }
    if (m <= GROUP_ROWS && trans_a == NO_TRANS && trans_b == TRANS) {
        __atomic_add_fetch(&n_kernel, 1, __ATOMIC_RELAXED);
        skinny_shared(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        return;
    }
    if (m != 1 && n != 1) {
        next_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        return;
    }
    __atomic_add_fetch(&n_gemv, 1, __ATOMIC_RELAXED);
    if (m == 1) {
        /* c (1 x n) = alpha * x (1 x k) * op(b) (k x n) + beta * c, that is
         * c^T = alpha * op(b)^T x^T + beta * c^T; x is row 0 of a, or column 0 of a^T. */
        int incx = trans_a == NO_TRANS ? 1 : lda;
        if (beta == 0.0f)  /* gemm ignores c when beta is 0; gemv would scale it (NaN * 0) */
            memset(c, 0, (size_t)n * sizeof(float));
        if (trans_b == NO_TRANS)  /* b is k x n */
            next_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a, incx, beta, c, 1);
        else                      /* b is n x k */
            next_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a, incx, beta, c, 1);
        return;
    }
    /* n == 1: c (m x 1, stride ldc) = alpha * op(a) (m x k) * y (k x 1) + beta * c. */
    int incy = trans_b == NO_TRANS ? ldb : 1;
    if (beta == 0.0f)
        for (int i = 0; i < m; i++) c[(long)i * ldc] = 0.0f;
    if (trans_a == NO_TRANS)  /* a is m x k */
        next_sgemv(ROW_MAJOR, NO_TRANS, m, k, alpha, a, lda, b, incy, beta, c, ldc);
    else                      /* a is k x m */
        next_sgemv(ROW_MAJOR, TRANS, k, m, alpha, a, lda, b, incy, beta, c, ldc);
}
