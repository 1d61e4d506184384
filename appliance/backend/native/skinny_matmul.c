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
 * Tiles of M rows by N columns keep M * N <= 24 accumulators in AVX-512's 32 registers
 * (docs/decisions.md has the measurements); without AVX-512 a tile is 2 columns.
 *
 * Instruction sets are chosen at run time, not at build time (a package built on one
 * processor must not die with SIGILL on another): the tile loops are compiled three times,
 * for AVX-512, for AVX2 with FMA and for the baseline of the architecture, and the first
 * call takes the best the processor and its OS support (__builtin_cpu_supports), or the
 * one APPLIANCE_SIMD names (avx512, avx2, portable) for tests. A width of tile never
 * changes a sum, but FMA does: the variants agree to rounding, not to the bit.
 *
 * Big enough products are split by columns between the calling thread and one helper
 * thread (see skinny_shared), so a decode step uses two cores as OpenBLAS's gemm does.
 *
 * It is built as a Python extension module only so that pip compiles it with the package;
 * Python never imports it (it defines no module init function).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <pthread.h>
#include <sched.h>
#include <string.h>

#include "lane_sums.h"

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };
enum { LANES = 16, MAX_ROWS = 8, GROUP_ROWS = 32, GROUP_COLUMNS = 64 };

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef float uvec __attribute__((vector_size(LANES * sizeof(float)), aligned(4)));

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int,
                         float, float *, int);

static sgemm_fn next_sgemm;
static sgemv_fn next_sgemv;
static unsigned long n_kernel, n_gemv;

static void choose_simd(void);

__attribute__((constructor)) static void resolve(void) {
    next_sgemm = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
    next_sgemv = (sgemv_fn)dlsym(RTLD_NEXT, "cblas_sgemv");
    choose_simd();
}

/* Products that ran the kernel, and that went to gemv (the tests read them via ctypes). */
unsigned long appliance_skinny_kernel_calls(void) { return __atomic_load_n(&n_kernel, __ATOMIC_RELAXED); }
unsigned long appliance_skinny_gemv_calls(void) { return __atomic_load_n(&n_gemv, __ATOMIC_RELAXED); }

/* 1 when OpenBLAS's gemm and gemv were found after this library, else 0. */
int appliance_skinny_active(void) { return next_sgemm != NULL && next_sgemv != NULL; }

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
    static void NAME(int m, int n, int k, float alpha, const float *a, int lda, \
                     const float *b, int ldb, float beta, float *c, int ldc) { \
        switch (m) { \
            ROWS_CASE(1, 8, IS_WIDE) ROWS_CASE(2, 8, IS_WIDE) ROWS_CASE(3, 6, IS_WIDE) \
            ROWS_CASE(4, 5, IS_WIDE) ROWS_CASE(5, 4, IS_WIDE) ROWS_CASE(6, 4, IS_WIDE) \
            ROWS_CASE(7, 3, IS_WIDE) ROWS_CASE(8, 3, IS_WIDE) \
            default: abort(); \
        } \
    }

typedef void (*rows_fn)(int, int, int, float, const float *, int, const float *, int, float,
                        float *, int);

ROWS_VARIANT(rows_portable, 0)
#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) ROWS_VARIANT(rows_avx2, 0)
__attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,fma"))) ROWS_VARIANT(rows_avx512, 1)
#endif

static rows_fn rows_up_to_8 = rows_portable;
static const char *simd_name = "portable";

/* The variant for this processor, or the one APPLIANCE_SIMD asks for (when it can run). */
static void choose_simd(void) {
    const char *want = getenv("APPLIANCE_SIMD");
#if defined(__x86_64__)
    __builtin_cpu_init();
    int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                 __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (want != NULL && *want != '\0') {
        avx512 = avx512 && strcmp(want, "avx512") == 0;
        avx2 = avx2 && (strcmp(want, "avx2") == 0);
    }
    if (avx512) {
        rows_up_to_8 = rows_avx512;
        simd_name = "avx512";
    } else if (avx2) {
        rows_up_to_8 = rows_avx2;
        simd_name = "avx2";
    }
#else
    (void)want;
#endif
}

/* The variant in use: "avx512", "avx2" or "portable" (the tests and the log read it). */
const char *appliance_skinny_simd(void) { return simd_name; }

/* Up to MAX_ROWS rows at once; more (up to GROUP_ROWS) in groups of MAX_ROWS over blocks of
 * GROUP_COLUMNS columns of B, so each block is read from memory once and from the cache by
 * the later groups. Every output is summed as rows_kernel sums it, whatever its group. */
static void skinny(int m, int n, int k, float alpha, const float *a, int lda, const float *b,
                   int ldb, float beta, float *c, int ldc) {
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

/* One helper thread shares the kernel's products. The columns are cut into blocks that
 * either thread claims from a shared counter, so when the helper is not running (another
 * process has the core) the caller computes every block itself instead of waiting a time
 * slice for it: on a busy 2-core machine a fixed half-and-half split made some decode steps
 * eight times slower. A column is summed the same way on either thread. Between products
 * the helper waits spinning (about a millisecond: a decode step's products come
 * microseconds apart), then yielding the core to anyone who wants it (a step's Python work
 * between two steps), then asleep on a condition variable, so an idle daemon uses no CPU for
 * it. Waking a sleeping thread costs far more on a virtual machine than these products do:
 * sleeping after a millisecond made a decode step of 8 rows 10 % slower here. */
typedef struct {
    int m, n, k, lda, ldb, ldc, blocks;
    float alpha, beta;
    const float *a, *b;
    float *c;
} job_t;

enum { SPLIT_MIN = 1 << 16, PAUSES = 20000, YIELDS = 20000, BLOCK_MIN = 32 };

static job_t job;

/* The job's fields are written by the caller and copied by the helper, possibly while the
 * caller writes the next job's. Each field is a release store and an acquire load, so the
 * copy is no data race, and a helper that read any field of the next job also sees the old
 * job's claim closed (it was closed before that store): its claim fails. */
#define JOB_FIELDS(X) X(m) X(n) X(k) X(lda) X(ldb) X(ldc) X(blocks) X(alpha) X(beta) \
    X(a) X(b) X(c)
static void publish_job(const job_t *next) {
#define PUT(f) __atomic_store(&job.f, &next->f, __ATOMIC_RELEASE);
    JOB_FIELDS(PUT)
#undef PUT
}
static job_t read_job(void) {
    job_t j;
#define GET(f) __atomic_load(&job.f, &j.f, __ATOMIC_ACQUIRE);
    JOB_FIELDS(GET)
#undef GET
    return j;
}
static unsigned posted;
static unsigned long long claim;  /* (job number << 32) | next block to claim */
static int done_blocks;
static int helper_up, helper_asleep;
static pthread_mutex_t helper_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t helper_busy = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t helper_wake = PTHREAD_COND_INITIALIZER;

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

enum { CLOSED = 0x7fffffff };  /* a finished job's claim index: nothing left to take */

/* Claims the next block of job `number`; -1 when it has none left (or is over). A helper
 * late for a job holds a copy of it that may be torn by the next job's writing; its claim
 * fails because the caller closes a job's counter before writing the next job. */
static int take_block(unsigned number, int blocks) {
    unsigned long long seen = __atomic_load_n(&claim, __ATOMIC_SEQ_CST);
    for (;;) {
        unsigned index = (unsigned)(seen & 0xffffffffu);
        if ((unsigned)(seen >> 32) != number || index >= CLOSED || (int)index >= blocks)
            return -1;
        if (__atomic_compare_exchange_n(&claim, &seen, seen + 1, 0, __ATOMIC_SEQ_CST,
                                        __ATOMIC_SEQ_CST))
            return (int)(seen & 0xffffffffu);
    }
}

static void run_block(const job_t *j, int block) {
    int width = ((j->n + j->blocks - 1) / j->blocks + 1) & ~1;
    int n0 = block * width, n1 = n0 + width < j->n ? n0 + width : j->n;
    if (n1 > n0)
        skinny(j->m, n1 - n0, j->k, j->alpha, j->a, j->lda, j->b + (long)n0 * j->ldb, j->ldb,
               j->beta, j->c + n0, j->ldc);
    __atomic_add_fetch(&done_blocks, 1, __ATOMIC_SEQ_CST);
}

static void *helper(void *unused) {
    (void)unused;
    unsigned seen = 0;
    for (;;) {
        for (int spin = 0; __atomic_load_n(&posted, __ATOMIC_SEQ_CST) == seen; spin++) {
            if (spin < PAUSES) {
                relax();
            } else if (spin < PAUSES + YIELDS) {
                sched_yield();
            } else {
                pthread_mutex_lock(&helper_lock);
                __atomic_store_n(&helper_asleep, 1, __ATOMIC_SEQ_CST);
                while (__atomic_load_n(&posted, __ATOMIC_SEQ_CST) == seen)
                    pthread_cond_wait(&helper_wake, &helper_lock);
                __atomic_store_n(&helper_asleep, 0, __ATOMIC_SEQ_CST);
                pthread_mutex_unlock(&helper_lock);
            }
        }
        seen = __atomic_load_n(&posted, __ATOMIC_SEQ_CST);
        /* The copy is of job `seen` whenever a claim below succeeds: a job's fields do not
         * change until all its blocks are done, and a claim needs one not yet taken. */
        job_t j = read_job();
        for (int block; (block = take_block(seen, j.blocks)) >= 0;) run_block(&j, block);
    }
    return NULL;
}

static void wake_helper(void) {
    if (__atomic_load_n(&helper_asleep, __ATOMIC_SEQ_CST)) {
        pthread_mutex_lock(&helper_lock);
        pthread_cond_signal(&helper_wake);
        pthread_mutex_unlock(&helper_lock);
    }
}

/* Whether this process may run on two cores or more (its affinity mask: a process pinned
 * to one core, as a machine of a distributed group is, would have the helper spin on the
 * core the caller computes on). Read once. */
static int may_share(void) {
    static int known = -1;
    if (known < 0) {
        cpu_set_t set;
        known = sched_getaffinity(0, sizeof(set), &set) != 0 || CPU_COUNT(&set) >= 2;
    }
    return known;
}

/* skinny() on two threads when the product is big enough and the helper is free. */
static void skinny_shared(int m, int n, int k, float alpha, const float *a, int lda,
                          const float *b, int ldb, float beta, float *c, int ldc) {
    if ((long)n * k < SPLIT_MIN || n < 2 * BLOCK_MIN || !may_share()
        || pthread_mutex_trylock(&helper_busy) != 0) {
        skinny(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        return;
    }
    if (!helper_up) {
        pthread_t t;
        if (pthread_create(&t, NULL, helper, NULL) != 0) {
            pthread_mutex_unlock(&helper_busy);
            skinny(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
            return;
        }
        pthread_detach(t);
        helper_up = 1;
    }
    int blocks = n / BLOCK_MIN < 16 ? n / BLOCK_MIN : 16;
    unsigned number = __atomic_load_n(&posted, __ATOMIC_SEQ_CST) + 1;
    const job_t next = {m, n, k, lda, ldb, ldc, blocks, alpha, beta, a, b, c};
    publish_job(&next);
    __atomic_store_n(&done_blocks, 0, __ATOMIC_SEQ_CST);
    __atomic_store_n(&claim, (unsigned long long)number << 32, __ATOMIC_SEQ_CST);
    __atomic_store_n(&posted, number, __ATOMIC_SEQ_CST);
    wake_helper();
    for (int block; (block = take_block(number, blocks)) >= 0;) run_block(&next, block);
    for (long spin = 1; __atomic_load_n(&done_blocks, __ATOMIC_SEQ_CST) < blocks; spin++) {
        relax();
        if (spin % 4096 == 0)
            wake_helper();  /* belt and braces: never wait on a helper that sleeps */
    }
    /* Closed before the next job is written: a late helper's claim on it now fails. */
    __atomic_store_n(&claim, ((unsigned long long)number << 32) | CLOSED, __ATOMIC_SEQ_CST);
    pthread_mutex_unlock(&helper_busy);
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
