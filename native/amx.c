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
 * V2-Lite Q4_K layer at batch 512.) */
#include "ktk_int.h"
#include <immintrin.h>

int64_t ktk_amx_pack_x_elems(int64_t nt, int64_t K) { return (nt + 15) / 16 * 16 * K; }

/* 8 x 8 u32 transpose: r[i][j] -> r[j][i] */
__attribute__((target("avx2")))
static inline void transpose8x8(__m256i *r) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int h = 0; h < 2; h++) {   /* rows 4h .. 4h+3: values [j] | [j + 4] per register */
        u[4 * h] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
        u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
        u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
        u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
    }
    for (int j = 0; j < 4; j++) {
        r[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20);
        r[j + 4] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
    }
}

/* Per token tile and chunk of up to 16 k-steps: the 16 tokens' values in bf16 (16 KiB), then
 * every 1 KiB B block built from four 8 x 8 transposes of bf16 pairs and written whole (writing
 * pair by pair touched a different cache line with every store). */
__attribute__((target("avx2")))
void ktk_amx_pack_x(const float *const *X, int64_t nt, int64_t K, uint16_t *pk) {
    int64_t KS = K / 32, ntt = (nt + 15) / 16;
    const ktk_kernels *kern = ktk_kernels_for(KTK_ISA_AVX2);
    uint32_t buf[16][256] __attribute__((aligned(32)));   /* 16 tokens x 512 bf16 */
    for (int64_t tt = 0; tt < ntt; tt++)
        for (int64_t k0 = 0; k0 < K; k0 += 512) {
            int64_t kn = K - k0 < 512 ? K - k0 : 512;
            for (int t = 0; t < 16; t++) {
                int64_t tok = tt * 16 + t;
                uint16_t *b = (uint16_t *)buf[t];
                if (tok >= nt) memset(b, 0, (size_t)kn * 2);
                else if (kern) kern->to_bf16(X[tok] + k0, b, kn);
                else for (int64_t i = 0; i < kn; i++) b[i] = ktk_f32_to_bf16(X[tok][k0 + i]);
            }
            for (int64_t ks = 0; ks < kn / 32; ks++) {
                uint32_t *blk = (uint32_t *)pk + (tt * KS + k0 / 32 + ks) * 256;   /* [pair p][token t] */
                for (int pb = 0; pb < 16; pb += 8)
                    for (int tb = 0; tb < 16; tb += 8) {
                        __m256i r[8];
                        for (int i = 0; i < 8; i++) r[i] = _mm256_load_si256((const __m256i *)(buf[tb + i] + ks * 16 + pb));
                        transpose8x8(r);
                        for (int i = 0; i < 8; i++) _mm256_storeu_si256((__m256i *)(blk + (pb + i) * 16 + tb), r[i]);
                    }
            }
        }
}

#if defined(__x86_64__)
typedef struct __attribute__((packed, aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

static __thread int t_configured;

__attribute__((target("amx-tile,amx-bf16,avx512f")))
static void amx_config(void) {
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) { cfg.colsb[i] = 64; cfg.rows[i] = 16; }
    _tile_loadconfig(&cfg);
    t_configured = 1;
}

__attribute__((target("amx-tile,amx-bf16,avx512f")))
void ktk_amx_gemm(const uint16_t *Wt, int64_t K, const uint16_t *pk, int64_t nt, float *C, int64_t ldc) {
    if (!t_configured) amx_config();
    int64_t KS = K / 32, ntt = (nt + 15) / 16;
    for (int64_t tt = 0; tt < ntt; tt += 2) {
        const uint16_t *b0 = pk + tt * KS * 512, *b1 = pk + (tt + 1) * KS * 512;
        float *c0 = C + tt * 16, *c1 = C + 16 * ldc + tt * 16;
        _tile_zero(0); _tile_zero(1);
        if (tt + 1 < ntt) {
            _tile_zero(2); _tile_zero(3);
            for (int64_t ks = 0; ks < KS; ks++) {
                _tile_loadd(4, Wt + ks * 1024, 64);
                _tile_loadd(5, Wt + ks * 1024 + 512, 64);
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
                _tile_loadd(4, Wt + ks * 1024, 64);
                _tile_loadd(5, Wt + ks * 1024 + 512, 64);
                _tile_loadd(6, b0 + ks * 512, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 5, 6);
            }
        }
        _tile_stored(0, c0, ldc * 4);
        _tile_stored(1, c1, ldc * 4);
    }
}

/* ---- GGML rows to tile-major bf16 (AVX-512 + AVX512-BF16) ----
 * Each writer emits one row's 32-value k-steps, chunk ks at dst + ks * cs (cs: elements). The
 * values are those of the f32 dequantization (same fused multiply-adds) rounded to nearest even
 * (subnormals flush to zero in the AVX512-BF16 conversions). 4- and 5-bit types go through a
 * table: the 16 (or 32) values a block or sub-block can take are computed and converted once,
 * and one word permutation per 32 values looks them up. */
#define KTK_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")))

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

KTK_BF16_TARGET static void row_q4_k(const uint8_t *src, int64_t n, uint16_t *dst, int64_t cs) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int64_t i = 0; i < n / 256; i++, src += sizeof(blk_q4_k)) {
        const blk_q4_k *b = (const blk_q4_k *)src;
        float d = _cvtsh_ss(b->d), dmin = _cvtsh_ss(b->dmin);
        for (int j = 0; j < 4; j++) {
            uint8_t sc0, m0, sc1, m1;
            ktk_scale_min_k4(2 * j, b->scales, &sc0, &m0);
            ktk_scale_min_k4(2 * j + 1, b->scales, &sc1, &m1);
            __m256i v = _mm256_loadu_si256((const __m256i *)(b->qs + 32 * j));
            uint16_t *o = dst + (i * 8 + 2 * j) * cs;
            put32(o, _mm256_and_si256(v, m4), bf16_table16(d * sc0, -dmin * m0));
            put32(o + cs, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4), bf16_table16(d * sc1, -dmin * m1));
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

KTK_BF16_TARGET
void ktk_amx_rows_bf16(const ktk_kernels *K, int type, const uint8_t *rows, int64_t rb, int nrows, int64_t n,
                       uint16_t *dst, float *tmp) {
    const int64_t cs = (int64_t)nrows * 32;
    for (int r = 0; r < nrows; r++, rows += rb, dst += 32) {
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
#else
void ktk_amx_gemm(const uint16_t *Wt, int64_t K, const uint16_t *pk, int64_t nt, float *C, int64_t ldc) {
    (void)Wt; (void)K; (void)pk; (void)nt; (void)C; (void)ldc;
}
void ktk_amx_rows_bf16(const ktk_kernels *K, int type, const uint8_t *rows, int64_t rb, int nrows, int64_t n,
                       uint16_t *dst, float *tmp) {
    (void)K; (void)type; (void)rows; (void)rb; (void)nrows; (void)n; (void)dst; (void)tmp;
}
#endif
