/* The AVX512-BF16 dot product's own speed, the roofline of the AVX-512 path's BF16 grouped (prefill) work
 * (ktk_dp_gemm): vdpbf16ps on 24 independent accumulators with the operands in registers (no loads), on THREADS
 * threads at once, one per CPU. Each instruction is 16 lanes x 2 products = 64 flops.
 *     gcc -O2 -pthread scripts/dp_peak.c -o /tmp/dp_peak && /tmp/dp_peak 1 && /tmp/dp_peak 2
 * Measured on the forty-sixth session's development machine (AMD EPYC, Zen 4, 2 vCPUs): docs/benchmarks.md. */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
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
#define ALL(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11) M(12) M(13) M(14) M(15) M(16) M(17) \
               M(18) M(19) M(20) M(21) M(22) M(23)
    ALL(ACC)
    const double t0 = now();
    for (long r = 0; r < REPS; r++) {
        ALL(DP)
        __asm__ volatile("" ::: "memory");
    }
    const double s = now() - t0;
#define SUM(i) sum += _mm512_reduce_add_ps(a##i);
    float sum = 0;
    ALL(SUM)
    a->sink = sum;
    a->gflops = REPS * 24.0 * 64 / s * 1e-9;
    return NULL;
}

int main(int argc, char **argv) {
    const int n = argc > 1 ? atoi(argv[1]) : 1;
    if (n < 1 || n > 256) { fprintf(stderr, "threads: 1-256\n"); return 2; }
    if (!__builtin_cpu_supports("avx512bf16")) { fprintf(stderr, "this CPU has no AVX512-BF16\n"); return 1; }
    pthread_t th[256];
    arg_t args[256];
    for (int t = 0; t < n; t++) {
        args[t] = (arg_t){.cpu = t};
        if (pthread_create(&th[t], NULL, worker, &args[t])) { fprintf(stderr, "thread %d\n", t); return 1; }
    }
    double total = 0;
    for (int t = 0; t < n; t++) { pthread_join(th[t], NULL); total += args[t].gflops; }
    printf("vdpbf16ps, %d threads: %.1f GFLOPS together, %.1f a thread\n", n, total, total / n);
    return 0;
}
