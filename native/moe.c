/* The fused routed-experts layer.
 *
 * One call = one pool job of four phases (items claimed dynamically by the workers):
 *   P0  quantize each token's activations to Q8 blocks (when some expert takes the row-dot
 *       path); pack the tokens of every grouped expert (AMX tiles, or f32 panels); for AMX tiles
 *       the tokens are first quantized (INT8) or converted (bf16) once, in a chunk a worker, and
 *       the packs wait for all chunks
 *                                             items: threads or 0, + T or 0, + grouped experts
 *   P1  gate and up projections, h = SiLU(gate) * up, for (expert, 32 rows of I)
 *                                                                items: active experts * I/32
 *   P2  quantize h of the row-dot experts' (token, expert) pairs; pack h of grouped experts (on AMX with a bf16
 *       down, P1's epilogue packs h itself: $KTINJECT_AMX_FUSE_H=0 for the f32 rows and this packing)
 *                                  items: row-dot experts + grouped experts (none of those with P1's packing)
 *   P3  down projection and weighted sum, for 32 rows of H over every active expert, so each
 *       output element has one writer (no atomics, fixed summation order)     items: H/32
 *       (with every expert grouped: two halves of the experts summed apart and added, in one item or,
 *       where that balances the threads better, in two: phase_down_halves; $KTINJECT_DOWN_CHUNKS=n: the items
 *       that fill whole rounds take n chunks of 32 rows, each expert's packed h read once for them)    or 2 H/32
 * Tokens are grouped by expert (counting sort). An expert with fewer than `tile_min` tokens
 * (decode) takes the row-dot path: each weight row is read once from memory and dotted with its
 * tokens' Q8 activations straight on the GGUF blocks, four rows per multi-row kernel call
 * ($KTINJECT_MULTIROW=0: the one-row kernels). An expert with more (prefill) takes the grouped
 * path: 32 weight rows are converted once into per-thread scratch and multiplied with all of its
 * tokens, packed per expert in P0 / P2: on AVX2 / AVX-512 quantized rows as bytes against the
 * tokens quantized to 8 bits (pack_q8 / rows_u8 / gemm_q8; $KTINJECT_VNNI_GROUPED=0: f32), other
 * types dequantized against f32 panels; on the AMX path rows as bf16 tiles, by AMX-BF16 tiles. A matrix with an R16 copy (desc gate_r16 / up_r16 / down_r16, r16.c)
 * takes the row-dot path on that copy, several (group, token) pairs per kernel call; the grouped
 * path reads the GGML rows, or, on AMX with AMX-INT8, the I8 copies (desc gate_i8 / up_i8 / down_i8,
 * i8.c) with AMX-INT8 tiles, the tokens packed to 8 bits per token and group, or, on AMX, BF16 tile copies (desc
 * gate_bt / up_bt / down_bt, amx.c ktk_bt_repack) whose tiles load as 1 KiB blocks. */
#define _GNU_SOURCE
#include "ktk_int.h"
#include <math.h>
#include <sched.h>
#include <stdlib.h>
#include <time.h>

#define RC 32
#define DG 4   /* rows per multi-row dot call on the decode path (divides RC / 2) */

#if defined(KTK_LAYER_TRACE)   /* scripts/amx_parts.c "layer" only: TSC cycles per thread and part (ktk_int.h) */
#include <x86intrin.h>
uint64_t ktk_layer_tr[KTK_LAYER_TRACE_T][KTK_LAYER_TRACE_PARTS];
#define TR_START() uint64_t tr_t0 = __rdtsc()
#define TR_ADD(tid, part) do { uint64_t tr_t1 = __rdtsc(); ktk_layer_tr[tid][part] += tr_t1 - tr_t0; tr_t0 = tr_t1; } while (0)
#else
#define TR_START() do { } while (0)
#define TR_ADD(tid, part) do { } while (0)
#endif

struct ktk_moe {
    ktk_moe_desc d;
    ktk_pool *pool;
    const ktk_kernels *K;
    int amx, isa, tile_min, busy, prefetch, multirow, bf16_in_place, pf_next, packed_f32, vnni_on;
    int tmul, dp, dp_on;   /* amx: the bf16 tile path's packing and epilogues, its products by tiles (tmul) or by
                            * AVX512-BF16 dot products (dp: the AVX-512 path's BF16 layers, $KTINJECT_AVX512_BF16_GROUPED) */
    int64_t rcd;                                        /* rows per down item: 32, or 16 at decode */
    int64_t T, k, P, nact, ntile, nci, nch, maxcnt, maxk;
    const float *x;
    const float *w;
    float *out;
    int64_t *cnt, *off, *act, *tile_list, *pk_off;   /* [E], [E+1], [E], [E], [E] */
    int64_t *plain_list, nplain, nq0;                  /* [E] active experts on the row-dot path; tokens to quantize */
    uint8_t *tile;                                     /* [E] */
    int64_t *tok;                                      /* [P] token of each pair, grouped by expert */
    float *wt;                                         /* [P] its routing weight */
    const float **xptr, **hptr;                        /* [P] */
    uint8_t *xq, *hq;                                  /* activation records: [T, act(H)], [P, act(I)] */
    float *h;                                          /* [P, I] */
    uint16_t *xpk, *hpk;                               /* packed bf16 tokens for AMX (in xpk_mem, hpk_mem) */
    void *xpk_mem, *hpk_mem;
    int packed;                                        /* grouped experts' tokens packed per expert (AMX, or pack_f32) */
    float *xpf, *hpf;                                  /* packed f32 tokens for gemm_packed (in xpk_mem, hpk_mem) */
    int vnni_gu, vnni_dn;                              /* gate/up, down on the 8-bit grouped path (pack_q8, gemm_q8) */
    int8_t *xq8, *hq8;                                 /* its packed tokens and their scales (in xpk_mem, hpk_mem) */
    float *xs8, *hs8;
    int i8_gu, i8_dn;                                  /* gate/up, down from the I8 copies on AMX-INT8 tiles */
    int bt_gu, bt_dn;                                  /* gate/up, down from the BF16 tile copies (AMX, no I8 copy) */
    int64_t i8_es_gu, i8_es_dn, npad;                  /* their bytes per expert; padded tokens of the packing */
    int64_t i8_g_gu, i8_g_dn;                          /* their group sizes (the desc's, 0 resolved) */
    int i8_pf, i8_overlap;                             /* their tile GEMM's prefetch distance in k-steps; overlap */
    int i4_ahead;                                      /* I4: widen the nibbles this many k-steps before their loads */
    int64_t gu_claim;                                  /* AMX prefill: gate/up items a worker claims at once (0: the pool's) */
    int i4;                                            /* the copies are I4 ones (desc i8_bits 4) */
    int down_acc;                                      /* grouped down sums in a compact block first (phase_down) */
    int down_split;                                    /* $KTINJECT_DOWN_SPLIT: 0 by the thread count, 1 never, 2 always */
    int down_chunks;                                   /* $KTINJECT_DOWN_CHUNKS: 32-row chunks a halves' item (1-8) */
    int64_t dch, nbig;                                 /* chunks of the first nbig halves' items (the rest: one each) */
    int halves;                                        /* down: grouped experts only, summed as two halves (phase_down) */
    int64_t dsplit, amid;                              /* down items per chunk (1, 2: one per half); act[] index of half 1 */
    float *dslot, *dmem;                               /* [nch][2][T][RC]: the halves' sums when split (in h or dmem) */
    int *dcnt;                                         /* [nch] halves done, per item's chunk (or pair), when split */
    int pack_once;                                     /* $KTINJECT_PACK_ONCE: the AMX gate/up tokens quantized / converted once (P0) */
    int fuse_h_on, fuse_h;                             /* $KTINJECT_AMX_FUSE_H; this job: P1 packs h (bf16 down) */
    int64_t nqt, qchunk;                               /* P0's token chunks to quantize first (0: none), tokens in each */
    int8_t *tq, *tqmem;                                /* their bytes [T][H], then scales and zero terms [T][H / G] each; bf16
                                                          [T][H] (in h, which P1 writes only later, or in tqmem) */
    int tq_done;                                       /* chunks done (the packs wait for all of them) */
    int fail;                                          /* a worker found no scratch: set atomically, read by sync */
    size_t cap_T, cap_P, cap_xpk, cap_hpk;
};

static void *grow(void *ptr, size_t *cap, size_t need, size_t elem, int *fail) {
    (void)cap;
    if (need == 0) need = 1;
    void *q = realloc(ptr, need * elem);
    if (!q) { *fail = 1; return ptr; }
    return q;
}

/* The packed tokens, page-aligned so that every 64-byte tile row is one cache line (realloc's blocks
 * were 16-byte aligned: each row of a B tile touched two lines; on the lent Xeon the difference was
 * within the run-to-run noise of a layer, 20.1-20.7 vs 17.7-20.2 ms). Contents are rewritten every call. */
static uint16_t *grow_pk(void **mem, size_t *cap, size_t bytes, int *fail) {
    if (bytes > *cap || !*mem) {
        size_t sz = (bytes + 4095) & ~(size_t)4095;
        void *q = aligned_alloc(4096, sz);
        if (!q) { *fail = 1; return *mem; }
        free(*mem);
        *mem = q; *cap = sz;
    }
    return *mem;
}

/* bytes per expert of an I8 copy (bits 0 or 8) or an I4 one (bits 4) */
static int64_t ix_expert_bytes(int bits, int64_t rows, int64_t n, int64_t G) {
    return bits == 4 ? ktk_i4_expert_bytes(rows, n, G) : ktk_i8_expert_bytes(rows, n, G);
}

ktk_moe *ktk_moe_new(const ktk_moe_desc *d, int *err) {
    int e = KTK_OK;
    if (!d || d->n_experts <= 0 || d->hidden <= 0 || d->inter <= 0 || d->hidden % 32 || d->inter % 32 ||
        !d->gate || !d->up || !d->down)
        e = KTK_EINVAL;
    else if (ktk_row_bytes(d->gate_type, d->hidden) != d->gate_rb || ktk_row_bytes(d->up_type, d->hidden) != d->up_rb ||
             ktk_row_bytes(d->down_type, d->inter) != d->down_rb)
        e = KTK_EINVAL;
    /* R16 copies: gate and up together and of one type, types with the layout, rows in groups of 16 */
    if (!e && ((d->gate_r16 != NULL) != (d->up_r16 != NULL) || (d->gate_r16 && d->gate_type != d->up_type) ||
               (d->gate_r16 && (!ktk_r16_supported(d->gate_type) || d->inter % 16 || ktk_r16_row_bytes(d->gate_type, d->hidden) < 0)) ||
               (d->down_r16 && (!ktk_r16_supported(d->down_type) || d->hidden % 16 || ktk_r16_row_bytes(d->down_type, d->inter) < 0))))
        e = KTK_EINVAL;
    /* I8 (or I4) copies: gate and up both or neither, shapes the layout takes */
    if (!e && (d->i8_bits != 0 && d->i8_bits != 8 && d->i8_bits != 4))
        e = KTK_EINVAL;
    if (!e && ((d->gate_i8 != NULL) != (d->up_i8 != NULL) ||
               (d->gate_i8 && ix_expert_bytes(d->i8_bits, d->inter, d->hidden, d->gate_i8_group) < 0) ||
               (d->down_i8 && ix_expert_bytes(d->i8_bits, d->hidden, d->inter, d->down_i8_group) < 0)))
        e = KTK_EINVAL;
    /* BF16 tile copies: gate and up both or neither, of BF16 matrices */
    if (!e && ((d->gate_bt != NULL) != (d->up_bt != NULL) ||
               (d->gate_bt && (d->gate_type != KTK_BF16 || d->up_type != KTK_BF16)) ||
               (d->down_bt && d->down_type != KTK_BF16)))
        e = KTK_EINVAL;
    if (e) { if (err) *err = e; return NULL; }
    if (d->gate_r16 || d->down_r16) ktk_r16_init();
    ktk_moe *m = calloc(1, sizeof *m);
    int64_t E = d->n_experts;
    if (m) {
        m->d = *d;
        if (!m->d.gate_es) m->d.gate_es = d->inter * d->gate_rb;
        if (!m->d.up_es) m->d.up_es = d->inter * d->up_rb;
        if (!m->d.down_es) m->d.down_es = d->hidden * d->down_rb;
        m->i4 = d->i8_bits == 4;
        m->i8_es_gu = d->gate_i8 ? ix_expert_bytes(d->i8_bits, d->inter, d->hidden, d->gate_i8_group) : 0;
        m->i8_es_dn = d->down_i8 ? ix_expert_bytes(d->i8_bits, d->hidden, d->inter, d->down_i8_group) : 0;
        m->i8_g_gu = d->gate_i8_group ? d->gate_i8_group : ktk_ix_group(d->hidden, m->i4 ? 4 : 8);
        m->i8_g_dn = d->down_i8_group ? d->down_i8_group : ktk_ix_group(d->inter, m->i4 ? 4 : 8);
        m->cnt = calloc((size_t)E, sizeof(int64_t)); m->off = calloc((size_t)E + 1, sizeof(int64_t));
        m->act = calloc((size_t)E, sizeof(int64_t)); m->tile_list = calloc((size_t)E, sizeof(int64_t));
        m->plain_list = calloc((size_t)E, sizeof(int64_t));
        m->pk_off = calloc((size_t)E, sizeof(int64_t)); m->tile = calloc((size_t)E, 1);
        m->maxk = d->hidden > d->inter ? d->hidden : d->inter;
        const char *s = getenv("KTINJECT_TILE_MIN");
        m->tile_min = s ? atoi(s) : 4;
        s = getenv("KTINJECT_PREFETCH");
        m->prefetch = s ? atoi(s) : 1;   /* decode: prefetch the rows this many calls ahead (0: none) */
        if (m->prefetch < 0 || m->prefetch > 3) m->prefetch = 1;   /* an item has 4-8 calls per stream */
        s = getenv("KTINJECT_MULTIROW");   /* 0: decode with the one-row dots (A/B of the kernels) */
        m->multirow = s ? atoi(s) : 1;
        s = getenv("KTINJECT_AMX_BF16_IN_PLACE");   /* 0: BF16 rows copied to tile-major like the others (A/B) */
        m->bf16_in_place = !(s && s[0] == '0');
        s = getenv("KTINJECT_AMX_PREFETCH_NEXT");   /* 0: the tile GEMMs do not bring in the next rows (A/B) */
        m->pf_next = !(s && s[0] == '0');
        s = getenv("KTINJECT_AMX_I8_PREFETCH");   /* I8 tile GEMM: prefetch the copy's rows this many k-steps ahead */
        m->i8_pf = s ? atoi(s) : 8;   /* 8 and 4 measured alike on the lent Xeon, 0 slower (eighteenth session) */
        if (m->i8_pf < 0 || m->i8_pf > 32) m->i8_pf = 8;
        s = getenv("KTINJECT_AMX_I8_OVERLAP");   /* 0: the I8 GEMM scales each group's sums before the next group starts (A/B) */
        m->i8_overlap = !(s && s[0] == '0');
        s = getenv("KTINJECT_AMX_I4_AHEAD");   /* I4 tile GEMM: widen the nibbles this many k-steps before the tiles */
        m->i4_ahead = s ? atoi(s) : 2;          /* load them (0-8; 2 beat 0 by 4-7% in the layer, twenty-fourth session) */
        if (m->i4_ahead < 0 || m->i4_ahead > 8) m->i4_ahead = 2;
        s = getenv("KTINJECT_AMX_GU_CLAIM");   /* AMX prefill: consecutive gate/up items (row chunks of one expert) */
        m->gu_claim = s ? atol(s) : 4;         /* per claim, so its packed tokens stay in one worker's L2 (0: the pool's) */
        if (m->gu_claim < 0 || m->gu_claim > 64) m->gu_claim = 4;
        s = getenv("KTINJECT_DOWN_ACC");   /* 0: grouped down sums straight into the output rows (A/B) */
        m->down_acc = !(s && s[0] == '0');
        s = getenv("KTINJECT_DOWN_SPLIT");   /* 1: one down item per 32 output rows; 2: two (halves); else by the threads */
        m->down_split = s && (s[0] == '1' || s[0] == '2') && s[1] == 0 ? s[0] - '0' : 0;
        s = getenv("KTINJECT_DOWN_CHUNKS");   /* n: each expert's packed h used for n chunks' GEMMs in a row (A/B) */
        m->down_chunks = s && *s ? atoi(s) : 1;
        if (m->down_chunks < 1 || m->down_chunks > 8) m->down_chunks = 1;
        s = getenv("KTINJECT_PACK_ONCE");   /* 0: each expert's AMX packing quantizes / converts its tokens itself (A/B) */
        m->pack_once = !(s && s[0] == '0');
        s = getenv("KTINJECT_AMX_FUSE_H");   /* 0: P1 writes h in f32 rows and P2 packs them for a bf16 down (A/B) */
        m->fuse_h_on = !(s && s[0] == '0');
        s = getenv("KTINJECT_PACKED_F32");   /* 0: the grouped f32 path multiplies unpacked tokens (A/B) */
        m->packed_f32 = !(s && s[0] == '0');
        s = getenv("KTINJECT_VNNI_GROUPED");   /* 0: AVX2 / AVX-512 grouped work in f32, not 8-bit integers (A/B) */
        m->vnni_on = !(s && s[0] == '0');
        m->dp_on = ktk_avx512bf16_grouped();   /* AVX-512 BF16 grouped work on bf16 dots ($KTINJECT_AVX512_BF16_GROUPED) */
        if (m->tile_min < 1) m->tile_min = 1;
    }
    if (!m || !m->cnt || !m->off || !m->act || !m->tile_list || !m->plain_list || !m->pk_off || !m->tile) {
        ktk_moe_free(m);
        if (err) *err = KTK_ENOMEM;
        return NULL;
    }
    if (err) *err = KTK_OK;
    return m;
}

void ktk_moe_free(ktk_moe *m) {
    if (!m) return;
    if (m->busy && m->pool) ktk_pool_wait(m->pool);
    free(m->cnt); free(m->off); free(m->act); free(m->tile_list); free(m->plain_list); free(m->pk_off); free(m->tile);
    free(m->tok); free(m->wt); free(m->xptr); free(m->hptr); free(m->xq); free(m->hq); free(m->h);
    free(m->xpk_mem); free(m->hpk_mem); free(m->dmem); free(m->dcnt); free(m->tqmem);
    free(m);
}

static inline float silu(float g) { return g / (1.f + expf(-g)); }

/* Per-thread scratch: W f32 [RC, maxk], W bf16 [RC, maxk] (tile-major), two C blocks of
 * RC x (maxcnt rounded up to 16) floats; C[j * ct + r * cr] = row r . token j (grouped sets the
 * strides: the f32 GEMM writes token-major, AMX row-major). */
typedef struct { float *wf; uint16_t *wb; float *c0, *c1, *acc; int64_t ct, cr; } scratch_t;

/* (and acc: 2 x [T][RC] floats, the down phase's sums of the grouped experts for one item's 32 output rows, a block
 * per half of the experts when the layer is summed in halves) */
static scratch_t get_scratch(ktk_moe *m, int tid) {
    size_t wf = (size_t)RC * m->maxk * 4, wb = (size_t)RC * m->maxk * 2, c = (size_t)(m->maxcnt + 16) * RC * 4;
    if (wb < 6144) wb = 6144;   /* (wb is also the INT8 tile GEMM's ci: 6 KiB) */
    wf = (wf + 63) & ~(size_t)63; wb = (wb + 63) & ~(size_t)63; c = (c + 63) & ~(size_t)63;
    const size_t acc = (size_t)m->T * RC * 4 * 2 * (size_t)(m->dch > 1 ? m->dch : 1);   /* (dch: set per job) */
    uint8_t *s = ktk_pool_scratch(m->pool, tid, wf + wb + 2 * c + acc);
    scratch_t r = {0, 0, 0, 0, 0, 0, 0};
    if (!s) return r;
    r.wf = (float *)s; r.wb = (uint16_t *)(s + wf); r.c0 = (float *)(s + wf + wb); r.c1 = (float *)(s + wf + wb + c);
    r.acc = (float *)(s + wf + wb + 2 * c);
    return r;
}

static inline void prefetch_row(const uint8_t *p, int64_t bytes) { ktk_prefetch(p, bytes); }

/* C[j * s->ct + r * s->cr] = row (r0 + r) of expert matrix . token j, on the grouped path without
 * AMX: in 8-bit integers (pq, ps: the tokens by pack_q8), else f32 (pk: by pack_f32; NULL: unpacked). */
static void grouped(ktk_moe *m, scratch_t *s, int type, const uint8_t *rows, int64_t rb, int64_t K,
                    const float *const *X, const float *pk, const int8_t *pq, const float *ps, int64_t nt, float *C) {
    if (pq) {   /* the 8-bit path: rows to bytes with per-32 scales (in wf's space), tokens packed by pack_q8 */
        uint8_t *U = (uint8_t *)s->wf;
        float *S = (float *)(U + RC * K), *Mn = S + RC * K / 16;   /* groups of 32 or 16 values */
        const int64_t ldc = (nt + 15) / 16 * 16;
        m->K->rows_u8(type, rows, rb, RC, K, U, S, Mn);
        m->K->gemm_q8(U, S, Mn, RC, K, pq, ps, nt, C, ldc, ktk_u8_flags(type));
        s->ct = 1; s->cr = ldc;
        return;
    }
    for (int r = 0; r < RC; r++) m->K->dequant(type, rows + r * rb, s->wf + (int64_t)r * K, K);
    if (pk) {   /* the expert's tokens packed (pack_f32): C row-major, as on AMX */
        const int64_t ldc = (nt + 15) / 16 * 16;
        m->K->gemm_packed(s->wf, RC, K, pk, nt, C, ldc);
        s->ct = 1; s->cr = ldc;
        return;
    }
    m->K->gemm(s->wf, RC, K, X, nt, C, RC);
    s->ct = RC; s->cr = 1;
}

/* The same on AMX, C row-major: the RC rows as bf16 tiles straight from their GGML blocks, then
 * the tile GEMM against the expert's packed tokens; with a BF16 tile copy (bt: the block's), the GEMM on it. On the
 * AVX-512 path's BF16 layers (m->dp) the same product by AVX512-BF16 dot products.
 * next, next_bytes: what the GEMM brings into L2 meanwhile (in the copy when bt is). */
static void grouped_amx(ktk_moe *m, scratch_t *s, int type, const uint8_t *rows, int64_t rb, const uint8_t *bt,
                        int64_t K, const uint16_t *pk, int64_t nt, float *C, const uint8_t *next, int64_t next_bytes,
                        int tid, int part) {
    int64_t ldc = (nt + 15) / 16 * 16;
    TR_START();
    if (m->dp) {   /* (BF16 rows only: m->dp is set for layers of BF16 experts) */
        if (bt) ktk_dp_gemm((const uint16_t *)bt, 1024, 32, K, pk, nt, C, ldc);
        else ktk_dp_gemm((const uint16_t *)rows, 32, rb / 2, K, pk, nt, C, ldc);
    } else if (bt) ktk_amx_gemm_next((const uint16_t *)bt, K, pk, nt, C, ldc, m->pf_next ? next : NULL, next_bytes);
    else if (type == KTK_BF16 && m->bf16_in_place) ktk_amx_gemm_rows(rows, rb, K, pk, nt, C, ldc);
    else {
        ktk_amx_rows_bf16(m->K, type, rows, rb, RC, K, s->wb, s->wf);
        TR_ADD(tid, part);
        ktk_amx_gemm_next(s->wb, K, pk, nt, C, ldc, m->pf_next ? next : NULL, next_bytes);
    }
    TR_ADD(tid, part + 1);
    s->ct = 1; s->cr = ldc;
    (void)tid; (void)part;
}

/* The AMX-INT8 path: the expert's tokens packed by ktk_amx_pack_x_i8 in the space of the bf16 ones (npad * K bytes,
 * then the scales: npad * K / G floats, never more than the bf16 packing's 2 bytes a value), and a block of 32 rows
 * from the expert's I8 (or I4) copy at w. */
static inline int8_t *pk_i8(const ktk_moe *m, uint16_t *base, int64_t K, int64_t e) {
    return (int8_t *)base + m->pk_off[e] * K;
}
static inline float *ts_i8(const ktk_moe *m, uint16_t *base, int64_t K, int64_t G, int64_t e) {
    return (float *)((int8_t *)base + m->npad * K) + m->pk_off[e] * (K / G);
}
static void grouped_i8(const ktk_moe *m, scratch_t *s, const uint8_t *w, int64_t rows, int64_t K, int64_t G, int64_t r0,
                       const int8_t *pk, const float *ts, int64_t nt, float *C) {
    const int64_t ldc = (nt + 15) / 16 * 16, NG = K / G;
    if (m->i4) {   /* the widened nibbles go to the (here unused) f32 rows' scratch: 4 * RC * maxk bytes */
        const float *ws = (const float *)(w + rows * K / 2);
        const uint8_t *wk = w + rows * K / 2 + rows * NG * 4 + r0 * (K / 64);   /* the block's sub-scales (i8.c) */
        ktk_amx_gemm_i4(w + r0 * K / 2, ws + r0 * NG, wk, K, G, pk, ts, nt, C, ldc, (int32_t *)s->wb, (uint8_t *)s->wf,
                        m->i8_pf, m->i8_overlap, m->i4_ahead);
    } else {
        ktk_amx_gemm_i8((const int8_t *)w + r0 * K, (const float *)(w + rows * K) + r0 * NG, K, G, pk, ts, nt, C, ldc,
                        (int32_t *)s->wb, m->i8_pf, m->i8_overlap);
    }
    s->ct = 1; s->cr = ldc;
}

/* A grouped expert's rows of K values (its tokens for gate/up, its h for down) packed for the grouped GEMM of the
 * path at hand: I8 copies (i8, groups of G), AMX bf16 tiles, 8-bit panels (vnni) or f32 panels, into the buffers
 * of that side (pk: the AMX packings' base; q8, s8: the 8-bit panels and their scales; pf: the f32 panels) */
static void pack_rows(const ktk_moe *m, const float *const *rows, int64_t e, int64_t K, int i8, int64_t G, int vnni,
                      uint16_t *pk, int8_t *q8, float *s8, float *pf) {
    const int64_t n = m->cnt[e], at = m->pk_off[e];
    if (i8) ktk_amx_pack_x_i8(rows, n, K, G, pk_i8(m, pk, K, e), ts_i8(m, pk, K, G, e));
    else if (m->amx) ktk_amx_pack_x(rows, n, K, pk + at * K);
    else if (vnni) m->K->pack_q8(rows, n, K, q8 + at * K, s8 + at / 16 * 2 * K);
    else m->K->pack_f32(rows, n, K, pf + at * K);
}

/* A grouped expert's h (its tokens' SiLU(gate) * up, written by P1) packed for the down GEMM (P2) */
static void pack_h(ktk_moe *m, int64_t e, int tid) {
    TR_START();
    pack_rows(m, m->hptr + m->off[e], e, m->d.inter, m->i8_dn, m->i8_g_dn, m->vnni_dn, m->hpk, m->hq8, m->hs8, m->hpf);
    TR_ADD(tid, 7);
    (void)tid;
}

/* The h slices a tile item will store (32 floats, two cache lines, of each of its n tokens' rows, I floats apart),
 * asked for with write intent before its GEMMs, so that their ownership requests complete under the GEMMs instead
 * of stalling the stores after them: the SiLU + h stores part 0.76x on the development machine and 0.77-0.82x on
 * the lent 16-core Xeon at 8 and 16 threads; the whole layer within the tile unit's noise (docs/native.md).
 * Every AMX CPU has PREFETCHW. */
static inline void prefetch_h_for_write(const float *h, int64_t n, int64_t I) {
#if defined(__x86_64__) && defined(__GNUC__)
    for (int64_t j = 0; j < n; j++) {
        const char *p = (const char *)(h + j * I);
        __asm__ volatile("prefetchw %0" ::"m"(*p));
        __asm__ volatile("prefetchw %0" ::"m"(*(p + 64)));
    }
#else
    (void)h; (void)n; (void)I;
#endif
}

/* The same for h packed in P1 (fuse_h): the 1 KiB blocks of k-step ks of the expert's n tokens, KS k-steps apart */
static inline void prefetch_pack_for_write(const uint16_t *pk, int64_t n, int64_t KS, int64_t ks) {
#if defined(__x86_64__) && defined(__GNUC__)
    for (int64_t tt = 0; tt < (n + 15) / 16; tt++) {
        const char *blk = (const char *)(pk + (tt * KS + ks) * 512);
        for (int l = 0; l < 16; l++) __asm__ volatile("prefetchw %0" ::"m"(*(blk + 64 * l)));
    }
#else
    (void)pk; (void)n; (void)KS; (void)ks;
#endif
}

static void phase_gate_up(ktk_moe *m, int64_t item, int tid) {
    const ktk_moe_desc *d = &m->d;
    int64_t a = item / m->nci, c = item % m->nci, e = m->act[a], n = m->cnt[e], base = m->off[e];
    int64_t H = d->hidden, I = d->inter, r0 = c * RC;
    const uint8_t *g = d->gate + e * d->gate_es + r0 * d->gate_rb, *u = d->up + e * d->up_es + r0 * d->up_rb;
    if (m->tile[e]) {
        scratch_t s = get_scratch(m, tid);
        if (!s.wf) { __atomic_store_n(&m->fail, 1, __ATOMIC_RELAXED); return; }
        uint16_t *hpk = m->fuse_h ? m->hpk + m->pk_off[e] * I : NULL;   /* h packed here for the down GEMM */
        if (hpk) prefetch_pack_for_write(hpk, n, I / RC, c);
        else if (m->amx) prefetch_h_for_write(m->h + base * I + r0, n, I);
        if (m->i8_gu) {
            const int8_t *pk = pk_i8(m, m->xpk, H, e);
            const float *ts = ts_i8(m, m->xpk, H, m->i8_g_gu, e);
            TR_START();
            grouped_i8(m, &s, d->gate_i8 + e * m->i8_es_gu, I, H, m->i8_g_gu, r0, pk, ts, n, s.c0);
            grouped_i8(m, &s, d->up_i8 + e * m->i8_es_gu, I, H, m->i8_g_gu, r0, pk, ts, n, s.c1);
            TR_ADD(tid, 1);
        } else if (m->amx) {
            const uint16_t *pk = m->xpk + m->pk_off[e] * H;
            const int64_t bo = (e * I + r0) * H * 2;   /* the block's bytes into a tile copy */
            const uint8_t *gb = m->bt_gu ? d->gate_bt + bo : NULL, *ub = m->bt_gu ? d->up_bt + bo : NULL;
            grouped_amx(m, &s, d->gate_type, g, d->gate_rb, gb, H, pk, n, s.c0, ub ? ub : u, RC * (ub ? H * 2 : d->up_rb),
                        tid, 0);
            grouped_amx(m, &s, d->up_type, u, d->up_rb, ub, H, pk, n, s.c1, NULL, 0, tid, 0);
        } else {
            const float *pf = m->xpf ? m->xpf + m->pk_off[e] * H : NULL;
            const int8_t *pq = m->vnni_gu ? m->xq8 + m->pk_off[e] * H : NULL;
            const float *ps = m->vnni_gu ? m->xs8 + m->pk_off[e] / 16 * 2 * H : NULL;
            grouped(m, &s, d->gate_type, g, d->gate_rb, H, m->xptr + base, pf, pq, ps, n, s.c0);
            grouped(m, &s, d->up_type, u, d->up_rb, H, m->xptr + base, pf, pq, ps, n, s.c1);
        }
        if (m->amx) {   /* C row-major: SiLU(gate) * up in place, vectorized, then each token's 32 values */
            TR_START();
            ktk_amx_silu_mul(s.c0, s.c1, s.cr, RC);
            if (hpk) ktk_amx_c_to_pack(s.c0, s.cr, n, I / RC, c, hpk);
            else ktk_amx_c_to_rows(s.c0, s.cr, RC, n, m->h + base * I + r0, NULL, I, NULL);
            TR_ADD(tid, 2);
        } else if (s.ct == 1) {   /* the packed f32 path: row-major C blocks, as on AMX */
            ktk_silu_mul_avx2(s.c0, s.c1, s.cr, RC);
            ktk_amx_c_to_rows(s.c0, s.cr, RC, n, m->h + base * I + r0, NULL, I, NULL);
        } else {
            for (int64_t j = 0; j < n; j++) {
                float *hr = m->h + (base + j) * I + r0;
                const float *a = s.c0 + j * s.ct, *b = s.c1 + j * s.ct;
                for (int r = 0; r < RC; r++) hr[r] = silu(a[r * s.cr]) * b[r * s.cr];
            }
        }
        return;
    }
    size_t ab = ktk_act_bytes(H);
    if (d->gate_r16) {   /* R16 gate and up: both groups of 16 rows of both, up to 4 tokens, in one call */
        enum { NT = KTK_R16_P / 4 };
        const int64_t rb = ktk_r16_row_bytes(d->gate_type, H);   /* gate and up: one type */
        const uint8_t *g16 = d->gate_r16 + (e * I + r0) * rb, *u16 = d->up_r16 + (e * I + r0) * rb;
        float o[16 * KTK_R16_P];
        const uint8_t *gs[KTK_R16_P];
        const ktk_q8 *xs[KTK_R16_P];
        for (int64_t j0 = 0; j0 < n; j0 += NT) {
            int nt = n - j0 < NT ? (int)(n - j0) : NT, P = 0;
            for (int q = 0; q < RC; q += 16)            /* pair 2p: gate, 2p + 1: up */
                for (int t = 0; t < nt; t++, P += 2) {
                    xs[P] = xs[P + 1] = (const ktk_q8 *)(m->xq + m->tok[base + j0 + t] * ab);
                    gs[P] = g16 + q * rb;
                    gs[P + 1] = u16 + q * rb;
                }
            ktk_r16_dot(m->isa, d->gate_type, P, gs, xs, H, o);
            for (int p = 0; p < P; p += 2) {
                int q = p / (2 * nt) * 16, t = p / 2 % nt;
                float *hr = m->h + (base + j0 + t) * I + r0 + q;
                for (int r = 0; r < 16; r++) hr[r] = silu(o[16 * p + r]) * o[16 * (p + 1) + r];
            }
        }
        return;
    }
    if (!m->multirow) {   /* one row at a time, each read once and dotted with every token */
        ktk_dot_fn dg1 = m->K->dot[d->gate_type], du1 = m->K->dot[d->up_type];
        for (int r = 0; r < RC; r++, g += d->gate_rb, u += d->up_rb) {
            if (m->prefetch && r + m->prefetch < RC) {
                prefetch_row(g + m->prefetch * d->gate_rb, d->gate_rb);
                prefetch_row(u + m->prefetch * d->up_rb, d->up_rb);
            }
            for (int64_t j = 0; j < n; j++) {
                int64_t t = m->tok[base + j];
                const ktk_q8 *xa = (const ktk_q8 *)(m->xq + t * ab);
                m->h[(base + j) * I + r0 + r] = silu(dg1(g, m->x + t * H, xa, H)) * du1(u, m->x + t * H, xa, H);
            }
        }
        return;
    }
    /* DG rows of gate and of up per multi-row dot (shared activation loads), taken RC / DG rows
     * apart: call p reads rows p, p + RC/DG, ..., so each of the DG rows continues the sequential
     * stream of the previous call's and the hardware prefetchers follow them (rows side by side
     * in one page defeat them); the kernels prefetch the next call's rows themselves. */
    ktk_dotn_fn dg = m->K->dotn[d->gate_type], du = m->K->dotn[d->up_type];
    const int S = RC / DG;
    float gv[DG], uv[DG];
    for (int p = 0; p < S; p++, g += d->gate_rb, u += d->up_rb) {
        int pf = m->prefetch && p + m->prefetch < S;
        for (int64_t j = 0; j < n; j++, pf = 0) {
            int64_t t = m->tok[base + j];
            const ktk_q8 *xa = (const ktk_q8 *)(m->xq + t * ab);
            dg(g, S * d->gate_rb, DG, m->x + t * H, xa, H, gv, pf ? g + m->prefetch * d->gate_rb : NULL);
            du(u, S * d->up_rb, DG, m->x + t * H, xa, H, uv, pf ? u + m->prefetch * d->up_rb : NULL);
            float *hr = m->h + (base + j) * I + r0 + p;
            for (int q = 0; q < DG; q++) hr[q * S] = silu(gv[q]) * uv[q];
        }
    }
}

/* R16 down: P (group, h record) pairs in one kernel call, each pair's 16 results weighted into its output rows */
typedef struct {
    int P;
    float o[16 * KTK_R16_P], wv[KTK_R16_P];
    const uint8_t *gs[KTK_R16_P];
    const ktk_q8 *hs[KTK_R16_P];
    float *dst[KTK_R16_P];
} r16_batch;

static void r16_down_flush(const ktk_moe *m, r16_batch *b) {
    if (!b->P) return;
    ktk_r16_dot(m->isa, m->d.down_type, b->P, b->gs, b->hs, m->d.inter, b->o);
    for (int p = 0; p < b->P; p++)
        for (int r = 0; r < 16; r++) b->dst[p][r] += b->wv[p] * b->o[16 * p + r];
    b->P = 0;
}

/* One grouped expert's down projection for output rows r0 .. r0 + RC, its tokens' weighted sums added into
 * o_base (token t's row at o_base + t * o_ld); the next grouped expert before act[a_end] is prefetched. */
static void down_grouped(ktk_moe *m, scratch_t *s, int64_t a, int64_t a_end, int64_t r0, float *o_base, int64_t o_ld, int tid) {
    const ktk_moe_desc *d = &m->d;
    int64_t H = d->hidden, I = d->inter, e = m->act[a], n = m->cnt[e], base = m->off[e];
    const uint8_t *rows = d->down + e * d->down_es + r0 * d->down_rb;
    if (m->i8_dn) {
        TR_START();
        grouped_i8(m, s, d->down_i8 + e * m->i8_es_dn, H, I, m->i8_g_dn, r0, pk_i8(m, m->hpk, I, e),
                   ts_i8(m, m->hpk, I, m->i8_g_dn, e), n, s->c0);
        TR_ADD(tid, 4);
    } else if (m->amx) {
        int64_t a1 = a + 1;   /* the next grouped expert's rows come in during this GEMM */
        while (a1 < a_end && !m->tile[m->act[a1]]) a1++;
        const uint8_t *bt = m->bt_dn ? d->down_bt + (e * H + r0) * I * 2 : NULL, *nx = NULL;
        if (a1 < a_end) nx = bt ? d->down_bt + (m->act[a1] * H + r0) * I * 2 : d->down + m->act[a1] * d->down_es + r0 * d->down_rb;
        grouped_amx(m, s, d->down_type, rows, d->down_rb, bt, I, m->hpk + m->pk_off[e] * I, n, s->c0,
                    nx, RC * (bt ? I * 2 : d->down_rb), tid, 3);
    } else {
        grouped(m, s, d->down_type, rows, d->down_rb, I, m->hptr + base,
                m->hpf ? m->hpf + m->pk_off[e] * I : NULL, m->vnni_dn ? m->hq8 + m->pk_off[e] * I : NULL,
                m->vnni_dn ? m->hs8 + m->pk_off[e] / 16 * 2 * I : NULL, n, s->c0);
    }
    TR_START();
    if (s->ct == 1) ktk_amx_c_to_rows(s->c0, s->cr, RC, n, o_base, m->tok + base, o_ld, m->wt + base);
    else
        for (int64_t j = 0; j < n; j++) {
            float *o = o_base + m->tok[base + j] * o_ld, wv = m->wt[base + j];
            const float *c = s->c0 + j * s->ct;
            for (int r = 0; r < RC; r++) o[r] += wv * c[r * s->cr];
        }
    TR_ADD(tid, 5);
}

/* A layer whose active experts are all grouped (prefill) sums each chunk of 32 output rows as two halves of
 * its experts (act[0, amid) and act[amid, nact), split by token tiles), each in its own compact [T][RC] block,
 * and writes out = half 0 + half 1. One worker does both halves (dsplit 1) or two workers one each (dsplit 2:
 * where the thread count does not divide the chunks, the last round of the phase has half-size items; the one
 * finishing second adds the two). The arithmetic is the same either way, so the result does not depend on
 * the thread count. */
static void phase_down_halves(ktk_moe *m, int64_t item, int tid) {
    /* an item: chunks c_lo .. c_hi - 1 (one, or up to dch with $KTINJECT_DOWN_CHUNKS: each expert's GEMMs for all of
     * them back to back, so its packed h comes from L3 once for them, not once a chunk); each chunk's sums in the same
     * order either way, so the same bits */
    const int64_t S = m->dsplit, q = item / S, H = m->d.hidden, G = m->dch;
    const int64_t c_lo = q < m->nbig ? G * q : G * m->nbig + (q - m->nbig), c_hi = c_lo + (q < m->nbig ? G : 1);
    const size_t blk = (size_t)m->T * RC;
    scratch_t s = get_scratch(m, tid);
    if (!s.wf) { __atomic_store_n(&m->fail, 1, __ATOMIC_RELAXED); return; }
    const int h0 = S == 2 ? (int)(item % 2) : 0, h1 = S == 2 ? h0 + 1 : 2;
    for (int h = h0; h < h1; h++) {
        float *acc[8] = {NULL};   /* chunk c_lo + j's block of this half (dch <= 8) */
        for (int64_t c = c_lo; c < c_hi; c++) {
            acc[c - c_lo] = S == 2 ? m->dslot + ((size_t)c * 2 + h) * blk : s.acc + ((size_t)(c - c_lo) * 2 + h) * blk;
            memset(acc[c - c_lo], 0, blk * sizeof(float));
        }
        const int64_t a_lo = h ? m->amid : 0, a_hi = h ? m->nact : m->amid;
        for (int64_t a = a_lo; a < a_hi; a++)
            for (int64_t c = c_lo; c < c_hi; c++)
                down_grouped(m, &s, a, S == 2 ? a_hi : m->nact, c * RC, acc[c - c_lo], RC, tid);
    }
    if (S == 2) {   /* the halves' blocks are written before the count goes up (release), read after (acquire) */
        if (__atomic_fetch_add(&m->dcnt[q], 1, __ATOMIC_ACQ_REL) == 0) return;   /* the other half adds them */
    }
    TR_START();
    for (int64_t c = c_lo; c < c_hi; c++) {
        const float *A = S == 2 ? m->dslot + (size_t)c * 2 * blk : s.acc + (size_t)(c - c_lo) * 2 * blk;
        for (int64_t t = 0; t < m->T; t++) {
            float *o = m->out + t * H + c * RC;
            const float *x0 = A + t * RC, *x1 = A + blk + t * RC;
            for (int r = 0; r < RC; r++) o[r] = x0[r] + x1[r];
        }
    }
    TR_ADD(tid, 5);
}

static void phase_down(ktk_moe *m, int64_t c, int tid) {
    if (m->halves) { phase_down_halves(m, c, tid); return; }
    const ktk_moe_desc *d = &m->d;
    int64_t H = d->hidden, I = d->inter, r0 = c * m->rcd, rc = m->rcd;
    size_t ab = ktk_act_bytes(I);
    /* The grouped experts' weighted sums go to a compact [T][RC] block (acc) and reach the output once, at the
     * end: summed into the output's rows H floats apart, every token's row of a V2-Lite layer (H = 2048: 8 KiB)
     * falls in the same few cache sets, and the read-modify-writes missed L1 and L2 (KTINJECT_DOWN_ACC=0: the old
     * order, for A/B). Here row-dot experts share the rows: the block is added (with none, phase_down_halves). */
    const int use_acc = m->down_acc && m->ntile > 0 && rc == RC;
    for (int64_t t = 0; t < m->T; t++) memset(m->out + t * H + r0, 0, (size_t)rc * sizeof(float));
    ktk_dotn_fn dd = m->K->dotn[d->down_type];
    scratch_t s = {0, 0, 0, 0, 0, 0, 0};
    if (d->down_r16) {   /* R16: the (expert, token) pairs of the row-dot experts, up to KTK_R16_P per call */
        const int64_t rb = ktk_r16_row_bytes(d->down_type, I);
        r16_batch b;
        b.P = 0;
        for (int64_t q = 0; q < rc; q += 16) {
            for (int64_t a = 0; a < m->nact; a++) {
                int64_t e = m->act[a];
                if (m->tile[e]) continue;
                for (int64_t pos = m->off[e]; pos < m->off[e + 1]; pos++) {
                    b.gs[b.P] = d->down_r16 + (e * H + r0 + q) * rb;
                    b.hs[b.P] = (const ktk_q8 *)(m->hq + pos * ab);
                    b.dst[b.P] = m->out + m->tok[pos] * H + r0 + q;
                    b.wv[b.P++] = m->wt[pos];
                    if (b.P == KTK_R16_P) r16_down_flush(m, &b);
                }
            }
            r16_down_flush(m, &b);
        }
    }
    for (int64_t a = 0; a < m->nact; a++) {
        int64_t e = m->act[a], n = m->cnt[e], base = m->off[e];
        const uint8_t *rows = d->down + e * d->down_es + r0 * d->down_rb;
        if (m->tile[e]) {
            if (!s.wf) {
                s = get_scratch(m, tid);
                if (!s.wf) { __atomic_store_n(&m->fail, 1, __ATOMIC_RELAXED); return; }
                if (use_acc) memset(s.acc, 0, (size_t)(m->T * RC) * sizeof(float));
            }
            down_grouped(m, &s, a, m->nact, r0, use_acc ? s.acc : m->out + r0, use_acc ? RC : H, tid);
            continue;
        }
        if (d->down_r16) continue;   /* done above */
        if (!m->multirow) {
            ktk_dot_fn dd1 = m->K->dot[d->down_type];
            for (int r = 0; r < rc; r++, rows += d->down_rb) {
                if (m->prefetch && r + m->prefetch < rc) prefetch_row(rows + m->prefetch * d->down_rb, d->down_rb);
                for (int64_t j = 0; j < n; j++) {
                    int64_t pos = base + j;
                    m->out[m->tok[pos] * H + r0 + r] += m->wt[pos] * dd1(rows, m->hptr[pos], (const ktk_q8 *)(m->hq + pos * ab), I);
                }
            }
            continue;
        }
        const int S = (int)(rc / DG);   /* as in phase_gate_up: DG rows S apart per call */
        for (int p = 0; p < S; p++, rows += d->down_rb) {
            int pf = m->prefetch && p + m->prefetch < S;
            for (int64_t j = 0; j < n; j++, pf = 0) {
                int64_t pos = base + j;
                float dv[DG], wv = m->wt[pos], *o = m->out + m->tok[pos] * H + r0 + p;
                dd(rows, S * d->down_rb, DG, m->hptr[pos], (const ktk_q8 *)(m->hq + pos * ab), I, dv,
                   pf ? rows + m->prefetch * d->down_rb : NULL);
                for (int q = 0; q < DG; q++) o[q * S] += wv * dv[q];
            }
        }
    }
    if (use_acc && s.acc) {
        TR_START();
        for (int64_t t = 0; t < m->T; t++) {
            float *o = m->out + t * H + r0;
            const float *a = s.acc + t * RC;
            for (int r = 0; r < RC; r++) o[r] += a[r];
        }
        TR_ADD(tid, 5);
    }
}

/* A grouped expert's tokens packed for its gate/up GEMMs (P0): from the once-quantized (or converted) tokens, which
 * P0's chunks write, else from their floats (pack_rows) */
static void pack_x(ktk_moe *m, int64_t e, int tid) {
    const int64_t H = m->d.hidden;
    TR_START();
    if (m->nqt) {
        /* the chunks were claimed before any pack: wait for the last of them to finish (yielding now and then:
         * on an oversubscribed pool its worker may need this core) */
        for (long spin = 1; __atomic_load_n(&m->tq_done, __ATOMIC_ACQUIRE) < m->nqt; spin++)
            if (spin & 0xff) ktk_relax(); else sched_yield();
        TR_ADD(tid, 9);
    }
    if (m->i8_gu && m->nqt) {
        const float *qs = (const float *)(m->tq + m->T * H);
        ktk_amx_pack_q_i8(m->tq, qs, m->tok + m->off[e], m->cnt[e], H, m->i8_g_gu, pk_i8(m, m->xpk, H, e),
                          ts_i8(m, m->xpk, H, m->i8_g_gu, e));
    } else if (m->amx && m->nqt)
        ktk_amx_pack_b((const uint16_t *)m->tq, m->tok + m->off[e], m->cnt[e], H, m->xpk + m->pk_off[e] * H);
    else
        pack_rows(m, m->xptr + m->off[e], e, H, m->i8_gu, m->i8_g_gu, m->vnni_gu, m->xpk, m->xq8, m->xs8, m->xpf);
    TR_ADD(tid, 6);
    (void)tid;
}

static void moe_item(void *ctx, int phase, int64_t item, int tid) {
    ktk_moe *m = ctx;
    const ktk_moe_desc *d = &m->d;
    int64_t H = d->hidden, I = d->inter;
    switch (phase) {
    case 0:
        if (item < m->nqt) {   /* a chunk of tokens quantized (or converted) for the packs below, which wait for them all */
            TR_START();
            const int64_t t0 = item * m->qchunk, n = m->T - t0 < m->qchunk ? m->T - t0 : m->qchunk;
            if (m->i8_gu) {
                const int64_t NG = H / m->i8_g_gu;
                float *qs = (float *)(m->tq + m->T * H);
                ktk_amx_quant_rows_i8(m->x + t0 * H, H, n, H, m->i8_g_gu, m->tq + t0 * H, qs + t0 * NG);
            } else {
                ktk_amx_rows_to_bf16(m->x + t0 * H, H, n, H, (uint16_t *)m->tq + t0 * H);
            }
            TR_ADD(tid, 8);
            __atomic_fetch_add(&m->tq_done, 1, __ATOMIC_RELEASE);
            break;
        }
        item -= m->nqt;
        if (item < m->nq0) { m->K->quant_act(m->x + item * H, (ktk_q8 *)(m->xq + item * ktk_act_bytes(H)), H); break; }
        pack_x(m, m->tile_list[item - m->nq0], tid);
        break;
    case 1: phase_gate_up(m, item, tid); break;
    case 2:
        if (item < m->nplain) {   /* the row-dot experts' h, quantized (the grouped path reads floats) */
            int64_t e = m->plain_list[item];
            for (int64_t pos = m->off[e]; pos < m->off[e + 1]; pos++)
                m->K->quant_act(m->h + pos * I, (ktk_q8 *)(m->hq + pos * ktk_act_bytes(I)), I);
            break;
        }
        pack_h(m, m->tile_list[item - m->nplain], tid);   /* (none with fuse_h: P1 packed them) */
        break;
    default: phase_down(m, item, tid); break;
    }
}

int ktk_moe_submit(ktk_moe *m, ktk_pool *p, int isa, int64_t T, int64_t k, const float *x,
                   const int64_t *ids, const float *w, float *out) {
    if (!m || !p || T < 0 || k < 1 || (T > 0 && (!x || !ids || !w || !out))) return KTK_EINVAL;
    if (m->busy) return KTK_EBUSY;
    const ktk_kernels *K = ktk_kernels_for(isa);
    if (!K) return KTK_EISA;
    const ktk_moe_desc *d = &m->d;
    int64_t E = d->n_experts, H = d->hidden, I = d->inter, P = T * k;
    if (!K->dot[d->gate_type] || !K->dot[d->up_type] || !K->dot[d->down_type] ||
        !K->dotn[d->gate_type] || !K->dotn[d->up_type] || !K->dotn[d->down_type])
        return KTK_EINVAL;
    for (int64_t i = 0; i < P; i++)
        if (ids[i] < 0 || ids[i] >= E) return KTK_ERANGE;
    if (T == 0) { m->T = 0; return KTK_OK; }
    int fail = 0;
    m->tok = grow(m->tok, &m->cap_P, P, sizeof *m->tok, &fail);
    m->wt = grow(m->wt, &m->cap_P, P, sizeof *m->wt, &fail);
    m->xptr = grow(m->xptr, &m->cap_P, P, sizeof *m->xptr, &fail);
    m->hptr = grow(m->hptr, &m->cap_P, P, sizeof *m->hptr, &fail);
    m->h = grow(m->h, &m->cap_P, P * I, sizeof *m->h, &fail);
    m->hq = grow(m->hq, &m->cap_P, P * ktk_act_bytes(I), 1, &fail);
    m->xq = grow(m->xq, &m->cap_T, T * ktk_act_bytes(H), 1, &fail);
    if (fail) return KTK_ENOMEM;
    /* group (token, slot) pairs by expert, stable in token order */
    memset(m->cnt, 0, (size_t)E * sizeof *m->cnt);
    for (int64_t i = 0; i < P; i++) m->cnt[ids[i]]++;
    m->off[0] = 0;
    for (int64_t e = 0; e < E; e++) m->off[e + 1] = m->off[e] + m->cnt[e];
    for (int64_t e = 0; e < E; e++) m->pk_off[e] = m->off[e];   /* reused as fill cursor */
    for (int64_t i = 0; i < P; i++) {
        int64_t pos = m->pk_off[ids[i]]++;
        m->tok[pos] = i / k;
        m->wt[pos] = w[i];
        m->xptr[pos] = x + (i / k) * H;
        m->hptr[pos] = m->h + pos * I;
    }
#if defined(KTK_AMX_EMULATE)   /* amx_emulate_check.c: isa AVX2 takes the grouped AMX path on the emulated tiles */
    m->tmul = isa == KTK_ISA_AVX2;
#else
    m->tmul = isa == KTK_ISA_AMX;
#endif
    /* the AVX-512 path's layers of BF16 experts: the tile path's packing and epilogues, bf16 dot products for its
     * tile products (the weights read as they are, the tokens rounded to bf16 as on AMX) */
    m->dp = isa == KTK_ISA_AVX512 && m->dp_on && ktk_avx512bf16_usable() && d->gate_type == KTK_BF16 &&
            d->up_type == KTK_BF16 && d->down_type == KTK_BF16;
    m->amx = m->tmul || m->dp;
#if defined(KTK_AMX_EMULATE)
    const int i8_ok = m->tmul;
#else
    const int i8_ok = m->tmul && ktk_amx_int8_usable();
#endif
    m->i8_gu = i8_ok && d->gate_i8 != NULL;
    m->i8_dn = i8_ok && d->down_i8 != NULL;
    m->bt_gu = m->amx && !m->i8_gu && d->gate_bt != NULL;
    m->bt_dn = m->amx && !m->i8_dn && d->down_bt != NULL;
    m->isa = isa;
    m->packed = m->amx || (K->pack_f32 && K->gemm_packed && m->packed_f32);
    const int vnni = !m->amx && m->packed && m->vnni_on && K->pack_q8 && K->rows_u8 && K->gemm_q8;
    m->vnni_gu = vnni && (K->u8_types >> d->gate_type & 1) && (K->u8_types >> d->up_type & 1);
    m->vnni_dn = vnni && (K->u8_types >> d->down_type & 1);
    m->xpf = m->hpf = NULL;
    m->xq8 = m->hq8 = NULL;
    m->xs8 = m->hs8 = NULL;
    m->nact = m->ntile = m->maxcnt = m->nplain = 0;
    int64_t npad = 0;
    for (int64_t e = 0; e < E; e++) {
        m->tile[e] = 0;
        if (!m->cnt[e]) continue;
        m->act[m->nact++] = e;
        if (m->cnt[e] >= m->tile_min) {
            m->tile[e] = 1;
            if (m->cnt[e] > m->maxcnt) m->maxcnt = m->cnt[e];
            m->pk_off[e] = npad;
            npad += (m->cnt[e] + 15) / 16 * 16;
            if (m->packed) m->tile_list[m->ntile++] = e;
        } else {
            m->plain_list[m->nplain++] = e;
        }
    }
    m->npad = npad;
    if (m->amx && npad) {   /* (the I8 packing, K bytes and 2K / 64 floats at most a token, fits in the bf16 one's space) */
        m->xpk = grow_pk(&m->xpk_mem, &m->cap_xpk, (size_t)(npad * H) * sizeof *m->xpk, &fail);
        m->hpk = grow_pk(&m->hpk_mem, &m->cap_hpk, (size_t)(npad * I) * sizeof *m->hpk, &fail);
        if (fail) return KTK_ENOMEM;
    } else if (m->packed && npad) {   /* 8-bit: npad * K bytes, then npad / 16 * 2K floats of scales; f32: npad * K floats */
        size_t xb = m->vnni_gu ? (size_t)(npad * H) * 2 : (size_t)(npad * H) * sizeof(float);
        size_t hb = m->vnni_dn ? (size_t)(npad * I) * 2 : (size_t)(npad * I) * sizeof(float);
        uint8_t *xm = (uint8_t *)grow_pk(&m->xpk_mem, &m->cap_xpk, xb, &fail);
        uint8_t *hm = (uint8_t *)grow_pk(&m->hpk_mem, &m->cap_hpk, hb, &fail);
        if (fail) return KTK_ENOMEM;
        if (m->vnni_gu) { m->xq8 = (int8_t *)xm; m->xs8 = (float *)(xm + npad * H); }
        else m->xpf = (float *)xm;
        if (m->vnni_dn) { m->hq8 = (int8_t *)hm; m->hs8 = (float *)(hm + npad * I); }
        else m->hpf = (float *)hm;
    }
    m->K = K; m->pool = p; m->T = T; m->k = k; m->P = P; m->x = x; m->w = w; m->out = out; m->fail = 0;
    m->rcd = (m->maxcnt > 0 || H % 64) ? RC : RC / 2;   /* decode: finer down items balance better */
    m->nci = I / RC; m->nch = H / m->rcd;
    m->nq0 = m->nplain ? T : 0;   /* token activations are quantized for the row-dot path only */
    m->nqt = 0; m->tq_done = 0;
    if (m->amx && m->ntile && m->pack_once && (!m->i8_gu || ktk_amx_pack_once_usable())) {
        /* I8: bytes, then a float a group; bf16 tiles: 2 bytes a value. In h where it fits (always, for real shapes) */
        const size_t need = m->i8_gu ? (size_t)(T * H + T * (H / m->i8_g_gu) * 4) : (size_t)(T * H * 2);
        if (need <= (size_t)(P * I) * sizeof *m->h) m->tq = (int8_t *)m->h;
        else m->tq = m->tqmem = grow(m->tqmem, NULL, need, 1, &fail);
        if (fail) return KTK_ENOMEM;
        /* a chunk a worker (at least 4 tokens), so that the packs, which wait for the last chunk, start together:
         * 16-token chunks left 2 of 15 workers a third round at batch 512 while the rest waited */
        const int64_t nt = ktk_pool_threads(p);
        m->qchunk = (T + nt - 1) / nt < 4 ? 4 : (T + nt - 1) / nt;
        m->nqt = (T + m->qchunk - 1) / m->qchunk;
    }
    /* all experts grouped: the down phase sums two halves of them (phase_down_halves), split by token tiles (and one
     * per expert for its rows' conversion); two items a chunk where that shortens the phase's last round */
    m->halves = m->down_acc && m->ntile > 0 && m->nplain == 0 && m->rcd == RC;
    m->dsplit = 1;
    m->nbig = 0;
    m->dch = m->halves && m->down_chunks <= m->nch ? m->down_chunks : 1;
    if (m->halves) {
        int64_t tot = 0, cum = 0;
        for (int64_t a = 0; a < m->nact; a++) tot += (m->cnt[m->act[a]] + 15) / 16 + 1;
        m->amid = m->nact;
        for (int64_t a = 0; a < m->nact; a++) {
            const int64_t c2 = cum + (m->cnt[m->act[a]] + 15) / 16 + 1;
            if (2 * c2 > tot) { m->amid = tot - 2 * cum <= 2 * c2 - tot ? a : a + 1; break; }
            cum = c2;
        }
        const int64_t nt = ktk_pool_threads(p), rounds1 = (m->nch + nt - 1) / nt, rounds2 = (2 * m->nch + nt - 1) / nt;
        if (m->down_split == 2 || (m->down_split == 0 && rounds2 < 2 * rounds1)) {
            /* the halves' blocks, 2 H T floats: in h (P I floats), which no grouped expert reads after its packing in
             * P2, where it is large enough (2 H <= k I: every model the rule packs name), else in a buffer of their own */
            if (2 * H <= k * I) m->dslot = m->h;
            else m->dslot = m->dmem = grow(m->dmem, NULL, (size_t)(m->nch * 2 * T * RC), sizeof *m->dmem, &fail);
            m->dcnt = grow(m->dcnt, NULL, (size_t)m->nch, sizeof *m->dcnt, &fail);
            if (fail) return KTK_ENOMEM;
            memset(m->dcnt, 0, (size_t)m->nch * sizeof *m->dcnt);
            m->dsplit = 2;
        }
        if (m->dch > 1) {
            /* items of dch chunks for those that fill whole rounds (the pool hands them out first), one chunk for the
             * last round or two, so the phase keeps the single items' balance: at 15 threads and 2 chunks, 60 of 64
             * chunks in pairs, the last 8 half-chunk items single (all in pairs, 64 items: a fifth round for 4 of 15) */
            const int64_t w = m->nch * m->dsplit, full = nt * (w / (m->dch * nt));
            m->nbig = full / m->dsplit < m->nch / m->dch ? full / m->dsplit : m->nch / m->dch;
        }
    }
    /* a bf16 down on AMX takes h packed by P1 straight from the gate/up epilogue: no f32 rows, no P2 packing */
    m->fuse_h = m->amx && m->ntile && !m->i8_dn && m->fuse_h_on;
    int64_t items[4] = {m->nqt + m->nq0 + m->ntile, m->nact * m->nci, m->nplain + (m->fuse_h ? 0 : m->ntile),
                        m->halves ? (m->nch - m->nbig * (m->dch - 1)) * m->dsplit : m->nch};
    /* with grouped experts on AMX, workers take gate/up items (row chunks of one expert) 4 at a time,
     * so the expert's packed tokens stay in one worker's L2: 14-18% faster layers on the lent Xeon at
     * 8 and 16 threads (twenty-fourth session, as the pool-wide KTINJECT_POOL_CLAIM=4; 8 no better);
     * fewer where that would leave less than 4 claims a worker; decode unchanged */
    int64_t gu = m->amx && m->maxcnt > 0 ? m->gu_claim : 0;   /* 0: the pool's own */
    const int64_t per = items[1] / (4 * (int64_t)ktk_pool_threads(p));
    if (gu > per) gu = per > 1 ? per : 1;
    const int64_t claims[4] = {0, gu, 0, 0};
    int rc = ktk_pool_run_async_claims(p, moe_item, m, 4, items, claims);
    if (rc == KTK_OK) m->busy = 1;
    return rc;
}

int64_t ktk_moe_hidden(const ktk_moe *m) { return m ? m->d.hidden : -1; }

int ktk_moe_sync(ktk_moe *m, ktk_pool *p) {
    if (!m || !p) return KTK_EINVAL;
    if (!m->busy) return KTK_OK;
    if (m->pool != p) return KTK_EINVAL;
    ktk_pool_wait(p);
    m->busy = 0;
    /* a worker without scratch left some of the output unwritten: an error, not a silent wrong answer */
    return __atomic_load_n(&m->fail, __ATOMIC_RELAXED) ? KTK_ENOMEM : KTK_OK;
}

int ktk_moe_forward(ktk_moe *m, ktk_pool *p, int isa, int64_t T, int64_t k, const float *x,
                    const int64_t *ids, const float *w, float *out) {
    int rc = ktk_moe_submit(m, p, isa, T, k, x, ids, w, out);
    if (rc) return rc;
    return ktk_moe_sync(m, p);
}

int ktk_moe_chain(ktk_moe **m, int64_t n, ktk_pool *p, int isa, int64_t T, int64_t k, const float *x,
                  const int64_t **ids, const float **w, int64_t nroutes, float *out, int64_t calls,
                  double *seconds) {
    if (!m || n < 1 || !p || T < 1 || k < 1 || !x || !ids || !w || nroutes < 1 || !out || calls < 1 || !seconds)
        return KTK_EINVAL;
    int64_t E = INT64_MAX;
    for (int64_t i = 0; i < n; i++) {
        if (!m[i] || m[i]->d.hidden != m[0]->d.hidden || m[i]->busy) return KTK_EINVAL;
        if (m[i]->d.n_experts < E) E = m[i]->d.n_experts;
    }
    for (int64_t r = 0; r < nroutes; r++) {      /* every id against every layer, before any runs */
        if (!ids[r] || !w[r]) return KTK_EINVAL;
        for (int64_t i = 0; i < T * k; i++)
            if (ids[r][i] < 0 || ids[r][i] >= E) return KTK_ERANGE;
    }
    /* off the workers' cores while it runs, as the doorbell thread places itself (hostjob.c) */
    cpu_set_t saved;
    int restore = sched_getaffinity(0, sizeof saved, &saved) == 0 && ktk_pool_pin_outside(p) > 0;
    struct timespec t0, t1;
    int rc = KTK_OK;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int64_t c = 0; c < calls && rc == KTK_OK; c++)
        rc = ktk_moe_forward(m[c % n], p, isa, T, k, x, ids[c % nroutes], w[c % nroutes], out);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (restore) sched_setaffinity(0, sizeof saved, &saved);
    *seconds = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    return rc;
}

int ktk_dequant_row_isa(int isa, int type, const uint8_t *src, float *dst, int64_t n) {
    const ktk_kernels *K = ktk_kernels_for(isa);
    if (!K) return KTK_EISA;
    if (ktk_type_block(type) == 0 || n % ktk_type_block(type)) return KTK_EINVAL;
    K->dequant(type, src, dst, n);
    return KTK_OK;
}

int ktk_gemv(int isa, int type, const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t n,
             const float *x, float *y) {
    const ktk_kernels *K = ktk_kernels_for(isa);
    if (!K) return KTK_EISA;
    if (type < 0 || type >= KTK_NTYPES || !K->dotn[type] || ktk_row_bytes(type, n) != row_bytes || rows < 0)
        return KTK_EINVAL;
    int64_t nq = n - n % 32;   /* element types may have any n: their dots read x itself */
    ktk_q8 *xq = malloc(ktk_act_bytes(nq) + 64);
    if (!xq) return KTK_ENOMEM;
    K->quant_act(x, xq, nq);
    for (int64_t r = 0; r < rows; r += 1 << 20) {   /* the multi-row dot takes an int row count */
        int nr = rows - r < (1 << 20) ? (int)(rows - r) : 1 << 20;
        ktk_dotn_spread(K->dotn[type], w + r * row_bytes, row_bytes, nr, x, xq, n, y + r, 1);
    }
    free(xq);
    return KTK_OK;
}
