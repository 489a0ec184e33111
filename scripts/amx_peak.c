/* The AMX-BF16 unit's own speed, the roofline of the grouped (prefill) path: TDPBF16PS on 4
 * accumulators with the operands in tiles (no loads), then with 2 A + 2 B tile loads per 4
 * products cycling over 4-256 KiB, on THREADS threads at once (each its own buffers). Whether the
 * lent machine's 16 vCPUs are 16 AMX units or fewer shared ones shows as the per-thread rate at 16
 * threads against 1.
 *     gcc -O2 -pthread -mamx-tile -mamx-bf16 scripts/amx_peak.c -o /tmp/amx_peak
 *     for t in 1 8 16; do /tmp/amx_peak $t; done
 * Measured on the lent Xeon (eleventh session, the single-thread version): 0.91 TFLOPS from
 * tiles, 0.54-0.85 with loads; fourteenth session, 1.37-1.41 a thread from tiles on one thread. The
 * lent host's tile unit changes speed over time by up to 3x (docs/benchmarks.md, fourteenth
 * session, `amx_parts duty`): compare rates from one run only. */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define REPS 2000000L

typedef struct __attribute__((packed, aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

typedef struct { double tiles_s, loads_s[4]; } result_t;

static pthread_barrier_t start;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void configure(void) {   /* all 8 tiles 16 rows x 64 bytes; the asm keeps the stores (see native/amx.c) */
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) { cfg.colsb[i] = 64; cfg.rows[i] = 16; }
    __asm__ __volatile__("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}

static void *run(void *arg) {
    result_t *res = arg;
    uint16_t *a = aligned_alloc(64, 128 * 1024), *b = aligned_alloc(64, 128 * 1024);
    float *c = aligned_alloc(64, 4096);
    for (int i = 0; i < 64 * 1024; i++) a[i] = b[i] = 0x3f80;   /* bf16 1.0 */
    configure();
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    _tile_loadd(4, a, 64); _tile_loadd(5, a + 512, 64); _tile_loadd(6, b, 64); _tile_loadd(7, b + 512, 64);
    pthread_barrier_wait(&start);
    double t = now();
    for (long i = 0; i < REPS; i++) {
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 5, 6); _tile_dpbf16ps(2, 4, 7); _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c, 64);
    res->tiles_s = now() - t;
    for (int s = 0; s < 4; s++) {   /* 1, 4, 16, 64 pairs of 1 KiB A and B tiles: 4 - 256 KiB */
        long span = 1L << (2 * s);
        pthread_barrier_wait(&start);
        t = now();
        for (long i = 0; i < REPS / 4; i++) {
            long o = (i % span) * 1024;
            _tile_loadd(4, a + o, 64); _tile_loadd(5, a + o + 512, 64);
            _tile_loadd(6, b + o, 64); _tile_loadd(7, b + o + 512, 64);
            _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 5, 6); _tile_dpbf16ps(2, 4, 7); _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, c, 64);
        res->loads_s[s] = now() - t;
    }
    _tile_release();
    free(a); free(b); free(c);
    return NULL;
}

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 1;
    if (n < 1 || n > 1024) { fprintf(stderr, "usage: amx_peak [threads]\n"); return 2; }
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) { fprintf(stderr, "no AMX tile state\n"); return 1; }
    pthread_t *th = calloc((size_t)n, sizeof *th);
    result_t *res = calloc((size_t)n, sizeof *res);
    pthread_barrier_init(&start, NULL, (unsigned)n);
    for (int i = 0; i < n; i++) pthread_create(&th[i], NULL, run, &res[i]);
    for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
    const double flop = 4.0 * REPS * 16 * 16 * 32 * 2;   /* per thread, each phase */
    double tiles = 0, loads[4] = {0, 0, 0, 0};
    for (int i = 0; i < n; i++) {
        tiles += flop / res[i].tiles_s / 1e12;
        for (int s = 0; s < 4; s++) {
            loads[s] += flop / 4 / res[i].loads_s[s] / 1e12;
        }
    }
    printf("%d threads: from tiles %.2f TFLOPS (%.2f a thread); with loads over 4/16/64/256 KiB: "
           "%.2f %.2f %.2f %.2f TFLOPS\n", n, tiles, tiles / n, loads[0], loads[1], loads[2], loads[3]);
    free(th); free(res);
    return 0;
}
