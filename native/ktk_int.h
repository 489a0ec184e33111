/* Internal declarations shared by the ktk sources (not part of the cffi surface). */
#ifndef KTK_INT_H
#define KTK_INT_H
#include "ktk.h"
#include <string.h>

#define QK 32          /* activation block: 32 values */
#define QKK 256        /* K-quant super-block */

/* Activations quantized on the fly. One vector of n values becomes an "activation record":
 * n/32 ktk_q8 blocks (for Q4_0/Q5_0/Q8_0), then, when n % 256 == 0, n/256 ktk_q8k blocks (for
 * the K-quants, whose integer sums then need only one float multiply per 256 values). */
typedef struct {
    float d;          /* x[i] ~= d * q[i] */
    float ds;         /* d * sum(q) */
    int16_t s[2];     /* sum of q over each 16-half */
    int8_t q[QK];
} ktk_q8;
typedef struct {
    float d;
    int16_t bsums[16];  /* sum of q over each 16 values */
    int8_t q[QKK];
} ktk_q8k;
static inline size_t ktk_act_bytes(int64_t n) {
    return (size_t)(n / QK) * sizeof(ktk_q8) + (n % QKK ? 0 : (size_t)(n / QKK) * sizeof(ktk_q8k));
}
static inline const ktk_q8k *ktk_act_k(const ktk_q8 *xq, int64_t n) { return (const ktk_q8k *)(xq + n / QK); }

/* GGML blocks (little-endian, packed as in ggml-common.h). */
typedef struct { uint16_t d; uint8_t qs[16]; } blk_q4_0;                      /* 18 bytes */
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; } blk_q5_0;             /* 22 bytes */
typedef struct { uint16_t d; int8_t qs[32]; } blk_q8_0;                       /* 34 bytes */
/* Q2_K: 16 sub-blocks of 16 values; scales[j] = 4-bit scale sc | 4-bit min m << 4; value v = 128n + 32s + l
 * (l < 32, sub-block v / 16) is q = bits 2s, 2s+1 of qs[32n + l]: w = d * sc * q - dmin * m */
typedef struct { uint8_t scales[16]; uint8_t qs[64]; uint16_t d, dmin; } blk_q2_k;                 /* 84 */
/* Q3_K: 16 sub-blocks of 16 values, 6-bit scales (minus 32) packed in 12 bytes (ktk_q3k_scales); value
 * v = 128n + 32s + l: low bits 2s, 2s+1 of qs[32n + l], bit 2 from bit 4n + s of hmask[l]; w = d * sc * (q - 4) */
typedef struct { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; uint16_t d; } blk_q3_k;   /* 110 */
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } blk_q4_k;           /* 144 */
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; } blk_q5_k;  /* 176 */
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; } blk_q6_k;   /* 210 */
typedef struct { uint16_t d; uint16_t scales_h; uint8_t scales_l[4]; uint8_t qs[128]; } blk_iq4_xs;   /* 136 */

/* IQ4_NL / IQ4_XS non-linear 4-bit grid */
static const int8_t ktk_kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
/* the 6-bit scale of sub-block ib (0..7) of an IQ4_XS super-block, minus 32 */
static inline int ktk_iq4xs_scale(const blk_iq4_xs *x, int ib) {
    return (int)(((x->scales_l[ib / 2] >> (4 * (ib % 2))) & 0xf) | (((x->scales_h >> (2 * ib)) & 3) << 4)) - 32;
}

/* y = dot(row, x) over n values; xf: floats, xq: the activation record of the same values. */
typedef float (*ktk_dot_fn)(const uint8_t *row, const float *xf, const ktk_q8 *xq, int64_t n);
/* out[r] = dot(row + r * rs, x) for r < nrows (rows rs bytes apart): the decode kernel, which
 * shares activation loads and scales between rows (same arguments as ktk_dot_fn otherwise).
 * next: NULL, or the rows the caller reads after these, row for row (next + r * rs follows row r);
 * the kernel prefetches them while it reads its own rows. Rows read side by side are best kept
 * in different 4 KiB pages (rs >= 4 KiB, or rows that each continue a sequential stream): the
 * hardware prefetchers follow several streams, but not several interleaved in one page. */
typedef void (*ktk_dotn_fn)(const uint8_t *row, int64_t rs, int nrows, const float *xf, const ktk_q8 *xq, int64_t n,
                            float *out, const uint8_t *next);
/* the layer's hidden size (moe.c): a job record's `hidden` must equal it (hostjob.c) */
int64_t ktk_moe_hidden(const struct ktk_moe *m);
static inline void ktk_prefetch(const uint8_t *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const void *)((uintptr_t)p + (uintptr_t)o), 0, 3);
}
/* out[r] = dot(row r, x) for r < nrows, rows rs apart (linear.c): chunks of 64 rows in 16 passes of
 * four rows 16 apart, each pass prefetching the next one's rows when pf is set, as the MoE decode
 * reads its rows (four streams that each run sequentially; four rows side by side, read block by
 * block, defeat the hardware prefetchers), the rest in one call; the same values as one dotn call. */
void ktk_dotn_spread(ktk_dotn_fn dotn, const uint8_t *row, int64_t rs, int64_t nrows, const float *xf,
                     const ktk_q8 *xq, int64_t n, float *out, int pf);
/* a ktk_dotn_fn that loops over a ktk_dot_fn (types without a multi-row kernel) */
#define KTK_DOTN_LOOP(NAME, DOT, TYPE)                                                                       \
    static void NAME(const uint8_t *row, int64_t rs, int nrows, const float *xf, const ktk_q8 *xq, int64_t n, \
                     float *out, const uint8_t *next) {                                                     \
        for (int r = 0; r < nrows; r++) {                                                                   \
            if (next) ktk_prefetch((const uint8_t *)((uintptr_t)next + (uintptr_t)(r * rs)), ktk_row_bytes(TYPE, n)); \
            out[r] = DOT(row + r * rs, xf, xq, n);                                                          \
        }                                                                                                   \
    }
/* C[t*ldc + r] = dot(W[r], X[t]) for r < R, t < NT; W: [R, K] f32, X: NT pointers to K floats. */
typedef void (*ktk_gemm_fn)(const float *W, int64_t R, int64_t K, const float *const *X, int64_t NT,
                            float *C, int64_t ldc);

#define KTK_NTYPES 32
typedef struct {
    ktk_dot_fn dot[KTK_NTYPES];
    ktk_dotn_fn dotn[KTK_NTYPES];   /* set wherever dot is */
    void (*quant_act)(const float *x, ktk_q8 *q, int64_t n);   /* fills the activation record */
    ktk_gemm_fn gemm;
    /* optional (NULL: the grouped path multiplies with gemm): the expert's tokens packed once
     * (ktk_pack_f32_panels, 8 tokens a panel for AVX2, 16 for AVX-512), then C[r*ldc + t] =
     * W[r] . token t (R % 8 == 0, t < nt rounded up to the panel width, ldc >= that) */
    void (*pack_f32)(const float *const *X, int64_t nt, int64_t K, float *pk);
    void (*gemm_packed)(const float *W, int64_t R, int64_t K, const float *pk, int64_t nt, float *C, int64_t ldc);
    /* optional (AVX2, AVX-512; NULL in scalar): the grouped path in 8-bit integers, for the types
     * in u8_types. pack_q8: the expert's nt tokens quantized per 32 values as quant_act does
     * (d = max|x| / 127, q = round(x / d)), in panels of 16 tokens: panel g at pk + g * K * 16 holds,
     * for every 4 values k .. k+3, the 16 tokens' 4 bytes (64 bytes); ps + (g * K / 32 + b) * 64
     * holds block b's 16 values of d, then of d * sum(q) over its 32 values, over its first 16 and
     * over its last 16 (zeros past nt). rows_u8: nrows GGML rows (rb bytes apart) to bytes
     * U[r * K + k] and, per row r and group j of G values (ktk_u8_group: 16 for Q2_K, Q3_K, Q6_K, else 32),
     * S and Mn at [r * K / G + j] with weight = S * U + Mn (S, Mn the f32 dequantization's own
     * products). gemm_q8: C[r * ldc + t] = sum over groups of S * d * (U . q) + Mn * d * sum(q),
     * for r < R (R % 4 == 0) and t < nt rounded up to 16 (ldc >= that); flags: ktk_u8_flags. */
    void (*pack_q8)(const float *const *X, int64_t nt, int64_t K, int8_t *pk, float *ps);
    void (*rows_u8)(int type, const uint8_t *rows, int64_t rb, int nrows, int64_t K, uint8_t *U, float *S, float *Mn);
    void (*gemm_q8)(const uint8_t *U, const float *S, const float *Mn, int64_t R, int64_t K, const int8_t *pk,
                    const float *ps, int64_t nt, float *C, int64_t ldc, int flags);
    uint32_t u8_types;   /* bit t: rows_u8 / gemm_q8 take type t */
    void (*dequant)(int type, const uint8_t *src, float *dst, int64_t n);   /* one row */
    void (*to_bf16)(const float *x, uint16_t *y, int64_t n);
    uint64_t (*stream)(const uint8_t *p, size_t n);   /* read n bytes (n % 256 == 0), return a checksum */
} ktk_kernels;

#define KTK_Q8_U4 1    /* gemm_q8 flags: every U <= 15 */
#define KTK_Q8_G16 2   /* S, Mn per 16 values */
#define KTK_Q8_U8 4    /* U up to 255 (offset 8-bit types) */
static inline int ktk_u8_group(int type) {   /* values per S, Mn */
    return type == KTK_Q6_K || type == KTK_Q2_K || type == KTK_Q3_K ? 16 : 32;
}
static inline int ktk_u8_flags(int type) {   /* the gemm_q8 flags of a u8 type (U <= 31 otherwise) */
    return (type == KTK_Q4_0 || type == KTK_Q4_K || type == KTK_Q2_K || type == KTK_Q3_K ? KTK_Q8_U4 : 0) |
           (ktk_u8_group(type) == 16 ? KTK_Q8_G16 : 0) | (type == KTK_Q8_0 || type == KTK_IQ4_XS ? KTK_Q8_U8 : 0);
}
void ktk_pack_f32_panels(const float *const *X, int64_t nt, int64_t K, float *pk, int pw);   /* AVX2; pw 8 or 16 */
void ktk_silu_mul_avx2(float *g, const float *u, int64_t ldc, int rows);   /* g = SiLU(g) * u, ldc % 8 == 0 */

extern const ktk_kernels ktk_kernels_scalar;
extern const ktk_kernels ktk_kernels_avx2;
extern const ktk_kernels ktk_kernels_avx512;
const ktk_kernels *ktk_kernels_for(int isa);   /* NULL if not usable here */

/* helpers (scalar) */
float ktk_f16_to_f32(uint16_t h);
static inline float ktk_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline uint16_t ktk_f32_to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                          /* round to nearest even */
    return (uint16_t)(u >> 16);
}
/* All 8 six-bit scales and mins of a Q4_K / Q5_K block at once, as the bytes of four words:
 * w[0], w[1]: scales 0-3, 4-7; w[2], w[3]: mins 0-3, 4-7 (ktk_scale_min_k4's values). */
static inline void ktk_scale_min_k4_all(const uint8_t *q, uint32_t w[4]) {
    uint32_t u0, u1, u2;
    memcpy(&u0, q, 4); memcpy(&u1, q + 4, 4); memcpy(&u2, q + 8, 4);
    w[0] = u0 & 0x3f3f3f3fu;
    w[1] = (u2 & 0x0f0f0f0fu) | ((u0 >> 2) & 0x30303030u);
    w[2] = u1 & 0x3f3f3f3fu;
    w[3] = ((u2 >> 4) & 0x0f0f0f0fu) | ((u1 >> 2) & 0x30303030u);
}
static inline void ktk_scale_min_k4(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) { *sc = q[j] & 63; *m = q[j + 4] & 63; }
    else { *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4); *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4); }
}
/* The 16 six-bit scales of a Q3_K block (0..63; the scale is the value - 32) as the bytes of four words:
 * byte j of w[k] is scale 4k + j. Bytes 0-7 of the field hold the low nibbles (scale j < 8 in the low half
 * of byte j, scale j + 8 in its high half); byte 8 + j % 4 holds the top two bits of scale j at bits
 * 2 * (j / 4). */
static inline void ktk_q3k_scales(const uint8_t *s, uint32_t w[4]) {
    uint32_t a0, a1, a2;
    memcpy(&a0, s, 4); memcpy(&a1, s + 4, 4); memcpy(&a2, s + 8, 4);
    w[0] = (a0 & 0x0f0f0f0fu) | ((a2 << 4) & 0x30303030u);
    w[1] = (a1 & 0x0f0f0f0fu) | ((a2 << 2) & 0x30303030u);
    w[2] = ((a0 >> 4) & 0x0f0f0f0fu) | (a2 & 0x30303030u);
    w[3] = ((a1 >> 4) & 0x0f0f0f0fu) | ((a2 >> 2) & 0x30303030u);
}
/* A Q2_K / Q3_K block's 16 scale bytes (Q2_K: scale | min << 4 as stored; Q3_K: the six-bit scales,
 * 0..63, before the -32), its fp16 d and (Q2_K; Q3_K: 0) dmin */
static inline void ktk_q23k_head(int three, const uint8_t *blk, uint8_t sc[16], uint16_t *d, uint16_t *dmin) {
    if (three) {
        uint32_t w[4];
        ktk_q3k_scales(blk + 96, w);
        memcpy(sc, w, 16);
        memcpy(d, blk + 108, 2);
        *dmin = 0;
    } else {
        memcpy(sc, blk, 16);
        memcpy(d, blk + 80, 2);
        memcpy(dmin, blk + 82, 2);
    }
}
/* value v (0..255) of a Q2_K / Q3_K block, unsigned (Q2_K 0..3; Q3_K 0..7, before the -4): v = 128h + 32g + l
 * is bits 2g, 2g+1 of qs[32h + l], and Q3_K's bit 2 is bit 4h + g of hmask[l] */
static inline int ktk_q23k_value(int three, const uint8_t *blk, int v) {
    const int h = v / 128, g = v % 128 / 32, l = v % 32;
    const int lo = (blk[(three ? 32 : 16) + 32 * h + l] >> (2 * g)) & 3;
    return three ? lo | ((blk[l] >> (4 * h + g)) & 1) << 2 : lo;
}
void ktk_dequant_block(int type, const uint8_t *blk, float *dst);   /* one block */
void ktk_quant_act_scalar(const float *x, ktk_q8 *q, int64_t n);

/* AMX (amx.c), on a block of 32 weight rows: C[r*ldc + t] = dot(W[r], X[t]) for r < 32 and
 * t < 16 * ceil(nt / 16) (columns past nt hold zeros; ldc >= that); Wt: the rows as
 * ktk_amx_rows_bf16 writes them; X packed by ktk_amx_pack_x.
 * ktk_amx_silu_mul: g = SiLU(g) * u over rows x ldc floats (ldc % 16 == 0). */
int ktk_amx_usable(void);
int64_t ktk_amx_pack_x_elems(int64_t nt, int64_t K);
void ktk_amx_pack_x(const float *const *X, int64_t nt, int64_t K, uint16_t *packed);
void ktk_amx_gemm(const uint16_t *Wt, int64_t K, const uint16_t *packed, int64_t nt, float *C, int64_t ldc);
/* ktk_amx_gemm, bringing next_bytes at `next` (the rows converted next) into L2 meanwhile */
void ktk_amx_gemm_next(const uint16_t *Wt, int64_t K, const uint16_t *packed, int64_t nt, float *C, int64_t ldc,
                       const uint8_t *next, int64_t next_bytes);
/* The same with the 32 rows' A tiles loaded in place from BF16 weight rows rb bytes apart (no conversion) */
void ktk_amx_gemm_rows(const uint8_t *rows, int64_t rb, int64_t K, const uint16_t *packed, int64_t nt, float *C, int64_t ldc);
/* nrows GGML rows (rb bytes apart, n values each, n % 32 == 0) to bf16, tile-major: the 32
 * values of k-step ks of row r at dst[(ks * nrows + r) * 32], so each 16-row A tile of a k-step
 * is 1 KiB of contiguous memory; tmp: n floats of scratch. Q4_K, Q4_0, Q5_0, Q8_0, BF16 and F32
 * are written straight from their blocks, the other types dequantized by K first. The values
 * are the f32 dequantization's, rounded to nearest even (subnormals flushed to zero, as the
 * AVX512-BF16 conversions do). Needs AVX512-BF16. */
void ktk_amx_rows_bf16(const ktk_kernels *K, int type, const uint8_t *rows, int64_t rb, int nrows, int64_t n,
                       uint16_t *dst, float *tmp);
/* The tile GEMM's product without tiles (AVX512-BF16 dot products; the AVX-512 path's BF16 experts where the CPU has
 * AVX512-BF16, ktk_avx512bf16_usable): C[r][t] (32 rows, ldc floats apart) = row r . token t, row r's k-step ks at
 * A + ks * a_ks + r * a_r values (BF16 rows in place: 32, rb / 2; tile-major: 1024, 32), pk as ktk_amx_gemm's. */
void ktk_dp_gemm(const uint16_t *A, int64_t a_ks, int64_t a_r, int64_t K, const uint16_t *pk, int64_t nt, float *C,
                 int64_t ldc);
void ktk_amx_silu_mul(float *g, const float *u, int64_t ldc, int rows);
/* The AMX-INT8 path (layouts in i8.c): C[r*ldc + t] = dot(row r, token t) for the block of 32 rows
 * of an I8 copy at A (scales ws, row r's group g at ws[r * K / G + g]) and the tokens packed by
 * ktk_amx_pack_x_i8 (pk, ts); ci: 1536 int32 (6 KiB) of scratch; pf: in the first pass over the tokens,
 * prefetch the rows this many k-steps ahead (0: none; the copy is read from memory there);
 * overlap: scale a group's sums into C while the next group's products run (0: after each group). */
void ktk_amx_gemm_i8(const int8_t *A, const float *ws, int64_t K, int64_t G, const int8_t *pk, const float *ts,
                     int64_t nt, float *C, int64_t ldc, int32_t *ci, int pf, int overlap);
/* The same on a block of 32 rows of an I4 copy (nibbles at A, 1 KiB a 64-value k-step; scales ws as above; wk: the
 * block's sub-scales, 32 bytes a k-step, layout in i8.c): a8: 32 * K bytes of scratch, where the first pass over the
 * tokens widens the nibbles to signed bytes (the later passes read them there), ahead k-steps before the tiles load
 * them (0: the step about to be loaded). */
void ktk_amx_gemm_i4(const uint8_t *A, const float *ws, const uint8_t *wk, int64_t K, int64_t G, const int8_t *pk,
                     const float *ts, int64_t nt, float *C, int64_t ldc, int32_t *ci, uint8_t *a8, int pf, int overlap,
                     int ahead);
/* tokens for ktk_amx_gemm_i8 / ktk_amx_gemm_i4 (layout in i8.c) */
void ktk_amx_pack_x_i8(const float *const *X, int64_t nt, int64_t K, int64_t G, int8_t *pk, float *ts);
/* the same packing in two steps (AVX-512 only: ktk_amx_pack_once_usable): every token quantized once, row t of X
 * (ldx floats apart) to q + t * K, its groups' scales to qs[t * K / G + g]; then each expert's tokens idx[0 .. nt)
 * packed from those bytes */
void ktk_amx_quant_rows_i8(const float *X, int64_t ldx, int64_t nt, int64_t K, int64_t G, int8_t *q, float *qs);
void ktk_amx_pack_q_i8(const int8_t *q, const float *qs, const int64_t *idx, int64_t nt, int64_t K, int64_t G,
                       int8_t *pk, float *ts);
int ktk_amx_pack_once_usable(void);
/* with AVX-512, the packs from once-converted / once-quantized tokens (ktk_amx_pack_b, ktk_amx_pack_q_i8) write
 * their blocks with non-temporal stores; $KTINJECT_PACK_NT=0 (read once): cached stores (A/B) */
int ktk_pack_nt(void);
/* ktk_amx_pack_x in two steps: rows of X (ldx floats apart) to bf16 once, y[t * K + k]; then the tokens idx[0 .. nt)
 * of those rows packed as ktk_amx_pack_x packs them (the same bits) */
void ktk_amx_rows_to_bf16(const float *X, int64_t ldx, int64_t nt, int64_t K, uint16_t *y);
void ktk_amx_pack_b(const uint16_t *xb, const int64_t *idx, int64_t nt, int64_t K, uint16_t *pk);
/* C's 32 rows (one k-step of h) of n tokens into the down GEMM's packing, k-step ks of KS (ktk_amx_pack_x's bits;
 * ldc >= n rounded up to 16) */
void ktk_amx_c_to_pack(const float *C, int64_t ldc, int64_t n, int64_t KS, int64_t ks, uint16_t *pk);
/* C [rows][ldc] (rows % 8 == 0, ldc >= n rounded up to 8) to token rows: for j < n, row
 * out + (idx ? idx[j] : j) * stride gets C[0 .. rows)[j], stored (wv NULL) or added times wv[j] */
void ktk_amx_c_to_rows(const float *C, int64_t ldc, int rows, int64_t n, float *out, const int64_t *idx,
                       int64_t stride, const float *wv);

/* R16 (r16.c): out[p * 16 + r] = dot(row r of the group at g[p], activation record xq[p]) for
 * p < P <= KTK_R16_P (the pairs' blocks read in lockstep: P streams in flight); the AVX-512 VNNI
 * kernels for isa >= KTK_ISA_AVX512, a scalar loop otherwise. dequant_group: the group's 16
 * rows -> dst[r * ld + k]. KTK_R16_NT: tokens per ktk_r16_gemv call. */
#define KTK_R16_P 16
#define KTK_R16_NT 4
void ktk_r16_dot(int isa, int type, int P, const uint8_t *const *g, const ktk_q8 *const *xq, int64_t n, float *out);
void ktk_r16_dequant_group(int type, const uint8_t *g, int64_t n, float *dst, int64_t ld);
void ktk_r16_init(void);   /* reads the $KTINJECT_R16_* knobs once; call before a pool job runs the dots */

/* pool (pool.c): a job is `nphase` phases; phase p has `items[p]` work items run by fn. */
typedef void (*ktk_item_fn)(void *ctx, int phase, int64_t item, int tid);
int ktk_pool_run_async(ktk_pool *p, ktk_item_fn fn, void *ctx, int nphase, const int64_t *items);
/* the same, with the items a worker takes per claim for each phase (claims NULL, or an entry 0: the
 * pool's own, $KTINJECT_POOL_CLAIM or 1; at most 64) */
int ktk_pool_run_async_claims(ktk_pool *p, ktk_item_fn fn, void *ctx, int nphase, const int64_t *items,
                              const int64_t *claims);
int ktk_pool_wait(ktk_pool *p);
void *ktk_pool_scratch(ktk_pool *p, int tid, size_t bytes);   /* per-thread scratch, grows */

/* Spin-wait step of the pool, its callers and the doorbell dispatcher. KTINJECT_SPIN_PAUSE=0
 * (read once, by the first pool made) spins on plain loads instead of the PAUSE instruction: in a
 * virtual machine whose hypervisor uses pause-loop exiting, a vCPU seen pausing for long is
 * descheduled, and a worker that waited out a gap between layers then starts the next layer
 * late (an A/B knob for the lent machine; the default keeps PAUSE). */
extern int ktk_spin_pause;
#if defined(KTK_LAYER_TRACE)
#define KTK_LAYER_TRACE_T 64
/* cycles per worker: [0] gate/up rows to bf16, [1] their tile GEMMs, [2] SiLU and h stores, [3] down rows
 * to bf16, [4] their GEMMs, [5] the weighted sums into out, [6] packing tokens, [7] packing h, [8] P0's
 * chunks of tokens quantized (or converted) once, [9] the packs' wait for the last of those chunks */
#define KTK_LAYER_TRACE_PARTS 10
extern uint64_t ktk_layer_tr[KTK_LAYER_TRACE_T][KTK_LAYER_TRACE_PARTS];
#endif
static inline void ktk_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    if (ktk_spin_pause) { __builtin_ia32_pause(); return; }
#endif
    __asm__ __volatile__("" ::: "memory");
}

#endif
