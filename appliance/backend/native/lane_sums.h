/* lane_sums.h: the lane sums of 16 vectors of 16 floats at once, for skinny_matmul.c (C) and
 * mlx_fast.cpp (C++), and the same sums of 16-float vectors held as 8- or 4-float parts
 * (skinny_kernel.h's AVX2 and baseline tiles). Lane r of the result is the sum of v[r]'s lanes, each by one fixed
 * tree (lanes l and l + 8, then 4, 2 and 1 apart: a vector's own horizontal sum, the same
 * additions), whatever its neighbours; two vectors at a time, in a quarter of the
 * operations of 16 sums one by one. */

#pragma once

typedef float lanes16 __attribute__((vector_size(16 * sizeof(float))));
typedef int lanes16_index __attribute__((vector_size(16 * sizeof(int))));

static inline __attribute__((always_inline)) lanes16 lane_sums16(const lanes16 *v) {
    const lanes16_index lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const lanes16_index hi1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const lanes16_index lo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const lanes16_index hi2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const lanes16_index lo3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const lanes16_index hi3 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const lanes16_index lo4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const lanes16_index hi4 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    lanes16 h[8], q[4], e[2]; /* 2 sums a vector (8 lanes each), then 4, then 8 */
    for (int i = 0; i < 8; i++)
        h[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], lo1) +
               __builtin_shuffle(v[2 * i], v[2 * i + 1], hi1);
    for (int i = 0; i < 4; i++)
        q[i] = __builtin_shuffle(h[2 * i], h[2 * i + 1], lo2) +
               __builtin_shuffle(h[2 * i], h[2 * i + 1], hi2);
    for (int i = 0; i < 2; i++)
        e[i] = __builtin_shuffle(q[2 * i], q[2 * i + 1], lo3) +
               __builtin_shuffle(q[2 * i], q[2 * i + 1], hi3);
    return __builtin_shuffle(e[0], e[1], lo4) + __builtin_shuffle(e[0], e[1], hi4);
}

typedef float lanes8 __attribute__((vector_size(8 * sizeof(float))));
typedef int lanes8_index __attribute__((vector_size(8 * sizeof(int))));

/* Lane r is the sum of v[r]'s 8 lanes by lane_sums16's tree less its first step (lanes l and
 * l + 4, then 2 and 1 apart): a 16-lane vector held as 8-lane halves lo and hi has the sum
 * lane_sums16 gives it in lane_sums8 of lo + hi. */
static inline __attribute__((always_inline)) lanes8 lane_sums8(const lanes8 *v) {
    const lanes8_index lo2 = {0, 1, 2, 3, 8, 9, 10, 11};
    const lanes8_index hi2 = {4, 5, 6, 7, 12, 13, 14, 15};
    const lanes8_index lo3 = {0, 1, 4, 5, 8, 9, 12, 13};
    const lanes8_index hi3 = {2, 3, 6, 7, 10, 11, 14, 15};
    const lanes8_index lo4 = {0, 2, 4, 6, 8, 10, 12, 14};
    const lanes8_index hi4 = {1, 3, 5, 7, 9, 11, 13, 15};
    lanes8 q[4], e[2]; /* 2 sums a vector (4 lanes each), then 4, then 8 */
    for (int i = 0; i < 4; i++)
        q[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], lo2) +
               __builtin_shuffle(v[2 * i], v[2 * i + 1], hi2);
    for (int i = 0; i < 2; i++)
        e[i] = __builtin_shuffle(q[2 * i], q[2 * i + 1], lo3) +
               __builtin_shuffle(q[2 * i], q[2 * i + 1], hi3);
    return __builtin_shuffle(e[0], e[1], lo4) + __builtin_shuffle(e[0], e[1], hi4);
}

typedef float lanes4 __attribute__((vector_size(4 * sizeof(float))));
typedef int lanes4_index __attribute__((vector_size(4 * sizeof(int))));

/* Lane r is the sum of v[r]'s 4 lanes by lane_sums16's last two steps (lanes l and l + 2,
 * then 1 apart): a 16-lane vector held as 4-lane quarters q0..q3 has the sum lane_sums16
 * gives it in lane_sums4 of (q0 + q2) + (q1 + q3). */
static inline __attribute__((always_inline)) lanes4 lane_sums4(const lanes4 *v) {
    const lanes4_index lo3 = {0, 1, 4, 5}, hi3 = {2, 3, 6, 7};
    const lanes4_index lo4 = {0, 2, 4, 6}, hi4 = {1, 3, 5, 7};
    lanes4 e[2]; /* 2 sums a vector (2 lanes each), then 4 */
    for (int i = 0; i < 2; i++)
        e[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], lo3) +
               __builtin_shuffle(v[2 * i], v[2 * i + 1], hi3);
    return __builtin_shuffle(e[0], e[1], lo4) + __builtin_shuffle(e[0], e[1], hi4);
}
