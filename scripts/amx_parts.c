/* The AMX prefill path's parts timed apart on one thread, to set against a whole layer
 * (`ktinject bench experts --batch 512 --isa amx`): ktk_amx_rows_bf16 (GGML rows -> tile-major
 * bf16, 32 rows x K) from rows hot in cache and from a set far larger than it, ktk_amx_gemm on a
 * converted block for several token counts, and the two back to back as the MoE layer runs them
 * (BF16 rows: ktk_amx_gemm_rows, read in place).
 * Build and run from the repository root on an AMX machine:
 *   gcc -O3 -std=gnu11 -pthread -Inative scripts/amx_parts.c $(ls native/[a-z]*.c | grep -v -E "_check|driver") \
 *       -lm -o /tmp/amx_parts
 *   /tmp/amx_parts [K]          (K: 2048, V2-Lite's gate/up; 1408 its down)
 *   /tmp/amx_parts more         (gemm by K and placement; items on 1, 8, 16 threads at once)
 *   /tmp/amx_parts place        (gemm with rows and tokens at offsets in 4 KiB or huge pages)
 *   /tmp/amx_parts flip         (gemm in windows: the same buffers or fresh pages; AP_HUGE=1: huge pages)
 *   /tmp/amx_parts gap          (gemm once fast, after gaps of spinning or conversions between calls)
 *   /tmp/amx_parts duty         (gemm speed over time: mixed with conversions, alone, mixed again)
 *   /tmp/amx_parts data [K]     (gemm on rows of different data; the layer's item sequence on one thread)
 *   /tmp/amx_parts i8           (the AMX-INT8 GEMM of I8 copies by K, group size and tokens, hot and
 *                                cold, beside the bf16 GEMM of the same block)
 *   /tmp/amx_parts conc [threads ...]  (the I4 GEMM on every thread at once, hot and from memory)
 *   /tmp/amx_parts streams [threads ...]  (the BF16 GEMM from memory on every thread at once: rows in place against a
 *                                tile-major copy, with and without the next block brought into L2)
 *   /tmp/amx_parts pack         (the INT8 token packing, tokens gathered from 64 MiB; no AMX needed)
 *   /tmp/amx_parts pack1        (a layer's gate/up token packing, per expert or the tokens quantized once; no AMX)
 *   /tmp/amx_parts sums         (a down item's weighted sums into the output rows or a compact block; no AMX)
 *   /tmp/amx_parts stream       (one core streaming BF16 blocks: rows in place against tile-major copies)
 *   /tmp/amx_parts tokens       (the bf16 tile GEMM with its packed tokens hot, cycling over 64 experts' packs as
 *                                the down phase reads them, and each pack used twice in a row)
 *   /tmp/amx_parts rowspf       (one core streaming BF16 rows in place through the tiles, the tile loads alone and
 *                                with the products, by software prefetch: none, T0 / T1 / T2 4-16 k-steps ahead)
 *   /tmp/amx_parts shapes       (TDPBF16PS's cost by the A tile's rows and the B tile's columns)
 * and, built with -DKTK_LAYER_TRACE added to the line above (TSC counters in moe.c):
 *   /tmp/amx_parts layer [threads] [bf16|i8|i4|bf16w|bf16t|bf16d]   (one V2-Lite layer at batch 512 on AMX: each part's time
 *                                inside it; Q4_K / Q5_0 weights on bf16 tiles, I8 or I4 copies, or BF16 weights read
 *                                in place or from tile copies, of all three or of the down only) */
#define _GNU_SOURCE   /* CPU_SET, pthread_setaffinity_np ("conc", "streams") */
#include "ktk_int.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <time.h>

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

static uint8_t *random_rows(int type, int64_t K, int64_t nrows, int64_t *rb) {
    *rb = ktk_row_bytes(type, K);
    uint8_t *p = aligned_alloc(64, (size_t)(*rb * nrows + 63) / 64 * 64);
    for (int64_t i = 0; i < *rb * nrows; i++) p[i] = (uint8_t)((uint64_t)i * 2654435761u >> 13);
    /* plain scales: fp16 1.0 / 0.5 in the leading d (and dmin) of every block, so no NaN or inf */
    int64_t bs = type == KTK_Q4_K ? 144 : type == KTK_Q5_0 ? 22 : type == KTK_Q8_0 ? 34 : 0;
    if (bs) for (int64_t r = 0; r < nrows; r++) for (int64_t o = 0; o + bs <= *rb; o += bs) {
        uint16_t h[2] = {0x3c00, 0x3800};
        memcpy(p + r * *rb + o, h, type == KTK_Q4_K ? 4 : 2);
    }
    if (type == KTK_BF16) for (int64_t i = 0; i < *rb * nrows; i += 2) p[i + 1] = 0x3f;
    return p;
}

/* nt tokens of K values (x, which the caller frees) and their row pointers in X[0 .. nt) */
static float *tokens(int64_t nt, int64_t K, const float **X) {
    float *x = malloc((size_t)(nt * K) * 4);
    for (int64_t i = 0; i < nt * K; i++) x[i] = (float)((i * 7919) % 1000) * 1e-3f - 0.5f;
    for (int64_t t = 0; t < nt; t++) X[t] = x + t * K;
    return x;
}

/* seconds per ktk_amx_gemm call: the best of `reps` timings of `iters` back-to-back calls */
static double gemm_time(const uint16_t *wt, int64_t K, const uint16_t *pk, int64_t nt, float *C, int64_t ldc,
                        int iters, int reps) {
    ktk_amx_gemm(wt, K, pk, nt, C, ldc);
    double best = 1e30;
    for (int rep = 0; rep < reps; rep++) {
        double t0 = now();
        for (int i = 0; i < iters; i++) ktk_amx_gemm(wt, K, pk, nt, C, ldc);
        double dt = (now() - t0) / iters;
        if (dt < best) best = dt;
    }
    return best;
}

/* One thread of the concurrent run: its own 32 cold Q4_K row blocks, its own packed tokens (48) */
typedef struct { int64_t K; double us; } item_job;

static void *item_thread(void *arg) {
    item_job *j = arg;
    const int64_t K = j->K, nt = 48, ldc = 48, N = 512;
    const ktk_kernels *kern = ktk_kernels_for(KTK_ISA_AVX512);
    int64_t rb;
    uint8_t *cr = random_rows(KTK_Q4_K, K, 32 * N, &rb);
    uint16_t *wt = aligned_alloc(64, 32 * K * 2), *pk = aligned_alloc(64, ktk_amx_pack_x_elems(nt, K) * 2);
    float *tmp = aligned_alloc(64, K * 4), *C = aligned_alloc(64, 32 * ldc * 4);
    const float *X[48];
    float *x = tokens(nt, K, X);
    ktk_amx_pack_x(X, nt, K, pk);
    double best = 1e30;
    for (int rep = 0; rep < 3; rep++) {
        double t0 = now();
        for (int i = 0; i < N; i++) {
            ktk_amx_rows_bf16(kern, KTK_Q4_K, cr + (int64_t)i * 32 * rb, rb, 32, K, wt, tmp);
            ktk_amx_gemm(wt, K, pk, nt, C, ldc);
        }
        double dt = (now() - t0) / N * 1e6;
        if (dt < best) best = dt;
    }
    j->us = best;
    free(cr); free(wt); free(pk); free(tmp); free(C); free(x);
    return NULL;
}

/* "more": ktk_amx_gemm at several K and relative placements of the rows and the tokens (48 and 64
 * tokens, hot), then convert + gemm items on 1, 8 and 16 threads at once (frequency, shared caches) */
static int more(void) {
    const ktk_kernels *kern = ktk_kernels_for(KTK_ISA_AVX512);
    const int64_t Ks[] = {1024, 1408, 1536, 2048, 2304};
    for (int ki = 0; ki < 5; ki++)
        for (int nt = 48; nt <= 64; nt += 16)
            for (int oi = 0; oi < 5; oi++) {
                const int off = (int[]){0, 64, 576, 1088, 2048}[oi];
                const int64_t K = Ks[ki], ldc = nt;
                uint8_t *raw = aligned_alloc(4096, 32 * K * 2 + ktk_amx_pack_x_elems(nt, K) * 2 + 8192);
                uint16_t *wt = (uint16_t *)raw, *pk = (uint16_t *)(raw + ((32 * K * 2 + 4095) / 4096 * 4096) + off);
                float *C = aligned_alloc(64, 32 * ldc * 4), *tmp = malloc(K * 4);
                const float **X = malloc(nt * sizeof *X);
                float *x = tokens(nt, K, X);
                int64_t rb;
                ktk_amx_pack_x(X, nt, K, pk);
                uint8_t *bf = random_rows(KTK_BF16, K, 32, &rb);
                ktk_amx_rows_bf16(kern, KTK_BF16, bf, rb, 32, K, wt, tmp);
                const double best = gemm_time(wt, K, pk, nt, C, ldc, 500, 5);
                printf("gemm K=%ld tokens %d, tokens %d B past a page: %.2f us, %.3f TFLOPS\n", (long)K, nt, off, best * 1e6,
                       2.0 * 32 * nt * K / best * 1e-12);
                free(raw); free(x); free(C); free(tmp); free(X); free(bf);
            }
    const int nths[] = {1, 8, 16};
    for (int ni = 0; ni < 3; ni++) {
        pthread_t th[16];
        item_job jobs[16];
        for (int t = 0; t < nths[ni]; t++) { jobs[t].K = 2048; pthread_create(&th[t], NULL, item_thread, &jobs[t]); }
        double sum = 0, worst = 0;
        for (int t = 0; t < nths[ni]; t++) { pthread_join(th[t], NULL); sum += jobs[t].us; if (jobs[t].us > worst) worst = jobs[t].us; }
        printf("items (q4_k 32 x 2048 cold, convert + gemm of 48 tokens) on %d threads at once: %.2f us mean, %.2f worst\n",
               nths[ni], sum / nths[ni], worst);
    }
    return 0;
}

/* "place": the GEMM (32 rows x 48 tokens, K 2048, hot) with the rows and the tokens carved out of one
 * 64 MiB anonymous mapping, huge pages asked for or refused (madvise), at several offsets each: some
 * separate allocations ran it 2.4x faster than others (docs/benchmarks.md, twelfth session). */
static int place(void) {
    const ktk_kernels *kern = ktk_kernels_for(KTK_ISA_AVX512);
    const int64_t K = 2048, nt = 48, ldc = 48, MB = 1 << 20;
    float *tmp = malloc(K * 4), *C = aligned_alloc(64, 32 * ldc * 4);
    const float *X[48];
    float *x = tokens(nt, K, X);
    int64_t rb;
    uint8_t *bf = random_rows(KTK_BF16, K, 32, &rb);
    for (int huge = 0; huge < 2; huge++) {
        uint8_t *map = mmap(NULL, 64 * MB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (map == MAP_FAILED) return 1;
        uint8_t *base = (uint8_t *)(((uintptr_t)map + 2 * MB - 1) & ~(uintptr_t)(2 * MB - 1));
        madvise(base, 60 * MB, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
        memset(base, 0, 60 * MB);
        const int offs[] = {0, 64, 1024, 2112, 4096 + 576};
        for (int ai = 0; ai < 5; ai++)
            for (int bi = 0; bi < 5; bi++) {
                uint16_t *wt = (uint16_t *)(base + offs[ai]), *pk = (uint16_t *)(base + 8 * MB + offs[bi]);
                ktk_amx_rows_bf16(kern, KTK_BF16, bf, rb, 32, K, wt, tmp);
                ktk_amx_pack_x(X, nt, K, pk);
                const double best = gemm_time(wt, K, pk, nt, C, ldc, 300, 5);
                printf("place %s pages: rows at +%d, tokens at +%d: %.2f us, %.3f TFLOPS\n", huge ? "huge" : "4 KiB",
                       offs[ai], offs[bi], best * 1e6, 2.0 * 32 * nt * K / best * 1e-12);
            }
        munmap(map, 64 * MB);
    }
    free(x); free(tmp); free(C); free(bf);
    return 0;
}

/* "data": the same hot GEMM (32 rows x 48 tokens) on rows converted from different data: is the tile
 * multiply's speed data-dependent? (the layer's GEMM on converted Q4_K rows ran 3x this tool's hot one
 * on random BF16 rows, one thread, same machine: docs/benchmarks.md, fourteenth session). Then the
 * layer's sequence on one thread without the pool: per item, gate rows converted, GEMM, up rows
 * converted, GEMM, SiLU and h stores, each part timed. */
static int data(int64_t K) {
    const ktk_kernels *kern = ktk_kernels_for(KTK_ISA_AVX512);
    const int64_t nt = 48, ldc = 48;
    if (getenv("AP_HEAP")) { void *big = malloc(64 << 20); memset(big, 1, 64 << 20); free(big); }   /* glibc: later blocks from the heap */
    if (getenv("AP_WARM")) {   /* a second of AVX-512 conversions first, as the default mode runs before its GEMMs */
        int64_t rb;
        uint8_t *rows = random_rows(KTK_Q4_K, 2048, 32 * 64, &rb);
        uint16_t *w = aligned_alloc(64, 32 * 2048 * 2);
        float *t = aligned_alloc(64, 2048 * 4);
        for (double t0 = now(); now() - t0 < 1.0;)
            for (int i = 0; i < 64; i++) ktk_amx_rows_bf16(kern, KTK_Q4_K, rows + (int64_t)i * 32 * rb, rb, 32, 2048, w, t);
        free(rows); free(w); free(t);
    }
    uint16_t *wt = aligned_alloc(64, 32 * K * 2), *pk = aligned_alloc(64, ktk_amx_pack_x_elems(nt, K) * 2);
    float *tmp = aligned_alloc(64, K * 4), *C = aligned_alloc(64, 32 * ldc * 4), *C1 = aligned_alloc(64, 32 * ldc * 4);
    const float *X[48];
    float *x = tokens(nt, K, X), *f = aligned_alloc(64, 32 * K * 4);
    ktk_amx_pack_x(X, nt, K, pk);
    const char *names[] = {"bf16 random bits", "q4_k converted", "q5_0 converted", "zeros", "f32 small values",
                           "f32 integers 0-945"};
    const int nv = getenv("AP_QUICK") ? 1 : 6;   /* AP_QUICK: the first case alone */
    for (int v = 0; v < nv; v++) {
        int64_t rb;
        int type = v == 1 ? KTK_Q4_K : v == 2 ? KTK_Q5_0 : KTK_BF16;
        if (v == 1 && K % 256) continue;
        if (v >= 3) {
            uint64_t r = 1234567;
            for (int64_t i = 0; i < 32 * K; i++) {
                r ^= r << 13; r ^= r >> 7; r ^= r << 17;
                f[i] = v == 3 ? 0.f : v == 4 ? (float)(int64_t)(r % 2001 - 1000) * 1e-4f : (float)(r % 946);
            }
            ktk_amx_rows_bf16(kern, KTK_F32, (const uint8_t *)f, K * 4, 32, K, wt, tmp);
        } else {
            uint8_t *rows = random_rows(type, K, 32, &rb);
            ktk_amx_rows_bf16(kern, type, rows, rb, 32, K, wt, tmp);
            free(rows);
        }
        const double dt = gemm_time(wt, K, pk, nt, C, ldc, 2000, 3);
        printf("data: gemm 32 rows x 48 tokens, K=%ld, rows %s: %.2f us, %.3f TFLOPS\n", (long)K, names[v], dt * 1e6,
               2.0 * 32 * nt * K / dt * 1e-12);
    }
    if (nv == 1) { free(wt); free(pk); free(tmp); free(C); free(C1); free(x); free(f); return 0; }
    /* the layer's sequence, one expert's items (K = hidden: gate/up rows of K, 1408 items' worth of rows) */
    const int type = K % 256 ? KTK_Q5_0 : KTK_Q4_K, ITEMS = 44;
    int64_t rb;
    uint8_t *g = random_rows(type, K, 32 * ITEMS, &rb), *u = random_rows(type, K, 32 * ITEMS, &rb);
    float *h = aligned_alloc(64, (size_t)nt * 32 * ITEMS * 4);
    for (int pass = 0; pass < 3; pass++) {
        double tc = 0, tg = 0, ts = 0, t0;
        for (int i = 0; i < ITEMS; i++) {
            t0 = now(); ktk_amx_rows_bf16(kern, type, g + (int64_t)i * 32 * rb, rb, 32, K, wt, tmp); tc += now() - t0;
            t0 = now(); ktk_amx_gemm_next(wt, K, pk, nt, C, ldc, u + (int64_t)i * 32 * rb, 32 * rb); tg += now() - t0;
            t0 = now(); ktk_amx_rows_bf16(kern, type, u + (int64_t)i * 32 * rb, rb, 32, K, wt, tmp); tc += now() - t0;
            t0 = now(); ktk_amx_gemm(wt, K, pk, nt, C1, ldc); tg += now() - t0;
            t0 = now();
            ktk_amx_silu_mul(C, C1, ldc, 32);
            ktk_amx_c_to_rows(C, ldc, 32, nt, h + i * 32, NULL, 32 * ITEMS, NULL);
            ts += now() - t0;
        }
        printf("seq pass %d (%s rows, K=%ld, 48 tokens): per block convert %.2f us, gemm %.2f us; per item SiLU + h %.2f us\n",
               pass, type == KTK_Q4_K ? "q4_k" : "q5_0", (long)K, tc / (2 * ITEMS) * 1e6, tg / (2 * ITEMS) * 1e6, ts / ITEMS * 1e6);
    }
    free(g); free(u); free(h); free(wt); free(pk); free(tmp); free(C); free(C1); free(x); free(f);
    return 0;
}

/* "flip": the hot GEMM (32 rows x 48 tokens, K 2048) timed in 30 windows of one process: even windows
 * on one pair of buffers, odd ones on a pair freshly mapped (new physical pages) each time. Tells a
 * GEMM speed that follows the buffers' pages from one that follows the time (the host). */
static int flip(void) {
    const ktk_kernels *kern = ktk_kernels_for(KTK_ISA_AVX512);
    const int64_t K = 2048, nt = 48, ldc = 48, wbytes = 32 * K * 2, pbytes = ktk_amx_pack_x_elems(nt, K) * 2;
    const int huge = getenv("AP_HUGE") != NULL;
    const float *X[48];
    float *x = tokens(nt, K, X), *C = aligned_alloc(64, 32 * ldc * 4), *tmp = aligned_alloc(64, K * 4);
    int64_t rb;
    uint8_t *bf = random_rows(KTK_BF16, K, 32, &rb), *keep = NULL;
    for (int w = 0; w < 30; w++) {
        uint8_t *m = keep;
        if (!m || w % 2) {
            m = mmap(NULL, 4 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (m == MAP_FAILED) return 1;
            uint8_t *b = (uint8_t *)(((uintptr_t)m + (2 << 20) - 1) & ~(uintptr_t)((2 << 20) - 1));
            madvise(b, 2 << 20, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
            memset(b, 0, 2 << 20);
            m = b;
            if (!keep) keep = m;
        }
        uint16_t *wt = (uint16_t *)m, *pk = (uint16_t *)(m + ((wbytes + 4095) & ~4095));
        ktk_amx_rows_bf16(kern, KTK_BF16, bf, rb, 32, K, wt, tmp);
        ktk_amx_pack_x(X, nt, K, pk);
        const double dt = gemm_time(wt, K, pk, nt, C, ldc, 1000, 2);
        printf("flip window %2d, %s buffers: %.2f us\n", w, m == keep ? "same " : "fresh", dt * 1e6);
    }
    (void)pbytes;
    free(x); free(C); free(tmp); free(bf);
    return 0;
}

/* "gap": does the tile unit slow down when other work runs between GEMMs? The hot GEMM (32 x 48, K
 * 2048) run back to back for up to 3 s until it is fast, then each call preceded by a gap of spinning
 * or of AVX-512 conversions (hot rows, 32 x 2048 Q4_K per 6-7 us) of a given length; median per case. */
static int cmp_d(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }

static int gap(void) {
    const ktk_kernels *kern = ktk_kernels_for(KTK_ISA_AVX512);
    const int64_t K = 2048, nt = 48, ldc = 48;
    const float *X[48];
    float *x = tokens(nt, K, X), *C = aligned_alloc(64, 32 * ldc * 4), *tmp = aligned_alloc(64, K * 4);
    uint16_t *wt = aligned_alloc(64, 32 * K * 2), *pk = aligned_alloc(64, ktk_amx_pack_x_elems(nt, K) * 2), *w2 = aligned_alloc(64, 32 * K * 2);
    int64_t rb, rq;
    uint8_t *bf = random_rows(KTK_BF16, K, 32, &rb), *q = random_rows(KTK_Q4_K, K, 32, &rq);
    ktk_amx_rows_bf16(kern, KTK_BF16, bf, rb, 32, K, wt, tmp);
    ktk_amx_pack_x(X, nt, K, pk);
    double t0 = now(), dt = 0;
    int fast = 0;
    while (now() - t0 < 3.0 && fast < 20) {
        dt = gemm_time(wt, K, pk, nt, C, ldc, 500, 1);
        fast = dt < 7e-6 ? fast + 1 : 0;
    }
    printf("gap: back to back after %.2f s: %.2f us (%s)\n", now() - t0, dt * 1e6, fast ? "fast" : "still slow");
    static double v[400];
    const double gaps[] = {0, 1e-6, 3e-6, 10e-6, 30e-6, 100e-6, 300e-6, 1e-3};
    for (int kind = 0; kind < 2; kind++)
        for (int gi = 0; gi < 8; gi++) {
            const int n = gaps[gi] >= 300e-6 ? 100 : 400;
            for (int i = 0; i < n; i++) {
                double g0 = now();
                if (gaps[gi] > 0)
                    do { if (kind) ktk_amx_rows_bf16(kern, KTK_Q4_K, q, rq, 32, K, w2, tmp); } while (now() - g0 < gaps[gi]);
                double a = now();
                ktk_amx_gemm(wt, K, pk, nt, C, ldc);
                v[i] = now() - a;
            }
            qsort(v, n, sizeof v[0], cmp_d);
            printf("gap: %s %6.0f us before each GEMM: median %.2f us, p10 %.2f, p90 %.2f\n", kind ? "conversions" : "spinning   ",
                   gaps[gi] * 1e6, v[n / 2] * 1e6, v[n / 10] * 1e6, v[n * 9 / 10] * 1e6);
        }
    printf("gap: back to back at the end: %.2f us\n", gemm_time(wt, K, pk, nt, C, ldc, 500, 3) * 1e6);
    free(x); free(C); free(tmp); free(wt); free(pk); free(w2); free(bf); free(q);
    return 0;
}

/* "duty": does the tile unit turn fast only under sustained use? In one process, 100 ms windows of
 * (a) the layer's mix, convert 32 hot Q4_K rows then the GEMM, for 3 s, then (b) GEMMs alone for 3 s,
 * then (a) again; each window's mean GEMM time (the GEMM alone timed inside the mix). */
static int duty(void) {
    const ktk_kernels *kern = ktk_kernels_for(KTK_ISA_AVX512);
    const int64_t K = 2048, nt = 48, ldc = 48;
    const float *X[48];
    float *x = tokens(nt, K, X), *C = aligned_alloc(64, 32 * ldc * 4), *tmp = aligned_alloc(64, K * 4);
    uint16_t *wt = aligned_alloc(64, 32 * K * 2), *pk = aligned_alloc(64, ktk_amx_pack_x_elems(nt, K) * 2);
    int64_t rq;
    uint8_t *q = random_rows(KTK_Q4_K, K, 32, &rq);
    ktk_amx_rows_bf16(kern, KTK_Q4_K, q, rq, 32, K, wt, tmp);
    ktk_amx_pack_x(X, nt, K, pk);
    for (int phase = 0; phase < 3; phase++) {
        const int mix = phase != 1;
        printf("duty %s:", mix ? "convert + GEMM" : "GEMM alone    ");
        for (int wdw = 0; wdw < 30; wdw++) {
            double t0 = now(), g = 0;
            long n = 0;
            while (now() - t0 < 0.1) {
                if (mix) ktk_amx_rows_bf16(kern, KTK_Q4_K, q, rq, 32, K, wt, tmp);
                double a = now();
                ktk_amx_gemm(wt, K, pk, nt, C, ldc);
                g += now() - a; n++;
            }
            printf(" %.1f", g / n * 1e6);
        }
        printf(" us\n");
    }
    free(x); free(C); free(tmp); free(wt); free(pk); free(q);
    return 0;
}

#if defined(KTK_LAYER_TRACE)
#include <x86intrin.h>
/* "layer": one DeepSeek-V2-Lite MoE layer (64 experts of 1408, Q4_K gate/up, Q5_0 down, top-6) at
 * batch 512 on the AMX path, random and balanced routing (every expert 48 tokens); per call: its
 * wall time, and each part's time summed in moe.c's counters, as a mean over the workers. */
static int layer(int nthreads, int bits) {   /* bits 0: bf16 tiles; 8 / 4: I8 / I4 copies at the default groups;
                                                 * -1: BF16 weights (read in place by the bf16 tiles); -2: BF16
                                                 * weights with tile copies (ktk_bt_repack); -3: tile copies of the
                                                 * down only */
    const int64_t E = 64, H = 2048, I = 1408, T = 512, k = 6, CALLS = 20;
    if (nthreads < 1 || nthreads > KTK_LAYER_TRACE_T) {
        fprintf(stderr, "layer: threads must be 1-%d, not %d\n", KTK_LAYER_TRACE_T, nthreads);
        return 2;
    }
    int64_t rbh, rbi;
    const int tgu = bits < 0 ? KTK_BF16 : KTK_Q4_K, tdn = bits < 0 ? KTK_BF16 : KTK_Q5_0;
    uint8_t *g = random_rows(tgu, H, E * I, &rbh), *u = random_rows(tgu, H, E * I, &rbh);
    uint8_t *dn = random_rows(tdn, I, E * H, &rbi);
    ktk_moe_desc d = {tgu, tgu, tdn, E, H, I, g, u, dn, rbh, rbh, rbi, 0, 0, 0};
    const int bt = bits == -2 || bits == -3, bt_first = bits == -3 ? 2 : 0;
    if (bits < 0) bits = 0;
    int err = 0;
    ktk_pool *pool = ktk_pool_new(nthreads, 1);
    uint8_t *cp[3] = {NULL, NULL, NULL};
    if (bt && pool) {   /* BF16 tile copies of the three matrices, as cpu_experts makes them with bf16_tiles */
        const uint8_t *src[3] = {g, u, dn};
        const int64_t rows[3] = {I, I, H}, n[3] = {H, H, I}, rb[3] = {rbh, rbh, rbi};
        for (int j = bt_first; j < 3; j++) {
            cp[j] = aligned_alloc(4096, (size_t)(E * ktk_bt_expert_bytes(rows[j], n[j])));
            if (!cp[j] || ktk_bt_repack(pool, KTK_BF16, src[j], rb[j], rows[j] * rb[j], E, rows[j], n[j], cp[j])) {
                fprintf(stderr, "layer: bt_repack %d failed\n", j);
                return 1;
            }
        }
        d.gate_bt = cp[0]; d.up_bt = cp[1]; d.down_bt = cp[2];
    }
    if (bits && pool) {   /* I8 / I4 copies of the three matrices, as cpu_experts makes them with int8_prefill */
        const int types[3] = {KTK_Q4_K, KTK_Q4_K, KTK_Q5_0};
        const uint8_t *src[3] = {g, u, dn};
        const int64_t rows[3] = {I, I, H}, n[3] = {H, H, I}, rb[3] = {rbh, rbh, rbi};
        for (int j = 0; j < 3; j++) {
            const int64_t es = bits == 4 ? ktk_i4_expert_bytes(rows[j], n[j], 0) : ktk_i8_expert_bytes(rows[j], n[j], 0);
            cp[j] = aligned_alloc(64, (size_t)(E * es));
            if (!cp[j] || (bits == 4 ? ktk_i4_repack : ktk_i8_repack)(pool, types[j], src[j], rb[j], rows[j] * rb[j], E,
                                                                        rows[j], n[j], 0, cp[j])) {
                fprintf(stderr, "layer: repack %d failed\n", j);
                return 1;
            }
        }
        d.gate_i8 = cp[0]; d.up_i8 = cp[1]; d.down_i8 = cp[2]; d.i8_bits = bits;
    }
    ktk_moe *m = ktk_moe_new(&d, &err);
    if (!m || !pool) { fprintf(stderr, "layer: moe_new %d or pool failed\n", err); return 1; }
    const float **X = malloc((size_t)T * sizeof *X);
    float *x = tokens(T, H, X), *out = malloc((size_t)(T * H) * 4), *w = malloc((size_t)(T * k) * 4);
    int64_t *ids = malloc((size_t)(T * k) * 8);
    double c0 = now(); uint64_t s0 = __rdtsc();
    while (now() - c0 < 0.2) { }
    const double ghz = (double)(__rdtsc() - s0) / (now() - c0) * 1e-9;
    static const char *names[KTK_LAYER_TRACE_PARTS] = {"gate/up rows->bf16", "gate/up tile GEMM", "SiLU + h stores",
                                                       "down rows->bf16", "down tile GEMM", "down weighted sums",
                                                       "pack tokens", "pack h", "tokens once (P0)", "wait for P0 chunks"};
    for (int balanced = 0; balanced < 2; balanced++) {
        uint64_t r = 88172645463325252ull;
        for (int64_t t = 0; t < T; t++)
            for (int64_t j = 0; j < k; j++) {
                int64_t e;
                if (balanced) e = (t * k + j) % E;
                else for (;;) {   /* k distinct experts, xorshift */
                    r ^= r << 13; r ^= r >> 7; r ^= r << 17;
                    e = (int64_t)(r % (uint64_t)E);
                    int dup = 0;
                    for (int64_t q = 0; q < j; q++) dup |= ids[t * k + q] == e;
                    if (!dup) break;
                }
                ids[t * k + j] = e; w[t * k + j] = 1.f / k;
            }
        for (int i = 0; i < 3; i++) ktk_moe_forward(m, pool, KTK_ISA_AMX, T, k, x, ids, w, out);
        memset(ktk_layer_tr, 0, sizeof ktk_layer_tr);
        double t0 = now();
        for (int i = 0; i < CALLS; i++)
            if (ktk_moe_forward(m, pool, KTK_ISA_AMX, T, k, x, ids, w, out)) { fprintf(stderr, "forward failed\n"); return 1; }
        double wall = (now() - t0) / CALLS * 1e3, busy = 0;
        int n = ktk_pool_threads(pool);
        printf("layer %s routing, %s, %d threads: %.2f ms per call (TSC %.2f GHz)\n", balanced ? "balanced" : "random",
               bits == 4 ? "I4 copies" : bits == 8 ? "I8 copies" : bt_first ? "bf16 tiles, the down on tile copies" : bt ? "bf16 tiles on tile copies" : "bf16 tiles", n, wall, ghz);
        for (int p = 0; p < KTK_LAYER_TRACE_PARTS; p++) {
            double sum = 0, mx = 0;
            for (int t = 0; t < n && t < KTK_LAYER_TRACE_T; t++) {
                double v = ktk_layer_tr[t][p] / ghz * 1e-6 / CALLS;
                sum += v; if (v > mx) mx = v;
            }
            busy += sum / n;
            printf("  %-20s %6.2f ms a worker (max %.2f)\n", names[p], sum / n, mx);
        }
        printf("  %-20s %6.2f ms a worker of %.2f\n", "all parts", busy, wall);
    }
    ktk_moe_free(m); ktk_pool_free(pool);
    free(g); free(u); free(dn); free(x); free(X); free(out); free(w); free(ids);
    for (int j = 0; j < 3; j++) free(cp[j]);
    return 0;
}
#endif

/* "i8": ktk_amx_gemm_i8 on 32 rows of an I8 copy (and ktk_amx_gemm_i4 on an I4 one, at G 256 / 704 / 1024) (random int8 values and scales; any group size G
 * that is a multiple of 64 dividing K, since the GEMM takes G as an argument), hot (one block, in L1/L2)
 * and cold (a fresh block of a 256 MiB set each call, as the layer's first pass over the tokens reads
 * them), beside the bf16 tile GEMM of the same shape (the bench's tile probe is its 48-token row). */
static int i8(void) {
    const int64_t Ks[] = {2048, 1408}, COLD = 2048;
    const int ntoks[] = {16, 32, 48, 64, 96};
    int32_t *ci = aligned_alloc(64, 6144);
    uint8_t *a8 = aligned_alloc(64, 32 * 2048);   /* the I4 GEMM's widened rows */
    for (int ki = 0; ki < 2; ki++) {
        const int64_t K = Ks[ki], KS = K / 64;
        int8_t *A = aligned_alloc(64, (size_t)(32 * K * COLD));
        for (int64_t i = 0; i < 32 * K * COLD; i++) A[i] = (int8_t)(((uint64_t)i * 2654435761u >> 13) % 255 - 127);
        float *ws = aligned_alloc(64, 32 * KS * 4);
        for (int64_t i = 0; i < 32 * KS; i++) ws[i] = 1e-3f * (1 + i % 7);
        uint8_t *wk = aligned_alloc(64, (size_t)32 * (size_t)KS * (size_t)COLD);   /* I4 sub-scales, a block's after another's */
        for (int64_t i = 0; i < 32 * KS * COLD; i++) wk[i] = (uint8_t)((i * 37) % 16);
        uint16_t *wt = aligned_alloc(64, (size_t)(32 * 2 * 2048));
        for (int64_t i = 0; i < 32 * K; i++) wt[i] = 0x3f80 + (uint16_t)(i % 64);
        for (int ni = 0; ni < 5; ni++) {
            const int64_t nt = ntoks[ni], ntt = (nt + 15) / 16, ldc = ntt * 16;
            int8_t *pk = aligned_alloc(64, ntt * KS * 1024);
            for (int64_t i = 0; i < ntt * KS * 1024; i++) pk[i] = (int8_t)((i * 7919) % 255 - 127);
            float *ts = aligned_alloc(64, ntt * KS * 16 * 4), *C = aligned_alloc(64, 32 * ldc * 4);
            for (int64_t i = 0; i < ntt * KS * 16; i++) ts[i] = 1e-2f;
            uint16_t *pb = aligned_alloc(64, ktk_amx_pack_x_elems(nt, K) * 2);
            for (int64_t i = 0; i < ktk_amx_pack_x_elems(nt, K); i++) pb[i] = 0x3f80;
            const double bf = gemm_time(wt, K, pb, nt, C, ldc, 1000, 3);
            printf("K=%ld tokens %ld: bf16 gemm hot %.2f us (%.2f TFLOPS)\n", (long)K, (long)nt, bf * 1e6,
                   2.0 * 32 * nt * K / bf * 1e-12);
            for (int64_t G = 64; G <= K; G += 64) {
                if (K % G || (G != 128 && G != 256 && G != 512 && G != 704 && G != 1024 && G != K)) continue;
                for (int cold = 0; cold < 2; cold++) {   /* cold: the rows from memory, prefetched 8 k-steps ahead */
                    const int reps = cold ? (int)COLD : 1000, pf = cold ? 8 : 0;
                    ktk_amx_gemm_i8(A, ws, K, G, pk, ts, nt, C, ldc, ci, pf, 1);
                    double best = 1e30;
                    for (int rep = 0; rep < 3; rep++) {
                        double t0 = now();
                        for (int i = 0; i < reps; i++)
                            ktk_amx_gemm_i8(A + (cold ? (int64_t)i * 32 * K : 0), ws, K, G, pk, ts, nt, C, ldc, ci, pf, 1);
                        double dt = (now() - t0) / reps;
                        if (dt < best) best = dt;
                    }
                    printf("K=%ld tokens %ld G=%ld %s: i8 gemm %.2f us (%.2f TOPS, %.2fx bf16 hot)\n", (long)K, (long)nt,
                           (long)G, cold ? "cold" : "hot ", best * 1e6, 2.0 * 32 * nt * K / best * 1e-12, bf / best);
                    if (G != 256 && G != 704 && G != 1024) continue;
                    /* the same block as an I4 copy (the first half of these bytes as nibbles; a block is 16 K bytes),
                     * its nibbles widened 0, 1, 2 or 4 k-steps before their tile loads */
                    const uint8_t *A4 = (const uint8_t *)A;
                    for (int ahead = 0; ahead <= 4; ahead += 1 + (ahead == 2)) {
                        ktk_amx_gemm_i4(A4, ws, wk, K, G, pk, ts, nt, C, ldc, ci, a8, pf, 1, ahead);
                        best = 1e30;
                        for (int rep = 0; rep < 3; rep++) {
                            double t0 = now();
                            for (int i = 0; i < reps; i++)
                                ktk_amx_gemm_i4(A4 + (cold ? (int64_t)i * 16 * K : 0), ws, wk + (cold ? (int64_t)i * 32 * KS : 0),
                                                K, G, pk, ts, nt, C, ldc, ci, a8, pf, 1, ahead);
                            double dt = (now() - t0) / reps;
                            if (dt < best) best = dt;
                        }
                        printf("K=%ld tokens %ld G=%ld %s: i4 gemm ahead %d %.2f us (%.2f TOPS, %.2fx bf16 hot)\n", (long)K,
                               (long)nt, (long)G, cold ? "cold" : "hot ", ahead, best * 1e6, 2.0 * 32 * nt * K / best * 1e-12,
                               bf / best);
                    }
                }
            }
            free(pk); free(ts); free(C); free(pb);
        }
        free(A); free(ws); free(wt); free(wk);
    }
    free(ci); free(a8);
    return 0;
}

/* "conc [threads ...]": ktk_amx_gemm_i4 (K 2048, G 1024, 48 tokens, widened 2 k-steps ahead) on every thread at once,
 * each pinned to its own CPU with its own buffers: hot (one block again and again, in L1/L2) and cold (a fresh
 * block of the thread's own 64 MiB set each call, prefetched 8 k-steps ahead, as the layer reads its rows).
 * Per thread count, each thread's mean time a call (median and worst over the threads) and the cold rows'
 * aggregate GB/s: does a block slow down when every core runs them, hot or from memory? */
typedef struct {
    int cpu, cold, iters;
    pthread_barrier_t *bar;
    double us;
} conc_arg;

/* the calling thread onto one CPU ("conc", "streams") */
static void pin_self(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static void *conc_worker(void *p) {
    conc_arg *a = p;
    pin_self(a->cpu);
    const int64_t K = 2048, G = 1024, KS = K / 64, NG = K / G, nt = 48, ntt = 3, ldc = 48;
    const int64_t nb = a->cold ? 2048 : 1, bb = 16 * K;          /* blocks in the set, nibble bytes a block */
    uint8_t *A = aligned_alloc(64, (size_t)(bb * nb)), *wk = aligned_alloc(64, (size_t)(32 * KS * nb));
    float *ws = aligned_alloc(64, 32 * NG * 4), *ts = aligned_alloc(64, ntt * KS * 16 * 4), *C = aligned_alloc(64, 32 * ldc * 4);
    int8_t *pk = aligned_alloc(64, ntt * KS * 1024);
    int32_t *ci = aligned_alloc(64, 6144);
    uint8_t *a8 = aligned_alloc(64, 32 * 2048);
    if (!A || !wk || !ws || !ts || !C || !pk || !ci || !a8) {   /* still meet the others at the barrier */
        fprintf(stderr, "conc: thread %d could not allocate its buffers\n", a->cpu);
        pthread_barrier_wait(a->bar);
        a->us = -1;
        free(A); free(wk); free(ws); free(ts); free(C); free(pk); free(ci); free(a8);
        return NULL;
    }
    for (int64_t i = 0; i < bb * nb; i++) A[i] = (uint8_t)((uint64_t)i * 2654435761u >> 13);
    for (int64_t i = 0; i < 32 * KS * nb; i++) wk[i] = (uint8_t)((i * 37) % 16);
    for (int64_t i = 0; i < 32 * NG; i++) ws[i] = 1e-3f;
    for (int64_t i = 0; i < ntt * KS * 16; i++) ts[i] = 1e-2f;
    for (int64_t i = 0; i < ntt * KS * 1024; i++) pk[i] = (int8_t)((i * 7919) % 255 - 127);
    const int pf = a->cold ? 8 : 0;
    ktk_amx_gemm_i4(A, ws, wk, K, G, pk, ts, nt, C, ldc, ci, a8, pf, 1, 2);
    pthread_barrier_wait(a->bar);
    const double t0 = now();
    for (int i = 0; i < a->iters; i++) {
        const int64_t b = a->cold ? i % nb : 0;
        ktk_amx_gemm_i4(A + b * bb, ws, wk + b * 32 * KS, K, G, pk, ts, nt, C, ldc, ci, a8, pf, 1, 2);
    }
    a->us = (now() - t0) / a->iters * 1e6;
    free(A); free(wk); free(ws); free(ts); free(C); free(pk); free(ci); free(a8);
    return NULL;
}

static int cmp_double(const void *x, const void *y) {
    const double a = *(const double *)x, b = *(const double *)y;
    return (a > b) - (a < b);
}

static int conc(int argc, char **argv) {
    int counts[16], nc = 0;
    for (int i = 2; i < argc && nc < 16; i++) counts[nc++] = atoi(argv[i]);
    if (!nc) { counts[0] = 1; counts[1] = 8; counts[2] = 15; counts[3] = 16; nc = 4; }
    for (int ci = 0; ci < nc; ci++) {
        const int n = counts[ci];
        if (n < 1 || n > 256) continue;
        for (int cold = 0; cold < 2; cold++) {
            pthread_t th[256];
            conc_arg args[256];
            pthread_barrier_t bar;
            pthread_barrier_init(&bar, NULL, (unsigned)n);
            for (int t = 0; t < n; t++) {
                args[t] = (conc_arg){.cpu = t, .cold = cold, .iters = cold ? 8192 : 20000, .bar = &bar};
                if (pthread_create(&th[t], NULL, conc_worker, &args[t])) {   /* the barrier would wait for it */
                    fprintf(stderr, "conc: could not start thread %d of %d\n", t, n);
                    exit(1);
                }
            }
            double us[256];
            int failed = 0;
            for (int t = 0; t < n; t++) { pthread_join(th[t], NULL); us[t] = args[t].us; failed |= us[t] < 0; }
            pthread_barrier_destroy(&bar);
            if (failed) { fprintf(stderr, "conc: %d threads: a thread could not allocate its buffers\n", n); return 1; }
            qsort(us, (size_t)n, sizeof us[0], cmp_double);
            const double med = us[n / 2], gbps = cold ? n * (16.0 * 2048 + 32 * 32) / med * 1e-3 : 0;
            printf("conc %2d threads %s: i4 gemm %.2f us a call (median of the threads; %.2f-%.2f)%s", n,
                   cold ? "cold" : "hot ", med, us[0], us[n - 1], cold ? "" : "\n");
            if (cold) printf(", rows %.1f GB/s together\n", gbps);
            fflush(stdout);
        }
    }
    return 0;
}

/* "streams [threads ...]": the BF16 tile GEMM of 32 x 2048 blocks (48 tokens) from memory on n threads at once, one
 * core each, every thread over its own blocks (64 MiB or more, 1 GiB or more together): the rows read in place
 * (ktk_amx_gemm_rows, the layer's BF16 path), a tile-major copy (ktk_amx_gemm, each k-step's 2 KiB contiguous) with
 * no software prefetch, and the same with the next block brought into L2 during each GEMM (ktk_amx_gemm_next). One
 * core streams about 10 GB/s either way (benchmarks.md, twenty-ninth session); does the contiguous copy stream faster
 * with 15 cores at once? */
typedef struct {
    int cpu, variant;
    int64_t nb;   /* blocks of this thread: the threads' sets together >= 1 GiB, far past L3 */
    pthread_barrier_t *bar;
    double us;
} streams_arg;

static void *streams_worker(void *p) {
    streams_arg *a = p;
    pin_self(a->cpu);
    const int64_t K = 2048, nt = 48, ldc = 48, NB = a->nb, bb = 32 * K * 2;
    uint8_t *W = aligned_alloc(4096, (size_t)(NB * bb));
    uint16_t *pk = aligned_alloc(64, ktk_amx_pack_x_elems(nt, K) * 2);
    float *C = aligned_alloc(64, 32 * ldc * 4);
    if (!W || !pk || !C) {   /* still meet the others at the barrier */
        fprintf(stderr, "streams: thread %d could not allocate its buffers\n", a->cpu);
        pthread_barrier_wait(a->bar);
        a->us = -1;
        free(W); free(pk); free(C);
        return NULL;
    }
    for (int64_t i = 0; i < NB * bb; i += 2) { W[i] = (uint8_t)(i >> 7); W[i + 1] = 0x3f; }
    for (int64_t i = 0; i < ktk_amx_pack_x_elems(nt, K); i++) pk[i] = 0x3f80;
    ktk_amx_gemm((const uint16_t *)W, K, pk, nt, C, ldc);   /* configures this thread's tiles */
    pthread_barrier_wait(a->bar);
    const int reps = 4;
    const double t0 = now();
    for (int r = 0; r < reps; r++)
        for (int64_t i = 0; i < NB; i++) {
            const uint8_t *b = W + i * bb;
            if (a->variant == 0) ktk_amx_gemm_rows(b, K * 2, K, pk, nt, C, ldc);
            else if (a->variant == 1) ktk_amx_gemm((const uint16_t *)b, K, pk, nt, C, ldc);
            else ktk_amx_gemm_next((const uint16_t *)b, K, pk, nt, C, ldc, b + bb, i + 1 < NB ? bb : 0);
        }
    a->us = (now() - t0) / (reps * NB) * 1e6;
    free(W); free(pk); free(C);
    return NULL;
}

static int streams(int argc, char **argv) {
    int counts[16], nc = 0;
    for (int i = 2; i < argc && nc < 16; i++) counts[nc++] = atoi(argv[i]);
    if (!nc) { counts[0] = 1; counts[1] = 8; counts[2] = 15; nc = 3; }
    static const char *names[3] = {"rows in place", "tile-major", "tile-major, next block into L2"};
    for (int round = 0; round < 2; round++)
        for (int ci = 0; ci < nc; ci++)
            for (int v = 0; v < 3; v++) {
                const int n = counts[ci];
                if (n < 1 || n > 256) continue;
                pthread_t th[256];
                streams_arg args[256];
                pthread_barrier_t bar;
                pthread_barrier_init(&bar, NULL, (unsigned)n);
                for (int t = 0; t < n; t++) {
                    args[t] = (streams_arg){.cpu = t, .variant = v, .nb = n >= 16 ? 512 : 8192 / n, .bar = &bar};
                    if (pthread_create(&th[t], NULL, streams_worker, &args[t])) {
                        fprintf(stderr, "streams: could not start thread %d of %d\n", t, n);
                        exit(1);
                    }
                }
                double us[256];
                int failed = 0;
                for (int t = 0; t < n; t++) { pthread_join(th[t], NULL); us[t] = args[t].us; failed |= us[t] < 0; }
                pthread_barrier_destroy(&bar);
                if (failed) { fprintf(stderr, "streams: %d threads: a thread could not allocate\n", n); return 1; }
                qsort(us, (size_t)n, sizeof us[0], cmp_double);
                printf("round %d, %2d threads, %-31s %.2f us a block (median; %.2f-%.2f), %.1f GB/s together\n",
                       round + 1, n, names[v], us[n / 2], us[0], us[n - 1], n * 131072.0 / us[n / 2] * 1e-3);
                fflush(stdout);
            }
    return 0;
}

/* pack: the INT8 token packing of 48 tokens (K 2048, G 256; K 1408, G 704) gathered at random from 64 MiB of
 * tokens, as a batch-512 layer's experts take theirs (no AMX needed; run it with KTINJECT_PACK_PREFETCH=0 and 1) */
static int pack(void) {
    const int64_t T = 8192, KMAX = 2048, nt = 48;
    float *x = aligned_alloc(64, (size_t)(T * KMAX) * 4);
    for (int64_t i = 0; i < T * KMAX; i++) x[i] = (float)((i * 7919) % 1000) * 1e-3f - 0.5f;
    int8_t *pk = aligned_alloc(64, (size_t)(64 * KMAX));
    float *ts = malloc((size_t)(64 * KMAX / 64) * 4);
    const int64_t shapes[2][2] = {{2048, 256}, {1408, 704}};
    const float *X[48];
    uint64_t r = 88172645463325252ull;
    for (int si = 0; si < 2; si++) {
        const int64_t K = shapes[si][0], G = shapes[si][1];
        double best = 1e30, sum = 0;
        for (int rep = 0; rep < 2000; rep++) {
            for (int j = 0; j < nt; j++) { r ^= r << 13; r ^= r >> 7; r ^= r << 17; X[j] = x + (int64_t)(r % (uint64_t)T) * KMAX; }
            const double t0 = now();
            ktk_amx_pack_x_i8(X, nt, K, G, pk, ts);
            const double el = now() - t0;
            sum += el; if (el < best) best = el;
        }
        printf("pack %ld tokens x %ld (G %ld) gathered from 64 MiB: %.1f us mean, %.1f best\n", (long)nt, (long)K, (long)G,
               sum / 2000 * 1e6, best * 1e6);
    }
    free(x); free(pk); free(ts);
    return 0;
}

/* pack1: a batch-512 V2-Lite layer's token packing for its gate/up on one thread: 64 experts of 48 tokens (each
 * token in 6), each expert's packing quantizing its tokens (ktk_amx_pack_x_i8, KTINJECT_PACK_ONCE=0), against the
 * 512 tokens quantized once and each expert packed from their bytes (ktk_amx_quant_rows_i8 + ktk_amx_pack_q_i8);
 * the same for bf16 tiles (ktk_amx_pack_x against ktk_amx_rows_to_bf16 + ktk_amx_pack_b) */
static int pack1(void) {
    if (!ktk_amx_pack_once_usable()) { fprintf(stderr, "pack1: the once-quantized packing needs AVX-512\n"); return 1; }
    const int64_t T = 512, K = 2048, G = 256, E = 64, nt = 48, NG = K / G;
    float *x = aligned_alloc(64, (size_t)(T * K) * 4), *qs = malloc((size_t)(T * NG) * 4);
    for (int64_t i = 0; i < T * K; i++) x[i] = (float)((i * 7919) % 1000) * 1e-3f - 0.5f;
    int8_t *q = aligned_alloc(64, (size_t)(T * K)), *pk = aligned_alloc(64, (size_t)(E * nt * K));
    float *ts = malloc((size_t)(E * nt * NG) * 4);
    uint16_t *xb = aligned_alloc(64, (size_t)(T * K) * 2), *pb = aligned_alloc(64, (size_t)(E * nt * K) * 2);
    int64_t *idx = malloc((size_t)(E * nt) * 8);
    const float **X = malloc((size_t)(E * nt) * sizeof *X);
    uint64_t r = 88172645463325252ull;
    for (int64_t j = 0; j < E * nt; j++) { r ^= r << 13; r ^= r >> 7; r ^= r << 17; idx[j] = (int64_t)(r % (uint64_t)T); X[j] = x + idx[j] * K; }
    for (int rep = 0; rep < 6; rep++) {
        double t0 = now();
        for (int64_t e = 0; e < E; e++)
            ktk_amx_pack_x_i8(X + e * nt, nt, K, G, pk + e * nt * K, ts + e * nt * NG);
        const double per = now() - t0;
        t0 = now();
        ktk_amx_quant_rows_i8(x, K, T, K, G, q, qs);
        const double quant = now() - t0;
        for (int64_t e = 0; e < E; e++)
            ktk_amx_pack_q_i8(q, qs, idx + e * nt, nt, K, G, pk + e * nt * K, ts + e * nt * NG);
        const double once = now() - t0;
        t0 = now();
        for (int64_t e = 0; e < E; e++) ktk_amx_pack_x(X + e * nt, nt, K, pb + e * nt * K);
        const double perb = now() - t0;
        t0 = now();
        ktk_amx_rows_to_bf16(x, K, T, K, xb);
        for (int64_t e = 0; e < E; e++) ktk_amx_pack_b(xb, idx + e * nt, nt, K, pb + e * nt * K);
        const double onceb = now() - t0;
        printf("pack1 (512 tokens, 64 experts x 48, K 2048): I8 (G 256) per expert %.0f us, once %.0f us (quantize %.0f); "
               "bf16 per expert %.0f us, once %.0f us\n", per * 1e6, once * 1e6, quant * 1e6, perb * 1e6, onceb * 1e6);
    }
    free(x); free(qs); free(q); free(pk); free(ts); free(idx); free(X); free(xb); free(pb);
    return 0;
}

/* sums: a batch-512 V2-Lite down item's weighted sums (64 experts x 48 tokens, 32 rows each) added into the
 * output's rows H = 2048 floats apart, against a compact [512][32] block written out once (phase_down) */
static int sums(void) {
    const int64_t T = 512, H = 2048, E = 64, n = 48;
    float *out = aligned_alloc(64, (size_t)(T * H) * 4), *acc = aligned_alloc(64, (size_t)(T * 32) * 4), C[32 * 48];
    int64_t *tok = malloc((size_t)(E * n) * 8);
    float *wt = malloc((size_t)(E * n) * 4);
    for (int i = 0; i < 32 * 48; i++) C[i] = (float)i * 1e-3f;
    uint64_t r = 88172645463325252ull;
    for (int64_t i = 0; i < E * n; i++) { r ^= r << 13; r ^= r >> 7; r ^= r << 17; tok[i] = (int64_t)(r % (uint64_t)T); wt[i] = 0.1f; }
    memset(out, 0, (size_t)(T * H) * 4);
    for (int mode = 0; mode < 2; mode++) {
        double best = 1e30;
        for (int rep = 0; rep < 20; rep++) {
            const double t0 = now();
            for (int64_t r0 = 0; r0 < H; r0 += 32) {
                if (mode == 0) {
                    for (int64_t t = 0; t < T; t++) memset(out + t * H + r0, 0, 128);
                    for (int64_t e = 0; e < E; e++) ktk_amx_c_to_rows(C, 48, 32, n, out + r0, tok + e * n, H, wt + e * n);
                } else {
                    memset(acc, 0, (size_t)(T * 32) * 4);
                    for (int64_t e = 0; e < E; e++) ktk_amx_c_to_rows(C, 48, 32, n, acc, tok + e * n, 32, wt + e * n);
                    for (int64_t t = 0; t < T; t++) memcpy(out + t * H + r0, acc + t * 32, 128);
                }
            }
            const double el = (now() - t0) / (H / 32);
            if (el < best) best = el;
        }
        printf("down item's weighted sums, %s: %.1f us\n", mode ? "compact block, written once" : "into the output rows", best * 1e6);
    }
    free(out); free(acc); free(tok); free(wt);
    return 0;
}

/* "stream": one core streaming a 512 MiB set of BF16 blocks (32 rows x K 2048, 48 tokens) through the tiles:
 * rows read in place (ktk_amx_gemm_rows: 32 rows 4 KiB apart, prefetched 8 k-steps ahead), the same values
 * tile-major (ktk_amx_gemm, no prefetch), and tile-major with the next block brought into L2 during each
 * (ktk_amx_gemm_next), beside the hot tile-major block, which tells the tile unit's state. Would a tile-major
 * BF16 copy stream faster than the rows in place? */
static int stream(void) {
    const int64_t K = 2048, NB = 4096, nt = 48, ldc = 48, rb = K * 2;
    uint8_t *br = aligned_alloc(4096, (size_t)(NB * 32 * rb));
    uint16_t *tm = aligned_alloc(4096, (size_t)(NB * 32 * rb));
    for (int64_t i = 0; i < NB * 32 * rb; i += 2) { br[i] = (uint8_t)(i >> 7); br[i + 1] = 0x3f; }
    memcpy(tm, br, (size_t)(NB * 32 * rb));   /* the same values: only the time is of interest */
    uint16_t *pk = aligned_alloc(64, ktk_amx_pack_x_elems(nt, K) * 2);
    for (int64_t i = 0; i < ktk_amx_pack_x_elems(nt, K); i++) pk[i] = 0x3f80;
    float *C = aligned_alloc(64, 32 * ldc * 4);
    for (int round = 0; round < 3; round++) {
        double t0 = now();
        for (int i = 0; i < 2000; i++) ktk_amx_gemm(tm, K, pk, nt, C, ldc);
        const double hot = (now() - t0) / 2000;
        double dt[3];
        for (int v = 0; v < 3; v++) {
            t0 = now();
            for (int64_t i = 0; i < NB; i++) {
                if (v == 0) ktk_amx_gemm_rows(br + i * 32 * rb, rb, K, pk, nt, C, ldc);
                else if (v == 1) ktk_amx_gemm(tm + i * 32 * K, K, pk, nt, C, ldc);
                else ktk_amx_gemm_next(tm + i * 32 * K, K, pk, nt, C, ldc, (const uint8_t *)(tm + (i + 1) * 32 * K),
                                       i + 1 < NB ? 32 * rb : 0);
            }
            dt[v] = (now() - t0) / NB;
        }
        printf("hot tile-major %.2f us; cold: in place %.2f us (%.1f GB/s), tile-major %.2f (%.1f), "
               "tile-major + next block into L2 %.2f (%.1f)\n", hot * 1e6, dt[0] * 1e6, 32.0 * rb / dt[0] * 1e-9,
               dt[1] * 1e6, 32.0 * rb / dt[1] * 1e-9, dt[2] * 1e6, 32.0 * rb / dt[2] * 1e-9);
    }
    free(br); free(tm); free(pk); free(C);
    return 0;
}

/* tokens: the bf16 tile GEMM of one hot tile-major block (32 rows x K, 48 tokens) with its packed tokens (the B
 * tiles) hot, cycling over 64 experts' packs as the down phase reads them (an item: 32 output rows, every expert, so
 * each expert's pack comes from L3), cycling with the next pack brought into L2 meanwhile (ktk_amx_gemm_next), and
 * each pack used by two calls in a row (the second finds it in L2: items of 64 output rows would). us a call. */
static int tokens_probe(void) {
    const int64_t nt = 48, E = 64, ldc = 48;
    float *C = aligned_alloc(64, 32 * 64 * 4);
    for (int ki = 0; ki < 2; ki++) {
        const int64_t K = ki ? 1408 : 2048, pe = ktk_amx_pack_x_elems(nt, K);
        uint16_t *wt = aligned_alloc(4096, (size_t)32 * K * 2);
        uint16_t *pk = aligned_alloc(4096, (size_t)(E * pe * 2 + 4095) / 4096 * 4096);
        for (int64_t i = 0; i < 32 * K; i++) wt[i] = (uint16_t)(0x3f80 + i % 7);
        for (int64_t i = 0; i < E * pe; i++) pk[i] = (uint16_t)(0x3f00 + i % 13);
        static const char *names[4] = {"tokens hot", "cycling 64 packs", "cycling, next pack into L2", "each pack twice"};
        for (int round = 0; round < 3; round++) {
            printf("K %lld, round %d:", (long long)K, round + 1);
            for (int mode = 0; mode < 4; mode++) {
                const int iters = 2048;
                double t0 = now();
                for (int i = 0; i < iters; i++) {
                    const int64_t e = mode == 0 ? 0 : mode == 3 ? (i / 2) % E : i % E, e1 = (e + 1) % E;
                    if (mode == 2) ktk_amx_gemm_next(wt, K, pk + e * pe, nt, C, ldc, (const uint8_t *)(pk + e1 * pe), pe * 2);
                    else ktk_amx_gemm(wt, K, pk + e * pe, nt, C, ldc);
                }
                printf("  %s %.2f", names[mode], (now() - t0) / iters * 1e6);
            }
            printf(" us\n");
        }
        free(wt); free(pk);
    }
    free(C);
    return 0;
}

/* "rowspf": the tile loop of ktk_amx_gemm_rows's first pass (32 BF16 rows in place, 4 KiB apart, three token tiles:
 * six C tiles) over a 512 MiB set of 32 x 2048 blocks on one core, with the rows prefetched `dist` k-steps ahead by
 * `kind` (0 none, 1 T0, 2 T1, 3 T2, 4 T0 one row in four), the products on or off (the tile loads alone). Do the
 * software prefetches help the hardware's, or take its fill buffers? (Tiles configured by a ktk_amx_gemm call.) */
#if defined(__x86_64__)
__attribute__((target("amx-tile,amx-bf16")))
static void rows_pass(const uint8_t *A, const uint16_t *pk, int64_t K, int prod, int kind, int dist, float *C) {
    const int64_t KS = K / 32, rb = K * 2;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); _tile_zero(4); _tile_zero(5);
    for (int64_t ks = 0; ks < KS; ks++) {
        if (kind && ks + dist < KS)
            for (int r = 0; r < 32; r += kind == 4 ? 4 : 1) {
                const char *l = (const char *)(A + r * rb + (ks + dist) * 64);
                if (kind == 1 || kind == 4) _mm_prefetch(l, _MM_HINT_T0);
                else if (kind == 2) _mm_prefetch(l, _MM_HINT_T1);
                else _mm_prefetch(l, _MM_HINT_T2);
            }
        const uint16_t *b = pk + ks * 512;
        _tile_loadd(6, A + ks * 64, rb);
        if (prod) {
            _tile_loadd(7, b, 64); _tile_dpbf16ps(0, 6, 7);
            _tile_loadd(7, b + KS * 512, 64); _tile_dpbf16ps(1, 6, 7);
            _tile_loadd(7, b + 2 * KS * 512, 64); _tile_dpbf16ps(2, 6, 7);
        }
        _tile_loadd(6, A + 16 * rb + ks * 64, rb);
        if (prod) {
            _tile_dpbf16ps(5, 6, 7);
            _tile_loadd(7, b + KS * 512, 64); _tile_dpbf16ps(4, 6, 7);
            _tile_loadd(7, b, 64); _tile_dpbf16ps(3, 6, 7);
        }
    }
    _tile_stored(0, C, 192); _tile_stored(1, C + 16, 192); _tile_stored(2, C + 32, 192);
    _tile_stored(3, C + 768, 192); _tile_stored(4, C + 784, 192); _tile_stored(5, C + 800, 192);
}

static int rowspf(void) {
    const int64_t K = 2048, NB = 4096, nt = 48, bb = 32 * K * 2;
    uint8_t *br = aligned_alloc(4096, (size_t)(NB * bb));
    uint16_t *pk = aligned_alloc(64, ktk_amx_pack_x_elems(nt, K) * 2);
    float *C = aligned_alloc(64, 32 * nt * 4);
    if (!br || !pk || !C) { fprintf(stderr, "rowspf: out of memory (512 MiB of blocks)\n"); return 1; }
    for (int64_t i = 0; i < NB * bb; i += 2) { br[i] = (uint8_t)(i >> 7); br[i + 1] = 0x3f; }
    for (int64_t i = 0; i < ktk_amx_pack_x_elems(nt, K); i++) pk[i] = 0x3f80;
    ktk_amx_gemm((const uint16_t *)br, K, pk, nt, C, nt);   /* configures this thread's tiles */
    static const char *kinds[5] = {"none", "T0", "T1", "T2", "T0, one row in four"};
    static const int dists[3] = {4, 8, 16};
    for (int round = 0; round < 2; round++) {
        double t0 = now();
        for (int i = 0; i < 2000; i++) rows_pass(br, pk, K, 1, 0, 0, C);
        printf("round %d: the hot block %.2f us; us a block from memory (GB/s)\n", round + 1, (now() - t0) / 2000 * 1e6);
        for (int kind = 0; kind < 5; kind++)
            for (int di = 0; di < (kind ? 3 : 1); di++) {
                double dt[2];
                for (int prod = 0; prod < 2; prod++) {
                    t0 = now();
                    for (int64_t i = 0; i < NB; i++) rows_pass(br + i * bb, pk, K, prod, kind, dists[di], C);
                    dt[prod] = (now() - t0) / NB;
                }
                printf("  prefetch %-20s %2d ahead: loads alone %.2f (%.1f), with the products %.2f (%.1f)\n", kinds[kind],
                       kind ? dists[di] : 0, dt[0] * 1e6, bb / dt[0] * 1e-9, dt[1] * 1e6, bb / dt[1] * 1e-9);
            }
    }
    free(br); free(pk); free(C);
    return 0;
}
#endif

#if defined(__x86_64__)
/* "shapes": TDPBF16PS back to back (four independent C tiles, operands in tile registers) with A of M rows and B of N
 * columns (K 32 bf16 values): its cost by tile shape. On the development machine's AMX it was 14 TSC cycles for every
 * M and N in {1, 4, 8, 16}: a token tile padded from r tokens to 16 costs what a full one does, and so would a
 * narrower tile. (Reconfigures the tiles; the layer's own shapes come back with its next amx_config.) */
typedef struct __attribute__((packed, aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} shapes_cfg;

__attribute__((target("amx-tile,amx-bf16"), noinline))
static double shape_cycles(int M, int N, const uint8_t *A, const uint8_t *B) {
    shapes_cfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 4; t++) { c.rows[t] = (uint8_t)M; c.colsb[t] = (uint16_t)(N * 4); }   /* C: M x N floats */
    for (int t = 4; t < 8; t += 2) {
        c.rows[t] = (uint8_t)M; c.colsb[t] = 64;                                          /* A: M rows of 32 bf16 */
        c.rows[t + 1] = 16; c.colsb[t + 1] = (uint16_t)(N * 4);                           /* B: 16 pairs x N */
    }
    __asm__ __volatile__("" : : "r"(&c) : "memory");   /* keep the shape stores (see amx.c's amx_config) */
    _tile_loadconfig(&c);
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    _tile_loadd(4, A, 64); _tile_loadd(5, B, 64); _tile_loadd(6, A, 64); _tile_loadd(7, B, 64);
    const int n = 200000;
    const uint64_t t0 = __rdtsc();
    for (int i = 0; i < n; i++) {
        _tile_dpbf16ps(0, 4, 5); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 6, 5); _tile_dpbf16ps(3, 6, 7);
    }
    const uint64_t t1 = __rdtsc();
    _tile_release();
    return (double)(t1 - t0) / (4.0 * n);
}

static int shapes(void) {
    static uint8_t A[1024] __attribute__((aligned(64))), B[1024] __attribute__((aligned(64)));
    for (int i = 0; i < 1024; i++) { A[i] = (uint8_t)(i * 7); B[i] = (uint8_t)(i * 3); }
    static const int sz[] = {16, 8, 4, 1};
    shape_cycles(16, 16, A, B);   /* warm-up: the first run after the tiles' first use reads slower */
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < 4; b++)
            printf("TDPBF16PS, A %2d rows, B %2d columns: %.2f TSC cycles each\n", sz[a], sz[b],
                   shape_cycles(sz[a], sz[b], A, B));
    return 0;
}
#endif

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "pack")) return pack();
    if (argc > 1 && !strcmp(argv[1], "pack1")) return pack1();
    if (argc > 1 && !strcmp(argv[1], "sums")) return sums();
    if (!ktk_amx_usable()) { fprintf(stderr, "no usable AMX here\n"); return 1; }
#if defined(KTK_LAYER_TRACE)
    if (argc > 1 && !strcmp(argv[1], "layer"))   /* layer [threads] [bf16|i8|i4|bf16w|bf16t] */
        return layer(argc > 2 ? atoi(argv[2]) : 16, argc > 3 ? (!strcmp(argv[3], "i4") ? 4 : !strcmp(argv[3], "i8") ? 8 :
                                                                 !strcmp(argv[3], "bf16w") ? -1 :
                                                                 !strcmp(argv[3], "bf16t") ? -2 :
                                                                 !strcmp(argv[3], "bf16d") ? -3 : 0) : 0);
#endif
    if (argc > 1 && !strcmp(argv[1], "place")) return place();
    if (argc > 1 && !strcmp(argv[1], "i8")) return i8();
    if (argc > 1 && !strcmp(argv[1], "conc")) return conc(argc, argv);
    if (argc > 1 && !strcmp(argv[1], "streams")) return streams(argc, argv);
    if (argc > 1 && !strcmp(argv[1], "stream")) return stream();
    if (argc > 1 && !strcmp(argv[1], "tokens")) return tokens_probe();
#if defined(__x86_64__)
    if (argc > 1 && !strcmp(argv[1], "rowspf")) return rowspf();
    if (argc > 1 && !strcmp(argv[1], "shapes")) return shapes();
#endif
    if (argc > 1 && !strcmp(argv[1], "more")) return more();
    if (argc > 1 && !strcmp(argv[1], "flip")) return flip();
    if (argc > 1 && !strcmp(argv[1], "gap")) return gap();
    if (argc > 1 && !strcmp(argv[1], "duty")) return duty();
    if (argc > 1 && !strcmp(argv[1], "data")) return data(argc > 2 ? atoll(argv[2]) : 2048);
    const int64_t K = argc > 1 ? atoll(argv[1]) : 2048, COLD = 4096;   /* cold set: 4096 blocks of 32 rows */
    const ktk_kernels *kern = ktk_kernels_for(KTK_ISA_AVX512);
    uint16_t *wt = aligned_alloc(64, 32 * K * 2);
    float *tmp = aligned_alloc(64, K * 4);
    const int types[] = {KTK_Q4_K, KTK_Q5_0, KTK_Q8_0, KTK_BF16};
    const char *names[] = {"q4_k", "q5_0", "q8_0", "bf16"};
    for (int ti = 0; ti < 4; ti++) {
        int64_t rb;
        if (types[ti] == KTK_Q4_K && K % 256) continue;
        uint8_t *rows = random_rows(types[ti], K, 32 * COLD, &rb);
        for (int cold = 0; cold < 2; cold++) {
            int reps = cold ? COLD : 2000;
            ktk_amx_rows_bf16(kern, types[ti], rows, rb, 32, K, wt, tmp);
            double t0 = now();
            for (int i = 0; i < reps; i++)
                ktk_amx_rows_bf16(kern, types[ti], rows + (cold ? (int64_t)i * 32 * rb : 0), rb, 32, K, wt, tmp);
            double dt = (now() - t0) / reps;
            printf("rows_bf16 %s K=%ld %s: %.2f us per 32 rows, %.2f weights/ns, %.1f GB/s of rows read\n", names[ti],
                   (long)K, cold ? "cold" : "hot ", dt * 1e6, 32.0 * K / dt * 1e-9, 32.0 * rb / dt * 1e-9);
        }
        free(rows);
    }
    const int ntoks[] = {16, 32, 48, 64, 96, 128};
    int64_t rb;
    uint8_t *bf = random_rows(KTK_BF16, K, 32, &rb);
    ktk_amx_rows_bf16(kern, KTK_BF16, bf, rb, 32, K, wt, tmp);
    for (int ni = 0; ni < 6; ni++) {
        int64_t nt = ntoks[ni], ldc = (nt + 15) / 16 * 16;
        float *C = aligned_alloc(64, 32 * ldc * 4);
        const float **X = malloc(nt * sizeof *X);
        float *x = tokens(nt, K, X);
        uint16_t *pk = aligned_alloc(64, ktk_amx_pack_x_elems(nt, K) * 2);
        ktk_amx_pack_x(X, nt, K, pk);
        double dt = gemm_time(wt, K, pk, nt, C, ldc, 2000, 1), t0;
        printf("gemm 32 rows x %ld tokens, K=%ld: %.2f us, %.3f TFLOPS\n", (long)nt, (long)K, dt * 1e6,
               2.0 * 32 * nt * K / dt * 1e-12);
        if (nt == 48) {   /* a work item as the layer runs it: convert 32 cold rows, multiply, twice (gate, up) */
            int type = K % 256 ? KTK_Q5_0 : KTK_Q4_K;
            uint8_t *cr = random_rows(type, K, 32 * COLD, &rb);
            t0 = now();
            for (int i = 0; i < COLD; i += 2) {
                ktk_amx_rows_bf16(kern, type, cr + (int64_t)i * 32 * rb, rb, 32, K, wt, tmp);
                ktk_amx_gemm(wt, K, pk, nt, C, ldc);
                ktk_amx_rows_bf16(kern, type, cr + (int64_t)(i + 1) * 32 * rb, rb, 32, K, wt, tmp);
                ktk_amx_gemm(wt, K, pk, nt, C, ldc);
            }
            dt = (now() - t0) / COLD;
            printf("item (%s rows cold, convert + gemm of 48 tokens), K=%ld: %.2f us per 32 rows\n",
                   type == KTK_Q4_K ? "q4_k" : "q5_0", (long)K, dt * 1e6);
            free(cr);
            uint8_t *br = random_rows(KTK_BF16, K, 32 * 512, &rb);   /* BF16 rows read in place, cold */
            t0 = now();
            for (int i = 0; i < 512; i++) ktk_amx_gemm_rows(br + (int64_t)i * 32 * rb, rb, K, pk, nt, C, ldc);
            dt = (now() - t0) / 512;
            printf("item (bf16 rows cold, read in place by the tiles), K=%ld: %.2f us per 32 rows\n", (long)K, dt * 1e6);
            free(br);
        }
        free(x); free(C); free(X); free(pk);
    }
    free(bf);
    return 0;
}
