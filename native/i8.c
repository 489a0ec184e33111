/* I8 copies: expert matrices requantized at load to 8 bits for the AMX-INT8 prefill path.
 *
 * A matrix of `rows` rows (rows % 32 == 0) of n values (n % 64 == 0) becomes, per expert:
 *   - rows * n int8 values, tile-major: for each block of 32 rows and 64-value k-step ks, the
 *     block's 32 rows x 64 values at (block * n / 64 + ks) * 2048 + r * 64 (each 16-row A tile of a
 *     k-step is 1 KiB of contiguous memory, as ktk_amx_gemm_i8 loads it);
 *   - then f32 scales [rows][n / G]: row r, group g of G values (G: a multiple of 64 that divides n,
 *     at most KTK_I8_GMAX; by default ktk_i8_group(n): 256 for V2-Lite's n = 2048, 704 for its
 *     down's 1408), symmetric: value = q * scale, q in [-127, 127],
 *     scale = max |w| / 127 over the group of the f32 dequantization's values w.
 * The expert's bytes are rounded up to 64 (ktk_i8_expert_bytes); experts are back to back.
 * Requantizing adds at most half a step (scale / 2) per value to the GGML type's own error.
 *
 * Tokens for the tile GEMM (ktk_amx_pack_x_i8): per token and group of G values, the same
 * symmetric 8 bits, in the VNNI quad layout of a B tile: token tile tt, k-step ks at
 * pk[(tt * n / 64 + ks) * 1024], byte q * 64 + t * 4 + i = token tt * 16 + t, value ks * 64 + 4q + i;
 * scales at ts[(tt * NG + g) * 16 + t] (NG = n / G); tokens past nt are zeros with scale 0.
 *
 * I4 copies (ktk_i4_repack, opt-in, `int8_bits: 4`): 4 bits a weight, symmetric, with an integer sub-scale per
 * 64 values under each group's float scale, so that the tiles multiply exact bytes and a group's sums need one
 * scaling, as I8's: value = S * k * q, q in [-8, 7] (stored as the nibble q + 8), k in [1, 16] (stored as k - 1)
 * for each sub-group of 64 values, S per row and group of G values (by default the longest up to 1024 that
 * divides n, ktk_i4_group: 1024 for V2-Lite's 2048, 704 for its 1408). k * q is an int8 in [-128, 112], which the
 * GEMM gets from the nibble with one byte shuffle (ktk_amx_gemm_i4). Per expert:
 *   - rows * n / 2 bytes of nibbles: block of 32 rows b, k-step ks at (b * n / 64 + ks) * 1024, byte
 *     i * 64 + j holding row b*32 + i's value ks*64 + j in its low nibble and row b*32 + 16 + i's in its
 *     high one (so one AVX-512 mask gives a 16-row A tile's row, one shift and mask the other's);
 *   - then f32 scales S [rows][n / G];
 *   - then the sub-scales, one byte each (k - 1), block of 32 rows b, k-step ks at (b * n / 64 + ks) * 32 + r.
 * Each sub-group needs a step of at least m = max(max w / 7, -min w / 8) to hold its values unclipped; S is the
 * group's largest m / 16, and k the one of ceil(m / S), one and two below it (those clip the extremes to save
 * steps for the rest) whose values have the least squared error against the f32 dequantization's (a smaller k
 * only where it is less by more than 0.01%, so that a near tie keeps every value within half a step). On the
 * random V2-Lite-shaped blocks of scripts/prefill_copy_error.py the weights' error is 0.093 of their norm,
 * against 0.108 for the 4-bit copies with a float scale and zero per 256 values these replaced (thirtieth
 * session). */
#include "ktk_int.h"
#include <math.h>
#include <stdlib.h>

/* Each group costs the tile GEMM a flush of its int32 sums into C (ktk_amx_gemm_i8): on the lent Xeon,
 * a 32-row x 48-token block of K = 1408 took 3.2 us hot with G = 128 and 2.1 us with G = 704
 * (scripts/amx_parts.c i8), and a V2-Lite Q4_K layer's error went from 0.0080 to 0.0084 (nineteenth
 * session, docs/benchmarks.md). Groups of 256 or more keep that flush under a quarter of the tile
 * work; groups much longer let one large value coarsen the steps of more of its neighbours. */
int64_t ktk_i8_group(int64_t n) {
    if (n <= 0 || n % 64) return -1;
    for (int64_t G = 256; G <= KTK_I8_GMAX && G <= n; G += 64)
        if (n % G == 0) return G;
    for (int64_t G = 256 - 64; G > 64; G -= 64)
        if (n % G == 0) return G;
    return 64;
}

/* The I4 copies' default group: no sums to scale inside it, so the longest allowed (their sub-scales keep the
 * steps local) */
int64_t ktk_i4_group(int64_t n) {
    if (n <= 0 || n % 64) return -1;
    for (int64_t G = KTK_I8_GMAX < n ? KTK_I8_GMAX : n; G >= 64; G -= 64)
        if (n % G == 0) return G;
    return 64;
}

int64_t ktk_ix_group(int64_t n, int bits) { return bits == 4 ? ktk_i4_group(n) : ktk_i8_group(n); }

/* G itself (0: the default of the width), or -1 where it does not fit n */
static int64_t group_for(int64_t n, int64_t G, int bits) {
    if (n <= 0 || n % 64) return -1;
    if (G == 0) return ktk_ix_group(n, bits);
    return G >= 64 && G <= KTK_I8_GMAX && G % 64 == 0 && n % G == 0 ? G : -1;
}

int64_t ktk_i8_expert_bytes(int64_t rows, int64_t n, int64_t G) {
    G = group_for(n, G, 8);
    if (G < 0 || rows < 32 || rows % 32) return -1;
    return (rows * n + rows * (n / G) * 4 + 63) / 64 * 64;
}

int64_t ktk_i4_expert_bytes(int64_t rows, int64_t n, int64_t G) {
    G = group_for(n, G, 4);
    if (G < 0 || rows < 32 || rows % 32) return -1;
    return (rows * n / 2 + rows * (n / G) * 4 + rows * (n / 64) + 63) / 64 * 64;
}

/* one group of G floats to int8 (q = round(w * 127 / max|w|)), returning its scale max|w| / 127;
 * a group of zeros: scale 0; a group with a NaN or an infinity: zeros with scale NaN, so that every
 * product with it is NaN, as in the f32 and bf16 paths */
static inline float quant_group(const float *w, int64_t G, int8_t *q) {
    float amax = 0.f;
    int nan = 0;
    for (int64_t i = 0; i < G; i++) { float a = fabsf(w[i]); nan |= a != a; if (a > amax) amax = a; }
    if (nan || !(amax > 0.f) || !isfinite(amax)) {
        for (int64_t i = 0; i < G; i++) q[i] = 0;
        return nan || amax > 0.f ? NAN : 0.f;
    }
    const float inv = 127.f / amax;
    for (int64_t i = 0; i < G; i++) {
        float v = nearbyintf(w[i] * inv);
        q[i] = (int8_t)(v > 127.f ? 127.f : v < -127.f ? -127.f : v);
    }
    return amax / 127.f;
}

/* q = round(w / st) clamped to [-8, 7] (clamped first, then rounded to nearest even by adding and taking away
 * 1.5 * 2^52, as nearbyint does in the default mode, without a call) */
static inline double q4_of(float w, double st) {
    const double R = 6755399441055744.0;
    double v = (double)w / st;
    v = v > 7.0 ? 7.0 : v < -8.0 ? -8.0 : v;
    return (v + R) - R;
}

/* The squared errors of one sub-group of 64 values at three steps st[0 .. 2], in float with a multiplication by
 * each step's inverse: enough to choose among them (the values themselves come from q4_of). Over half of an I4
 * repack's time went here; compiled for AVX-512 and AVX2 as well and picked at load (GCC's target clones), it is
 * vectorized wide. */
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
static void sub_err4(const float *w, const double st[3], double e[3]) {
    const float R = 12582912.f;   /* 1.5 * 2^23 */
    for (int c = 0; c < 3; c++) {
        const float s = (float)st[c], inv = (float)(1.0 / st[c]);
        float acc[16] = {0};   /* 16 running sums, a lane each, which lets the compiler vectorize the loop */
        for (int i = 0; i < 64; i += 16)
            for (int l = 0; l < 16; l++) {
                float v = w[i + l] * inv;
                v = v > 7.f ? 7.f : v < -8.f ? -8.f : v;
                const float d = ((v + R) - R) * s - w[i + l];
                acc[l] += d * d;
            }
        double t = 0;
        for (int l = 0; l < 16; l++) t += acc[l];
        e[c] = t;
    }
}

/* One group of G values to an I4 copy's (layout above): nibbles to q, the G / 64 sub-scales (k - 1) to kc, one
 * byte each, returning S. A group of zeros: S 0 (nibbles 8, k 1); a group with a NaN or an infinity: S NaN, so
 * that every product with it is NaN, as in the f32 and bf16 paths. */
static float quant_group4(const float *w, int64_t G, uint8_t *q, uint8_t *kc) {
    const int64_t NS = G / 64;
    double need[KTK_I8_GMAX / 64], top = 0;
    int bad = 0;
    for (int64_t j = 0; j < NS; j++) {
        double hi = 0, lo = 0;
        for (int i = 0; i < 64; i++) {
            const float v = w[j * 64 + i];
            bad |= !isfinite(v);
            hi = v > hi ? v : hi;
            lo = v < lo ? v : lo;
        }
        need[j] = hi / 7.0 > -lo / 8.0 ? hi / 7.0 : -lo / 8.0;
        top = need[j] > top ? need[j] : top;
    }
    float S = (float)(top / 16.0);
    if (S > 0.f && (double)S * 16.0 < top) S = nextafterf(S, INFINITY);   /* k = 16 holds the largest unclipped */
    if (bad || !(S > 0.f)) {
        for (int64_t i = 0; i < G; i++) q[i] = 8;
        for (int64_t j = 0; j < NS; j++) kc[j] = 0;
        return bad ? NAN : 0.f;
    }
    for (int64_t j = 0; j < NS; j++) {
        double k0 = ceil(need[j] / S);
        k0 = k0 < 1.0 ? 1.0 : k0 > 16.0 ? 16.0 : k0;
        const int kk[3] = {(int)k0, k0 > 1 ? (int)k0 - 1 : 1, k0 > 2 ? (int)k0 - 2 : 1};
        const double st[3] = {(double)S * kk[0], (double)S * kk[1], (double)S * kk[2]};
        double e[3];
        sub_err4(w + j * 64, st, e);
        int c = 0;   /* a smaller k only where its error is clearly less: the float sums are not exact */
        if (e[1] < e[c] * (1 - 1e-4)) c = 1;
        if (e[2] < e[c] * (1 - 1e-4)) c = 2;
        for (int i = 0; i < 64; i++) q[j * 64 + i] = (uint8_t)(q4_of(w[j * 64 + i], st[c]) + 8.0);
        kc[j] = (uint8_t)(kk[c] - 1);
    }
    return S;
}

typedef struct {
    const ktk_kernels *K;
    int type, bits;
    const uint8_t *src;
    int64_t src_rb, src_es, rows, n, G, es;
    uint8_t *dst;
    int fail;
} i8_ctx;

/* an I4 block of 32 rows: all 32 dequantized and requantized, then paired into nibbles */
static void repack_block4(i8_ctx *c, int64_t e, int64_t b) {
    const int64_t n = c->n, NG = n / c->G, KS = n / 64, NS = c->G / 64;
    float *w = malloc((size_t)n * sizeof(float));
    uint8_t *q = malloc((size_t)(32 * n));
    if (!w || !q) { free(w); free(q); c->fail = 1; return; }
    uint8_t *base = c->dst + e * c->es, *dst = base + b * 32 * n / 2, kc[KTK_I8_GMAX / 64];
    float *ws = (float *)(base + c->rows * n / 2);
    uint8_t *wk = base + c->rows * n / 2 + c->rows * NG * 4 + b * KS * 32;
    for (int r = 0; r < 32; r++) {
        const int64_t row = b * 32 + r;
        c->K->dequant(c->type, c->src + e * c->src_es + row * c->src_rb, w, n);
        for (int64_t g = 0; g < NG; g++) {
            ws[row * NG + g] = quant_group4(w + g * c->G, c->G, q + r * n + g * c->G, kc);
            for (int64_t j = 0; j < NS; j++) wk[(g * NS + j) * 32 + r] = kc[j];
        }
    }
    for (int64_t ks = 0; ks < KS; ks++)
        for (int i = 0; i < 16; i++)
            for (int j = 0; j < 64; j++)
                dst[ks * 1024 + i * 64 + j] = (uint8_t)(q[i * n + ks * 64 + j] | q[(16 + i) * n + ks * 64 + j] << 4);
    free(w); free(q);
}

static void repack_item(void *ctx, int phase, int64_t item, int tid) {
    (void)phase; (void)tid;
    i8_ctx *c = ctx;
    const int64_t nb = c->rows / 32, e = item / nb, b = item % nb, NG = c->n / c->G;
    if (c->bits == 4) { repack_block4(c, e, b); return; }
    float *w = malloc((size_t)c->n * sizeof(float));
    if (!w) { c->fail = 1; return; }
    int8_t *q = (int8_t *)(c->dst + e * c->es) + b * 32 * c->n, tmp[KTK_I8_GMAX];
    float *ws = (float *)(c->dst + e * c->es + c->rows * c->n);
    for (int r = 0; r < 32; r++) {
        const int64_t row = b * 32 + r;
        c->K->dequant(c->type, c->src + e * c->src_es + row * c->src_rb, w, c->n);
        for (int64_t g = 0; g < NG; g++) {   /* the group's values go to G / 64 k-steps, 64 bytes each */
            ws[row * NG + g] = quant_group(w + g * c->G, c->G, tmp);
            for (int64_t i = 0; i < c->G; i += 64) memcpy(q + ((g * c->G + i) / 64) * 2048 + r * 64, tmp + i, 64);
        }
    }
    free(w);
}

static int repack(ktk_pool *p, int bits, int type, const uint8_t *src, int64_t src_rb, int64_t src_es, int64_t n_experts,
                  int64_t rows, int64_t n, int64_t G, uint8_t *dst) {
    const int64_t es = bits == 4 ? ktk_i4_expert_bytes(rows, n, G) : ktk_i8_expert_bytes(rows, n, G);
    const ktk_kernels *K = ktk_kernels_for(ktk_best_isa());
    if (!src || !dst || es < 0 || n_experts < 1 || type < 0 || type >= KTK_NTYPES || !K || !K->dequant ||
        ktk_row_bytes(type, n) <= 0 || src_rb != ktk_row_bytes(type, n) || src_es < rows * src_rb)
        return KTK_EINVAL;
    i8_ctx c = {K, type, bits, src, src_rb, src_es, rows, n, group_for(n, G, bits), es, dst, 0};
    int64_t items = n_experts * (rows / 32);
    if (p && ktk_pool_run_async(p, repack_item, &c, 1, &items) == KTK_OK) {
        int rc = ktk_pool_wait(p);
        if (rc) return rc;
    } else {
        for (int64_t i = 0; i < items; i++) repack_item(&c, 0, i, 0);
    }
    return c.fail ? KTK_ENOMEM : KTK_OK;
}

int ktk_i8_repack(ktk_pool *p, int type, const uint8_t *src, int64_t src_rb, int64_t src_es, int64_t n_experts,
                  int64_t rows, int64_t n, int64_t G, uint8_t *dst) {
    return repack(p, 8, type, src, src_rb, src_es, n_experts, rows, n, G, dst);
}

int ktk_i4_repack(ktk_pool *p, int type, const uint8_t *src, int64_t src_rb, int64_t src_es, int64_t n_experts,
                  int64_t rows, int64_t n, int64_t G, uint8_t *dst) {
    return repack(p, 4, type, src, src_rb, src_es, n_experts, rows, n, G, dst);
}

int ktk_i8_dequant(const uint8_t *w, int64_t rows, int64_t n, int64_t G, float *dst) {
    if (!w || !dst || ktk_i8_expert_bytes(rows, n, G) < 0) return KTK_EINVAL;
    G = group_for(n, G, 8);
    const int8_t *q = (const int8_t *)w;
    const float *ws = (const float *)(w + rows * n);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t k = 0; k < n; k++)
            dst[r * n + k] = (float)q[((r / 32) * (n / 64) + k / 64) * 2048 + (r % 32) * 64 + k % 64] * ws[r * (n / G) + k / G];
    return KTK_OK;
}

int ktk_i4_dequant(const uint8_t *w, int64_t rows, int64_t n, int64_t G, float *dst) {
    if (!w || !dst || ktk_i4_expert_bytes(rows, n, G) < 0) return KTK_EINVAL;
    G = group_for(n, G, 4);
    const int64_t NG = n / G, KS = n / 64;
    const float *ws = (const float *)(w + rows * n / 2);
    const uint8_t *wk = w + rows * n / 2 + rows * NG * 4;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t k = 0; k < n; k++) {
            const uint8_t byte = w[((r / 32) * KS + k / 64) * 1024 + (r % 16) * 64 + k % 64];
            const int q = (r % 32 < 16 ? byte & 15 : byte >> 4) - 8, c = (wk[((r / 32) * KS + k / 64) * 32 + r % 32] & 15) + 1;
            dst[r * n + k] = ws[r * NG + k / G] * (float)(c * q);   /* the GEMM's order: the int8 c * q, then S */
        }
    return KTK_OK;
}

/* the 4-byte quads of 16 values k .. k + 15 (k % 16 == 0) of token t to their B-tile rows */
static inline void put_quads(int8_t *pk, int64_t KS, int64_t tt, int t, int64_t k, const int8_t *q16) {
    for (int j = 0; j < 16; j += 4) {
        const int64_t kk = k + j;
        memcpy(pk + (tt * KS + kk / 64) * 1024 + (kk % 64) / 4 * 64 + t * 4, q16 + j, 4);
    }
}

/* quant_group, the group's quads written straight to the B tiles */
static float quant_group_tiles_c(const float *w, int64_t G, int8_t *pk, int64_t KS, int64_t tt, int t, int64_t k0) {
    int8_t tmp[KTK_I8_GMAX];
    const float s = quant_group(w, G, tmp);
    for (int64_t i = 0; i < G; i += 16) put_quads(pk, KS, tt, t, k0 + i, tmp + i);
    return s;
}

#if defined(__x86_64__)
#include <immintrin.h>
#include "transpose.h"
/* quant_group with AVX-512 (the same values: cvtps2dq rounds to nearest even, as nearbyintf does in
 * the default rounding mode) into q, contiguous */
__attribute__((target("avx512f,avx512bw,avx512vl")))
static float quant_group_512(const float *w, int64_t G, int8_t *q) {
    __m512 mx = _mm512_setzero_ps();
    __mmask16 nan = 0;   /* (max drops NaN operands) */
    for (int64_t i = 0; i < G; i += 16) {
        const __m512 v = _mm512_loadu_ps(w + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
    }
    const float amax = _mm512_reduce_max_ps(mx);
    if (nan || !(amax > 0.f) || !isfinite(amax)) return quant_group(w, G, q);   /* scale 0 or NaN: the portable code's */
    const __m512 inv = _mm512_set1_ps(127.f / amax);   /* (|w| * 127 / amax <= 127: the saturation changes nothing) */
    for (int64_t i = 0; i < G; i += 16)
        _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(w + i), inv))));
    return amax / 127.f;
}

/* One token tile: for each group, its 16 tokens quantized into rows of a scratch (G bytes apart),
 * then each of the group's k-steps moved to its B tile as 8 x 8 transposes of 4-byte quads (a tile
 * row is one quad of each of the 16 tokens). Writing quads one by one instead, 4 bytes to each of 16
 * lines per token, took 0.6 ms of a V2-Lite layer at 16 threads (twenty-fourth session). */
static int pack_pf_flag = -1;   /* KTINJECT_PACK_PREFETCH=0: pack_tile_512 does not prefetch the next token (A/B) */

__attribute__((target("avx512f,avx512bw,avx512vl")))
static void pack_tile_512(const float *const *X, int64_t nt, int64_t tt, int64_t K, int64_t G, int8_t *pk, float *ts) {
    const int64_t KS = K / 64, NG = K / G;
    int pf_next = __atomic_load_n(&pack_pf_flag, __ATOMIC_RELAXED);   /* read once; racing first readers agree */
    if (pf_next < 0) {
        const char *e = getenv("KTINJECT_PACK_PREFETCH");
        pf_next = !(e && e[0] == '0');
        __atomic_store_n(&pack_pf_flag, pf_next, __ATOMIC_RELAXED);
    }
    int8_t q[16 * KTK_I8_GMAX] __attribute__((aligned(64)));
    for (int64_t g = 0; g < NG; g++) {
        for (int t = 0; t < 16; t++) {
            const int64_t tok = tt * 16 + t, at = (tt * NG + g) * 16 + t;
            if (pf_next && tok + 1 < nt)   /* the next token's group starts elsewhere (a gather): its first 1 KiB, */
                for (int64_t i = 0; i < G && i < 256; i += 16)   /* after which the hardware streams the rest */
                    _mm_prefetch((const char *)(X[tok + 1] + g * G + i), _MM_HINT_T0);
            if (tok < nt) {
                ts[at] = quant_group_512(X[tok] + g * G, G, q + t * G);
            } else {
                ts[at] = 0.f;
                memset(q + t * G, 0, (size_t)G);
            }
        }
        for (int64_t ks = 0; ks < G / 64; ks++) {
            const uint32_t *row[16];
            for (int t = 0; t < 16; t++) row[t] = (const uint32_t *)(q + t * G + ks * 64);
            ktk_tile_from_rows(row, (uint32_t *)(pk + (tt * KS + g * G / 64 + ks) * 1024));   /* [quad p][token t] */
        }
    }
}
#define HAVE_TILES_512 1

/* The tokens quantized once (ktk_amx_quant_rows_i8), then each expert's tile packing from those bytes
 * (ktk_amx_pack_q_i8): a token's groups are quantized once, not once for each of its k experts, and the packing
 * gathers 1 byte a value instead of 4. The same values, scales and zero terms as ktk_amx_pack_x_i8's. */
__attribute__((target("avx512f,avx512bw,avx512vl")))
void ktk_amx_quant_rows_i8(const float *X, int64_t ldx, int64_t nt, int64_t K, int64_t G, int8_t *q, float *qs) {
    const int64_t NG = K / G;
    for (int64_t t = 0; t < nt; t++)
        for (int64_t g = 0; g < NG; g++) qs[t * NG + g] = quant_group_512(X + t * ldx + g * G, G, q + t * K + g * G);
}

__attribute__((target("avx512f,avx512bw,avx512vl")))
void ktk_amx_pack_q_i8(const int8_t *q, const float *qs, const int64_t *idx, int64_t nt, int64_t K, int64_t G,
                       int8_t *pk, float *ts) {
    const int64_t KS = K / 64, NG = K / G, ntt = (nt + 15) / 16;
    /* (an unaligned caller's buffer: cached stores, as in ktk_amx_pack_b) */
    const int nt_store = ktk_pack_nt() && ((uintptr_t)pk & 63) == 0;
    for (int64_t tt = 0; tt < ntt; tt++) {
        const uint32_t *base[16];   /* tokens past nt: a row of zeros */
        for (int t = 0; t < 16; t++) {
            const int64_t j = tt * 16 + t;
            base[t] = j < nt ? (const uint32_t *)(q + idx[j] * K) : NULL;
            for (int64_t g = 0; g < NG; g++) ts[(tt * NG + g) * 16 + t] = j < nt ? qs[idx[j] * NG + g] : 0.f;
        }
        for (int64_t ks = 0; ks < KS; ks++)   /* [quad p][token t], as pack_tile_512 */
            ktk_tile_from_rows_512(base, ks * 16, (uint32_t *)(pk + (tt * KS + ks) * 1024), nt_store);
    }
    if (nt_store) _mm_sfence();   /* the streamed blocks visible before the pool counts this item done */
}

int ktk_amx_pack_once_usable(void) { return (int)(ktk_cpu_features() >> KTK_ISA_AVX512 & 1); }
#else
/* Built without AVX-512: ktk_amx_pack_once_usable says so, and the layer packs each expert's tokens itself
 * (ktk_amx_pack_x_i8). Reaching these would be a bug in the caller: stop loudly rather than leave the
 * packing unwritten. */
void ktk_amx_quant_rows_i8(const float *X, int64_t ldx, int64_t nt, int64_t K, int64_t G, int8_t *q, float *qs) {
    (void)X; (void)ldx; (void)nt; (void)K; (void)G; (void)q; (void)qs;
    abort();
}
void ktk_amx_pack_q_i8(const int8_t *q, const float *qs, const int64_t *idx, int64_t nt, int64_t K, int64_t G,
                       int8_t *pk, float *ts) {
    (void)q; (void)qs; (void)idx; (void)nt; (void)K; (void)G; (void)pk; (void)ts;
    abort();
}
int ktk_amx_pack_once_usable(void) { return 0; }
#endif

void ktk_amx_pack_x_i8(const float *const *X, int64_t nt, int64_t K, int64_t G, int8_t *pk, float *ts) {
    const int64_t KS = K / 64, NG = K / G, ntt = (nt + 15) / 16;
    static const int8_t zeros[16];
#if defined(HAVE_TILES_512)   /* the AMX path always has AVX-512; direct callers (the C drivers) may not */
    if (ktk_cpu_features() >> KTK_ISA_AVX512 & 1) {
        for (int64_t tt = 0; tt < ntt; tt++) pack_tile_512(X, nt, tt, K, G, pk, ts);
        return;
    }
#endif
    for (int64_t tt = 0; tt < ntt; tt++)
        for (int t = 0; t < 16; t++) {
            const int64_t tok = tt * 16 + t;
            for (int64_t g = 0; g < NG; g++) {
                const int64_t at = (tt * NG + g) * 16 + t;
                if (tok < nt) {
                    ts[at] = quant_group_tiles_c(X[tok] + g * G, G, pk, KS, tt, t, g * G);
                } else {
                    ts[at] = 0.f;
                    for (int64_t i = 0; i < G; i += 16) put_quads(pk, KS, tt, t, g * G + i, zeros);
                }
            }
        }
}
