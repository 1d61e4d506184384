/* skinny_matmul's tile loops for AVX2 with FMA (skinny_kernel.h; chosen by skinny_matmul.c
 * through appliance_simd_level()). */
#include "skinny_kernel.h"

#if defined(__x86_64__)
__attribute__((target(APPLIANCE_AVX2_TARGET))) APPLIANCE_HIDDEN ROWS_VARIANT_SPLIT(skinny_rows_avx2, 8)
#endif
