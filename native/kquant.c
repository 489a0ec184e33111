/* Quantizers for `convert`: the K-quants (Q4_K, Q5_K, Q6_K, the algorithm of
 * ktinject/weights/kquant.py in C) and, at the end, the legacy Q4_0 / Q5_0 / Q8_0.
 *
 * `ktinject convert` spends most of its time here. The torch version evaluates every candidate as
 * tensors; its many small ops hold the GIL between kernels, so its worker threads stopped scaling
 * at ~3 cores on the lent 16-core machine. Here one call quantizes a run of super-blocks with no
 * GIL (cffi releases it) and no temporaries, so Python's threads scale.
 *
 * Per 32-value sub-block (16 for Q6_K), weights w = rms + |x|; eight candidate roundings on a grid
 * of inverse scales around the min/max one; for each, scale and min fitted by weighted least
 * squares in closed form and the weighted error from the same sums; the best kept. Sub-block
 * scales (and mins) then go to 6 bits (8 for Q6_K) under fp16 super-block scales, and the values
 * are re-rounded with the final scales. Rounding is to nearest even, as torch's. The float sums
 * run in another order than torch's reductions, so a block can come out differently where two
 * candidates tie within rounding; tests compare the error (SQNR), not the bytes. */
#include "ktk_int.h"
#include <math.h>

#pragma GCC optimize("fp-contract=off")   /* no fused multiply-adds: torch rounds each product */
#pragma GCC diagnostic ignored "-Wpsabi"   /* vector helpers are always inlined: no ABI crosses */

#define STEPS 8

/* fp32 -> fp16 bits, round to nearest even (what torch's .to(float16) does) */
static uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t mag = x & 0x7fffffffu;
    if (mag >= 0x7f800000u) return (uint16_t)(sign | (mag > 0x7f800000u ? 0x7e00u : 0x7c00u));
    if (mag >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);                 /* rounds past 65504 */
    if (mag < 0x38800000u) {                                                    /* subnormal or zero */
        float a;
        memcpy(&a, &mag, 4);
        return (uint16_t)(sign | (uint32_t)rintf(a * 16777216.0f));           /* a / 2^-24 */
    }
    uint32_t r = mag + 0xfffu + ((mag >> 13) & 1u);                              /* nearest even */
    return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
}

static float grid(int i) {                  /* torch.linspace(-1, 1, 8)[i], computed as torch does */
    const float step = 2.0f / (STEPS - 1);
    return i < STEPS / 2 ? -1.0f + step * (float)i : 1.0f - step * (float)(STEPS - 1 - i);
}

static inline __attribute__((always_inline)) void importance(const float *x, int L, float *w) {
    float s = 0;
    for (int i = 0; i < L; i++) s += x[i] * x[i];
    float rms = sqrtf(s / (float)L);
    for (int i = 0; i < L; i++) w[i] = rms + fabsf(x[i]);
}

static float clampf(float v, float lo, float hi) { return v < lo ? lo : v > hi ? hi : v; }

/* round(clamp(v, lo, hi)) to nearest even for |lo|, |hi| < 2^22: the same as clamping the rounded
 * value, without a libm call (rintf is one on baseline x86-64) */
#define MAGIC 12582912.0f                   /* 1.5 * 2^23 */
static inline float round_clamp(float v, float lo, float hi) {
    v = v < lo ? lo : v;
    v = v > hi ? hi : v;
    return (v + MAGIC) - MAGIC;
}

/* The eight candidates as the lanes of one vector (GCC vector extensions: one AVX register in the
 * avx2 clone, two SSE registers otherwise); each lane does the scalar arithmetic, in order. */
typedef float v8f __attribute__((vector_size(32)));
typedef int v8i __attribute__((vector_size(32)));

static inline v8f vsel(v8i m, v8f a, v8f b) { return (v8f)((m & (v8i)a) | (~m & (v8i)b)); }

static inline v8f vround_clamp(v8f v, float lo, float hi) {
    v8f vlo = (v8f){0} + lo, vhi = (v8f){0} + hi;
    v = vsel(v < vlo, vlo, v);
    v = vsel(v > vhi, vhi, v);
    return (v + MAGIC) - MAGIC;
}

/* x ~ scale*q - min, q in 0..nmax: best (scale >= 0, min >= 0) for L values */
static inline __attribute__((always_inline)) void fit_affine(const float *x, int L, int nmax, float *scale_out, float *min_out) {
    float w[32];
    importance(x, L, w);
    float sw = 0, sx = 0, sxx = 0, lo = x[0], hi = x[0];
    for (int i = 0; i < L; i++) {
        float wx = w[i] * x[i];
        sw += w[i];
        sx += wx;
        sxx += wx * x[i];
        lo = x[i] < lo ? x[i] : lo;
        hi = x[i] > hi ? x[i] : hi;
    }
    if (lo > 0) lo = 0;
    float rng = hi - lo;
    if (rng < 1e-30f) rng = 1e-30f;
    /* the candidates side by side (one lane each), every lane summing over i in order */
    v8f isc, vsq = {0}, vsqx = {0}, vsqq = {0};
    for (int s = 0; s < STEPS; s++) isc[s] = ((float)nmax + grid(s)) / rng;
    for (int i = 0; i < L; i++) {
        v8f q = vround_clamp((x[i] - lo) * isc, 0, (float)nmax);
        v8f wq = q * w[i];
        vsq += wq;
        vsqx += wq * x[i];
        vsqq += wq * q;
    }
    float best_err = 0, best_s = 0, best_m = 0;
    for (int s = 0; s < STEPS; s++) {
        float sq = vsq[s], sqx = vsqx[s], sqq = vsqq[s];
        float det = sw * sqq - sq * sq, scale = 0, mn = 0;
        if (fabsf(det) > 1e-6f * sw * sqq) {
            scale = (sw * sqx - sq * sx) / det;
            mn = (sqq * sx - sq * sqx) / det;
        } else {                            /* every value rounds alike: the scale alone or the min alone */
            float scale_a = sqx / (sqq > 1e-30f ? sqq : 1e-30f);
            float err_a = sxx - 2 * scale_a * sqx + scale_a * scale_a * sqq;
            float mn_b = sx / (sw > 1e-30f ? sw : 1e-30f);
            mn_b = mn_b > 0 ? 0 : mn_b;
            float err_b = sxx - 2 * mn_b * sx + mn_b * mn_b * sw;
            if (err_a <= err_b) scale = scale_a; else mn = mn_b;
        }
        if (mn > 0) {                       /* the format stores -min >= 0: refit the scale alone */
            scale = sqx / (sqq > 1e-30f ? sqq : 1e-30f);
            mn = 0;
        }
        float err = scale * scale * sqq + 2 * scale * mn * sq + mn * mn * sw - 2 * scale * sqx - 2 * mn * sx + sxx;
        if (s == 0 || err < best_err) { best_err = err; best_s = scale; best_m = mn; }
    }
    *scale_out = best_s > 0 ? best_s : 0;
    *min_out = -best_m > 0 ? -best_m : 0;
}

/* x ~ scale*q, q in -nmax-1..nmax: the best signed scale for L values (Q6_K) */
static inline __attribute__((always_inline)) float fit_symmetric(const float *x, int L, int nmax) {
    float w[16];
    importance(x, L, w);
    int imax = 0;
    for (int i = 1; i < L; i++) if (fabsf(x[i]) > fabsf(x[imax])) imax = i;
    float vmax = x[imax];
    if (fabsf(vmax) < 1e-30f) vmax = 1e-30f;
    v8f isc, vsqx = {0}, vsqq = {0};
    for (int s = 0; s < STEPS; s++) isc[s] = (-(float)(nmax + 1) * (1 + grid(s) * 0.1f)) / vmax;
    for (int i = 0; i < L; i++) {
        v8f q = vround_clamp(x[i] * isc, (float)(-nmax - 1), (float)nmax);
        v8f wq = q * w[i];
        vsqx += wq * x[i];
        vsqq += wq * q;
    }
    float best = 0, best_scale = 0;
    for (int s = 0; s < STEPS; s++) {
        float sqx = vsqx[s], sqq = vsqq[s];
        if (sqq < 1e-30f) sqq = 1e-30f;
        float score = sqx * sqx / sqq;
        if (s == 0 || score > best) { best = score; best_scale = sqx / sqq; }
    }
    return best_scale;
}

/* the Q4_K/Q5_K head and values: d, dmin (fp16), 12 bytes of 6-bit scales/mins, q [8][32] */
static inline __attribute__((always_inline)) int affine_superblock(const float *x, int nmax, uint8_t *head, uint8_t q[8][32]) {
    float sc[8], mn[8], smax = 0, mmax = 0;
    for (int j = 0; j < 8; j++) {
        fit_affine(x + 32 * j, 32, nmax, &sc[j], &mn[j]);
        smax = sc[j] > smax ? sc[j] : smax;
        mmax = mn[j] > mmax ? mn[j] : mmax;
    }
    uint16_t dh = f32_to_f16(smax / 63), mh = f32_to_f16(mmax / 63);
    float d = ktk_f16_to_f32(dh), dmin = ktk_f16_to_f32(mh);
    if (!isfinite(d) || !isfinite(dmin)) return KTK_ERANGE;                 /* scales past fp16 */
    uint8_t ls[8], lm[8];
    for (int j = 0; j < 8; j++) {
        ls[j] = d > 0 ? (uint8_t)clampf(rintf(sc[j] / (d > 1e-30f ? d : 1e-30f)), 0, 63) : 0;
        lm[j] = dmin > 0 ? (uint8_t)clampf(rintf(mn[j] / (dmin > 1e-30f ? dmin : 1e-30f)), 0, 63) : 0;
        float ed = d * (float)ls[j], em = dmin * (float)lm[j];
        for (int i = 0; i < 32; i++)
            q[j][i] = ed > 0 ? (uint8_t)round_clamp((x[32 * j + i] + em) / (ed > 1e-30f ? ed : 1e-30f), 0, (float)nmax)
                             : 0;
    }
    memcpy(head, &dh, 2);
    memcpy(head + 2, &mh, 2);
    uint8_t *p = head + 4;                  /* 6-bit scales and mins, llama.cpp's packing */
    for (int j = 0; j < 4; j++) {
        p[j] = (uint8_t)((ls[j] & 63) | ((ls[j + 4] >> 4) << 6));
        p[j + 4] = (uint8_t)((lm[j] & 63) | ((lm[j + 4] >> 4) << 6));
        p[j + 8] = (uint8_t)((ls[j + 4] & 15) | ((lm[j + 4] & 15) << 4));
    }
    return KTK_OK;
}

static inline __attribute__((always_inline)) void pack_nibbles(uint8_t q[8][32], uint8_t *out) {   /* sub-blocks 2c (low) and 2c+1 (high) */
    for (int c = 0; c < 4; c++)
        for (int i = 0; i < 32; i++) out[32 * c + i] = (uint8_t)((q[2 * c][i] & 15) | ((q[2 * c + 1][i] & 15) << 4));
}

static inline __attribute__((always_inline)) int q4_k_block(const float *x, uint8_t *out) {
    uint8_t q[8][32];
    if (affine_superblock(x, 15, out, q)) return KTK_ERANGE;
    pack_nibbles(q, out + 16);
    return KTK_OK;
}

static inline __attribute__((always_inline)) int q5_k_block(const float *x, uint8_t *out) {
    uint8_t q[8][32];
    if (affine_superblock(x, 31, out, q)) return KTK_ERANGE;
    for (int i = 0; i < 32; i++) {
        uint8_t h = 0;
        for (int j = 0; j < 8; j++) h |= (uint8_t)(((q[j][i] >> 4) & 1) << j);
        out[16 + i] = h;
    }
    pack_nibbles(q, out + 48);
    return KTK_OK;
}

static inline __attribute__((always_inline)) int q6_k_block(const float *x, uint8_t *out) {
    float sc[16], amax = 0;
    for (int j = 0; j < 16; j++) {
        sc[j] = fit_symmetric(x + 16 * j, 16, 31);
        amax = fabsf(sc[j]) > amax ? fabsf(sc[j]) : amax;
    }
    uint16_t dh = f32_to_f16(amax / 127);
    float d = ktk_f16_to_f32(dh);
    if (!isfinite(d)) return KTK_ERANGE;
    int8_t ls[16];
    uint8_t q[256];
    for (int j = 0; j < 16; j++) {
        ls[j] = d > 0 ? (int8_t)clampf(rintf(sc[j] / (d > 1e-30f ? d : 1e-30f)), -128, 127) : 0;
        float e = d * (float)ls[j];
        for (int i = 0; i < 16; i++)
            q[16 * j + i] = (uint8_t)((e != 0 ? round_clamp(x[16 * j + i] / e, -32, 31) : 0) + 32);
    }
    uint8_t *ql = out, *qh = out + 128;
    for (int h = 0; h < 2; h++) {           /* llama.cpp's Q6_K layout: two halves of 128 values */
        const uint8_t *v = q + 128 * h;     /* v[32*s + i]: shift group s of the half */
        for (int i = 0; i < 64; i++) {
            int lo = i < 32 ? 0 : 1;        /* ql byte i holds groups lo (low nibble) and lo+2 (high) */
            int k = i & 31;
            ql[64 * h + i] = (uint8_t)((v[32 * lo + k] & 15) | ((v[32 * (lo + 2) + k] & 15) << 4));
        }
        for (int i = 0; i < 32; i++)
            qh[32 * h + i] = (uint8_t)((v[i] >> 4) | ((v[32 + i] >> 4) << 2) | ((v[64 + i] >> 4) << 4) |
                                       ((v[96 + i] >> 4) << 6));
    }
    memcpy(out + 192, ls, 16);
    memcpy(out + 208, &dh, 2);
    return KTK_OK;
}

static int all_finite(const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) if (!isfinite(x[i])) return 0;
    return 1;
}

/* Quantize n super-blocks of 256 floats (x: n*256) into `out` (n * type size bytes): type is
 * KTK_Q4_K, KTK_Q5_K or KTK_Q6_K. Returns KTK_OK, KTK_EINVAL (bad type or pointers), or KTK_ERANGE
 * (a NaN / Inf value, or a super-block scale past fp16's range: |x| beyond ~6e7). */
/* one clone per ISA (the candidate lanes are 8 floats: one AVX register), picked at load */
__attribute__((target_clones("avx2", "default")))
int ktk_quantize_k(int type, const float *x, int64_t n, uint8_t *out) {
    if (!x || !out || n < 0) return KTK_EINVAL;
    if (type != KTK_Q4_K && type != KTK_Q5_K && type != KTK_Q6_K) return KTK_EINVAL;
    for (int64_t b = 0; b < n; b++) {
        const float *xb = x + 256 * b;
        if (!all_finite(xb, 256)) return KTK_ERANGE;                         /* NaN / Inf: refused */
        int rc = type == KTK_Q4_K ? q4_k_block(xb, out + 144 * b)
               : type == KTK_Q5_K ? q5_k_block(xb, out + 176 * b) : q6_k_block(xb, out + 210 * b);
        if (rc) return rc;
    }
    return KTK_OK;
}

/* ---- the legacy block types (Q4_0, Q5_0, Q8_0), byte for byte as the gguf package writes them ----
 * (its numpy quantizers, which follow ggml's reference: float32 arithmetic step by step, the scale
 * applied as the reciprocal of the unrounded d, d stored as fp16). `convert` spent half its time in
 * the numpy versions for q4_k_m models whose expert rows are not a multiple of 256 (Q5_0 there). */

static int argmax_abs(const float *x, int n) {
    int im = 0;
    for (int i = 1; i < n; i++) if (fabsf(x[i]) > fabsf(x[im])) im = i;
    return im;
}

/* vmax: the value of largest magnitude (signed), found once by the caller */
static void q4_0_block(const float *x, float vmax, uint8_t *out) {
    float d = vmax / -8.0f;
    float id = d == 0 ? 0.0f : 1.0f / d;
    uint8_t q[32];
    for (int i = 0; i < 32; i++) {
        float v = truncf(x[i] * id + 8.5f);
        q[i] = (uint8_t)(v > 15.0f ? 15.0f : v);
    }
    uint16_t dh = f32_to_f16(d);
    memcpy(out, &dh, 2);
    for (int j = 0; j < 16; j++) out[2 + j] = (uint8_t)(q[j] | (q[j + 16] << 4));
}

static void q5_0_block(const float *x, float vmax, uint8_t *out) {
    float d = vmax / -16.0f;
    float id = d == 0 ? 0.0f : 1.0f / d;
    uint8_t q[32];
    uint32_t qh = 0;
    for (int i = 0; i < 32; i++) {
        float v = truncf(x[i] * id + 16.5f);
        q[i] = (uint8_t)(v > 31.0f ? 31.0f : v);
        qh |= (uint32_t)((q[i] >> 4) & 1) << i;
    }
    uint16_t dh = f32_to_f16(d);
    memcpy(out, &dh, 2);
    for (int b = 0; b < 4; b++) out[2 + b] = (uint8_t)(qh >> (8 * b));
    for (int j = 0; j < 16; j++) out[6 + j] = (uint8_t)((q[j] & 15) | (q[j + 16] << 4));
}

static void q8_0_block(const float *x, float vmax, uint8_t *out) {
    float d = fabsf(vmax) / 127.0f;
    float id = d == 0 ? 0.0f : 1.0f / d;
    uint16_t dh = f32_to_f16(d);
    memcpy(out, &dh, 2);
    for (int i = 0; i < 32; i++) out[2 + i] = (uint8_t)(int8_t)roundf(x[i] * id);   /* half away from zero */
}

/* n blocks of 32 floats -> Q4_0 (18 bytes each), Q5_0 (22) or Q8_0 (34). KTK_OK, KTK_EINVAL, or
 * KTK_ERANGE for a NaN / Inf value or a block scale past fp16's range (blocks before it written). */
int ktk_quantize_legacy(int type, const float *x, int64_t n, uint8_t *out) {
    if (!x || !out || n < 0) return KTK_EINVAL;
    int64_t ts = type == KTK_Q4_0 ? 18 : type == KTK_Q5_0 ? 22 : type == KTK_Q8_0 ? 34 : 0;
    float qmax = type == KTK_Q4_0 ? 8.0f : type == KTK_Q5_0 ? 16.0f : 127.0f;
    if (!ts) return KTK_EINVAL;
    for (int64_t b = 0; b < n; b++) {
        const float *xb = x + 32 * b;
        if (!all_finite(xb, 32)) return KTK_ERANGE;
        float vmax = xb[argmax_abs(xb, 32)];
        if (fabsf(vmax) / qmax > 65504.0f) return KTK_ERANGE;
        if (type == KTK_Q4_0) q4_0_block(xb, vmax, out + ts * b);
        else if (type == KTK_Q5_0) q5_0_block(xb, vmax, out + ts * b);
        else q8_0_block(xb, vmax, out + ts * b);
    }
    return KTK_OK;
}
