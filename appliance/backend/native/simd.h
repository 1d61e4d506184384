/* simd.h: the one choice of instruction set for all the native code (skinny_matmul.c, the
 * quantized products, the fast operations, the fused decode layer).
 *
 * A loop that has variants is written once and compiled once per instruction set in a file of
 * its own (quant_avx2.cpp, quant_avx512.cpp, fast_avx2.cpp, fast_avx512.cpp, skinny_avx2.c,
 * skinny_avx512.c; the baseline's in the file that dispatches), its functions marked with the
 * targets below, never with a file-wide -mavx2: a file-wide flag would also compile the
 * header templates it instantiates (std::vector's, MLX's) for that instruction set, and the
 * linker keeps one copy of each, maybe that one, for the baseline's callers too. Which
 * variant runs is asked once, of appliance_simd_level(), which honours APPLIANCE_SIMD (the
 * `simd` setting, exported by the CLI). No target_clones: an ifunc chooses by the processor
 * alone. docs/decisions/one-simd-scheme-one-pool.md. */
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

#ifndef APPLIANCE_HIDDEN
#define APPLIANCE_HIDDEN __attribute__((visibility("hidden")))  /* each library its own copy */
#endif

enum { APPLIANCE_SIMD_PORTABLE = 0, APPLIANCE_SIMD_AVX2 = 1, APPLIANCE_SIMD_AVX512 = 2 };

/* The widest variant the processor (and its OS) runs, or the narrower one APPLIANCE_SIMD
 * names (avx512, avx2, portable; one the processor cannot run gives portable). Read once. */
APPLIANCE_HIDDEN int appliance_simd_level(void);
/* "avx512", "avx2" or "portable": appliance_simd_level()'s name. */
APPLIANCE_HIDDEN const char *appliance_simd_name(void);
/* Whether the AVX-512 variant may use VNNI (level 2 and the processor has it). */
APPLIANCE_HIDDEN int appliance_simd_vnni(void);

#ifdef __cplusplus
}
#endif

/* The targets of the variants (GCC's target attribute and pragma spellings). */
#define APPLIANCE_AVX2_TARGET "avx2,fma,f16c"
#define APPLIANCE_AVX512_TARGET "avx512f,avx512dq,avx512bw,avx512vl,avx2,fma,f16c"
#define APPLIANCE_VNNI_TARGET "avx512f,avx512dq,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"

/* Every function defined between APPLIANCE_TARGET_BEGIN(t) and APPLIANCE_TARGET_END gets
 * target t (a loop file included there is compiled for t; its helpers must have internal
 * linkage, so no other file's caller can get this copy). */
#define APPLIANCE_PRAGMA_(x) _Pragma(#x)
#define APPLIANCE_TARGET_BEGIN(t) _Pragma("GCC push_options") APPLIANCE_PRAGMA_(GCC target(t))
#define APPLIANCE_TARGET_END _Pragma("GCC pop_options")
