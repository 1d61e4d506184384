/* pool.c: the one thread pool (pool.h). Compiled into each native library; one process uses
 * one of the copies: the preloaded _skinny_matmul's when it is there (it exports it), else
 * the MLX extension's own.
 *
 * Persistent helpers share a job's tasks with the caller, claiming them from one counter, so
 * a helper that is not running (another process has the core) delays nothing: the caller
 * takes its tasks. Between jobs a helper spins a while (a decode step's products come
 * microseconds apart), then yields, then sleeps on a condition variable, so an idle daemon
 * uses no CPU for it. A job is known by its number in the claim counter's high half; the
 * caller closes the counter before it posts the next job, so a late helper's claim on an old
 * job fails, and a helper reads a job's function and context only after a claim succeeds
 * (while the caller waits for that job). Every shared field is an atomic: ThreadSanitizer
 * checks the hand-off (scripts/sanitize-native.sh). */
#define _GNU_SOURCE
#include "pool.h"

#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <unistd.h>

#define SC __ATOMIC_SEQ_CST

/* How long a helper waits for the next job, by the last job's linger (pool.h): pauses, then
 * yields, then asleep. SHORT, about 0.1 ms: long enough for the next product of a step,
 * short enough that the helpers sleep while the engine's thread builds the next step
 * (docs/decisions/quant-pool-sleeps-sooner.md). LONG, about 1 ms then many yields: a float32
 * model's step was 4-10 % slower at eight rows when they slept sooner
 * (docs/decisions/one-simd-scheme-one-pool.md). */
static const long PAUSES[2] = {2000, 20000}, YIELDS[2] = {200, 20000};
enum { MAX_THREADS = 64, PER_MACHINE = 8 };
static const unsigned CLOSED = 0x7fffffffu;  /* a finished job's claim index */

static int threads;
static pthread_once_t sized = PTHREAD_ONCE_INIT;
static pthread_mutex_t busy = PTHREAD_MUTEX_INITIALIZER, sleep_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake_cond = PTHREAD_COND_INITIALIZER;
static int started;  /* under busy */
static unsigned posted;
static unsigned long long claim;  /* (job number << 32) | next task to claim */
static long done, job_count;
static int asleep, job_linger;
static appliance_task_fn job_fn;
static const void *job_ctx;

/* The cores this process may run on: its affinity mask (a process pinned to one core, as a
 * machine of a distributed group is, gets no helper spinning beside its computing thread). */
static int usable_cores(void) {
#if defined(__linux__)
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0)
        return CPU_COUNT(&set) > 0 ? CPU_COUNT(&set) : 1;
#endif
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

static void size_pool(void) {
    const char *env = getenv("APPLIANCE_QUANT_THREADS");  /* the quant_threads setting */
    int asked = env != NULL ? atoi(env) : 0, cores = usable_cores();
    int n = asked > 0 ? asked : (cores < PER_MACHINE ? cores : PER_MACHINE);
    threads = n < 1 ? 1 : n > MAX_THREADS ? MAX_THREADS : n;
}

static int own_threads(void) {
    pthread_once(&sized, size_pool);
    return threads;
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* A task of job `number`, or -1 when none is left or the job is over. */
static long take(unsigned number) {
    unsigned long long seen = __atomic_load_n(&claim, SC);
    for (;;) {
        unsigned index = (unsigned)seen;
        if ((unsigned)(seen >> 32) != number || index >= CLOSED ||
            (long)index >= __atomic_load_n(&job_count, SC))
            return -1;
        if (__atomic_compare_exchange_n(&claim, &seen, seen + 1, 0, SC, SC)) return (long)index;
    }
}

static void work(unsigned number) {
    for (long i; (i = take(number)) >= 0;) {
        /* the claim succeeded: job `number` is live, these are its */
        appliance_task_fn fn = __atomic_load_n(&job_fn, SC);
        fn(__atomic_load_n(&job_ctx, SC), i);
        __atomic_add_fetch(&done, 1, SC);
    }
}

static void *helper(void *unused) {
    (void)unused;
    unsigned seen = 0;
    for (;;) {
        const int linger = __atomic_load_n(&job_linger, SC) == APPLIANCE_POOL_LONG;
        const long pauses = PAUSES[linger], yields = YIELDS[linger];
        for (long spin = 0; __atomic_load_n(&posted, SC) == seen; spin++) {
            if (spin < pauses) {
                relax();
            } else if (spin < pauses + yields) {
                sched_yield();
            } else {
                pthread_mutex_lock(&sleep_lock);
                __atomic_add_fetch(&asleep, 1, SC);
                while (__atomic_load_n(&posted, SC) == seen)
                    pthread_cond_wait(&wake_cond, &sleep_lock);
                __atomic_sub_fetch(&asleep, 1, SC);
                pthread_mutex_unlock(&sleep_lock);
            }
        }
        seen = __atomic_load_n(&posted, SC);
        work(seen);
    }
    return NULL;
}

static void start_helpers(void) {
    if (started) return;
    started = 1;
    for (int t = 1; t < threads; t++) {
        pthread_t id;
        if (pthread_create(&id, NULL, helper, NULL) != 0) break;  /* fewer: the caller does more */
#if defined(__linux__)
        pthread_setname_np(id, "appliance-pool");
#endif
        pthread_detach(id);
    }
}

static void wake(void) {
    if (__atomic_load_n(&asleep, SC) > 0) {
        pthread_mutex_lock(&sleep_lock);
        pthread_cond_broadcast(&wake_cond);
        pthread_mutex_unlock(&sleep_lock);
    }
}

static void own_run(appliance_task_fn fn, const void *ctx, long count, int linger) {
    if (own_threads() < 2 || count < 2 || pthread_mutex_trylock(&busy) != 0) {
        for (long i = 0; i < count; i++) fn(ctx, i);
        return;
    }
    start_helpers();
    const unsigned number = __atomic_load_n(&posted, SC) + 1;
    __atomic_store_n(&job_fn, fn, SC);
    __atomic_store_n(&job_ctx, ctx, SC);
    __atomic_store_n(&job_count, count, SC);
    __atomic_store_n(&job_linger, linger, SC);
    __atomic_store_n(&done, 0, SC);
    __atomic_store_n(&claim, (unsigned long long)number << 32, SC);
    __atomic_store_n(&posted, number, SC);
    wake();
    work(number);
    for (long spin = 1; __atomic_load_n(&done, SC) < count; spin++) {
        relax();
        if (spin % 4096 == 0) wake();  /* never wait on a helper that sleeps */
    }
    /* closed before the next job is written: a late helper's claim on this one now fails */
    __atomic_store_n(&claim, ((unsigned long long)number << 32) | CLOSED, SC);
    pthread_mutex_unlock(&busy);
}

#if defined(APPLIANCE_POOL_EXPORT)
__attribute__((visibility("default"))) const appliance_pool_api appliance_pool_v1 = {
    APPLIANCE_POOL_VERSION, own_threads, own_run};
#endif
static const appliance_pool_api own = {APPLIANCE_POOL_VERSION, own_threads, own_run};

/* The process's pool: another library's exported one (of this version), else our own. */
static const appliance_pool_api *chosen;
static pthread_once_t looked = PTHREAD_ONCE_INIT;

static void look_up(void) {
    const appliance_pool_api *found =
        (const appliance_pool_api *)dlsym(RTLD_DEFAULT, APPLIANCE_POOL_SYMBOL);
    chosen = found != NULL && found->version == APPLIANCE_POOL_VERSION ? found : &own;
}

static const appliance_pool_api *pool(void) {
    pthread_once(&looked, look_up);
    return chosen;
}

int appliance_pool_threads(void) { return pool()->threads(); }
void appliance_pool_run(appliance_task_fn fn, const void *ctx, long count, int linger) {
    pool()->run(fn, ctx, count, linger);
}
int appliance_pool_shared(void) { return pool()->run != own_run; }
