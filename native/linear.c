/* Dense layers on GGML rows, for linears kept on the CPU (the `cpu_linear` operator):
 *
 *   ktk_linear:       y[t, r] = dot(W[r], x[t]) for t < T, r < rows. Activations are quantized
 *                     once per token (phase 0), then rows go in chunks of LIN_CH over the pool's
 *                     workers (phase 1), each chunk's rows read once from memory for all T tokens
 *                     (they stay in L2 between tokens). Decode-sized T: the work is reading W.
 *                     From LIN_GROUPED_MIN tokens on, for the types the 8-bit grouped kernels take
 *                     (Q4_0, Q5_0, Q4_K, Q5_K, Q6_K on AVX2 / AVX-512), the MoE layer's grouped
 *                     path instead: tokens packed in panels of 16 (phase 0, per 32 values as
 *                     quant_act does), each chunk's rows widened to bytes and multiplied with all
 *                     panels by vpdpbusd / vpmaddubsw GEMMs (phase 1): at 16-256 tokens the work is
 *                     arithmetic, which the per-token dots spend 4-16x more instructions on.
 *   ktk_dequant_rows: rows of W to f32 over the pool (the prefill path multiplies those with BLAS).
 *
 * When the pool is busy (routed experts in flight: the moe operator computes the shared experts
 * while the CPU experts run), the caller's thread computes alone instead of waiting.
 * Every size, stride and type is checked here too (the Python wrapper checks first). */
#include "ktk_int.h"
#include <stdlib.h>

#define LIN_CH 64   /* rows per work item */

typedef struct {
    const ktk_kernels *K;
    int type;
    const uint8_t *w;
    int64_t rb, rows, n, nq, T;
    const float *x;
    float *y;
    uint8_t *xq;      /* T activation records of ab bytes */
    size_t ab;
    /* the grouped path (xq NULL): panels of 16 tokens by pack_q8, C blocks of LIN_CH rows */
    const float **X;  /* the T token pointers */
    int8_t *pk;
    float *ps;
    int64_t ldc;      /* T rounded up to 16 */
    ktk_pool *pool;   /* NULL: this thread alone (its scratch below) */
    uint8_t *own;
    int fail;         /* a worker found no scratch (set atomically; read after the wait) */
} lin_ctx;

/* tokens from which ktk_linear multiplies on the grouped path ($KTINJECT_LINEAR_GROUPED_MIN; 0: never).
 * 16: one whole panel. Below it the per-token dots measured as fast or faster (2-core Zen 4, 4-12
 * tokens: the rows' conversion to bytes costs as much as the dots); from 16 on the grouped GEMM
 * took 0.4-0.6x their time (twenty-fourth session, scripts/cpu_linear_crossover.py). */
int64_t ktk_linear_grouped_min(void) {
    const char *s = getenv("KTINJECT_LINEAR_GROUPED_MIN");
    if (!s) return 16;
    const long v = atol(s);
    return v < 0 ? 16 : v;
}

unsigned ktk_linear_grouped_types(int isa) {
    const ktk_kernels *K = ktk_kernels_for(isa);
    return K && K->pack_q8 && K->gemm_q8 && K->rows_u8 && ktk_linear_grouped_min() ? K->u8_types : 0;
}

static size_t grouped_scratch(const lin_ctx *c) {   /* U, S, Mn (groups of 16 at most), C */
    return (size_t)LIN_CH * (size_t)c->n + 2 * (size_t)LIN_CH * (size_t)(c->n / 16) * sizeof(float) +
           (size_t)LIN_CH * (size_t)c->ldc * sizeof(float) + 64;
}

static void grouped_rows(lin_ctx *c, int64_t item, int tid) {
    const int64_t r0 = item * LIN_CH, n = c->n, ng = n / ktk_u8_group(c->type);
    const int nr = (int)(c->rows - r0 < LIN_CH ? c->rows - r0 : LIN_CH), nr4 = (nr + 3) & ~3;
    uint8_t *mem = c->pool ? ktk_pool_scratch(c->pool, tid, grouped_scratch(c)) : c->own;
    if (!mem) { __atomic_store_n(&c->fail, 1, __ATOMIC_RELAXED); return; }
    uint8_t *U = mem;
    float *S = (float *)(U + (size_t)LIN_CH * n), *Mn = S + LIN_CH * ng, *C = Mn + LIN_CH * ng;
    c->K->rows_u8(c->type, c->w + r0 * c->rb, c->rb, nr, n, U, S, Mn);
    if (nr4 > nr) {   /* the last chunk's rows past a multiple of 4: zero rows, not stored */
        memset(U + (size_t)nr * n, 0, (size_t)(nr4 - nr) * n);
        memset(S + nr * ng, 0, (size_t)(nr4 - nr) * ng * sizeof(float));
        memset(Mn + nr * ng, 0, (size_t)(nr4 - nr) * ng * sizeof(float));
    }
    c->K->gemm_q8(U, S, Mn, nr4, n, c->pk, c->ps, c->T, C, c->ldc, ktk_u8_flags(c->type));
    for (int64_t t = 0; t < c->T; t++)
        for (int r = 0; r < nr; r++) c->y[t * c->rows + r0 + r] = C[r * c->ldc + t];
}

static void lin_rows(const lin_ctx *c, int64_t item) {
    int64_t r0 = item * LIN_CH;
    int nr = (int)(c->rows - r0 < LIN_CH ? c->rows - r0 : LIN_CH);
    float out[LIN_CH];
    for (int64_t t = 0; t < c->T; t++) {
        const ktk_q8 *xa = c->xq ? (const ktk_q8 *)(c->xq + t * c->ab) : NULL;   /* NULL: float rows */
        /* the first token reads the rows from memory (prefetched); the others find them in L2 */
        ktk_dotn_spread(c->K->dotn[c->type], c->w + r0 * c->rb, c->rb, nr, c->x + t * c->n, xa, c->n, out, t == 0);
        memcpy(c->y + t * c->rows + r0, out, (size_t)nr * sizeof(float));
    }
}

void ktk_dotn_spread(ktk_dotn_fn dotn, const uint8_t *row, int64_t rs, int64_t nrows, const float *xf,
                     const ktk_q8 *xq, int64_t n, float *out, int pf) {
    enum { CH = 64, G = 4, S = CH / G };
    int64_t r0 = 0;
    for (; r0 + CH <= nrows; r0 += CH) {
        const uint8_t *w = row + r0 * rs;
        for (int p = 0; p < S; p++) {
            float o[G];
            dotn(w + p * rs, S * rs, G, xf, xq, n, o, pf && p + 1 < S ? w + (p + 1) * rs : NULL);
            for (int q = 0; q < G; q++) out[r0 + p + q * S] = o[q];
        }
    }
    if (r0 < nrows) dotn(row + r0 * rs, rs, (int)(nrows - r0), xf, xq, n, out + r0, NULL);
}

static void lin_item(void *ctx, int phase, int64_t item, int tid) {
    lin_ctx *c = ctx;
    if (c->pk) {   /* the grouped path: panel `item` of 16 tokens, then chunk `item` of rows */
        if (phase == 0) {
            const int64_t t0 = item * 16, nt = c->T - t0 < 16 ? c->T - t0 : 16;
            c->K->pack_q8(c->X + t0, nt, c->n, c->pk + t0 * c->n, c->ps + item * (c->n / 32) * 64);
        } else {
            grouped_rows(c, item, tid);
        }
        return;
    }
    if (phase == 0) c->K->quant_act(c->x + item * c->n, (ktk_q8 *)(c->xq + item * c->ab), c->nq);
    else lin_rows(c, item);
}

static int check_rows(const ktk_kernels *K, int type, const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t n) {
    if (!K) return KTK_EISA;
    if (type < 0 || type >= KTK_NTYPES || !K->dotn[type] || n <= 0 || rows < 0 || (rows && !w)) return KTK_EINVAL;
    if (ktk_row_bytes(type, n) != row_bytes) return KTK_EINVAL;
    return KTK_OK;
}

static int linear_grouped(lin_ctx *c, ktk_pool *p) {
    const int64_t T = c->T, n = c->n, npan = (T + 15) / 16;
    c->ldc = npan * 16;
    const size_t pkb = (size_t)(npan * 16) * (size_t)n, psb = (size_t)npan * (size_t)(n / 32) * 64 * sizeof(float);
    uint8_t *mem = malloc(pkb + psb + (size_t)T * sizeof(float *) + 128);
    if (!mem) return KTK_ENOMEM;
    c->pk = (int8_t *)(((uintptr_t)mem + 63) & ~(uintptr_t)63);
    c->ps = (float *)(((uintptr_t)(c->pk + pkb) + 63) & ~(uintptr_t)63);
    c->X = (const float **)((uint8_t *)c->ps + psb);
    for (int64_t t = 0; t < T; t++) c->X[t] = c->x + t * n;
    int64_t chunks = (c->rows + LIN_CH - 1) / LIN_CH, items[2] = {npan, chunks};
    c->pool = p;
    if (p && ktk_pool_run_async(p, lin_item, c, 2, items) == KTK_OK) {
        ktk_pool_wait(p);
        if (c->fail) { free(mem); return KTK_ENOMEM; }   /* some rows unwritten: the caller takes the dots */
    } else {                                           /* no pool, or it is busy: this thread alone */
        c->pool = NULL;
        c->own = aligned_alloc(64, (grouped_scratch(c) + 63) / 64 * 64);
        if (!c->own) { free(mem); return KTK_ENOMEM; }
        for (int64_t i = 0; i < npan; i++) lin_item(c, 0, i, 0);
        for (int64_t i = 0; i < chunks; i++) grouped_rows(c, i, 0);
        free(c->own);
    }
    free(mem);
    return KTK_OK;
}

int ktk_linear(ktk_pool *p, int isa, int type, const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t n,
               int64_t T, const float *x, float *y) {
    const ktk_kernels *K = ktk_kernels_for(isa);
    int rc = check_rows(K, type, w, row_bytes, rows, n);
    if (rc) return rc;
    if (T < 0 || (T && (!x || !y))) return KTK_EINVAL;
    if (!T || !rows) return KTK_OK;
    lin_ctx c = {.K = K, .type = type, .w = w, .rb = row_bytes, .rows = rows, .n = n, .nq = n - n % QK, .T = T,
                 .x = x, .y = y};
    /* float rows (F32, F16, BF16) are dotted with the floats themselves: no activation records
     * (and a row may be shorter than one 32-value block) */
    const int quantized = type != KTK_F32 && type != KTK_F16 && type != KTK_BF16;
    const int64_t gmin = ktk_linear_grouped_min();
    if (quantized && gmin && T >= gmin && (ktk_linear_grouped_types(isa) >> type & 1) && n % 32 == 0 &&
        (uint64_t)T <= (uint64_t)INT32_MAX / 16) {
        rc = linear_grouped(&c, p);
        if (rc != KTK_ENOMEM) return rc;   /* (out of memory: the dots below need less) */
    }
    uint8_t *mem = NULL;
    if (quantized) {
        c.ab = ktk_act_bytes(c.nq);
        c.ab = (c.ab + 63) / 64 * 64;                  /* each record on its own cache lines */
        if (!c.ab || (uint64_t)T > (SIZE_MAX - 64) / c.ab) return KTK_ENOMEM;
        mem = malloc((size_t)T * c.ab + 64);
        if (!mem) return KTK_ENOMEM;
        c.xq = (uint8_t *)(((uintptr_t)mem + 63) & ~(uintptr_t)63);
    }
    int64_t chunks = (rows + LIN_CH - 1) / LIN_CH, items[2] = {quantized ? T : 0, chunks};
    if (p && ktk_pool_run_async(p, lin_item, &c, 2, items) == KTK_OK) {
        ktk_pool_wait(p);
    } else {                                           /* no pool, or it is busy: this thread alone */
        for (int64_t t = 0; t < items[0]; t++) lin_item(&c, 0, t, 0);
        for (int64_t i = 0; i < chunks; i++) lin_rows(&c, i);
    }
    free(mem);
    return KTK_OK;
}

typedef struct {
    const ktk_kernels *K;
    int type;
    const uint8_t *w;
    int64_t rb, rows, n;
    float *dst;
} deq_ctx;

static void deq_item(void *ctx, int phase, int64_t item, int tid) {
    (void)phase; (void)tid;
    deq_ctx *c = ctx;
    int64_t r0 = item * LIN_CH, nr = c->rows - r0 < LIN_CH ? c->rows - r0 : LIN_CH;
    for (int64_t r = r0; r < r0 + nr; r++) c->K->dequant(c->type, c->w + r * c->rb, c->dst + r * c->n, c->n);
}

int ktk_dequant_rows(ktk_pool *p, int isa, int type, const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t n,
                     float *dst) {
    const ktk_kernels *K = ktk_kernels_for(isa);
    int rc = check_rows(K, type, w, row_bytes, rows, n);
    if (rc) return rc;
    if (!rows) return KTK_OK;
    if (!dst) return KTK_EINVAL;
    deq_ctx c = {K, type, w, row_bytes, rows, n, dst};
    int64_t chunks = (rows + LIN_CH - 1) / LIN_CH;
    if (p && ktk_pool_run_async(p, deq_item, &c, 1, &chunks) == KTK_OK) {
        ktk_pool_wait(p);
    } else {
        for (int64_t i = 0; i < chunks; i++) deq_item(&c, 0, i, 0);
    }
    return KTK_OK;
}
