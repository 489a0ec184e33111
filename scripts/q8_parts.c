/* The 8-bit grouped path's parts timed apart on one thread (docs/native.md, "8-bit grouped path"):
 * rows_u8 (32 Q4_K rows of 2048 to bytes, scales and offsets), gemm_q8 (those rows x 48 tokens, hot)
 * and pack_q8 (48 tokens of 2048), on the AVX2 or the AVX-512 kernel table.
 * Build and run from the repository root:
 *   gcc -O3 -std=gnu11 -pthread -Inative scripts/q8_parts.c $(ls native/[a-z]*.c | grep -v -E "_check|driver") \
 *       -lm -o /tmp/q8_parts
 *   taskset -c 1 /tmp/q8_parts [avx2|avx512] */
#include "ktk_int.h"
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

int main(int argc, char **argv) {
    const int isa = argc > 1 && !strcmp(argv[1], "avx2") ? KTK_ISA_AVX2 : KTK_ISA_AVX512;
    const ktk_kernels *K = ktk_kernels_for(isa);
    if (!K || !K->gemm_q8) {
        fprintf(stderr, "q8_parts: the %s kernels are not usable on this CPU\n", isa == KTK_ISA_AVX2 ? "AVX2" : "AVX-512");
        return 1;
    }
    const int64_t H = 2048, nt = 48, ldc = 48, rb = ktk_row_bytes(KTK_Q4_K, H);
    uint8_t *rows = malloc((size_t)(rb * 32));
    for (int64_t i = 0; i < rb * 32; i++) rows[i] = (uint8_t)((uint64_t)i * 2654435761u >> 13);
    for (int r = 0; r < 32; r++)   /* plain fp16 d and dmin (1/16, 1/32) in every block */
        for (int64_t o = 0; o < rb; o += (int64_t)sizeof(blk_q4_k)) {
            const uint16_t h[2] = {0x2c00, 0x2800};
            memcpy(rows + r * rb + o, h, 4);
        }
    float *x = malloc((size_t)(nt * H) * 4);
    const float *X[48];
    for (int64_t i = 0; i < nt * H; i++) x[i] = (float)((i * 7919) % 1000) * 1e-3f - 0.5f;
    for (int t = 0; t < nt; t++) X[t] = x + t * H;
    int8_t *pk = aligned_alloc(64, (size_t)(nt * H));
    float *ps = aligned_alloc(64, (size_t)(3 * 2 * H) * 4), *C = aligned_alloc(64, (size_t)(32 * ldc) * 4);
    uint8_t *U = aligned_alloc(64, (size_t)(32 * H));
    float *S = aligned_alloc(64, (size_t)(32 * H / 16) * 4), *Mn = aligned_alloc(64, (size_t)(32 * H / 16) * 4);
    K->pack_q8(X, nt, H, pk, ps);
    K->rows_u8(KTK_Q4_K, rows, rb, 32, H, U, S, Mn);
    const int N = 3000;
    double t0 = now();
    for (int i = 0; i < N; i++) K->rows_u8(KTK_Q4_K, rows, rb, 32, H, U, S, Mn);
    const double tr = (now() - t0) / N;
    t0 = now();
    for (int i = 0; i < N; i++) K->gemm_q8(U, S, Mn, 32, H, pk, ps, nt, C, ldc, ktk_u8_flags(KTK_Q4_K));
    const double tg = (now() - t0) / N;
    t0 = now();
    for (int i = 0; i < N / 10; i++) K->pack_q8(X, nt, H, pk, ps);
    const double tp = (now() - t0) / (N / 10);
    printf("%s: rows_u8 32 Q4_K rows of 2048 %.2f us; gemm_q8 32 x 48 x 2048 %.2f us (%.1f GMAC/s); pack_q8 48 tokens %.2f us\n",
           isa == KTK_ISA_AVX2 ? "avx2" : "avx512", tr * 1e6, tg * 1e6, 32.0 * nt * H / tg * 1e-9, tp * 1e6);
    free(rows); free(x); free(pk); free(ps); free(C); free(U); free(S); free(Mn);
    return 0;
}
