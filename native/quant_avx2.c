/* AVX2 + FMA + F16C path: integer dots with maddubs, f32 GEMM micro-kernel, streaming read. */
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#include "ktk_int.h"
#include "transpose.h"

#define SFX(name) name##_avx2
static inline __m256i doti_avx2(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#define DOTI doti_avx2
/* two u8 x s8 pairs whose i16 pair sums may be added first (4/5-bit weights), one widening */
#define DOTI2(u1, s1, u2, s2) _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16((u1), (s1)),      \
                                                                 _mm256_maddubs_epi16((u2), (s2))),     \
                                                _mm256_set1_epi16(1))
/* acc (8 x i32) += sum of 2 adjacent i16 * i16 products */
#define DOTW(acc, a, b) _mm256_add_epi32((acc), _mm256_madd_epi16((a), (b)))
#include "quant_simd.inc"

static inline __m256 bf16x8_avx2(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static float dot_bf16_avx2(const uint8_t *row, const float *xf, const ktk_q8 *xq, int64_t n) {
    (void)xq;
    const uint16_t *w = (const uint16_t *)row;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        a0 = _mm256_fmadd_ps(bf16x8_avx2(w + i), _mm256_loadu_ps(xf + i), a0);
        a1 = _mm256_fmadd_ps(bf16x8_avx2(w + i + 8), _mm256_loadu_ps(xf + i + 8), a1);
        a2 = _mm256_fmadd_ps(bf16x8_avx2(w + i + 16), _mm256_loadu_ps(xf + i + 16), a2);
        a3 = _mm256_fmadd_ps(bf16x8_avx2(w + i + 24), _mm256_loadu_ps(xf + i + 24), a3);
    }
    float s = hsum8_avx2(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; i < n; i++) s += ktk_bf16_to_f32(w[i]) * xf[i];
    return s;
}

/* C[t*ldc + r] = W[r] . X[t]; blocks of 4 tokens x 2 rows (8 accumulators); K % 8 == 0. */
static void gemm_avx2(const float *W, int64_t R, int64_t K, const float *const *X, int64_t NT,
                      float *C, int64_t ldc) {
    int64_t t = 0;
    for (; t + 4 <= NT; t += 4) {
        const float *x0 = X[t], *x1 = X[t + 1], *x2 = X[t + 2], *x3 = X[t + 3];
        int64_t r = 0;
        for (; r + 2 <= R; r += 2) {
            const float *w0 = W + r * K, *w1 = w0 + K;
            __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00;
            for (int64_t k = 0; k < K; k += 8) {
                __m256 a = _mm256_loadu_ps(w0 + k), b = _mm256_loadu_ps(w1 + k), x;
                x = _mm256_loadu_ps(x0 + k); c00 = _mm256_fmadd_ps(a, x, c00); c01 = _mm256_fmadd_ps(b, x, c01);
                x = _mm256_loadu_ps(x1 + k); c10 = _mm256_fmadd_ps(a, x, c10); c11 = _mm256_fmadd_ps(b, x, c11);
                x = _mm256_loadu_ps(x2 + k); c20 = _mm256_fmadd_ps(a, x, c20); c21 = _mm256_fmadd_ps(b, x, c21);
                x = _mm256_loadu_ps(x3 + k); c30 = _mm256_fmadd_ps(a, x, c30); c31 = _mm256_fmadd_ps(b, x, c31);
            }
            C[t * ldc + r] = hsum8_avx2(c00); C[t * ldc + r + 1] = hsum8_avx2(c01);
            C[(t + 1) * ldc + r] = hsum8_avx2(c10); C[(t + 1) * ldc + r + 1] = hsum8_avx2(c11);
            C[(t + 2) * ldc + r] = hsum8_avx2(c20); C[(t + 2) * ldc + r + 1] = hsum8_avx2(c21);
            C[(t + 3) * ldc + r] = hsum8_avx2(c30); C[(t + 3) * ldc + r + 1] = hsum8_avx2(c31);
        }
        for (; r < R; r++)
            for (int j = 0; j < 4; j++) C[(t + j) * ldc + r] = dot_f32_avx2((const uint8_t *)(W + r * K), X[t + j], 0, K);
    }
    for (; t < NT; t++)
        for (int64_t r = 0; r < R; r++) C[t * ldc + r] = dot_f32_avx2((const uint8_t *)(W + r * K), X[t], 0, K);
}

/* The grouped path's tokens packed once per expert: panel g holds tokens pw*g .. pw*g + pw-1 as
 * [K][pw] floats (pw 8 or 16; zeros past nt), so a GEMM reads the panel's tokens' values of one k
 * as one vector (AVX2: 8, AVX-512: 16). */
void ktk_pack_f32_panels(const float *const *X, int64_t nt, int64_t K, float *pk, int pw) {
    for (int64_t g = 0; g * pw < nt; g++) {
        float *P = pk + g * K * pw;
        for (int h = 0; h < pw; h += 8) {   /* 8 tokens at a time, columns h .. h+7 of the panel */
            const int64_t t0 = g * pw + h;
            const int valid = nt - t0 < 0 ? 0 : nt - t0 < 8 ? (int)(nt - t0) : 8;
            for (int64_t k = 0; k < K; k += 8) {
                __m256i r[8];
                for (int j = 0; j < 8; j++)
                    r[j] = j < valid ? _mm256_loadu_si256((const __m256i *)(X[t0 + j] + k)) : _mm256_setzero_si256();
                ktk_transpose8x8(r);   /* r[i]: the 8 tokens' values at k + i */
                for (int i = 0; i < 8; i++) _mm256_storeu_si256((__m256i *)(P + (k + i) * pw + h), r[i]);
            }
        }
    }
}

static void pack_f32_avx2(const float *const *X, int64_t nt, int64_t K, float *pk) {
    ktk_pack_f32_panels(X, nt, K, pk, 8);
}

/* 4 weight rows x nv panels (8 tokens each), all of K: 4 * nv accumulators, each k one broadcast
 * weight per row and one panel load per 8 tokens (outer products: no horizontal sums). W rows and
 * panels are K values apart. */
static inline __attribute__((always_inline)) void gemm_4xn(const float *W, int64_t K, const float *P, float *C,
                                                           int64_t ldc, const int nv) {
    __m256 acc[4][3];
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++)
#pragma GCC unroll 3
        for (int v = 0; v < nv; v++) acc[r][v] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {   /* unrolled whole (at -O2 too), so the accumulators stay in registers */
        __m256 x[3];
#pragma GCC unroll 3
        for (int v = 0; v < nv; v++) x[v] = _mm256_loadu_ps(P + v * K * 8 + k * 8);
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            const __m256 w = _mm256_broadcast_ss(W + r * K + k);
#pragma GCC unroll 3
            for (int v = 0; v < nv; v++) acc[r][v] = _mm256_fmadd_ps(w, x[v], acc[r][v]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++)
#pragma GCC unroll 3
        for (int v = 0; v < nv; v++) _mm256_storeu_ps(C + r * ldc + v * 8, acc[r][v]);
}

/* C[r*ldc + t] = W[r] . token t for r < R (R % 4 == 0), t < nt rounded up to 8 (ldc >= that; the
 * padding tokens give zeros); pk as pack_f32_avx2 wrote it. (Running K in L1-sized chunks of
 * 64-512, the accumulators going through C between them, measured no faster on the 2-core
 * development machine.) */
static void gemm_packed_avx2(const float *W, int64_t R, int64_t K, const float *pk, int64_t nt, float *C, int64_t ldc) {
    const int64_t ng = (nt + 7) / 8;
    for (int64_t g0 = 0; g0 < ng; g0 += 3)
        for (int64_t r0 = 0; r0 < R; r0 += 4) {
            const float *P = pk + g0 * K * 8, *w = W + r0 * K;
            float *c = C + r0 * ldc + g0 * 8;
            switch (ng - g0 < 3 ? (int)(ng - g0) : 3) {
            case 3: gemm_4xn(w, K, P, c, ldc, 3); break;
            case 2: gemm_4xn(w, K, P, c, ldc, 2); break;
            default: gemm_4xn(w, K, P, c, ldc, 1); break;
            }
        }
}

/* exp(x) for SiLU, 8 lanes: x = n ln2 + r (ln2 in two parts), e^r by its Taylor polynomial to r^6,
 * 2^n built in the exponent bits. x is clamped to [-87, 88.8] first: at the bottom the result stays
 * a normal float (no subnormal assists; SiLU adds it to 1, where that changes nothing), at the top
 * n is at most 128, whose exponent bits make inf, as the true value is. */
static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.8f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
    __m256 p = _mm256_set1_ps(1.f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* g = SiLU(g) * u over rows x ldc floats (ldc % 8 == 0): the packed grouped path's gate/up epilogue
 * on its row-major C blocks. NaN stays NaN (x is the numerator); -inf gives NaN, as x / (1 + e^-x) does. */
void ktk_silu_mul_avx2(float *g, const float *u, int64_t ldc, int rows) {
    for (int64_t i = 0; i < rows * ldc; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i), e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), x));
        _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e)), _mm256_loadu_ps(u + i)));
    }
}

static void to_bf16_avx2(const float *x, uint16_t *y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i u = ktk_bf16_lanes(_mm256_loadu_ps(x + i));
        __m128i p = _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
        _mm_storeu_si128((__m128i *)(y + i), p);
    }
    for (; i < n; i++) y[i] = ktk_f32_to_bf16(x[i]);
}

static uint64_t stream_avx2(const uint8_t *p, size_t n) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i < n; i += 128) {
        a0 = _mm256_xor_si256(a0, _mm256_load_si256((const __m256i *)(p + i)));
        a1 = _mm256_xor_si256(a1, _mm256_load_si256((const __m256i *)(p + i + 32)));
        a2 = _mm256_xor_si256(a2, _mm256_load_si256((const __m256i *)(p + i + 64)));
        a3 = _mm256_xor_si256(a3, _mm256_load_si256((const __m256i *)(p + i + 96)));
    }
    __m256i a = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
    return (uint64_t)_mm256_extract_epi64(a, 0) ^ (uint64_t)_mm256_extract_epi64(a, 3);
}

/* The grouped path in 8-bit integers (ktk_kernels.gemm_q8), for 4-, 5- and 6-bit weights
 * (u8_types: Q4_0, Q5_0, Q4_K, Q5_K in groups of 32, Q2_K, Q3_K, Q6_K in groups of 16; bytes <= 63, so
 * maddubs's i16 pair sums, <= 2 * 63 * 127, cannot saturate. Q8_0's and IQ4_XS's offset bytes, up
 * to 255, could: they stay on f32 panels). 4 rows x one 16-token panel (two halves of 8). The i16
 * pair sums of `steps` 4-value steps are added in i16 before one widening madd: 8 steps for 4-bit
 * bytes (<= 8 * 2 * 15 * 127 = 30480), 4 for 5-bit ones (4 * 2 * 31 * 127 = 31496), 2 for 6-bit
 * ones (2 * 2 * 63 * 127 = 32004); the widened sums of a group (32 values, or 16 for g16) are
 * added in i32, then scaled into C in memory once per group. */
static inline __attribute__((always_inline)) void gemm_q8_4x16(const uint8_t *u, const float *S, const float *Mn,
                                                               int64_t K, const int8_t *P, const float *PS, float *c,
                                                               int64_t ldc, const int steps, const int g16) {
    const int64_t nb = K / 32, ng = g16 ? 2 * nb : nb;
    const int gsteps = g16 ? 4 : 8;   /* 4-value steps per group */
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < 4; r++) {
        _mm256_storeu_ps(c + r * ldc, _mm256_setzero_ps());
        _mm256_storeu_ps(c + r * ldc + 8, _mm256_setzero_ps());
    }
    for (int64_t j = 0; j < ng; j++) {
        const int64_t b = g16 ? j / 2 : j, kb = b * 8 + (g16 ? (j % 2) * 4 : 0);
        const float *pb = PS + b * 64;
        __m256i s32[4][2];
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) s32[r][0] = s32[r][1] = _mm256_setzero_si256();
        for (int k0 = 0; k0 < gsteps; k0 += steps) {
            __m256i a[4][2];
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) a[r][0] = a[r][1] = _mm256_setzero_si256();
            /* not unrolled: unrolled 8 steps deep, GCC hoisted the products and spilled a dozen of the 16 ymm
             * registers (Q4_K 1.19x, Q4_0 1.25x at batch 512 without: docs/bench/cpu_experts.md) */
#pragma GCC unroll 1
            for (int k = k0; k < k0 + steps; k++) {
                const __m256i x0 = _mm256_loadu_si256((const __m256i *)(P + (kb + k) * 64));
                const __m256i x1 = _mm256_loadu_si256((const __m256i *)(P + (kb + k) * 64 + 32));
#pragma GCC unroll 4
                for (int r = 0; r < 4; r++) {
                    int32_t w4;
                    memcpy(&w4, u + r * K + (kb + k) * 4, 4);
                    const __m256i w = _mm256_set1_epi32(w4);
                    a[r][0] = _mm256_add_epi16(a[r][0], _mm256_maddubs_epi16(w, x0));
                    a[r][1] = _mm256_add_epi16(a[r][1], _mm256_maddubs_epi16(w, x1));
                }
            }
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) {
                s32[r][0] = _mm256_add_epi32(s32[r][0], _mm256_madd_epi16(a[r][0], ones));
                s32[r][1] = _mm256_add_epi32(s32[r][1], _mm256_madd_epi16(a[r][1], ones));
            }
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {   /* d; d * sum(q) over the block, or over this half of it (g16) */
            const __m256 d = _mm256_loadu_ps(pb + 8 * h), ds = _mm256_loadu_ps(pb + (g16 ? 32 + 16 * (j % 2) : 16) + 8 * h);
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) {
                float *o = c + r * ldc + 8 * h;
                __m256 acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[r][h]), _mm256_mul_ps(_mm256_set1_ps(S[r * ng + j]), d),
                                             _mm256_loadu_ps(o));
                _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_set1_ps(Mn[r * ng + j]), ds, acc));
            }
        }
    }
}

static void gemm_q8_avx2(const uint8_t *U, const float *S, const float *Mn, int64_t R, int64_t K, const int8_t *pk,
                         const float *ps, int64_t nt, float *C, int64_t ldc, int flags) {
    const int64_t ng = (nt + 15) / 16, nb = K / 32, ngr = flags & KTK_Q8_G16 ? K / 16 : nb;
    if (flags & KTK_Q8_U8) {   /* not in this table's u8_types: never called so; loud if it were */
        for (int64_t r = 0; r < R; r++)
            for (int64_t t = 0; t < ng * 16; t++) C[r * ldc + t] = __builtin_nanf("");
        return;
    }
    for (int64_t g = 0; g < ng; g++)
        for (int64_t r0 = 0; r0 < R; r0 += 4) {
            const int8_t *P = pk + g * K * 16;
            const float *PS = ps + g * nb * 64, *s = S + r0 * ngr, *mn = Mn + r0 * ngr;
            float *c = C + r0 * ldc + g * 16;
            if (flags & KTK_Q8_G16) gemm_q8_4x16(U + r0 * K, s, mn, K, P, PS, c, ldc, 2, 1);
            else if (flags & KTK_Q8_U4) gemm_q8_4x16(U + r0 * K, s, mn, K, P, PS, c, ldc, 8, 0);
            else gemm_q8_4x16(U + r0 * K, s, mn, K, P, PS, c, ldc, 4, 0);
        }
}

KTK_DOTN_LOOP(dotn_f32_avx2, dot_f32_avx2, KTK_F32)

const ktk_kernels ktk_kernels_avx2 = {
    .dot = {[KTK_F32] = dot_f32_avx2, [KTK_F16] = dot_f16_avx2, [KTK_BF16] = dot_bf16_avx2,
            [KTK_Q4_0] = dot_q4_0_avx2, [KTK_Q5_0] = dot_q5_0_avx2, [KTK_Q8_0] = dot_q8_0_avx2, [KTK_Q2_K] = dot_q2_k_avx2, [KTK_Q3_K] = dot_q3_k_avx2,
            [KTK_Q4_K] = dot_q4_k_avx2,
            [KTK_Q5_K] = dot_q5_k_avx2, [KTK_Q6_K] = dot_q6_k_avx2, [KTK_IQ4_XS] = dot_iq4_xs_avx2},
    .dotn = {[KTK_F32] = dotn_f32_avx2, [KTK_F16] = dotn_f16_avx2, [KTK_BF16] = dotn_bf16_avx2,
             [KTK_Q4_0] = dotn_q4_0_avx2, [KTK_Q5_0] = dotn_q5_0_avx2, [KTK_Q8_0] = dotn_q8_0_avx2,
             [KTK_Q2_K] = dotn_q2_k_avx2, [KTK_Q3_K] = dotn_q3_k_avx2, [KTK_Q4_K] = dotn_q4_k_avx2, [KTK_Q5_K] = dotn_q5_k_avx2, [KTK_Q6_K] = dotn_q6_k_avx2, [KTK_IQ4_XS] = dotn_iq4_xs_avx2},
    .quant_act = quant_act_avx2,
    .gemm = gemm_avx2,
    .pack_f32 = pack_f32_avx2,
    .gemm_packed = gemm_packed_avx2,
    .pack_q8 = pack_q8_avx2,
    .rows_u8 = rows_u8_avx2,
    .gemm_q8 = gemm_q8_avx2,
    .u8_types = 1u << KTK_Q4_0 | 1u << KTK_Q5_0 | 1u << KTK_Q4_K | 1u << KTK_Q5_K | 1u << KTK_Q6_K | 1u << KTK_Q2_K | 1u << KTK_Q3_K,
    .dequant = dequant_avx2,
    .to_bf16 = to_bf16_avx2,
    .stream = stream_avx2,
};
