/* simd.c: appliance_simd_level() (simd.h). Compiled into each native library (the preloaded
 * _skinny_matmul and the MLX extension _mlx_fast), hidden in each: the same source and the
 * same variable give the same answer in both. */
#include "simd.h"

#include <stdlib.h>
#include <string.h>


static int chosen = -1, vnni;

static void choose(void) {
    int best = APPLIANCE_SIMD_PORTABLE, has_vnni = 0;
#if defined(__x86_64__)
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                     __builtin_cpu_supports("f16c");
    const int avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                       __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512vl");
    best = avx512 ? APPLIANCE_SIMD_AVX512 : avx2 ? APPLIANCE_SIMD_AVX2 : APPLIANCE_SIMD_PORTABLE;
    const char *want = getenv("APPLIANCE_SIMD");
    if (want != NULL && *want != '\0' && strcmp(want, "auto") != 0) {
        if (strcmp(want, "avx512") == 0 && avx512) best = APPLIANCE_SIMD_AVX512;
        else if (strcmp(want, "avx2") == 0 && avx2) best = APPLIANCE_SIMD_AVX2;
        else best = APPLIANCE_SIMD_PORTABLE;
    }
    has_vnni = best == APPLIANCE_SIMD_AVX512 && __builtin_cpu_supports("avx512vnni");
#endif
    __atomic_store_n(&vnni, has_vnni, __ATOMIC_RELAXED);
    __atomic_store_n(&chosen, best, __ATOMIC_RELEASE);
}

int appliance_simd_level(void) {
    /* Every thread that gets here first computes the same answer; the store publishes vnni. */
    int level = __atomic_load_n(&chosen, __ATOMIC_ACQUIRE);
    if (level < 0) {
        choose();
        level = __atomic_load_n(&chosen, __ATOMIC_ACQUIRE);
    }
    return level;
}

const char *appliance_simd_name(void) {
    switch (appliance_simd_level()) {
        case APPLIANCE_SIMD_AVX512: return "avx512";
        case APPLIANCE_SIMD_AVX2: return "avx2";
        default: return "portable";
    }
}

int appliance_simd_vnni(void) {
    appliance_simd_level();
    return __atomic_load_n(&vnni, __ATOMIC_RELAXED);
}
