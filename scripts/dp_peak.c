/* The AVX512-BF16 dot product's own speed, the roofline of the AVX-512 path's BF16 grouped (prefill) work, and the
 * library's GEMM on it (ktk_dp_gemm) against that roofline:
 *   /tmp/dp_peak [threads]            vdpbf16ps on 24 independent accumulators with the operands in registers (no
 *                                     loads), on that many threads at once, one per CPU: 64 flops an instruction
 *   /tmp/dp_peak gemm [K nt blocks]   ktk_dp_gemm on one 32-row block of K values and nt packed tokens (defaults 2048,
 *                                     48, 1: hot in the caches), or cycling over `blocks` blocks (2000: 256 MiB,
 *                                     from memory), on the calling thread
 *     gcc -O3 -std=gnu11 -pthread -Inative scripts/dp_peak.c $(ls native/[a-z]*.c | grep -v -E '_check|driver') \
 *         -lm -o /tmp/dp_peak && /tmp/dp_peak 1 && /tmp/dp_peak 2 && taskset -c 1 /tmp/dp_peak gemm
 * Measured on the forty-sixth session's development machine (AMD EPYC, Zen 4, 2 vCPUs): docs/benchmarks.md. */
#define _GNU_SOURCE
#include "ktk_int.h"
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define REPS 20000000L

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

typedef struct { int cpu; double gflops; float sink; } arg_t;

__attribute__((target("avx512f,avx512bf16")))
static void *worker(void *p) {
    arg_t *a = p;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(a->cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), y = (__m512bh)_mm512_set1_epi32(0x35803580);
#define ACC(i) __m512 a##i = _mm512_set1_ps((float)i);
#define DP(i) a##i = _mm512_dpbf16_ps(a##i, x, y);
#define SUM(i) sum += _mm512_reduce_add_ps(a##i);
#define ALL(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11) M(12) M(13) M(14) M(15) M(16) M(17) \
               M(18) M(19) M(20) M(21) M(22) M(23)
    ALL(ACC)
    const double t0 = now();
    for (long r = 0; r < REPS; r++) {
        ALL(DP)
        __asm__ volatile("" ::: "memory");
    }
    const double s = now() - t0;
    float sum = 0;
    ALL(SUM)
    a->sink = sum;
    a->gflops = REPS * 24.0 * 64 / s * 1e-9;
    return NULL;
}

static int peak(int n) {
    if (n < 1 || n > 256) { fprintf(stderr, "threads: 1-256\n"); return 2; }
    pthread_t th[256];
    arg_t args[256];
    for (int t = 0; t < n; t++) {
        args[t] = (arg_t){.cpu = t};
        if (pthread_create(&th[t], NULL, worker, &args[t])) { fprintf(stderr, "could not start thread %d\n", t); return 1; }
    }
    double total = 0;
    for (int t = 0; t < n; t++) { pthread_join(th[t], NULL); total += args[t].gflops; }
    printf("vdpbf16ps, %d threads: %.1f GFLOPS together, %.1f a thread\n", n, total, total / n);
    return 0;
}

static int gemm(int64_t K, int64_t nt, int64_t nb) {
    if (K < 32 || K % 32 || K > 65536 || nt < 1 || nt > 512 || nb < 1 || nb > 100000) {
        fprintf(stderr, "gemm: K a multiple of 32 up to 65536, nt 1-512, blocks 1-100000\n");
        return 2;
    }
    const int64_t ldc = (nt + 15) / 16 * 16, npk = ktk_amx_pack_x_elems(nt, K);
    uint16_t *W = aligned_alloc(64, (size_t)(nb * 32 * K * 2)), *pk = aligned_alloc(64, (size_t)npk * 2);
    float *C = aligned_alloc(64, (size_t)(32 * ldc * 4));
    if (!W || !pk || !C) { fprintf(stderr, "gemm: out of memory\n"); return 1; }
    for (int64_t i = 0; i < nb * 32 * K; i++) W[i] = (uint16_t)(0x3f80 + i % 7);   /* bf16 values near 1 */
    for (int64_t i = 0; i < npk; i++) pk[i] = (uint16_t)(0x3f80 + i % 5);
    const int64_t reps = nb > 2000 ? nb : 2000 / nb * nb;
    ktk_dp_gemm(W, 32, K, K, pk, nt, C, ldc);   /* rows in place: k-steps 32 values apart, rows K apart */
    const double t0 = now();
    for (int64_t r = 0; r < reps; r++) ktk_dp_gemm(W + r % nb * 32 * K, 32, K, K, pk, nt, C, ldc);
    const double s = (now() - t0) / reps;
    printf("ktk_dp_gemm, K %lld, %lld tokens, %lld block%s: %.2f us a block, %.1f GFLOPS\n", (long long)K, (long long)nt,
           (long long)nb, nb > 1 ? "s" : "", s * 1e6, 2.0 * 32 * K * nt / s * 1e-9);
    free(W); free(pk); free(C);
    return 0;
}

int main(int argc, char **argv) {
    if (!ktk_avx512bf16_usable()) { fprintf(stderr, "no usable AVX512-BF16 here\n"); return 1; }
    if (argc > 1 && !strcmp(argv[1], "gemm"))
        return gemm(argc > 2 ? atol(argv[2]) : 2048, argc > 3 ? atol(argv[3]) : 48, argc > 4 ? atol(argv[4]) : 1);
    return peak(argc > 1 ? atoi(argv[1]) : 1);
}
