/* A stress driver for skinny_matmul's products shared with the native code's pool, built
 * with AddressSanitizer and UBSan by scripts/sanitize-native.sh (ThreadSanitizer runs the
 * pool in tests/native/pool_tsan.cpp). Thousands of products of 1-32 rows, big enough to be
 * shared, each checked against a plain double-precision loop: a lost block shows as a wrong
 * result, a bad read or write as the sanitizers' report. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta, float *c,
                 int ldc);
const char *appliance_skinny_simd(void);
unsigned long appliance_skinny_kernel_calls(void);

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112, K = 160 };

static float frand(unsigned *s) {
    *s = *s * 1103515245u + 12345u;
    return (float)((*s >> 8) & 0xffff) / 32768.0f - 1.0f;
}

int main(int argc, char **argv) {
    int rounds = argc > 1 ? atoi(argv[1]) : 2000;
    const int widths[] = {512, 700, 1024};
    float *a = malloc(sizeof(float) * 32 * K), *b = malloc(sizeof(float) * 1024 * K);
    float *c = malloc(sizeof(float) * 32 * 1024);
    unsigned seed = 1;
    for (int i = 0; i < 32 * K; i++) a[i] = frand(&seed);
    for (int i = 0; i < 1024 * K; i++) b[i] = frand(&seed);
    int bad = 0;
    for (int r = 0; r < rounds; r++) {
        int m = 1 + r % 32, n = widths[r % 3];
        cblas_sgemm(ROW_MAJOR, NO_TRANS, TRANS, m, n, K, 1.0f, a, K, b, K, 0.0f, c, n);
        if (r % 37 != 0) continue;
        for (int i = 0; i < m; i++)
            for (int j = 0; j < n; j++) {
                double want = 0;
                for (int p = 0; p < K; p++) want += (double)a[i * K + p] * b[j * K + p];
                if (fabs(c[i * n + j] - want) > 1e-3) bad++;
            }
    }
    printf("simd=%s products=%lu wrong=%d\n", appliance_skinny_simd(),
           appliance_skinny_kernel_calls(), bad);
    return bad != 0;
}
