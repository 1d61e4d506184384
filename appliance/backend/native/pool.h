/* pool.h: the one thread pool of the native code (skinny_matmul.c's products, the quantized
 * products, the fast operations' big ones, the fused decode layer's), sized by the
 * `quant_threads` setting (APPLIANCE_QUANT_THREADS; 0 or unset: the cores this process may
 * run on, at most 8), the caller included. docs/decisions/one-simd-scheme-one-pool.md. */
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

#ifndef APPLIANCE_HIDDEN
#define APPLIANCE_HIDDEN __attribute__((visibility("hidden")))  /* each library its own copy */
#endif

/* One task of a job: fn(ctx, i) for each i in [0, count). */
typedef void (*appliance_task_fn)(const void *ctx, long task);

/* Threads a job is shared across, the caller included (1: no helpers). */
APPLIANCE_HIDDEN int appliance_pool_threads(void);
/* Runs fn(ctx, i) once for every i < count, on the caller and the pool's helpers, and
 * returns when all are done. While another thread's job runs (or inside a task) the caller
 * runs its tasks alone, so a call never waits for a pool that is busy. linger: how long the
 * helpers wait for the next job before they sleep, APPLIANCE_POOL_SHORT (about 0.1 ms: the
 * quantized products, whose engine thread builds the next step on the same cores) or
 * APPLIANCE_POOL_LONG (about a millisecond, then yielding: float32 models' products, whose
 * steps the helpers' waking slowed). */
enum { APPLIANCE_POOL_SHORT = 0, APPLIANCE_POOL_LONG = 1 };
APPLIANCE_HIDDEN void appliance_pool_run(appliance_task_fn fn, const void *ctx, long count,
                                         int linger);
/* 1 when the two calls above reach the pool of another library (the preloaded
 * _skinny_matmul's, below), 0 when they reach this library's own. */
APPLIANCE_HIDDEN int appliance_pool_shared(void);

/* The pool as a library offers it to the others in the process: _skinny_matmul, preloaded
 * before anything else, exports its own under APPLIANCE_POOL_SYMBOL (pool.c compiled with
 * APPLIANCE_POOL_EXPORT); the others look it up once (dlsym) and use it instead of starting
 * helpers of their own. */
typedef struct {
    int version;
    int (*threads)(void);
    void (*run)(appliance_task_fn fn, const void *ctx, long count, int linger);
} appliance_pool_api;
#define APPLIANCE_POOL_SYMBOL "appliance_pool_v1"
#define APPLIANCE_POOL_VERSION 2

#ifdef __cplusplus
}
#endif
