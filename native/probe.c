/* Memory read-bandwidth probe: every pool thread streams its share of a buffer far larger
 * than the last-level cache with the widest loads of the ISA, in three patterns (below); the best
 * pass of `reps` of each pattern counts. One sequential stream a core is what most machines
 * stream fastest, but on some hosts a core reads more with several streams in flight and L2
 * prefetches ahead of them, as the decode kernels do (on one lent Xeon the Q4_K layer read 1.39
 * times the one-stream probe, twenty-fourth session): a probe below the kernels it measures is no
 * ceiling. */
#include "ktk_int.h"
#include <stdlib.h>
#include <time.h>

#define CHUNK ((size_t)4 << 20)

/* the read patterns of a chunk: one sequential stream; four, its quarters read 1 KiB of each in
 * turn; the same four with each next KiB's lines prefetched into L2 two pieces ahead */
enum { PROBE_ONE, PROBE_FOUR, PROBE_FOUR_PF, PROBE_PATTERNS };
#define PIECE ((size_t)1024)

typedef struct {
    uint8_t *buf;
    size_t chunk;
    const ktk_kernels *K;
    int fill, pattern;
    uint64_t sink[1024 * 8];
} probe_ctx;

static void probe_item(void *ctx, int phase, int64_t item, int tid) {
    (void)phase;
    probe_ctx *c = ctx;
    uint8_t *p = c->buf + (size_t)item * c->chunk;
    if (c->fill) { memset(p, (int)(item * 131 + 7), c->chunk); return; }
    uint64_t x = 0;
    if (c->pattern == PROBE_ONE) {
        x = c->K->stream(p, c->chunk);
    } else {
        const size_t q = c->chunk / 4;   /* CHUNK / 4: a whole number of pieces */
        for (size_t off = 0; off < q; off += PIECE)
            for (int s = 0; s < 4; s++) {
                const uint8_t *piece = p + (size_t)s * q + off;
                if (c->pattern == PROBE_FOUR_PF && off + 3 * PIECE <= q)
                    for (size_t l = 0; l < PIECE; l += 64) __builtin_prefetch(piece + 2 * PIECE + l, 0, 2);
                x ^= c->K->stream(piece, PIECE);
            }
    }
    c->sink[(size_t)tid * 8] ^= x;
}

static double seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

struct ktk_probe {
    probe_ctx c;
    int64_t items;
};

ktk_probe *ktk_probe_new(ktk_pool *p, size_t bytes) {
    if (!p || ktk_pool_threads(p) > 1024 || bytes > ((size_t)1 << 46)) return NULL;
    size_t nchunk = bytes / CHUNK;
    if (nchunk < 1) nchunk = 1;
    ktk_probe *pr = calloc(1, sizeof *pr);
    if (!pr) return NULL;
    pr->c.chunk = CHUNK;
    pr->c.buf = aligned_alloc(4096, nchunk * CHUNK);
    if (!pr->c.buf) { free(pr); return NULL; }
    pr->items = (int64_t)nchunk;
    pr->c.fill = 1;                                 /* first touch by the workers (NUMA-local) */
    if (ktk_pool_run_async(p, probe_item, &pr->c, 1, &pr->items) != KTK_OK) { ktk_probe_free(pr); return NULL; }
    ktk_pool_wait(p);
    pr->c.fill = 0;
    return pr;
}

void ktk_probe_free(ktk_probe *pr) {
    if (!pr) return;
    free(pr->c.buf);
    free(pr);
}

size_t ktk_probe_bytes(const ktk_probe *pr) { return pr ? (size_t)pr->items * CHUNK : 0; }

double ktk_probe_pass(ktk_probe *pr, ktk_pool *p, int isa, int reps) {
    const ktk_kernels *K = ktk_kernels_for(isa);
    if (!pr || !p || !K || reps < 1 || ktk_pool_threads(p) > 1024) return -1.0;
    pr->c.K = K;
    const char *only = getenv("KTINJECT_PROBE_PATTERN");   /* 0, 1 or 2: that pattern alone (diagnosis) */
    const int p0 = only && only[0] >= '0' && only[0] < '0' + PROBE_PATTERNS ? only[0] - '0' : 0;
    const int p1 = only && only[0] >= '0' && only[0] < '0' + PROBE_PATTERNS ? p0 + 1 : PROBE_PATTERNS;
    double best = 0.0;
    for (int r = 0; r < reps; r++)
        for (int pat = p0; pat < p1; pat++) {   /* the patterns in turn, so drift hits them alike */
            pr->c.pattern = pat;
            double t0 = seconds();
            if (ktk_pool_run_async(p, probe_item, &pr->c, 1, &pr->items) != KTK_OK) return -1.0;
            ktk_pool_wait(p);
            double gbps = (double)ktk_probe_bytes(pr) / (seconds() - t0) / 1e9;
            if (gbps > best) best = gbps;
        }
    uint64_t s = 0;
    for (int i = 0; i < ktk_pool_threads(p); i++) s ^= pr->c.sink[(size_t)i * 8];
    return s == 0x5a5a5a5a5a5a5a5aULL ? best + 1e-12 : best;   /* keep the reads observable */
}

double ktk_probe_read_gbps(ktk_pool *p, int isa, size_t bytes, int reps) {
    if (!ktk_kernels_for(isa) || reps < 1) return -1.0;
    ktk_probe *pr = ktk_probe_new(p, bytes);
    if (!pr) return -1.0;
    double best = ktk_probe_pass(pr, p, isa, reps);
    ktk_probe_free(pr);
    return best;
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
