/* skinny_matmul's tile loops for AVX-512 (skinny_kernel.h; chosen by skinny_matmul.c
 * through appliance_simd_level()). */
#include "skinny_kernel.h"

#if defined(__x86_64__)
__attribute__((target(APPLIANCE_AVX512_TARGET))) APPLIANCE_HIDDEN ROWS_VARIANT(skinny_rows_avx512, 1)
#endif
