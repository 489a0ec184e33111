/* 8 x 8 transpose of 32-bit lanes in AVX2 registers, shared by the AMX token packing (amx.c, i8.c) and the
 * AVX2 packed f32 path (quant_avx2.c); the 16 x 16 ones that build a token tile's 1 KiB B block (AVX2, AVX-512);
 * and eight floats to bf16, as ktk_f32_to_bf16 rounds them (quant_avx2.c's to_bf16, amx.c's h packing). */
#ifndef KTK_TRANSPOSE_H
#define KTK_TRANSPOSE_H
#include <immintrin.h>
#include <stdint.h>

/* r[i][j] -> r[j][i] */
__attribute__((target("avx2")))
static inline void ktk_transpose8x8(__m256i *r) {
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

/* Eight floats to bf16 bits, each in the low half of its 32-bit lane: round to nearest even, NaN kept a quiet NaN
 * (rounding would carry it into Inf or zero), as ktk_f32_to_bf16 */
__attribute__((target("avx2")))
static inline __m256i ktk_bf16_lanes(__m256 x) {
    const __m256i r = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1), inf = _mm256_set1_epi32(0x7f800000);
    __m256i u = _mm256_castps_si256(x);
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), inf);
    __m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    u = _mm256_add_epi32(u, _mm256_add_epi32(r, _mm256_and_si256(_mm256_srli_epi32(u, 16), one)));
    return _mm256_blendv_epi8(_mm256_srli_epi32(u, 16), q, nan);
}

/* A B tile block from 16 tokens' 64 bytes of one k-step: blk[p * 16 + t] = row[t][p] (p < 16: a bf16 pair or an
 * int8 quad), as four 8 x 8 transposes, each block row written whole */
__attribute__((target("avx2")))
static inline void ktk_tile_from_rows(const uint32_t *const row[16], uint32_t *blk) {
    for (int pb = 0; pb < 16; pb += 8)
        for (int tb = 0; tb < 16; tb += 8) {
            __m256i r[8];
            for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_si256((const __m256i *)(row[tb + i] + pb));
            ktk_transpose8x8(r);   /* r[j]: element pb + j of tokens tb .. tb + 7 */
            for (int j = 0; j < 8; j++) _mm256_storeu_si256((__m256i *)(blk + (pb + j) * 16 + tb), r[j]);
        }
}
/* ktk_tile_from_rows on AVX-512: row t's 64 bytes at base[t] + off (a row of zeros where base[t] is NULL) in one
 * register each, one 16 x 16 transpose of 32-bit lanes, every block row a whole cache line; nt_store: written with
 * non-temporal stores past the caches (blk 64-byte aligned; the caller fences before the blocks are read) */
__attribute__((target("avx512f")))
static inline void ktk_tile_from_rows_512(const uint32_t *const base[16], int64_t off, uint32_t *blk, int nt_store) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = base[i] ? _mm512_loadu_si512(base[i] + off) : _mm512_setzero_si512();
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    /* r[4i + j], 128-bit lane l: element 4l + j of rows 4i .. 4i + 3; the lanes gathered in two steps */
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) {
            t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
            t[8 * i + 4 + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
        r[j + 8] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
    }
    if (nt_store)
        for (int p = 0; p < 16; p++) _mm512_stream_si512((__m512i *)(blk + p * 16), r[p]);
    else
        for (int p = 0; p < 16; p++) _mm512_storeu_si512(blk + p * 16, r[p]);
}
#endif
