/* Portable scalar path: block dequantization of every supported GGML type, activation
 * quantization, a dot product over dequantized blocks and a plain f32 GEMM. */
#include "ktk_int.h"
#include <math.h>

float ktk_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0) {
        if (man == 0) { u = sign; }
        else {                                  /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            man &= 0x3ff;
            u = sign | (exp << 23) | (man << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f; memcpy(&f, &u, 4); return f;
}

int ktk_type_block(int type) {
    switch (type) {
    case KTK_F32: case KTK_F16: case KTK_BF16: return 1;
    case KTK_Q4_0: case KTK_Q5_0: case KTK_Q8_0: return 32;
    case KTK_Q2_K: case KTK_Q3_K: case KTK_Q4_K: case KTK_Q5_K: case KTK_Q6_K: case KTK_IQ4_XS: return 256;
    default: return 0;
    }
}

int ktk_type_size(int type) {
    switch (type) {
    case KTK_F32: return 4;
    case KTK_F16: case KTK_BF16: return 2;
    case KTK_Q4_0: return (int)sizeof(blk_q4_0);
    case KTK_Q5_0: return (int)sizeof(blk_q5_0);
    case KTK_Q8_0: return (int)sizeof(blk_q8_0);
    case KTK_Q2_K: return (int)sizeof(blk_q2_k);
    case KTK_Q3_K: return (int)sizeof(blk_q3_k);
    case KTK_Q4_K: return (int)sizeof(blk_q4_k);
    case KTK_Q5_K: return (int)sizeof(blk_q5_k);
    case KTK_Q6_K: return (int)sizeof(blk_q6_k);
    case KTK_IQ4_XS: return (int)sizeof(blk_iq4_xs);
    default: return 0;
    }
}

int64_t ktk_row_bytes(int type, int64_t n) {
    int bs = ktk_type_block(type);
    if (bs == 0 || n <= 0 || n % bs) return -1;
    return n / bs * ktk_type_size(type);
}

void ktk_dequant_block(int type, const uint8_t *b, float *y) {
    switch (type) {
    case KTK_F32: memcpy(y, b, 4); break;
    case KTK_F16: { uint16_t h; memcpy(&h, b, 2); y[0] = ktk_f16_to_f32(h); break; }
    case KTK_BF16: { uint16_t h; memcpy(&h, b, 2); y[0] = ktk_bf16_to_f32(h); break; }
    case KTK_Q4_0: {
        const blk_q4_0 *x = (const blk_q4_0 *)b; float d = ktk_f16_to_f32(x->d);
        for (int l = 0; l < 16; l++) {
            y[l] = d * (float)((x->qs[l] & 0xF) - 8);
            y[l + 16] = d * (float)((x->qs[l] >> 4) - 8);
        }
        break;
    }
    case KTK_Q5_0: {
        const blk_q5_0 *x = (const blk_q5_0 *)b; float d = ktk_f16_to_f32(x->d);
        uint32_t qh; memcpy(&qh, x->qh, 4);
        for (int l = 0; l < 16; l++) {
            y[l] = d * (float)((int)((x->qs[l] & 0xF) | (((qh >> l) & 1) << 4)) - 16);
            y[l + 16] = d * (float)((int)((x->qs[l] >> 4) | (((qh >> (l + 16)) & 1) << 4)) - 16);
        }
        break;
    }
    case KTK_Q8_0: {
        const blk_q8_0 *x = (const blk_q8_0 *)b; float d = ktk_f16_to_f32(x->d);
        for (int l = 0; l < 32; l++) y[l] = d * (float)x->qs[l];
        break;
    }
    case KTK_Q2_K: case KTK_Q3_K: {   /* Q2_K: d * sc * q - dmin * m; Q3_K: d * (sc - 32) * (q - 4) */
        const int three = type == KTK_Q3_K;
        uint8_t sc[16];
        uint16_t dh, mh;
        ktk_q23k_head(three, b, sc, &dh, &mh);
        const float d = ktk_f16_to_f32(dh), dmin = ktk_f16_to_f32(mh);
        for (int v = 0; v < 256; v++) {
            const int q = ktk_q23k_value(three, b, v), s = sc[v / 16];
            y[v] = three ? d * (float)(s - 32) * (float)(q - 4) : d * (float)(s & 0xF) * (float)q - dmin * (float)(s >> 4);
        }
        break;
    }
    case KTK_Q4_K: {
        const blk_q4_k *x = (const blk_q4_k *)b;
        float d = ktk_f16_to_f32(x->d), dmin = ktk_f16_to_f32(x->dmin);
        for (int j = 0; j < 4; j++) {
            uint8_t sc0, m0, sc1, m1;
            ktk_scale_min_k4(2 * j, x->scales, &sc0, &m0);
            ktk_scale_min_k4(2 * j + 1, x->scales, &sc1, &m1);
            float d0 = d * sc0, mm0 = dmin * m0, d1 = d * sc1, mm1 = dmin * m1;
            for (int l = 0; l < 32; l++) {
                y[64 * j + l] = d0 * (float)(x->qs[32 * j + l] & 0xF) - mm0;
                y[64 * j + 32 + l] = d1 * (float)(x->qs[32 * j + l] >> 4) - mm1;
            }
        }
        break;
    }
    case KTK_Q5_K: {
        const blk_q5_k *x = (const blk_q5_k *)b;
        float d = ktk_f16_to_f32(x->d), dmin = ktk_f16_to_f32(x->dmin);
        for (int j = 0; j < 4; j++) {
            uint8_t sc0, m0, sc1, m1;
            ktk_scale_min_k4(2 * j, x->scales, &sc0, &m0);
            ktk_scale_min_k4(2 * j + 1, x->scales, &sc1, &m1);
            float d0 = d * sc0, mm0 = dmin * m0, d1 = d * sc1, mm1 = dmin * m1;
            for (int l = 0; l < 32; l++) {
                int lo = (x->qs[32 * j + l] & 0xF) | (((x->qh[l] >> (2 * j)) & 1) << 4);
                int hi = (x->qs[32 * j + l] >> 4) | (((x->qh[l] >> (2 * j + 1)) & 1) << 4);
                y[64 * j + l] = d0 * (float)lo - mm0;
                y[64 * j + 32 + l] = d1 * (float)hi - mm1;
            }
        }
        break;
    }
    case KTK_Q6_K: {
        const blk_q6_k *x = (const blk_q6_k *)b; float d = ktk_f16_to_f32(x->d);
        for (int n = 0; n < 2; n++) {
            const uint8_t *ql = x->ql + 64 * n, *qh = x->qh + 32 * n;
            const int8_t *sc = x->scales + 8 * n;
            float *yy = y + 128 * n;
            for (int l = 0; l < 32; l++) {
                int is = l / 16;
                int q1 = (int)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                int q2 = (int)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                yy[l] = d * sc[is + 0] * q1;
                yy[l + 32] = d * sc[is + 2] * q2;
                yy[l + 64] = d * sc[is + 4] * q3;
                yy[l + 96] = d * sc[is + 6] * q4;
            }
        }
        break;
    }
    case KTK_IQ4_XS: {
        const blk_iq4_xs *x = (const blk_iq4_xs *)b; float d = ktk_f16_to_f32(x->d);
        for (int ib = 0; ib < 8; ib++) {
            float dl = d * (float)ktk_iq4xs_scale(x, ib);
            const uint8_t *qs = x->qs + 16 * ib;
            for (int j = 0; j < 16; j++) {
                y[32 * ib + j] = dl * (float)ktk_kvalues_iq4nl[qs[j] & 0xf];
                y[32 * ib + j + 16] = dl * (float)ktk_kvalues_iq4nl[qs[j] >> 4];
            }
        }
        break;
    }
    default: break;
    }
}

int ktk_dequant_row(int type, const uint8_t *src, float *dst, int64_t n) {
    int bs = ktk_type_block(type), ts = ktk_type_size(type);
    if (bs == 0 || n % bs) return KTK_EINVAL;
    if (type == KTK_F32) { memcpy(dst, src, (size_t)n * 4); return KTK_OK; }
    for (int64_t i = 0; i < n / bs; i++) ktk_dequant_block(type, src + i * ts, dst + i * bs);
    return KTK_OK;
}

/* NaN or infinity among n floats: the block is stored with d = NaN and zero values (as quant_simd.inc) */
static int nonfinite(const float *x, int n) {
    for (int i = 0; i < n; i++)
        if (!isfinite(x[i])) return 1;
    return 0;
}

void ktk_quant_act_scalar(const float *x0, ktk_q8 *q0, int64_t n) {
    const float *x = x0;
    ktk_q8 *q = q0;
    for (int64_t b = 0; b < n / QK; b++, x += QK, q++) {
        if (nonfinite(x, QK)) {
            memset(q->q, 0, sizeof q->q);
            q->d = q->ds = NAN;
            q->s[0] = q->s[1] = 0;
            continue;
        }
        float amax = 0.f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(x[i]));
        float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        int s0 = 0, s1 = 0;
        for (int i = 0; i < QK; i++) {
            int v = (int)lrintf(x[i] * id);
            q->q[i] = (int8_t)v;
            if (i < 16) s0 += v; else s1 += v;
        }
        q->d = d; q->ds = d * (float)(s0 + s1); q->s[0] = (int16_t)s0; q->s[1] = (int16_t)s1;
    }
    if (n % QKK) return;
    ktk_q8k *k = (ktk_q8k *)(q0 + n / QK);
    for (int64_t b = 0; b < n / QKK; b++, k++) {
        const float *xb = x0 + b * QKK;
        if (nonfinite(xb, QKK)) {
            memset(k->q, 0, sizeof k->q);
            memset(k->bsums, 0, sizeof k->bsums);
            k->d = NAN;
            continue;
        }
        float amax = 0.f;
        for (int i = 0; i < QKK; i++) amax = fmaxf(amax, fabsf(xb[i]));
        float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        for (int j = 0; j < 16; j++) {
            int s = 0;
            for (int i = 0; i < 16; i++) {
                int v = (int)lrintf(xb[16 * j + i] * id);
                k->q[16 * j + i] = (int8_t)v;
                s += v;
            }
            k->bsums[j] = (int16_t)s;
        }
        k->d = d;
    }
}

/* Scalar dot: dequantize a block at a time, multiply by the float activations. */
static float dot_generic(int type, const uint8_t *row, const float *xf, int64_t n) {
    int bs = ktk_type_block(type), ts = ktk_type_size(type);
    float buf[QKK];
    double acc = 0.0;
    if (bs == 1) {   /* element types: dequantize in chunks of 256 */
        for (int64_t i = 0; i < n; i += QKK) {
            int64_t m = n - i < QKK ? n - i : QKK;
            for (int64_t j = 0; j < m; j++) ktk_dequant_block(type, row + (i + j) * ts, buf + j);
            float s = 0.f;
            for (int64_t j = 0; j < m; j++) s += buf[j] * xf[i + j];
            acc += s;
        }
        return (float)acc;
    }
    for (int64_t i = 0; i < n / bs; i++) {
        ktk_dequant_block(type, row + i * ts, buf);
        float s = 0.f;
        for (int j = 0; j < bs; j++) s += buf[j] * xf[i * bs + j];
        acc += s;
    }
    return (float)acc;
}

#define DOT_SCALAR(T, NAME) \
    static float NAME(const uint8_t *row, const float *xf, const ktk_q8 *xq, int64_t n) { \
        (void)xq; return dot_generic(T, row, xf, n); }
DOT_SCALAR(KTK_F32, dot_f32_s)
DOT_SCALAR(KTK_F16, dot_f16_s)
DOT_SCALAR(KTK_BF16, dot_bf16_s)
DOT_SCALAR(KTK_Q4_0, dot_q4_0_s)
DOT_SCALAR(KTK_Q5_0, dot_q5_0_s)
DOT_SCALAR(KTK_Q8_0, dot_q8_0_s)
DOT_SCALAR(KTK_Q2_K, dot_q2_k_s)
DOT_SCALAR(KTK_Q3_K, dot_q3_k_s)
DOT_SCALAR(KTK_Q4_K, dot_q4_k_s)
DOT_SCALAR(KTK_Q5_K, dot_q5_k_s)
DOT_SCALAR(KTK_Q6_K, dot_q6_k_s)
DOT_SCALAR(KTK_IQ4_XS, dot_iq4_xs_s)

KTK_DOTN_LOOP(dotn_f32_s, dot_f32_s, KTK_F32)
KTK_DOTN_LOOP(dotn_f16_s, dot_f16_s, KTK_F16)
KTK_DOTN_LOOP(dotn_bf16_s, dot_bf16_s, KTK_BF16)
KTK_DOTN_LOOP(dotn_q4_0_s, dot_q4_0_s, KTK_Q4_0)
KTK_DOTN_LOOP(dotn_q5_0_s, dot_q5_0_s, KTK_Q5_0)
KTK_DOTN_LOOP(dotn_q8_0_s, dot_q8_0_s, KTK_Q8_0)
KTK_DOTN_LOOP(dotn_q2_k_s, dot_q2_k_s, KTK_Q2_K)
KTK_DOTN_LOOP(dotn_q3_k_s, dot_q3_k_s, KTK_Q3_K)
KTK_DOTN_LOOP(dotn_q4_k_s, dot_q4_k_s, KTK_Q4_K)
KTK_DOTN_LOOP(dotn_q5_k_s, dot_q5_k_s, KTK_Q5_K)
KTK_DOTN_LOOP(dotn_q6_k_s, dot_q6_k_s, KTK_Q6_K)
KTK_DOTN_LOOP(dotn_iq4_xs_s, dot_iq4_xs_s, KTK_IQ4_XS)

static void gemm_scalar(const float *W, int64_t R, int64_t K, const float *const *X, int64_t NT,
                        float *C, int64_t ldc) {
    for (int64_t t = 0; t < NT; t++)
        for (int64_t r = 0; r < R; r++) {
            const float *w = W + r * K, *x = X[t];
            float s = 0.f;
            for (int64_t k = 0; k < K; k++) s += w[k] * x[k];
            C[t * ldc + r] = s;
        }
}

static void dequant_scalar(int type, const uint8_t *src, float *dst, int64_t n) {
    ktk_dequant_row(type, src, dst, n);
}

static void to_bf16_scalar(const float *x, uint16_t *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = ktk_f32_to_bf16(x[i]);
}

static uint64_t stream_scalar(const uint8_t *p, size_t n) {
    uint64_t a = 0, v;
    for (size_t i = 0; i < n; i += 8) { memcpy(&v, p + i, 8); a ^= v; }
    return a;
}

const ktk_kernels ktk_kernels_scalar = {
    .dot = {[KTK_F32] = dot_f32_s, [KTK_F16] = dot_f16_s, [KTK_BF16] = dot_bf16_s,
            [KTK_Q4_0] = dot_q4_0_s, [KTK_Q5_0] = dot_q5_0_s, [KTK_Q8_0] = dot_q8_0_s, [KTK_Q2_K] = dot_q2_k_s, [KTK_Q3_K] = dot_q3_k_s, [KTK_Q4_K] = dot_q4_k_s,
            [KTK_Q5_K] = dot_q5_k_s, [KTK_Q6_K] = dot_q6_k_s, [KTK_IQ4_XS] = dot_iq4_xs_s},
    .dotn = {[KTK_F32] = dotn_f32_s, [KTK_F16] = dotn_f16_s, [KTK_BF16] = dotn_bf16_s,
             [KTK_Q4_0] = dotn_q4_0_s, [KTK_Q5_0] = dotn_q5_0_s, [KTK_Q8_0] = dotn_q8_0_s, [KTK_Q2_K] = dotn_q2_k_s, [KTK_Q3_K] = dotn_q3_k_s, [KTK_Q4_K] = dotn_q4_k_s,
             [KTK_Q5_K] = dotn_q5_k_s, [KTK_Q6_K] = dotn_q6_k_s, [KTK_IQ4_XS] = dotn_iq4_xs_s},
    .quant_act = ktk_quant_act_scalar,
    .gemm = gemm_scalar,
    .dequant = dequant_scalar,
    .to_bf16 = to_bf16_scalar,
    .stream = stream_scalar,
};
