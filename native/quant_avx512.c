/* AVX-512 path (F/BW/VL/DQ + VNNI): integer dots with dpbusd (256-bit through VL: decode is
 * bound by memory, not by vector width), 512-bit BF16 dots, GEMM micro-kernel and stream read. */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#include <immintrin.h>
#include "ktk_int.h"
#include "transpose.h"

#define SFX(name) name##_avx512
#define DOTI(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#define DOTW(acc, a, b) _mm256_dpwssd_epi32((acc), (a), (b))   /* acc += sum of 2 adjacent i16 * i16 */
/* Q5_0 high bits through a mask register: byte i += 0x10 (= |= 0x10, bytes <= 0x0F) where bit i
 * of the 32-bit mask at p is set; replaces the shuffle/compare expansion of quant_simd.inc. */
#define KTK_HAVE_OR_X10_BITS
static inline __attribute__((always_inline)) __m256i or_x10_bits_avx512(__m256i v, const uint8_t *p) {
    uint32_t m;
    memcpy(&m, p, 4);
    return _mm256_mask_add_epi8(v, (__mmask32)m, v, _mm256_set1_epi8(0x10));
}
#include "quant_simd.inc"

static inline __m512 bf16x16_avx512(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static float dot_bf16_avx512(const uint8_t *row, const float *xf, const ktk_q8 *xq, int64_t n) {
    (void)xq;
    const uint16_t *w = (const uint16_t *)row;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        a0 = _mm512_fmadd_ps(bf16x16_avx512(w + i), _mm512_loadu_ps(xf + i), a0);
        a1 = _mm512_fmadd_ps(bf16x16_avx512(w + i + 16), _mm512_loadu_ps(xf + i + 16), a1);
        a2 = _mm512_fmadd_ps(bf16x16_avx512(w + i + 32), _mm512_loadu_ps(xf + i + 32), a2);
        a3 = _mm512_fmadd_ps(bf16x16_avx512(w + i + 48), _mm512_loadu_ps(xf + i + 48), a3);
    }
    for (; i + 16 <= n; i += 16) a0 = _mm512_fmadd_ps(bf16x16_avx512(w + i), _mm512_loadu_ps(xf + i), a0);
    float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    for (; i < n; i++) s += ktk_bf16_to_f32(w[i]) * xf[i];
    return s;
}

static float dot_f32_512(const float *w, const float *x, int64_t K) {
    __m512 a = _mm512_setzero_ps(), b = a;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        a = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(x + k), a);
        b = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 16), _mm512_loadu_ps(x + k + 16), b);
    }
    float s = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    for (; k < K; k++) s += w[k] * x[k];
    return s;
}

static void pack_f32_avx512(const float *const *X, int64_t nt, int64_t K, float *pk) {
    ktk_pack_f32_panels(X, nt, K, pk, 16);
}

/* 8 weight rows x nv panels (16 tokens each), all of K: 8 * nv accumulators (24 of the 32
 * registers), each k one broadcast weight per row and one panel load per 16 tokens. */
static inline __attribute__((always_inline)) void gemm_8xn_512(const float *W, int64_t K, const float *P, float *C,
                                                               int64_t ldc, const int nv) {
    __m512 acc[8][3];
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++)
#pragma GCC unroll 3
        for (int v = 0; v < nv; v++) acc[r][v] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m512 x[3];
#pragma GCC unroll 3
        for (int v = 0; v < nv; v++) x[v] = _mm512_loadu_ps(P + v * K * 16 + k * 16);
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++) {
            const __m512 w = _mm512_set1_ps(W[r * K + k]);
#pragma GCC unroll 3
            for (int v = 0; v < nv; v++) acc[r][v] = _mm512_fmadd_ps(w, x[v], acc[r][v]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++)
#pragma GCC unroll 3
        for (int v = 0; v < nv; v++) _mm512_storeu_ps(C + r * ldc + v * 16, acc[r][v]);
}

/* C[r*ldc + t] = W[r] . token t for r < R (R % 8 == 0), t < nt rounded up to 16 (ldc >= that) */
static void gemm_packed_avx512(const float *W, int64_t R, int64_t K, const float *pk, int64_t nt, float *C, int64_t ldc) {
    const int64_t ng = (nt + 15) / 16;
    for (int64_t g0 = 0; g0 < ng; g0 += 3)
        for (int64_t r0 = 0; r0 < R; r0 += 8) {
            const float *P = pk + g0 * K * 16, *w = W + r0 * K;
            float *c = C + r0 * ldc + g0 * 16;
            switch (ng - g0 < 3 ? (int)(ng - g0) : 3) {
            case 3: gemm_8xn_512(w, K, P, c, ldc, 3); break;
            case 2: gemm_8xn_512(w, K, P, c, ldc, 2); break;
            default: gemm_8xn_512(w, K, P, c, ldc, 1); break;
            }
        }
}

/* ---- The grouped path in 8-bit integers (ktk_kernels.pack_q8 / rows_u8 / gemm_q8) ----
 * Tokens are quantized per 32 values as for the row dots, weights become one unsigned byte each
 * (4- and 5-bit values as they are, Q8_0 offset by 128) with a scale and an offset per 32 values,
 * and 4 rows x 16-48 tokens are multiplied with vpdpbusd (64 byte products per instruction, 4x the
 * multiply-adds of an f32 FMA): per 32-block the integer sums are scaled once into f32. */
/* 4 rows x nv panels (16 tokens each) over all of K: per group of G values (32, or 16 for g16)
 * G / 4 steps of 4 bytes into 4 * nv integer accumulators, then those scaled into 4 * nv f32
 * accumulators with the group's S and Mn. */
static inline __attribute__((always_inline)) void gemm_q8_4xn(const uint8_t *U, const float *S, const float *Mn,
                                                              int64_t K, const int8_t *P, const float *PS, float *C,
                                                              int64_t ldc, const int nv, const int g16) {
    const int64_t nb = K / 32, ng = g16 ? 2 * nb : nb;
    const int steps = g16 ? 4 : 8;
    __m512 f[4][3];
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++)
#pragma GCC unroll 3
        for (int v = 0; v < nv; v++) f[r][v] = _mm512_setzero_ps();
    for (int64_t j = 0; j < ng; j++) {
        const int64_t b = g16 ? j / 2 : j, k0 = g16 ? (j % 2) * 4 : 0;
        __m512i a[4][3];
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++)
#pragma GCC unroll 3
            for (int v = 0; v < nv; v++) a[r][v] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int c = 0; c < steps; c++) {
            const int64_t kc = b * 8 + k0 + c;
            __m512i x[3];
#pragma GCC unroll 3
            for (int v = 0; v < nv; v++) x[v] = _mm512_loadu_si512((const void *)(P + v * K * 16 + kc * 64));
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) {
                int32_t w4;
                memcpy(&w4, U + r * K + kc * 4, 4);
                const __m512i w = _mm512_set1_epi32(w4);
#pragma GCC unroll 3
                for (int v = 0; v < nv; v++) a[r][v] = _mm512_dpbusd_epi32(a[r][v], w, x[v]);
            }
        }
#pragma GCC unroll 3
        for (int v = 0; v < nv; v++) {
            const float *ps = PS + (v * nb + b) * 64;
            const __m512 d = _mm512_loadu_ps(ps), ds = _mm512_loadu_ps(ps + (g16 ? 32 + 16 * (j % 2) : 16));
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) {
                const __m512 sd = _mm512_mul_ps(_mm512_set1_ps(S[r * ng + j]), d);
                f[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r][v]), sd, f[r][v]);
                f[r][v] = _mm512_fmadd_ps(_mm512_set1_ps(Mn[r * ng + j]), ds, f[r][v]);
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++)
#pragma GCC unroll 3
        for (int v = 0; v < nv; v++) _mm512_storeu_ps(C + r * ldc + v * 16, f[r][v]);
}

static void gemm_q8_avx512(const uint8_t *U, const float *S, const float *Mn, int64_t R, int64_t K, const int8_t *pk,
                           const float *ps, int64_t nt, float *C, int64_t ldc, int flags) {
    const int64_t ng = (nt + 15) / 16, nb = K / 32, ngr = flags & KTK_Q8_G16 ? K / 16 : nb;   /* vpdpbusd widens every step: U4 unused */
    for (int64_t g0 = 0; g0 < ng; g0 += 3)
        for (int64_t r0 = 0; r0 < R; r0 += 4) {
            const int8_t *P = pk + g0 * K * 16;
            const float *PS = ps + g0 * nb * 64, *s = S + r0 * ngr, *mn = Mn + r0 * ngr;
            const uint8_t *u = U + r0 * K;
            float *c = C + r0 * ldc + g0 * 16;
            const int nv = ng - g0 < 3 ? (int)(ng - g0) : 3;
            if (flags & KTK_Q8_G16) {
                if (nv == 3) gemm_q8_4xn(u, s, mn, K, P, PS, c, ldc, 3, 1);
                else if (nv == 2) gemm_q8_4xn(u, s, mn, K, P, PS, c, ldc, 2, 1);
                else gemm_q8_4xn(u, s, mn, K, P, PS, c, ldc, 1, 1);
            } else {
                if (nv == 3) gemm_q8_4xn(u, s, mn, K, P, PS, c, ldc, 3, 0);
                else if (nv == 2) gemm_q8_4xn(u, s, mn, K, P, PS, c, ldc, 2, 0);
                else gemm_q8_4xn(u, s, mn, K, P, PS, c, ldc, 1, 0);
            }
        }
}

/* C[t*ldc + r] = W[r] . X[t]; blocks of 4 tokens x 3 rows (12 accumulators); K % 16 == 0. */
static void gemm_avx512(const float *W, int64_t R, int64_t K, const float *const *X, int64_t NT,
                        float *C, int64_t ldc) {
    int64_t t = 0;
    for (; t + 4 <= NT; t += 4) {
        const float *x0 = X[t], *x1 = X[t + 1], *x2 = X[t + 2], *x3 = X[t + 3];
        int64_t r = 0;
        for (; r + 3 <= R; r += 3) {
            const float *w0 = W + r * K, *w1 = w0 + K, *w2 = w1 + K;
            __m512 c[12];
            for (int j = 0; j < 12; j++) c[j] = _mm512_setzero_ps();
            for (int64_t k = 0; k < K; k += 16) {
                __m512 a = _mm512_loadu_ps(w0 + k), b = _mm512_loadu_ps(w1 + k), e = _mm512_loadu_ps(w2 + k), x;
                x = _mm512_loadu_ps(x0 + k); c[0] = _mm512_fmadd_ps(a, x, c[0]); c[1] = _mm512_fmadd_ps(b, x, c[1]); c[2] = _mm512_fmadd_ps(e, x, c[2]);
                x = _mm512_loadu_ps(x1 + k); c[3] = _mm512_fmadd_ps(a, x, c[3]); c[4] = _mm512_fmadd_ps(b, x, c[4]); c[5] = _mm512_fmadd_ps(e, x, c[5]);
                x = _mm512_loadu_ps(x2 + k); c[6] = _mm512_fmadd_ps(a, x, c[6]); c[7] = _mm512_fmadd_ps(b, x, c[7]); c[8] = _mm512_fmadd_ps(e, x, c[8]);
                x = _mm512_loadu_ps(x3 + k); c[9] = _mm512_fmadd_ps(a, x, c[9]); c[10] = _mm512_fmadd_ps(b, x, c[10]); c[11] = _mm512_fmadd_ps(e, x, c[11]);
            }
            for (int j = 0; j < 4; j++)
                for (int i = 0; i < 3; i++) C[(t + j) * ldc + r + i] = _mm512_reduce_add_ps(c[3 * j + i]);
        }
        for (; r < R; r++)
            for (int j = 0; j < 4; j++) C[(t + j) * ldc + r] = dot_f32_512(W + r * K, X[t + j], K);
    }
    for (; t < NT; t++)
        for (int64_t r = 0; r < R; r++) C[t * ldc + r] = dot_f32_512(W + r * K, X[t], K);
}

static void to_bf16_avx512(const float *x, uint16_t *y, int64_t n) {
    int64_t i = 0;
    const __m512i r = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1), inf = _mm512_set1_epi32(0x7f800000);
    for (; i + 16 <= n; i += 16) {
        __m512i u = _mm512_castps_si512(_mm512_loadu_ps(x + i));
        /* NaN stays a quiet NaN (ktk_f32_to_bf16): rounding would carry it into Inf or zero */
        __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), inf);
        __m512i q = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
        u = _mm512_add_epi32(u, _mm512_add_epi32(r, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
        u = _mm512_mask_mov_epi32(_mm512_srli_epi32(u, 16), nan, q);
        _mm256_storeu_si256((__m256i *)(y + i), _mm512_cvtepi32_epi16(u));
    }
    for (; i < n; i++) y[i] = ktk_f32_to_bf16(x[i]);
}

static uint64_t stream_avx512(const uint8_t *p, size_t n) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i < n; i += 256) {
        a0 = _mm512_xor_si512(a0, _mm512_load_si512((const void *)(p + i)));
        a1 = _mm512_xor_si512(a1, _mm512_load_si512((const void *)(p + i + 64)));
        a2 = _mm512_xor_si512(a2, _mm512_load_si512((const void *)(p + i + 128)));
        a3 = _mm512_xor_si512(a3, _mm512_load_si512((const void *)(p + i + 192)));
    }
    __m512i a = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
    return (uint64_t)_mm512_reduce_add_epi64(a);
}

KTK_DOTN_LOOP(dotn_f32_avx512, dot_f32_avx512, KTK_F32)

const ktk_kernels ktk_kernels_avx512 = {
    .dot = {[KTK_F32] = dot_f32_avx512, [KTK_F16] = dot_f16_avx512, [KTK_BF16] = dot_bf16_avx512,
            [KTK_Q4_0] = dot_q4_0_avx512, [KTK_Q5_0] = dot_q5_0_avx512, [KTK_Q8_0] = dot_q8_0_avx512, [KTK_Q2_K] = dot_q2_k_avx512, [KTK_Q3_K] = dot_q3_k_avx512,
            [KTK_Q4_K] = dot_q4_k_avx512,
            [KTK_Q5_K] = dot_q5_k_avx512, [KTK_Q6_K] = dot_q6_k_avx512, [KTK_IQ4_XS] = dot_iq4_xs_avx512},
    .dotn = {[KTK_F32] = dotn_f32_avx512, [KTK_F16] = dotn_f16_avx512, [KTK_BF16] = dotn_bf16_avx512,
             [KTK_Q4_0] = dotn_q4_0_avx512, [KTK_Q5_0] = dotn_q5_0_avx512, [KTK_Q8_0] = dotn_q8_0_avx512,
             [KTK_Q2_K] = dotn_q2_k_avx512, [KTK_Q3_K] = dotn_q3_k_avx512, [KTK_Q4_K] = dotn_q4_k_avx512, [KTK_Q5_K] = dotn_q5_k_avx512, [KTK_Q6_K] = dotn_q6_k_avx512, [KTK_IQ4_XS] = dotn_iq4_xs_avx512},
    .quant_act = quant_act_avx512,
    .gemm = gemm_avx512,
    .pack_f32 = pack_f32_avx512,
    .gemm_packed = gemm_packed_avx512,
    .pack_q8 = pack_q8_avx512,
    .rows_u8 = rows_u8_avx512,
    .u8_types = 1u << KTK_Q4_0 | 1u << KTK_Q5_0 | 1u << KTK_Q8_0 | 1u << KTK_Q4_K | 1u << KTK_Q5_K | 1u << KTK_Q6_K | 1u << KTK_Q2_K | 1u << KTK_Q3_K |
                1u << KTK_IQ4_XS,
    .gemm_q8 = gemm_q8_avx512,
    .dequant = dequant_avx512,
    .to_bf16 = to_bf16_avx512,
    .stream = stream_avx512,
};
