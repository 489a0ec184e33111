/* AMX-BF16 tile GEMM for grouped (prefill) expert work.
 *
 * Roles: the dequantized weight rows are the A operand (16 rows x 32 bf16 per tile), the
 * tokens are the B operand, packed once per expert in the VNNI pair layout: for token tile tt
 * and k-step ks (32 values), a 1 KiB block B[p][t][e] = x[tt*16 + t][ks*32 + 2p + e].
 * The weight rows are written "tile-major" by ktk_amx_rows_bf16 straight from their GGML
 * blocks: the 32 values of k-step ks of row r (of a block of 32 rows) at (ks*32 + r)*32, so
 * every A tile is 1 KiB of contiguous memory. C tiles are [16 weight rows][16 tokens] f32,
 * stored straight into C[row][token].
 * Blocking: 2 row tiles x 2 token tiles = 4 accumulators, 2 A + 2 B tiles. (Running K in
 * L1-sized chunks, C accumulating in memory between them, measured slower: 29.4 vs 24.9 ms per
 * V2-Lite Q4_K layer at batch 512; converting the rows chunk by chunk as well, each chunk
 * multiplied while in L1, was not faster than this either.)
 * ktk_bt_repack: that layout made once at load from BF16 rows (desc gate_bt / up_bt / down_bt).
 * ktk_amx_silu_mul: the gate/up epilogue on the row-major C blocks; ktk_amx_c_to_rows: those blocks
 * back to token rows (h, or weighted into the layer's output). */
#include "ktk_int.h"
#include "transpose.h"
#include <immintrin.h>
#include <math.h>

int64_t ktk_amx_pack_x_elems(int64_t nt, int64_t K) { return (nt + 15) / 16 * 16 * K; }

/* an A/B knob: $name's first character '1' or not, read once (the default where unset); racing first readers agree */
static inline int env_flag(int *cache, const char *name, int dflt) {
    int v = __atomic_load_n(cache, __ATOMIC_RELAXED);
    if (v < 0) {
        const char *s = getenv(name);
        v = s && *s ? s[0] == '1' : dflt;
        __atomic_store_n(cache, v, __ATOMIC_RELAXED);
    }
    return v;
}

/* Tokens to bf16 (row t of X, ldx floats apart, to y + t * K), as the packings below convert them (AVX-512's
 * conversion where the CPU has it: the same rounding, 0.30 against 0.43 ms for a batch of 512 tokens of 2048 on one
 * core of the development machine) */
void ktk_amx_rows_to_bf16(const float *X, int64_t ldx, int64_t nt, int64_t K, uint16_t *y) {
    const ktk_kernels *kern = ktk_kernels_for(KTK_ISA_AVX512);
    if (!kern) kern = ktk_kernels_for(KTK_ISA_AVX2);
    for (int64_t t = 0; t < nt; t++) {
        if (kern) kern->to_bf16(X + t * ldx, y + t * K, K);
        else for (int64_t i = 0; i < K; i++) y[t * K + i] = ktk_f32_to_bf16(X[t * ldx + i]);
    }
}

/* Per token tile and chunk of up to 16 k-steps: the 16 tokens' values in bf16 (16 KiB), then
 * every 1 KiB B block built from four 8 x 8 transposes of bf16 pairs and written whole (writing
 * pair by pair touched a different cache line with every store). */
__attribute__((target("avx2")))
void ktk_amx_pack_x(const float *const *X, int64_t nt, int64_t K, uint16_t *pk) {
    int64_t KS = K / 32, ntt = (nt + 15) / 16;
    uint32_t buf[16][256] __attribute__((aligned(32)));   /* 16 tokens x 512 bf16 */
    for (int64_t tt = 0; tt < ntt; tt++)
        for (int64_t k0 = 0; k0 < K; k0 += 512) {
            int64_t kn = K - k0 < 512 ? K - k0 : 512;
            for (int t = 0; t < 16; t++) {
                int64_t tok = tt * 16 + t;
                if (tok >= nt) memset(buf[t], 0, (size_t)kn * 2);
                else ktk_amx_rows_to_bf16(X[tok] + k0, kn, 1, kn, (uint16_t *)buf[t]);
            }
            for (int64_t ks = 0; ks < kn / 32; ks++) {
                const uint32_t *row[16];
                for (int t = 0; t < 16; t++) row[t] = buf[t] + ks * 16;
                ktk_tile_from_rows(row, (uint32_t *)pk + (tt * KS + k0 / 32 + ks) * 256);   /* [pair p][token t] */
            }
        }
}

static int pack_nt_flag = -1;
int ktk_pack_nt(void) { return env_flag(&pack_nt_flag, "KTINJECT_PACK_NT", 1); }

/* ktk_amx_pack_b on AVX-512 (ktk_tile_from_rows_512: one core of the development machine, a batch-512 V2-Lite
 * layer's packs with the destination cold, 1.9 -> 1.7 ms; written past the caches, the default, 0.8 ms; on the lent
 * Xeon the layer's first phase 18-288 us shorter that way in each of 8 pairs, $KTINJECT_PACK_NT=0 the cached stores) */
__attribute__((target("avx512f")))
static void pack_b_512(const uint16_t *xb, const int64_t *idx, int64_t nt, int64_t K, uint16_t *pk, int nt_store) {
    const int64_t KS = K / 32, ntt = (nt + 15) / 16;
    for (int64_t tt = 0; tt < ntt; tt++) {
        const uint32_t *base[16];   /* tokens past nt: a row of zeros */
        for (int t = 0; t < 16; t++) base[t] = tt * 16 + t < nt ? (const uint32_t *)(xb + idx[tt * 16 + t] * K) : NULL;
        for (int64_t ks = 0; ks < KS; ks++)
            ktk_tile_from_rows_512(base, ks * 16, (uint32_t *)pk + (tt * KS + ks) * 256, nt_store);
    }
    if (nt_store) _mm_sfence();   /* the streamed blocks visible before the pool counts this item done */
}

/* The same packing in two steps: every token converted once (ktk_amx_rows_to_bf16, with ktk_amx_pack_x's
 * conversion), then each expert's tokens idx[0 .. nt) packed from those bf16 rows (ktk_amx_pack_b): a token is
 * converted once, not once for each of its k experts. The same bits as ktk_amx_pack_x. */
__attribute__((target("avx2")))
void ktk_amx_pack_b(const uint16_t *xb, const int64_t *idx, int64_t nt, int64_t K, uint16_t *pk) {
    static const uint32_t zeros[16];
    const int64_t KS = K / 32, ntt = (nt + 15) / 16;
    if (ktk_cpu_features() >> KTK_ISA_AVX512 & 1) {
        /* (streaming stores need 64-byte aligned lines: the layer's packs are page-aligned; a caller's unaligned
         * buffer gets the cached stores, the same bits) */
        pack_b_512(xb, idx, nt, K, pk, ktk_pack_nt() && ((uintptr_t)pk & 63) == 0);
        return;
    }
    for (int64_t tt = 0; tt < ntt; tt++) {
        const uint32_t *base[16], *row[16];   /* tokens past nt: a row of zeros */
        for (int t = 0; t < 16; t++) base[t] = tt * 16 + t < nt ? (const uint32_t *)(xb + idx[tt * 16 + t] * K) : NULL;
        for (int64_t ks = 0; ks < KS; ks++) {
            for (int t = 0; t < 16; t++) row[t] = base[t] ? base[t] + ks * 16 : zeros;
            ktk_tile_from_rows(row, (uint32_t *)pk + (tt * KS + ks) * 256);   /* [pair p][token t], as ktk_amx_pack_x */
        }
    }
}

/* ---- BF16 tile copies (ktk.h): ktk_amx_rows_bf16's layout for a BF16 block, made once at load. A pool item copies
 * one block of 32 rows: each row's 64-byte k-steps to their places, the destination written in order. */
int64_t ktk_bt_expert_bytes(int64_t rows, int64_t n) {
    return rows > 0 && n > 0 && rows % 32 == 0 && n % 32 == 0 && rows <= INT64_MAX / 2 / n ? rows * n * 2 : -1;
}

typedef struct { const uint8_t *src; int64_t src_rb, src_es, rows, n; uint8_t *dst; } bt_ctx;

static void bt_item(void *ctx, int phase, int64_t item, int tid) {
    (void)phase; (void)tid;
    const bt_ctx *c = ctx;
    const int64_t nb = c->rows / 32, e = item / nb, b = item % nb, KS = c->n / 32;
    const uint8_t *src = c->src + e * c->src_es + b * 32 * c->src_rb;
    uint8_t *dst = c->dst + (e * c->rows + b * 32) * c->n * 2;
    for (int64_t ks = 0; ks < KS; ks++)
        for (int r = 0; r < 32; r++) memcpy(dst + (ks * 32 + r) * 64, src + r * c->src_rb + ks * 64, 64);
}

int ktk_bt_repack(ktk_pool *p, int type, const uint8_t *src, int64_t src_rb, int64_t src_es, int64_t n_experts,
                  int64_t rows, int64_t n, uint8_t *dst) {
    const int64_t es = ktk_bt_expert_bytes(rows, n);
    if (!src || !dst || type != KTK_BF16 || es < 0 || n_experts < 1 || n_experts > INT64_MAX / es ||
        src_rb != ktk_row_bytes(KTK_BF16, n) || src_es < rows * src_rb)
        return KTK_EINVAL;
    bt_ctx c = {src, src_rb, src_es, rows, n, dst};
    int64_t items = n_experts * (rows / 32);
    if (p && ktk_pool_run_async(p, bt_item, &c, 1, &items) == KTK_OK) return ktk_pool_wait(p);
    for (int64_t i = 0; i < items; i++) bt_item(&c, 0, i, 0);
    return KTK_OK;
}

/* The row-major C blocks of the tile GEMM back to token rows, 8 x 8 blocks transposed in registers
 * (element by element, its column walk cost 1 ms a layer on 16 threads in the down projection) */
__attribute__((target("avx2")))
void ktk_amx_c_to_rows(const float *C, int64_t ldc, int rows, int64_t n, float *out, const int64_t *idx,
                       int64_t stride, const float *wv) {
    for (int64_t j0 = 0; j0 < n; j0 += 8) {
        const int jn = n - j0 < 8 ? (int)(n - j0) : 8;
        for (int r0 = 0; r0 < rows; r0 += 8) {
            __m256i v[8];
            for (int i = 0; i < 8; i++) v[i] = _mm256_loadu_si256((const __m256i *)(C + (r0 + i) * ldc + j0));
            ktk_transpose8x8(v);   /* v[t]: C[r0 .. r0 + 8)[j0 + t] */
            for (int t = 0; t < jn; t++) {
                float *o = out + (idx ? idx[j0 + t] : j0 + t) * stride + r0;
                __m256 c = _mm256_castsi256_ps(v[t]);
                if (wv) c = _mm256_add_ps(_mm256_loadu_ps(o), _mm256_mul_ps(_mm256_set1_ps(wv[j0 + t]), c));
                _mm256_storeu_ps(o, c);
            }
        }
    }
}

/* The gate/up epilogue's h straight into the down GEMM's packing (ktk_amx_pack_x's bits, without the f32 rows): C
 * holds one k-step of it, 32 values (rows of C, ldc floats apart) for each of the expert's n tokens (columns), and
 * the block of k-step ks of token tile tt, at pk + (tt * KS + ks) * 512, is B[p][t] = (C[2p][t], C[2p + 1][t]) in
 * bf16: a pair's two values from two rows of C, no transpose. Tokens past n are zeros, as the packing pads them. */
__attribute__((target("avx2")))
void ktk_amx_c_to_pack(const float *C, int64_t ldc, int64_t n, int64_t KS, int64_t ks, uint16_t *pk) {
    for (int64_t tt = 0; tt < (n + 15) / 16; tt++) {
        uint32_t *blk = (uint32_t *)pk + (tt * KS + ks) * 256;
        const int64_t left = n - tt * 16;
        const __m256i keep0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(left > 16 ? 16 : (int)left),
                                                 _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256i keep1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(left > 16 ? 16 : (int)left),
                                                 _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15));
        for (int p = 0; p < 16; p++) {
            const float *a = C + 2 * p * ldc + tt * 16, *b = a + ldc;
            for (int h = 0; h < 2; h++) {
                __m256i lo = ktk_bf16_lanes(_mm256_loadu_ps(a + 8 * h)), hi = ktk_bf16_lanes(_mm256_loadu_ps(b + 8 * h));
                __m256i v = _mm256_and_si256(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 16)), h ? keep1 : keep0);
                _mm256_storeu_si256((__m256i *)(blk + p * 16 + 8 * h), v);
            }
        }
    }
}

#if defined(KTK_AMX_EMULATE)
/* A software tile unit, so that the tile loop below runs (slowly) on any x86 CPU: built only into
 * native/amx_emulate_check.c's driver (tests/test_amx_emulated.py), never into the library. Eight
 * tiles of 16 rows x 64 bytes, as amx_config shapes them; TDPBF16PS as the ISA defines it, with
 * the pair products summed in float (the hardware's rounding differs in the last bits). */
static __thread uint8_t emu_tile[8][16 * 64];
static void emu_loadd(int t, const void *base, int64_t stride) {
    for (int r = 0; r < 16; r++) memcpy(emu_tile[t] + 64 * r, (const uint8_t *)base + r * stride, 64);
}
static void emu_stored(int t, void *base, int64_t stride) {
    for (int r = 0; r < 16; r++) memcpy((uint8_t *)base + r * stride, emu_tile[t] + 64 * r, 64);
}
static void emu_dpbf16ps(int d, int a, int b) {
    float c[256];
    uint16_t av[512], bv[512];
    memcpy(c, emu_tile[d], sizeof c); memcpy(av, emu_tile[a], sizeof av); memcpy(bv, emu_tile[b], sizeof bv);
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 16; n++)
            for (int k = 0; k < 16; k++)
                c[m * 16 + n] += ktk_bf16_to_f32(av[m * 32 + 2 * k]) * ktk_bf16_to_f32(bv[k * 32 + 2 * n]) +
                                 ktk_bf16_to_f32(av[m * 32 + 2 * k + 1]) * ktk_bf16_to_f32(bv[k * 32 + 2 * n + 1]);
    memcpy(emu_tile[d], c, sizeof c);
}
static void emu_dpbssd(int d, int a, int b) {   /* TDPBSSD: int8 x int8 quads summed into int32 */
    int32_t c[256];
    int8_t av[1024], bv[1024];
    memcpy(c, emu_tile[d], sizeof c); memcpy(av, emu_tile[a], sizeof av); memcpy(bv, emu_tile[b], sizeof bv);
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 16; n++)
            for (int k = 0; k < 64; k++) c[m * 16 + n] += (int32_t)av[m * 64 + k] * bv[(k / 4) * 64 + 4 * n + k % 4];
    memcpy(emu_tile[d], c, sizeof c);
}
#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#undef _tile_dpbssd
#define _tile_dpbssd(d, a, b) emu_dpbssd(d, a, b)
#define _tile_loadd(t, base, stride) emu_loadd(t, base, stride)
#define _tile_stored(t, base, stride) emu_stored(t, base, stride)
#define _tile_zero(t) memset(emu_tile[t], 0, sizeof emu_tile[t])
#define _tile_dpbf16ps(d, a, b) emu_dpbf16ps(d, a, b)
#define KTK_AMX_TARGET
static __thread int t_configured;
static void amx_config(void) { t_configured = 1; }
#elif defined(__x86_64__)
#define KTK_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,amx-int8,avx512f,avx512bw")))
typedef struct __attribute__((packed, aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

static __thread int t_configured;

/* GCC's _tile_loadconfig tells the compiler it reads only the first 8 bytes of the 64-byte
 * config, so once this is inlined the stores of the tile shapes can be dropped as dead (seen:
 * garbage tiles); the empty asm takes the config's address and clobbers memory, which keeps them. */
__attribute__((target("amx-tile,amx-bf16,avx512f"), noinline))
static void amx_config(void) {
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) { cfg.colsb[i] = 64; cfg.rows[i] = 16; }
    __asm__ __volatile__("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
    t_configured = 1;
}
#endif

#if defined(__x86_64__)
/* GCC's tile intrinsics are asm statements without a memory clobber: nothing orders them against
 * plain loads and stores, so (once inlined next to ktk_amx_rows_bf16 or the caller's reads of C)
 * the stores of the converted rows could sink below the tile loads that read them, or C be read
 * before the tile stores. A compiler barrier before and after the tile loops. */
#define AMX_MEMORY_BARRIER() __asm__ __volatile__("" ::: "memory")

/* $KTINJECT_AMX_PF_L2=1: the tile GEMMs' prefetches of weight rows ahead go to L2 (T1), not L1 (A/B: the 32 rows
 * of a k-step read in place, 4 KiB apart for V2-Lite's BF16 gate/up, fall in one 12-way L1 set) */
/* $KTINJECT_AMX_ROWS_PF: how many k-steps ahead the tile GEMM on BF16 rows read in place prefetches them (0: none,
 * the hardware's prefetchers alone; at most 32; 8 by default) (A/B) */
static int rows_pf_v = -1;
static inline int rows_pf(void) {
    int v = __atomic_load_n(&rows_pf_v, __ATOMIC_RELAXED);
    if (v < 0) {
        const char *s = getenv("KTINJECT_AMX_ROWS_PF");
        v = s && *s ? atoi(s) : 8;
        if (v < 0 || v > 32) v = 8;
        __atomic_store_n(&rows_pf_v, v, __ATOMIC_RELAXED);
    }
    return v;
}
static int pf_l2_flag = -1;
static inline int pf_l2(void) { return env_flag(&pf_l2_flag, "KTINJECT_AMX_PF_L2", 0); }
static inline void prefetch_line(const void *p, int l2) {
    if (l2) _mm_prefetch((const char *)p, _MM_HINT_T1);
    else _mm_prefetch((const char *)p, _MM_HINT_T0);
}

/* An odd number (3 or more) of token tiles starts with one pass over three of them, six C tiles (see gemm_ix and
 * amx_gemm; $KTINJECT_AMX_TRIPLE=0: a pair and a lone tile, for A/B). On the lent Xeon, alternating, twenty-eighth
 * session: the I4 layer 7.19-7.26 against 7.44-7.48 ms at 15 threads, 12.40-12.57 against 12.97-13.86 at 8; BF16
 * alike (15.2-15.7 ms both); the hot 32 x 48 x 2048 bf16 tile GEMM 3.7 against 4.5 us. */
static int triple_flag = -1;
static inline int triple_on(void) { return env_flag(&triple_flag, "KTINJECT_AMX_TRIPLE", 1); }

/* the 32 rows' 64 bytes of one k-step, its A tiles at A and A + a_rt, rows a_stride bytes apart */
static inline void prefetch_a(const uint16_t *A, int64_t a_rt, int64_t a_stride, int l2) {
    for (int r = 0; r < 32; r++) prefetch_line((const char *)(A + (r >> 4) * a_rt) + (r & 15) * a_stride, l2);
}

/* the bytes [p, p + n) of a region ending at end, into L2 */
static inline void prefetch_next(const uint8_t *p, int64_t n, const uint8_t *end) {
    for (int64_t o = 0; o < n && p + o < end; o += 64) _mm_prefetch((const char *)(p + o), _MM_HINT_T1);
}

/* The tile loops. A tile (row tile rt of the 32 rows, k-step ks) at A + ks * a_ks + rt * a_rt values, its
 * 16 rows a_stride bytes apart: the tile-major rows that ktk_amx_rows_bf16 writes (1024, 512, 64), or
 * BF16 weight rows read in place (32, 8 * rb, rb). `pf`: prefetch the A rows that many k-steps ahead in
 * the first pass over the tokens (rows read in place come from memory; the later passes find them in L2).
 * `nx`, `nx_bytes`: memory the caller converts next (the next weight rows), brought into L2 a few lines per
 * k-step of the first pass, so that the conversion does not wait on memory. */
KTK_AMX_TARGET
static inline void amx_gemm(const uint16_t *A, int64_t a_ks, int64_t a_rt, int64_t a_stride, int64_t K, int pf,
                            const uint16_t *pk, int64_t nt, float *C, int64_t ldc, const uint8_t *nx, int64_t nx_bytes) {
    if (!t_configured) amx_config();
    const int l2 = pf_l2();
    int64_t KS = K / 32, ntt = (nt + 15) / 16;
    const int64_t nx_step = nx ? (nx_bytes + 64 * KS - 1) / (64 * KS) * 64 : 0;   /* bytes per k-step */
    const uint8_t *nx_end = nx ? nx + nx_bytes : NULL;
    /* each k-step of the two loops below: the A rows pf steps ahead (first pass), and its share of nx */
#define STEP_PREFETCH(ks)                                                                          \
    do {                                                                                           \
        if (pf && (ks) + pf < KS) prefetch_a(A + ((ks) + pf) * a_ks, a_rt, a_stride, l2);           \
        if (tt == 0 && nx) prefetch_next(nx + (ks) * nx_step, nx_step, nx_end);                   \
    } while (0)
    AMX_MEMORY_BARRIER();
    int64_t tt3 = 0;
    if (ntt >= 3 && ntt % 2 && triple_on()) {   /* three token tiles in one pass first, as in gemm_ix */
        const int64_t tt = 0;
        const uint16_t *b0 = pk, *b1 = pk + KS * 512, *b2 = pk + 2 * KS * 512;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); _tile_zero(4); _tile_zero(5);
        for (int64_t ks = 0; ks < KS; ks++) {
            STEP_PREFETCH(ks);
            _tile_loadd(6, A + ks * a_ks, a_stride);
            _tile_loadd(7, b0 + ks * 512, 64); _tile_dpbf16ps(0, 6, 7);
            _tile_loadd(7, b1 + ks * 512, 64); _tile_dpbf16ps(1, 6, 7);
            _tile_loadd(7, b2 + ks * 512, 64); _tile_dpbf16ps(2, 6, 7);
            _tile_loadd(6, A + ks * a_ks + a_rt, a_stride); _tile_dpbf16ps(5, 6, 7);
            _tile_loadd(7, b1 + ks * 512, 64); _tile_dpbf16ps(4, 6, 7);
            _tile_loadd(7, b0 + ks * 512, 64); _tile_dpbf16ps(3, 6, 7);
        }
        _tile_stored(0, C, ldc * 4); _tile_stored(1, C + 16, ldc * 4); _tile_stored(2, C + 32, ldc * 4);
        _tile_stored(3, C + 16 * ldc, ldc * 4); _tile_stored(4, C + 16 * ldc + 16, ldc * 4);
        _tile_stored(5, C + 16 * ldc + 32, ldc * 4);
        tt3 = 3; pf = 0; nx = NULL;
    }
    for (int64_t tt = tt3; tt < ntt; tt += 2, pf = 0) {
        const uint16_t *b0 = pk + tt * KS * 512, *b1 = pk + (tt + 1) * KS * 512;
        float *c0 = C + tt * 16, *c1 = C + 16 * ldc + tt * 16;
        _tile_zero(0); _tile_zero(1);
        if (tt + 1 < ntt) {
            _tile_zero(2); _tile_zero(3);
            for (int64_t ks = 0; ks < KS; ks++) {
                STEP_PREFETCH(ks);
                _tile_loadd(4, A + ks * a_ks, a_stride);
                _tile_loadd(5, A + ks * a_ks + a_rt, a_stride);
                _tile_loadd(6, b0 + ks * 512, 64);
                _tile_loadd(7, b1 + ks * 512, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 5, 6);
                _tile_dpbf16ps(2, 4, 7);
                _tile_dpbf16ps(3, 5, 7);
            }
            _tile_stored(2, c0 + 16, ldc * 4);
            _tile_stored(3, c1 + 16, ldc * 4);
        } else {
            for (int64_t ks = 0; ks < KS; ks++) {
                STEP_PREFETCH(ks);
                _tile_loadd(4, A + ks * a_ks, a_stride);
                _tile_loadd(5, A + ks * a_ks + a_rt, a_stride);
                _tile_loadd(6, b0 + ks * 512, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 5, 6);
            }
        }
        _tile_stored(0, c0, ldc * 4);
        _tile_stored(1, c1, ldc * 4);
    }
    AMX_MEMORY_BARRIER();
#undef STEP_PREFETCH
}

KTK_AMX_TARGET
void ktk_amx_gemm(const uint16_t *Wt, int64_t K, const uint16_t *pk, int64_t nt, float *C, int64_t ldc) {
    amx_gemm(Wt, 1024, 512, 64, K, 0, pk, nt, C, ldc, NULL, 0);
}

KTK_AMX_TARGET
void ktk_amx_gemm_next(const uint16_t *Wt, int64_t K, const uint16_t *pk, int64_t nt, float *C, int64_t ldc,
                       const uint8_t *next, int64_t next_bytes) {
    amx_gemm(Wt, 1024, 512, 64, K, 0, pk, nt, C, ldc, next, next_bytes);
}

KTK_AMX_TARGET
void ktk_amx_gemm_rows(const uint8_t *rows, int64_t rb, int64_t K, const uint16_t *pk, int64_t nt, float *C, int64_t ldc) {
    amx_gemm((const uint16_t *)rows, 32, 8 * rb, rb, K, rows_pf(), pk, nt, C, ldc, NULL, 0);
}

/* ---- The 8-bit tile GEMM (AMX-INT8) on a block of 32 rows of an I8 copy (i8.c) ----
 * A: the block's int8 rows, tile-major ([K / 64][32 rows][64 values]: each 16-row A tile of a
 * 64-value k-step is 1 KiB); ws: their scales, row r's group g at ws[r * NG + g]; pk, ts: the tokens
 * by ktk_amx_pack_x_i8. Blocking as in amx_gemm (2 row tiles x 2 token tiles), but the int32 sums
 * of one group of G values (G / 64 k-steps) are stored to ci (4 KiB; 6 with three token tiles) and scaled
 * into C per group: C[r][t] (+)= sum * ws[r][g] * ts[t][g], that scaling issued after the next group's first tile
 * products, so that it runs while they do. */
#if defined(KTK_AMX_EMULATE)
static inline void i8_scale(const int32_t *ci, const float *ws, int64_t NG, int64_t g, const float *t0, const float *t1,
                            float *C, int64_t ldc, int first) {
    for (int j = 0; j < (t1 ? 2 : 1); j++) {
        const float *ts = j ? t1 : t0;
        for (int row = 0; row < 32; row++) {
            const float s = ws[row * NG + g];
            const int32_t *c = ci + (2 * j + row / 16) * 256 + (row % 16) * 16;
            float *o = C + row * ldc + j * 16;
            for (int t = 0; t < 16; t++) o[t] = (first ? 0.f : o[t]) + (float)c[t] * (s * ts[t]);
        }
    }
}
#else
KTK_AMX_TARGET static inline void i8_scale(const int32_t *ci, const float *ws, int64_t NG, int64_t g, const float *t0,
                                           const float *t1, float *C, int64_t ldc, int first) {
    for (int j = 0; j < (t1 ? 2 : 1); j++) {
        const __m512 ts = _mm512_loadu_ps(j ? t1 : t0);
        for (int row = 0; row < 32; row++) {
            const __m512 sc = _mm512_mul_ps(_mm512_set1_ps(ws[row * NG + g]), ts);
            const __m512 v = _mm512_cvtepi32_ps(_mm512_loadu_si512((const void *)(ci + (2 * j + row / 16) * 256 + (row % 16) * 16)));
            float *o = C + row * ldc + j * 16;
            _mm512_storeu_ps(o, first ? _mm512_mul_ps(v, sc) : _mm512_fmadd_ps(v, sc, _mm512_loadu_ps(o)));
        }
    }
}
#endif

/* I4 copies' values (i8.c): a nibble u of a sub-group whose stored sub-scale is c stands for (c + 1) * (u - 8), an
 * int8 in [-128, 112]; i4_lut[c] holds the 16 of them, so that one byte shuffle widens 64 nibbles of a row. */
#define I4_LUT_ROW(c) {(int8_t)(-8 * (c + 1)), (int8_t)(-7 * (c + 1)), (int8_t)(-6 * (c + 1)), (int8_t)(-5 * (c + 1)), \
                       (int8_t)(-4 * (c + 1)), (int8_t)(-3 * (c + 1)), (int8_t)(-2 * (c + 1)), (int8_t)(-(c + 1)), 0,    \
                       (int8_t)(c + 1), (int8_t)(2 * (c + 1)), (int8_t)(3 * (c + 1)), (int8_t)(4 * (c + 1)),              \
                       (int8_t)(5 * (c + 1)), (int8_t)(6 * (c + 1)), (int8_t)(7 * (c + 1))}
static const int8_t i4_lut[16][16] __attribute__((aligned(64))) = {
    I4_LUT_ROW(0), I4_LUT_ROW(1), I4_LUT_ROW(2), I4_LUT_ROW(3), I4_LUT_ROW(4), I4_LUT_ROW(5), I4_LUT_ROW(6),
    I4_LUT_ROW(7), I4_LUT_ROW(8), I4_LUT_ROW(9), I4_LUT_ROW(10), I4_LUT_ROW(11), I4_LUT_ROW(12), I4_LUT_ROW(13),
    I4_LUT_ROW(14), I4_LUT_ROW(15)};
#undef I4_LUT_ROW

/* one k-step (1 KiB) of an I4 block's nibbles widened to its two 16-row A tiles (2 KiB at dst) of signed bytes:
 * byte i*64 + j's low nibble to row i's byte j, its high nibble to row 16 + i's (the 32-bit shift brings the next
 * byte's low nibble into the high half, which the mask drops), each through its row's table for this k-step
 * (sub-scales kc[0 .. 32), one a row; only their low 4 bits are read, so no byte can index past the tables) */
#if defined(KTK_AMX_EMULATE)
static inline void i4_widen(const uint8_t *src, const uint8_t *kc, uint8_t *dst) {
    for (int i = 0; i < 1024; i++) {
        dst[i] = (uint8_t)i4_lut[kc[i / 64] & 15][src[i] & 15];
        dst[1024 + i] = (uint8_t)i4_lut[kc[16 + i / 64] & 15][src[i] >> 4];
    }
}
#else
KTK_AMX_TARGET static inline void i4_widen(const uint8_t *src, const uint8_t *kc, uint8_t *dst) {
    const __m512i m = _mm512_set1_epi8(15);
    for (int i = 0; i < 16; i++) {
        const __m512i v = _mm512_loadu_si512((const void *)(src + 64 * i));
        const __m512i ta = _mm512_broadcast_i32x4(_mm_load_si128((const __m128i *)i4_lut[kc[i] & 15]));
        const __m512i tb = _mm512_broadcast_i32x4(_mm_load_si128((const __m128i *)i4_lut[kc[16 + i] & 15]));
        _mm512_storeu_si512((void *)(dst + 64 * i), _mm512_shuffle_epi8(ta, _mm512_and_si512(v, m)));
        _mm512_storeu_si512((void *)(dst + 1024 + 64 * i),
                            _mm512_shuffle_epi8(tb, _mm512_and_si512(_mm512_srli_epi32(v, 4), m)));
    }
}
#endif

/* The first pass's work at k-step ks, before its tile loads: I4 nibbles widened `ahead` k-steps before they are
 * loaded (and, at the start, the ones before that), the copy's rows prefetched pf k-steps further on */
KTK_AMX_TARGET
static inline void first_pass_step(const int four, const uint8_t *A, const uint8_t *wk, uint8_t *a8, int64_t ks,
                                   int64_t KS, int64_t ahead, int pf, int l2) {
    if (four) {
        const int64_t kw = ks + ahead;
        if (ks == 0)
            for (int64_t j = 0; j < ahead && j < KS; j++) i4_widen(A + j * 1024, wk + j * 32, a8 + j * 2048);
        if (pf && kw + pf < KS)
            for (int i = 0; i < 16; i++) prefetch_line(A + (kw + pf) * 1024 + 64 * i, l2);
        if (kw < KS) i4_widen(A + kw * 1024, wk + kw * 32, a8 + kw * 2048);
        AMX_MEMORY_BARRIER();
    } else if (pf && ks + pf < KS) {
        prefetch_a((const uint16_t *)(A + (ks + pf) * 2048), 512, 64, l2);
    }
}

/* $KTINJECT_AMX_GROUP_MAJOR=1: the I8 / I4 tile GEMM takes each group's k-steps for every pass over the token tiles
 * before the next group's (A/B; see gemm_ix) */
static int group_major_flag = -1;
static inline int group_major_on(void) { return env_flag(&group_major_flag, "KTINJECT_AMX_GROUP_MAJOR", 0); }

/* What gemm_ix's passes share: the block, its tokens, C, and a pass's sums waiting in ci to be scaled into C */
typedef struct {
    const uint8_t *A, *At, *wk;
    uint8_t *a8;
    const float *ws, *ts;
    const int8_t *pk;
    float *C;
    int32_t *ci;
    int64_t KS, NG, SG, ldc, ahead;
    int four, pf, l2, overlap;
    int64_t p_tt, p_w, p_g;   /* the pass and group whose sums ci holds, unscaled (p_w 0: none) */
} ix_job;

/* the sums in ci of token tiles [tt, tt + w) over group g into C: C[r][t] (+)= sum * ws[r][g] * ts[t][g]; ci as the
 * passes store it: [token tile j][row tile][16 x 16] */
KTK_AMX_TARGET static inline void ix_scale(const ix_job *j, int64_t tt, int64_t w, int64_t g) {
    const int64_t NG = j->NG;
    const float *t0 = j->ts + tt * NG * 16 + g * 16;
    i8_scale(j->ci, j->ws, NG, g, t0, w > 1 ? t0 + NG * 16 : NULL, j->C + tt * 16, j->ldc, g == 0);
    if (w == 3) i8_scale(j->ci + 1024, j->ws, NG, g, t0 + 2 * NG * 16, NULL, j->C + (tt + 2) * 16, j->ldc, g == 0);
}

/* One pass over token tiles [tt, tt + w) (w 2: 2 row tiles x 2 token tiles, four C tiles, two A and two B; w 1: the
 * last odd tile alone; w 3: six C tiles, one A and one B tile reloaded, A0 against B0, B1, B2, then A1 against B2,
 * B1, B0: seven tile loads for six products, as the pair and the lone tile take, but every A tile used in the k-step
 * it is widened or fetched) for the k-steps of group g, its sums stored to ci. The pass with tt 0 widens the I4
 * nibbles and prefetches the rows. The sums waiting in ci from the pass before are scaled into C after this pass's
 * first products, while they run (overlap), else this pass's right after it. */
KTK_AMX_TARGET static inline void ix_pass(ix_job *j, int64_t tt, int64_t w, int64_t g) {
    const int four = j->four;
    const int64_t KS = j->KS;
    const uint8_t *At = j->At;
    const int8_t *b0 = j->pk + tt * KS * 1024, *b1 = b0 + KS * 1024, *b2 = b1 + KS * 1024;
    int32_t *ci = j->ci;
    AMX_MEMORY_BARRIER();
    _tile_zero(0); _tile_zero(1);
    if (w > 1) { _tile_zero(2); _tile_zero(3); }
    if (w > 2) { _tile_zero(4); _tile_zero(5); }
    for (int64_t ks = g * j->SG; ks < (g + 1) * j->SG; ks++) {
        if (tt == 0) first_pass_step(four, j->A, j->wk, j->a8, ks, KS, j->ahead, j->pf, j->l2);
        if (w == 3) {
            _tile_loadd(6, At + ks * 2048, 64);
            _tile_loadd(7, b0 + ks * 1024, 64); _tile_dpbssd(0, 6, 7);
            _tile_loadd(7, b1 + ks * 1024, 64); _tile_dpbssd(1, 6, 7);
            _tile_loadd(7, b2 + ks * 1024, 64); _tile_dpbssd(2, 6, 7);
            _tile_loadd(6, At + ks * 2048 + 1024, 64); _tile_dpbssd(5, 6, 7);
            _tile_loadd(7, b1 + ks * 1024, 64); _tile_dpbssd(4, 6, 7);
            _tile_loadd(7, b0 + ks * 1024, 64); _tile_dpbssd(3, 6, 7);
        } else {
            _tile_loadd(4, At + ks * 2048, 64);
            _tile_loadd(5, At + ks * 2048 + 1024, 64);
            _tile_loadd(6, b0 + ks * 1024, 64);
            _tile_dpbssd(0, 4, 6); _tile_dpbssd(1, 5, 6);
            if (w == 2) {
                _tile_loadd(7, b1 + ks * 1024, 64);
                _tile_dpbssd(2, 4, 7); _tile_dpbssd(3, 5, 7);
            }
        }
        if (j->overlap && ks == g * j->SG && j->p_w) {   /* the sums waiting in ci into C while these products run */
            AMX_MEMORY_BARRIER();
            ix_scale(j, j->p_tt, j->p_w, j->p_g);
            j->p_w = 0;
            AMX_MEMORY_BARRIER();
        }
    }
    AMX_MEMORY_BARRIER();
    if (w == 3) {   /* tiles 0-2: row tile 0 of token tiles 0-2; 3-5: row tile 1 */
        _tile_stored(0, ci, 64);        _tile_stored(3, ci + 256, 64);
        _tile_stored(1, ci + 512, 64);  _tile_stored(4, ci + 768, 64);
        _tile_stored(2, ci + 1024, 64); _tile_stored(5, ci + 1280, 64);
    } else {        /* tiles 0, 1: token tile 0's row tiles; 2, 3: token tile 1's */
        if (w == 2) { _tile_stored(2, ci + 512, 64); _tile_stored(3, ci + 768, 64); }
        _tile_stored(0, ci, 64);
        _tile_stored(1, ci + 256, 64);
    }
    AMX_MEMORY_BARRIER();
    if (j->overlap) { j->p_tt = tt; j->p_w = w; j->p_g = g; }
    else ix_scale(j, tt, w, g);
}

/* The I8 and I4 tile GEMMs (four: I4, its nibbles at A widened into a8 in the first pass through their sub-scales
 * wk to the signed bytes (c + 1) * (u - 8); from there on the same signed products and group scaling as I8's).
 * Token tiles go in pairs, a last odd one alone (ix_pass); but (unless KTINJECT_AMX_TRIPLE=0) an odd count of 3 or more
 * starts with three token tiles in one pass instead (a V2-Lite expert's 48 tokens at batch 512), with no second
 * pass reading the block's rows again. Passes over all of K one after the other, each group's sums scaled into C
 * as the next group's products run; with KTINJECT_AMX_GROUP_MAJOR=1 every pass's k-steps of one group before the
 * next group's, so that the group's widened rows (and the tokens' bytes) are still in L1 for the later passes
 * rather than read again from L2. The same sums in the same order either way: C alike bit for bit. */
KTK_AMX_TARGET
static inline void gemm_ix(const int four, const uint8_t *A, const float *ws, const uint8_t *wk, int64_t K, int64_t G,
                           const int8_t *pk, const float *ts, int64_t nt, float *C, int64_t ldc, int32_t *ci,
                           uint8_t *a8, int pf, int overlap, int64_t ahead) {
    if (!t_configured) amx_config();
    const int64_t ntt = (nt + 15) / 16;
    ix_job j = {A, four ? a8 : A, wk, a8, ws, ts, pk, C, ci, K / 64, K / G, G / 64, ldc, ahead,
                four, pf, pf_l2(), overlap, 0, 0, 0};
    const int tri = ntt >= 3 && ntt % 2 && triple_on();
#define PASS_W(tt) (tri && (tt) == 0 ? 3 : (tt) + 1 < ntt ? 2 : 1)
    if (group_major_on()) {
        for (int64_t g = 0; g < j.NG; g++)
            for (int64_t tt = 0; tt < ntt; tt += PASS_W(tt)) ix_pass(&j, tt, PASS_W(tt), g);
    } else {
        for (int64_t tt = 0; tt < ntt; tt += PASS_W(tt))
            for (int64_t g = 0; g < j.NG; g++) ix_pass(&j, tt, PASS_W(tt), g);
    }
#undef PASS_W
    if (j.p_w) ix_scale(&j, j.p_tt, j.p_w, j.p_g);
}

KTK_AMX_TARGET
void ktk_amx_gemm_i8(const int8_t *A, const float *ws, int64_t K, int64_t G, const int8_t *pk, const float *ts,
                     int64_t nt, float *C, int64_t ldc, int32_t *ci, int pf, int overlap) {
    gemm_ix(0, (const uint8_t *)A, ws, NULL, K, G, pk, ts, nt, C, ldc, ci, NULL, pf, overlap, 0);
}

KTK_AMX_TARGET
void ktk_amx_gemm_i4(const uint8_t *A, const float *ws, const uint8_t *wk, int64_t K, int64_t G, const int8_t *pk,
                     const float *ts, int64_t nt, float *C, int64_t ldc, int32_t *ci, uint8_t *a8, int pf, int overlap,
                     int ahead) {
    gemm_ix(1, A, ws, wk, K, G, pk, ts, nt, C, ldc, ci, a8, pf, overlap, ahead < 0 ? 0 : ahead);
}

#undef AMX_MEMORY_BARRIER

/* ---- GGML rows to tile-major bf16 (AVX-512 + AVX512-BF16) ----
 * Each writer emits one row's 32-value k-steps, chunk ks at dst + ks * cs (cs: elements). The
 * values are those of the f32 dequantization (same fused multiply-adds) rounded to nearest even
 * (subnormals flush to zero in the AVX512-BF16 conversions). 4- and 5-bit types go through a
 * table: the 16 (or 32) values a block or sub-block can take are computed and converted once,
 * and one word permutation per 32 values looks them up. */
#if defined(KTK_AMX_EMULATE_WRITERS)
/* The check driver's second build (tests/test_amx_emulated.py, on CPUs with AVX-512 F/BW/VL/DQ but
 * maybe not AVX512-BF16): the real writers and SiLU, with the two BF16 conversions done in AVX-512F
 * as the ISA defines them (round to nearest even, subnormal inputs as zero, NaN kept quiet). */
#define KTK_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
KTK_BF16_TARGET static inline __m256i emu_cvtneps(__m512 a) {
    __m512i u = _mm512_castps_si512(a);
    const __mmask16 sub = _mm512_testn_epi32_mask(u, _mm512_set1_epi32(0x7f800000));
    u = _mm512_mask_and_epi32(u, sub, u, _mm512_set1_epi32((int)0x80000000));   /* subnormal: signed zero */
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x00400000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}
KTK_BF16_TARGET static inline __m512i emu_cvtne2ps(__m512 hi, __m512 lo) {   /* words 0-15 from lo */
    return _mm512_inserti64x4(_mm512_castsi256_si512(emu_cvtneps(lo)), emu_cvtneps(hi), 1);
}
#undef _mm512_cvtneps_pbh
#undef _mm512_cvtne2ps_pbh
#define _mm512_cvtneps_pbh(a) ((__m256bh)emu_cvtneps(a))
#define _mm512_cvtne2ps_pbh(a, b) ((__m512bh)emu_cvtne2ps(a, b))
#else
#define KTK_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")))
#endif

KTK_BF16_TARGET static inline __m512i bf16_pair(__m512 lo, __m512 hi) {   /* 16 + 16 floats -> 32 bf16 */
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

KTK_BF16_TARGET static inline __m512i bf16_table16(float scale, float offset) {   /* words 0-15: q*scale + offset */
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 v = _mm512_fmadd_ps(iota, _mm512_set1_ps(scale), _mm512_set1_ps(offset));
    return _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(v));
}

KTK_BF16_TARGET static inline void put32(uint16_t *dst, __m256i q, __m512i table) {   /* 32 u8 indices */
    _mm512_storeu_si512((void *)dst, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(q), table));
}

/* Q4_K: the 8 sub-block scales and mins of a block unpacked at once (the 6-bit fields as four
 * 32-bit words), converted and multiplied in one vector: sv = [d*sc0 .. d*sc7, -dmin*m0 .. -dmin*m7],
 * the same products as the f32 dequantization's. Sub-blocks 2j and 2j+1 (the low and high nibbles
 * of 32 bytes) share one 32-entry table: low nibbles index words 0-15, high nibbles + 16 words 16-31. */
KTK_BF16_TARGET static void row_q4_k(const uint8_t *src, int64_t n, uint16_t *dst, int64_t cs) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), sixteen = _mm256_set1_epi8(0x10);
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t i = 0; i < n / 256; i++, src += sizeof(blk_q4_k)) {
        const blk_q4_k *b = (const blk_q4_k *)src;
        uint32_t w[4];
        ktk_scale_min_k4_all(b->scales, w);
        const float d = _cvtsh_ss(b->d), dmin = _cvtsh_ss(b->dmin);
        const __m512 dd = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(d), _mm512_set1_ps(-dmin));
        const __m512 sv = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                            _mm_setr_epi32((int)w[0], (int)w[1], (int)w[2], (int)w[3]))), dd);
        for (int j = 0; j < 4; j++) {
            __m512 lo = _mm512_fmadd_ps(iota, _mm512_permutexvar_ps(_mm512_set1_epi32(2 * j), sv),
                                        _mm512_permutexvar_ps(_mm512_set1_epi32(8 + 2 * j), sv));
            __m512 hi = _mm512_fmadd_ps(iota, _mm512_permutexvar_ps(_mm512_set1_epi32(2 * j + 1), sv),
                                        _mm512_permutexvar_ps(_mm512_set1_epi32(9 + 2 * j), sv));
            __m512i table = bf16_pair(lo, hi);
            __m256i v = _mm256_loadu_si256((const __m256i *)(b->qs + 32 * j));
            uint16_t *o = dst + (i * 8 + 2 * j) * cs;
            put32(o, _mm256_and_si256(v, m4), table);
            put32(o + cs, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), sixteen), table);
        }
    }
}

/* Q4_0 / Q5_0: the block's 32 nibbles as bytes 0-15 (low) | 16-31 (high), plus Q5_0's fifth bit */
KTK_BF16_TARGET static inline __m256i q45_0_bytes(const uint8_t *qs, const uint8_t *qh) {
    __m256i v = _mm256_and_si256(_mm256_srlv_epi64(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs)),
                                                   _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0F));
    if (!qh) return v;
    uint32_t m;
    memcpy(&m, qh, 4);
    return _mm256_mask_add_epi8(v, (__mmask32)m, v, _mm256_set1_epi8(0x10));
}

KTK_BF16_TARGET static void row_q4_0(const uint8_t *src, int64_t n, uint16_t *dst, int64_t cs) {
    for (int64_t i = 0; i < n / 32; i++, src += sizeof(blk_q4_0)) {
        const blk_q4_0 *b = (const blk_q4_0 *)src;
        float d = _cvtsh_ss(b->d);
        put32(dst + i * cs, q45_0_bytes(b->qs, NULL), bf16_table16(d, -8.f * d));
    }
}

KTK_BF16_TARGET static void row_q5_0(const uint8_t *src, int64_t n, uint16_t *dst, int64_t cs) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), sixteen = _mm512_set1_ps(16.f);
    for (int64_t i = 0; i < n / 32; i++, src += sizeof(blk_q5_0)) {
        const blk_q5_0 *b = (const blk_q5_0 *)src;
        float d = _cvtsh_ss(b->d);
        __m512 vd = _mm512_set1_ps(d), off = _mm512_set1_ps(-16.f * d);
        __m512i table = bf16_pair(_mm512_fmadd_ps(iota, vd, off), _mm512_fmadd_ps(_mm512_add_ps(iota, sixteen), vd, off));
        put32(dst + i * cs, q45_0_bytes(b->qs, b->qh), table);
    }
}

KTK_BF16_TARGET static void row_q8_0(const uint8_t *src, int64_t n, uint16_t *dst, int64_t cs) {
    for (int64_t i = 0; i < n / 32; i++, src += sizeof(blk_q8_0)) {
        const blk_q8_0 *b = (const blk_q8_0 *)src;
        __m512 d = _mm512_set1_ps(_cvtsh_ss(b->d)), z = _mm512_setzero_ps();
        __m128i q0 = _mm_loadu_si128((const __m128i *)b->qs), q1 = _mm_loadu_si128((const __m128i *)(b->qs + 16));
        __m512 f0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), d, z);
        __m512 f1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), d, z);
        _mm512_storeu_si512((void *)(dst + i * cs), bf16_pair(f0, f1));
    }
}

KTK_BF16_TARGET static void row_bf16(const uint8_t *src, int64_t n, uint16_t *dst, int64_t cs) {
    for (int64_t i = 0; i < n / 32; i++)
        _mm512_storeu_si512((void *)(dst + i * cs), _mm512_loadu_si512((const void *)(src + 64 * i)));
}

KTK_BF16_TARGET static void row_f32(const float *src, int64_t n, uint16_t *dst, int64_t cs) {
    for (int64_t i = 0; i < n / 32; i++)
        _mm512_storeu_si512((void *)(dst + i * cs), bf16_pair(_mm512_loadu_ps(src + 32 * i), _mm512_loadu_ps(src + 32 * i + 16)));
}

#if defined(KTK_AMX_EMULATE) && !defined(KTK_AMX_EMULATE_WRITERS)
#define KTK_ROWS_TARGET   /* the check driver's first build: the CPU may lack AVX-512 */
#else
#define KTK_ROWS_TARGET KTK_BF16_TARGET
#endif

KTK_ROWS_TARGET
void ktk_amx_rows_bf16(const ktk_kernels *K, int type, const uint8_t *rows, int64_t rb, int nrows, int64_t n,
                       uint16_t *dst, float *tmp) {
    const int64_t cs = (int64_t)nrows * 32;
    for (int r = 0; r < nrows; r++, rows += rb, dst += 32) {
#if defined(KTK_AMX_EMULATE) && !defined(KTK_AMX_EMULATE_WRITERS)   /* K's dequantization, rounded */
        K->dequant(type, rows, tmp, n);
        for (int64_t i = 0; i < n; i++) dst[i / 32 * cs + i % 32] = ktk_f32_to_bf16(tmp[i]);
        continue;
#endif
        switch (type) {
        case KTK_Q4_K: row_q4_k(rows, n, dst, cs); break;
        case KTK_Q4_0: row_q4_0(rows, n, dst, cs); break;
        case KTK_Q5_0: row_q5_0(rows, n, dst, cs); break;
        case KTK_Q8_0: row_q8_0(rows, n, dst, cs); break;
        case KTK_BF16: row_bf16(rows, n, dst, cs); break;
        case KTK_F32: row_f32((const float *)rows, n, dst, cs); break;
        default:   /* the other types: the table's f32 dequantization, then converted */
            K->dequant(type, rows, tmp, n);
            row_f32(tmp, n, dst, cs);
        }
    }
}

/* exp(x) for the SiLU epilogue: x = n ln2 + r (|r| <= ln2 / 2, ln2 in two parts), e^r by its Taylor
 * polynomial to r^6 (within 2 ulp on [-87, 88]), times 2^n by vscalefps (inf past the float range).
 * x is first raised to -87, where the result, 1.4 * 2^-126, is still a normal float: below that
 * exp gave subnormals, and every vector op that met one took a microcode assist (SiLU of gates
 * past +87, common in the benchmark's random layers, ran 16x slower: 8.7 against 0.55 us per 32 x 48
 * block; SiLU adds the result to 1, so the clamp changes no output); NaN stays NaN (max returns
 * its second operand). */
KTK_BF16_TARGET static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-87.f), x);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

#if defined(KTK_AMX_EMULATE) && !defined(KTK_AMX_EMULATE_WRITERS)
void ktk_amx_silu_mul(float *g, const float *u, int64_t ldc, int rows) {
    for (int64_t i = 0; i < rows * ldc; i++) g[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}
#else
KTK_BF16_TARGET
void ktk_amx_silu_mul(float *g, const float *u, int64_t ldc, int rows) {
    for (int r = 0; r < rows; r++)
        for (int64_t j = 0; j < ldc; j += 16) {
            __m512 x = _mm512_loadu_ps(g + r * ldc + j), y = _mm512_loadu_ps(u + r * ldc + j);
            __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), x));
            _mm512_storeu_ps(g + r * ldc + j, _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e)), y));
        }
}
#endif

/* ---- The tile GEMM's work without tiles: AVX512-BF16 dot products (vdpbf16ps) on the same packed tokens, for the
 * AVX-512 path's BF16 experts (moe.c, m->dp). Row r's k-step ks at A + ks * a_ks + r * a_r values: BF16 rows in
 * place (32, rb / 2) or tile-major (1024, 32). A pair of a row's values, broadcast (32 bits), against a packed
 * block's pair row (the same pair of 16 tokens, 64 bytes) gives 16 tokens' partial dots in one instruction: 8 rows
 * x up to 3 token tiles of accumulators (24 of the 32 registers), C row-major as amx_gemm writes it. */
#define KTK_DP_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
KTK_DP_TARGET static inline __attribute__((always_inline))
void dp_block(const uint16_t *A, int64_t a_ks, int64_t a_r, int64_t KS, const uint16_t *b, const int TT, float *C,
              int64_t ldc) {
    __m512 acc[8][3];
    for (int r = 0; r < 8; r++)
        for (int j = 0; j < TT; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t ks = 0; ks < KS; ks++) {
        const uint16_t *a = A + ks * a_ks, *bk = b + ks * 512;
        for (int p = 0; p < 16; p++) {
            __m512bh bv[3];
            for (int j = 0; j < TT; j++) bv[j] = (__m512bh)_mm512_loadu_si512((const void *)(bk + j * KS * 512 + p * 32));
            for (int r = 0; r < 8; r++) {
                int32_t pair;
                memcpy(&pair, a + r * a_r + 2 * p, 4);
                const __m512bh wv = (__m512bh)_mm512_set1_epi32(pair);
                for (int j = 0; j < TT; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv, bv[j]);
            }
        }
    }
    for (int r = 0; r < 8; r++)
        for (int j = 0; j < TT; j++) _mm512_storeu_ps(C + r * ldc + j * 16, acc[r][j]);
}

KTK_DP_TARGET
void ktk_dp_gemm(const uint16_t *A, int64_t a_ks, int64_t a_r, int64_t K, const uint16_t *pk, int64_t nt, float *C,
                 int64_t ldc) {
    const int64_t KS = K / 32, ntt = (nt + 15) / 16;
    for (int64_t tt = 0; tt < ntt;) {   /* token tiles three at a time (four as two pairs), then the rest */
        const int64_t left = ntt - tt, TT = left == 4 ? 2 : left >= 3 ? 3 : left;
        const uint16_t *b = pk + tt * KS * 512;
        for (int g = 0; g < 4; g++) {
            float *c = C + g * 8 * ldc + tt * 16;
            if (TT == 3) dp_block(A + g * 8 * a_r, a_ks, a_r, KS, b, 3, c, ldc);
            else if (TT == 2) dp_block(A + g * 8 * a_r, a_ks, a_r, KS, b, 2, c, ldc);
            else dp_block(A + g * 8 * a_r, a_ks, a_r, KS, b, 1, c, ldc);
        }
        tt += TT;
    }
}
#else
void ktk_amx_gemm(const uint16_t *Wt, int64_t K, const uint16_t *pk, int64_t nt, float *C, int64_t ldc) {
    (void)Wt; (void)K; (void)pk; (void)nt; (void)C; (void)ldc;
}
void ktk_amx_gemm_i8(const int8_t *A, const float *ws, int64_t K, int64_t G, const int8_t *pk, const float *ts,
                     int64_t nt, float *C, int64_t ldc, int32_t *ci, int pf, int overlap) {
    (void)overlap; (void)A; (void)ws; (void)K; (void)G; (void)pk; (void)ts; (void)nt; (void)C; (void)ldc; (void)ci; (void)pf;
}
void ktk_amx_gemm_rows(const uint8_t *rows, int64_t rb, int64_t K, const uint16_t *pk, int64_t nt, float *C, int64_t ldc) {
    (void)rows; (void)rb; (void)K; (void)pk; (void)nt; (void)C; (void)ldc;
}
void ktk_amx_gemm_i4(const uint8_t *A, const float *ws, const uint8_t *wk, int64_t K, int64_t G, const int8_t *pk,
                     const float *ts, int64_t nt, float *C, int64_t ldc, int32_t *ci, uint8_t *a8, int pf, int overlap,
                     int ahead) {
    (void)A; (void)ws; (void)wk; (void)K; (void)G; (void)pk; (void)ts; (void)nt; (void)C; (void)ldc; (void)ci;
    (void)a8; (void)pf; (void)overlap; (void)ahead;
}
void ktk_amx_gemm_next(const uint16_t *Wt, int64_t K, const uint16_t *pk, int64_t nt, float *C, int64_t ldc,
                       const uint8_t *next, int64_t next_bytes) {
    (void)Wt; (void)K; (void)pk; (void)nt; (void)C; (void)ldc; (void)next; (void)next_bytes;
}
void ktk_amx_rows_bf16(const ktk_kernels *K, int type, const uint8_t *rows, int64_t rb, int nrows, int64_t n,
                       uint16_t *dst, float *tmp) {
    (void)K; (void)type; (void)rows; (void)rb; (void)nrows; (void)n; (void)dst; (void)tmp;
}
void ktk_amx_silu_mul(float *g, const float *u, int64_t ldc, int rows) { (void)g; (void)u; (void)ldc; (void)rows; }
void ktk_dp_gemm(const uint16_t *A, int64_t a_ks, int64_t a_r, int64_t K, const uint16_t *pk, int64_t nt, float *C,
                 int64_t ldc) {
    (void)A; (void)a_ks; (void)a_r; (void)K; (void)pk; (void)nt; (void)C; (void)ldc;
}
#endif
