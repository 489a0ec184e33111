/* Memory read-bandwidth probe: every pool thread streams its share of a buffer far larger
 * than the last-level cache with the widest loads of the ISA; the best of `reps` passes counts. */
#include "ktk_int.h"
#include <stdlib.h>
#include <time.h>

#define CHUNK ((size_t)4 << 20)

typedef struct {
    uint8_t *buf;
    size_t chunk;
    const ktk_kernels *K;
    int fill;
    uint64_t sink[1024 * 8];
} probe_ctx;

static void probe_item(void *ctx, int phase, int64_t item, int tid) {
    (void)phase;
    probe_ctx *c = ctx;
    uint8_t *p = c->buf + (size_t)item * c->chunk;
    if (c->fill) { memset(p, (int)(item * 131 + 7), c->chunk); return; }
    c->sink[(size_t)tid * 8] ^= c->K->stream(p, c->chunk);
}

static double seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

double ktk_probe_read_gbps(ktk_pool *p, int isa, size_t bytes, int reps) {
    const ktk_kernels *K = ktk_kernels_for(isa);
    if (!p || !K || reps < 1 || ktk_pool_threads(p) > 1024) return -1.0;
    size_t nchunk = bytes / CHUNK;
    if (nchunk < 1) nchunk = 1;
    probe_ctx *c = calloc(1, sizeof *c);
    if (!c) return -1.0;
    c->chunk = CHUNK; c->K = K;
    c->buf = aligned_alloc(4096, nchunk * CHUNK);
    if (!c->buf) { free(c); return -1.0; }
    int64_t items = (int64_t)nchunk;
    c->fill = 1;                                    /* first touch by the workers (NUMA-local) */
    ktk_pool_run_async(p, probe_item, c, 1, &items);
    ktk_pool_wait(p);
    c->fill = 0;
    double best = 0.0;
    for (int r = 0; r < reps; r++) {
        double t0 = seconds();
        ktk_pool_run_async(p, probe_item, c, 1, &items);
        ktk_pool_wait(p);
        double dt = seconds() - t0;
        double gbps = (double)(nchunk * CHUNK) / dt / 1e9;
        if (gbps > best) best = gbps;
    }
    uint64_t s = 0;
    for (int i = 0; i < ktk_pool_threads(p); i++) s ^= c->sink[(size_t)i * 8];
    free(c->buf);
    free(c);
    return s == 0x5a5a5a5a5a5a5a5aULL ? best + 1e-12 : best;   /* keep the reads observable */
}

/* ---- the tile unit's speed, per worker: the prefill path's hot block GEMM, 32 rows x 48 tokens x
 * K 2048 (V2-Lite's gate/up shape at batch 512), from its own buffers in each worker's caches; the
 * best of 3 timings of 40 calls. On the lent Xeon this moved between 4.2 and 15 us over time
 * (docs/benchmarks.md, fourteenth session), so the bench reports it around its measurements. */
typedef struct { double *us; int n; } amx_probe_ctx;

static void amx_probe_item(void *ctx, int phase, int64_t item, int tid) {
    (void)phase; (void)tid;
    amx_probe_ctx *c = ctx;
    enum { K = 2048, NT = 48, CALLS = 40 };
    uint16_t *wt = aligned_alloc(64, 32 * K * 2), *pk = aligned_alloc(64, (size_t)ktk_amx_pack_x_elems(NT, K) * 2);
    float *C = aligned_alloc(64, 32 * NT * 4);
    double best = -1.0;
    if (wt && pk && C) {
        for (int64_t i = 0; i < 32 * K; i++) wt[i] = (uint16_t)(0x3f00 | (i * 37 & 0x7f));   /* 0.5 .. 1 */
        for (int64_t i = 0; i < ktk_amx_pack_x_elems(NT, K); i++) pk[i] = (uint16_t)(0xbe00 | (i * 11 & 0x7f));
        ktk_amx_gemm(wt, K, pk, NT, C, NT);
        for (int r = 0; r < 3; r++) {
            double t0 = seconds();
            for (int j = 0; j < CALLS; j++) ktk_amx_gemm(wt, K, pk, NT, C, NT);
            double us = (seconds() - t0) / CALLS * 1e6;
            if (best < 0 || us < best) best = us;
        }
    }
    if (item < c->n) c->us[item] = best;
    free(wt); free(pk); free(C);
}

int ktk_probe_amx_gemm(ktk_pool *p, double *us, int n) {
    if (!p || !us || n < 1) return KTK_EINVAL;
    if (!ktk_amx_usable()) return KTK_EISA;
    amx_probe_ctx c = {us, n};
    int64_t items = n;
    int rc = ktk_pool_run_async(p, amx_probe_item, &c, 1, &items);
    if (rc != KTK_OK) return rc;
    ktk_pool_wait(p);
    for (int i = 0; i < n; i++)
        if (us[i] < 0) return KTK_ENOMEM;
    return KTK_OK;
}
