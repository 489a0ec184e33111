/* Dense layers on GGML rows, for linears kept on the CPU (the `cpu_linear` operator):
 *
 *   ktk_linear:       y[t, r] = dot(W[r], x[t]) for t < T, r < rows. Activations are quantized
 *                     once per token (phase 0), then rows go in chunks of LIN_CH over the pool's
 *                     workers (phase 1), each chunk's rows read once from memory for all T tokens
 *                     (they stay in L2 between tokens). Decode-sized T: the work is reading W.
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
} lin_ctx;

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
    (void)tid;
    lin_ctx *c = ctx;
    if (phase == 0) c->K->quant_act(c->x + item * c->n, (ktk_q8 *)(c->xq + item * c->ab), c->nq);
    else lin_rows(c, item);
}

static int check_rows(const ktk_kernels *K, int type, const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t n) {
    if (!K) return KTK_EISA;
    if (type < 0 || type >= KTK_NTYPES || !K->dotn[type] || n <= 0 || rows < 0 || (rows && !w)) return KTK_EINVAL;
    if (ktk_row_bytes(type, n) != row_bytes) return KTK_EINVAL;
    return KTK_OK;
}

int ktk_linear(ktk_pool *p, int isa, int type, const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t n,
               int64_t T, const float *x, float *y) {
    const ktk_kernels *K = ktk_kernels_for(isa);
    int rc = check_rows(K, type, w, row_bytes, rows, n);
    if (rc) return rc;
    if (T < 0 || (T && (!x || !y))) return KTK_EINVAL;
    if (!T || !rows) return KTK_OK;
    lin_ctx c = {K, type, w, row_bytes, rows, n, n - n % QK, T, x, y, NULL, 0};
    /* float rows (F32, F16, BF16) are dotted with the floats themselves: no activation records
     * (and a row may be shorter than one 32-value block) */
    const int quantized = type != KTK_F32 && type != KTK_F16 && type != KTK_BF16;
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
