/* 8 x 8 transpose of 32-bit lanes in AVX2 registers, shared by the AMX token packing (amx.c) and the
 * AVX2 packed f32 path (quant_avx2.c). */
#ifndef KTK_TRANSPOSE_H
#define KTK_TRANSPOSE_H
#include <immintrin.h>

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
#endif
