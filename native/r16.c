/* "R16" layouts: GGML rows repacked in groups of 16 for the decode kernels.
 *
 * The GGUF layout keeps a row's blocks together, so a dot kernel reads each row as a stream of
 * bytes and spends most of its instructions moving a row's values into place and reducing them
 * (Q4_K: ~10 vector ops per 64 weights on AVX2/AVX-512).
 * R16 interleaves 16 rows block by block: a 64-byte vector holds 4 values of each of 16 rows,
 * one per 32-bit lane, so one VNNI dot (vpdpbusd) against 4 activations broadcast to all lanes
 * accumulates 16 rows' partial dots with no shuffles and no horizontal sums (Q4_K: 2 masks and
 * 2 dots per 128 weights). Block scales sit beside their block, one per lane. Whether that is
 * faster from memory depends on the type (docs/native.md): fewer instructions alone were not.
 *
 * A group of 16 rows of n values is n / B blocks (B = 256 for Q4_K / Q6_K, 32 for Q5_0 / Q8_0), block
 * i of all 16 rows together, GB bytes each; so rows r .. r+15 (r % 16 == 0) start at r * rb,
 * rb = GB / 16 bytes per row, as if the rows were stored one after another. Per block:
 *
 *   Q4_K (GB 2368 = 16 x 148; GGUF 16 x 144: the scales unpacked to bytes):
 *     [0, 32)      d[16]    fp16, one per row
 *     [32, 64)     dmin[16] fp16
 *     [64, 192)    sc[8][16]: the 6-bit scale of sub-block s (32 values) of row r
 *     [192, 320)   m[4][16][2]: the 6-bit mins of sub-blocks 2p and 2p+1 of row r, side by side
 *     [320, 2368)  q[32][16][4]: chunk c (values 8c .. 8c+7), row r, byte b:
 *                  low nibble = value 8c+b, high nibble = value 8c+4+b
 *   Q5_K (GB 2880 = 16 x 180; GGUF 16 x 176): Q4_K's, with the fifth bits as Q5_0 keeps them:
 *     [0, 320)     d, dmin, sc, m as Q4_K's
 *     [320, 832)   h[32][2]: 64-bit masks, bit 4r+b = the fifth bit of value 8c+b (h[c][0]) and
 *                  of value 8c+4+b (h[c][1]) of row r
 *     [832, 2880)  q[32][16][4]: as Q4_K's nibbles
 *   IQ4_XS (GB 2208 = 16 x 138; GGUF 16 x 136):
 *     [0, 32)      d[16]    fp16
 *     [32, 160)    sc[4][16][2]: the scales (6-bit, minus 32: int8) of sub-blocks 2p and 2p+1 of row r
 *     [160, 2208)  q[32][16][4]: as Q4_K's nibbles, each an index into the non-linear grid
 *   Q4_0 (GB 288 = 16 x 18):
 *     [0, 32)      d[16]    fp16
 *     [32, 288)    q[4][16][4]: as Q5_0's nibbles
 *   Q5_0 (GB 352 = 16 x 22):
 *     [0, 32)      d[16]    fp16
 *     [32, 96)     h[4][2]: 64-bit masks, bit 4r+b = the fifth bit of value 8c+b (h[c][0]) and
 *                  of value 8c+4+b (h[c][1]) of row r: the byte masks of chunk c's two halves
 *     [96, 352)    q[4][16][4]: as Q4_K's, 4 chunks
 *   Q6_K (GB 3360 = 16 x 210):
 *     [0, 32)      d[16]    fp16
 *     [32, 288)    sc[8][16][2]: the int8 scales of sub-blocks 2p and 2p+1 (16 values each) of row r
 *     [288, 2336)  q[32][16][4]: the low 4 bits, as Q4_K's nibbles
 *     [2336, 3360) h[8][2][16][4]: per 4 chunks c = 4G + k, two vectors (values 8c+b, 8c+4+b):
 *                  bits 2k, 2k+1 of byte b of row r = the value's high 2 bits
 *   Q2_K (GB 1344 = 16 x 84):
 *     [0, 32)      d[16]    fp16
 *     [32, 64)     dmin[16] fp16
 *     [64, 320)    sm[8][16][2]: the scale | min << 4 bytes of sub-blocks 2p and 2p+1 (16 values each) of row r
 *     [320, 1344)  q[16][16][4]: sub-block c (values 16c .. 16c+15), row r, byte b: bits 2k, 2k+1 = value
 *                  16c + 4k + b (one shift and mask per k gives 4 values of each row, one per lane byte)
 *   Q3_K (GB 1824 = 16 x 114; GGUF 16 x 110: the scales unpacked to bytes):
 *     [0, 32)      d[16]    fp16
 *     [32, 288)    sc[8][16][2]: the scales (6-bit, minus 32: int8) of sub-blocks 2p and 2p+1 of row r
 *     [288, 1312)  q[16][16][4]: the low 2 bits, as Q2_K's
 *     [1312, 1824) h[16][4]: 64-bit masks, bit 4r+b of h[c][k] = the third bit of value 16c + 4k + b of row r
 *   Q8_0 (GB 544 = 16 x 34):
 *     [0, 32)      d[16]    fp16
 *     [32, 544)    q[8][16][4]: chunk c, row r, byte b = value 4c+b + 128 (as an unsigned byte:
 *                  the VNNI dot takes unsigned x signed bytes; the dot subtracts 128 * sum(x))
 *
 * Q4_0, Q5_0, Q8_0, Q2_K and Q6_K keep GGUF's size; Q4_K grows by 2.8% (Q5_K 2.3%, IQ4_XS 1.5%, Q3_K 3.6%), which costs less
 * than unpacking 6-bit scales for 16 rows in every block would. Every value and scale is kept as it was: dequantizing
 * a group gives exactly the floats GGML's dequantization gives (tested). */
#include "ktk_int.h"
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>

static int group_bytes(int type) {
    switch (type) {
    case KTK_Q4_K: return 2368;
    case KTK_Q5_K: return 2880;
    case KTK_Q4_0: return 288;
    case KTK_IQ4_XS: return 2208;
    case KTK_Q5_0: return 352;
    case KTK_Q8_0: return 544;
    case KTK_Q6_K: return 3360;
    case KTK_Q2_K: return 1344;
    case KTK_Q3_K: return 1824;
    default: return 0;
    }
}

int ktk_r16_supported(int type) { return group_bytes(type) != 0; }

int64_t ktk_r16_row_bytes(int type, int64_t n) {
    int gb = group_bytes(type), blk = ktk_type_block(type);
    if (!gb || n <= 0 || n % blk) return -1;
    return n / blk * (gb / 16);
}

/* ---- repacking ---- */

/* groups of 16 bytes, each 32 values: the low nibbles, then the high ones (Q4_0, IQ4_XS's sub-blocks) */
static void split_nibbles(const uint8_t *qs, int groups, uint8_t *v) {
    for (int g = 0; g < groups; g++)
        for (int j = 0; j < 16; j++) {
            v[32 * g + j] = qs[16 * g + j] & 0xF;
            v[32 * g + 16 + j] = qs[16 * g + j] >> 4;
        }
}

/* The values of one GGML block, unsigned (Q2_K 2 bits, Q3_K 3, Q4_0 / Q4_K 4, Q5_0 / Q5_K 5, Q6_K 6, Q8_0 as the R16 byte: + 128),
 * in the block's value order: unpacked once per row, then scattered into the R16 block. */
static void unpack_values(int type, const uint8_t *b, uint8_t *v) {
    switch (type) {
    case KTK_Q4_K: {
        const blk_q4_k *x = (const blk_q4_k *)b;
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) {
                v[64 * j + l] = x->qs[32 * j + l] & 0xF;
                v[64 * j + 32 + l] = x->qs[32 * j + l] >> 4;
            }
        break;
    }
    case KTK_Q5_K: {   /* step j: low nibbles + bit 2j of qh, then high nibbles + bit 2j + 1 */
        const blk_q5_k *x = (const blk_q5_k *)b;
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) {
                v[64 * j + l] = (uint8_t)((x->qs[32 * j + l] & 0xF) | ((x->qh[l] >> (2 * j)) & 1) << 4);
                v[64 * j + 32 + l] = (uint8_t)((x->qs[32 * j + l] >> 4) | ((x->qh[l] >> (2 * j + 1)) & 1) << 4);
            }
        break;
    }
    case KTK_Q4_0: split_nibbles(((const blk_q4_0 *)b)->qs, 1, v); break;
    case KTK_IQ4_XS: split_nibbles(((const blk_iq4_xs *)b)->qs, 8, v); break;   /* the grid indices */
    case KTK_Q5_0: {
        const blk_q5_0 *x = (const blk_q5_0 *)b;
        uint32_t qh;
        memcpy(&qh, x->qh, 4);
        for (int l = 0; l < 16; l++) {
            v[l] = (uint8_t)((x->qs[l] & 0xF) | ((qh >> l) & 1) << 4);
            v[l + 16] = (uint8_t)((x->qs[l] >> 4) | ((qh >> (l + 16)) & 1) << 4);
        }
        break;
    }
    case KTK_Q2_K: case KTK_Q3_K:
        for (int u = 0; u < 256; u++) v[u] = (uint8_t)ktk_q23k_value(type == KTK_Q3_K, b, u);
        break;
    case KTK_Q6_K: {
        const blk_q6_k *x = (const blk_q6_k *)b;
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = x->ql + 64 * h, *qh = x->qh + 32 * h;
            for (int l = 0; l < 32; l++) {
                v[128 * h + l] = (uint8_t)((ql[l] & 0xF) | (qh[l] & 3) << 4);
                v[128 * h + 32 + l] = (uint8_t)((ql[l + 32] & 0xF) | ((qh[l] >> 2) & 3) << 4);
                v[128 * h + 64 + l] = (uint8_t)((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4);
                v[128 * h + 96 + l] = (uint8_t)((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4);
            }
        }
        break;
    }
    default: {   /* Q8_0 */
        const blk_q8_0 *x = (const blk_q8_0 *)b;
        for (int l = 0; l < 32; l++) v[l] = (uint8_t)x->qs[l] ^ 0x80;
    }
    }
}

/* block i of the 16 rows at src (srb bytes apart) -> dst (one R16 block) */
static void repack_block(int type, const uint8_t *src, int64_t srb, int64_t i, uint8_t *dst) {
    const int bs = ktk_type_size(type);
    uint8_t v[256];
    memset(dst, 0, (size_t)group_bytes(type));
    for (int r = 0; r < 16; r++) {
        const uint8_t *b = src + r * srb + i * bs;
        unpack_values(type, b, v);
        uint8_t *q = dst + 4 * r;   /* row r's 4 bytes in each chunk vector */
        switch (type) {
        case KTK_Q4_K: case KTK_Q5_K: {   /* d, dmin, scales and mins: the same fields, the same places */
            const uint8_t *scales = b + 4;   /* after d and dmin in both blocks */
            memcpy(dst + 2 * r, b, 2);
            memcpy(dst + 32 + 2 * r, b + 2, 2);
            for (int s = 0; s < 8; s++) {
                uint8_t sc, m;
                ktk_scale_min_k4(s, scales, &sc, &m);
                dst[64 + 16 * s + r] = sc;
                dst[192 + 32 * (s / 2) + 2 * r + (s & 1)] = m;
            }
            const int qo = type == KTK_Q4_K ? 320 : 832;
            for (int c = 0; c < 32; c++)
                for (int k = 0; k < 4; k++) {
                    const int lo = v[8 * c + k], hi = v[8 * c + 4 + k];
                    q[qo + 64 * c + k] = (uint8_t)((lo & 0xF) | (hi & 0xF) << 4);
                    if (type == KTK_Q5_K) {   /* row r's fifth bits into chunk c's two masks (little-endian) */
                        const int bit = 4 * r + k;
                        dst[320 + 16 * c + bit / 8] |= (uint8_t)((lo >> 4) << (bit % 8));
                        dst[328 + 16 * c + bit / 8] |= (uint8_t)((hi >> 4) << (bit % 8));
                    }
                }
            break;
        }
        case KTK_Q4_0:
            memcpy(dst + 2 * r, b, 2);
            for (int c = 0; c < 4; c++)
                for (int k = 0; k < 4; k++) q[32 + 64 * c + k] = (uint8_t)(v[8 * c + k] | v[8 * c + 4 + k] << 4);
            break;
        case KTK_IQ4_XS:
            memcpy(dst + 2 * r, b, 2);
            for (int s = 0; s < 8; s++)
                dst[32 + 32 * (s / 2) + 2 * r + (s & 1)] = (uint8_t)(int8_t)ktk_iq4xs_scale((const blk_iq4_xs *)b, s);
            for (int c = 0; c < 32; c++)
                for (int k = 0; k < 4; k++) q[160 + 64 * c + k] = (uint8_t)(v[8 * c + k] | v[8 * c + 4 + k] << 4);
            break;
        case KTK_Q5_0: {
            memcpy(dst + 2 * r, b, 2);
            uint64_t ml[4] = {0}, mh[4] = {0};   /* this row's bits of the eight masks */
            for (int c = 0; c < 4; c++)
                for (int k = 0; k < 4; k++) {
                    const int lo = v[8 * c + k], hi = v[8 * c + 4 + k];
                    q[96 + 64 * c + k] = (uint8_t)((lo & 0xF) | (hi & 0xF) << 4);
                    ml[c] |= (uint64_t)(lo >> 4) << (4 * r + k);
                    mh[c] |= (uint64_t)(hi >> 4) << (4 * r + k);
                }
            for (int c = 0; c < 4; c++) {   /* little-endian masks: OR this row's bytes in */
                uint64_t a, z;
                memcpy(&a, dst + 32 + 16 * c, 8); memcpy(&z, dst + 40 + 16 * c, 8);
                a |= ml[c]; z |= mh[c];
                memcpy(dst + 32 + 16 * c, &a, 8); memcpy(dst + 40 + 16 * c, &z, 8);
            }
            break;
        }
        case KTK_Q6_K: {
            const blk_q6_k *x = (const blk_q6_k *)b;
            memcpy(dst + 2 * r, &x->d, 2);
            for (int j = 0; j < 16; j++) dst[32 + 32 * (j / 2) + 2 * r + (j & 1)] = (uint8_t)x->scales[j];
            for (int c = 0; c < 32; c++) {
                const int G = c / 4, sh = 2 * (c % 4);
                for (int k = 0; k < 4; k++) {
                    const int a = v[8 * c + k], z = v[8 * c + 4 + k];
                    q[288 + 64 * c + k] = (uint8_t)((a & 0xF) | (z & 0xF) << 4);
                    q[2336 + 128 * G + k] |= (uint8_t)((a >> 4) << sh);
                    q[2336 + 128 * G + 64 + k] |= (uint8_t)((z >> 4) << sh);
                }
            }
            break;
        }
        case KTK_Q2_K: case KTK_Q3_K: {
            const int three = type == KTK_Q3_K;
            uint8_t sc[16];
            uint16_t d, dmin;
            ktk_q23k_head(three, b, sc, &d, &dmin);
            memcpy(dst + 2 * r, &d, 2);
            if (three) {   /* the scales minus 32 as int8 */
                for (int j = 0; j < 16; j++) dst[32 + 32 * (j / 2) + 2 * r + (j & 1)] = (uint8_t)(int8_t)((int)sc[j] - 32);
            } else {       /* dmin, the scale | min bytes as stored */
                memcpy(dst + 32 + 2 * r, &dmin, 2);
                for (int j = 0; j < 16; j++) dst[64 + 32 * (j / 2) + 2 * r + (j & 1)] = sc[j];
            }
            const int qo = three ? 288 : 320;
            for (int c = 0; c < 16; c++)
                for (int k = 0; k < 4; k++)
                    for (int bb = 0; bb < 4; bb++) {
                        const int u = v[16 * c + 4 * k + bb], bit = 4 * r + bb;
                        q[qo + 64 * c + bb] |= (uint8_t)((u & 3) << (2 * k));
                        if (three) dst[1312 + 32 * c + 8 * k + bit / 8] |= (uint8_t)((u >> 2) << (bit % 8));
                    }
            break;
        }
        default:   /* Q8_0 */
            memcpy(dst + 2 * r, b, 2);
            for (int c = 0; c < 8; c++) memcpy(q + 32 + 64 * c, v + 4 * c, 4);
        }
    }
}

typedef struct {
    int type;
    const uint8_t *src;
    int64_t srb, ses, rows, n, nb, groups_per_expert;
    uint8_t *dst;
} repack_ctx;

static void repack_item(void *ctx, int phase, int64_t item, int tid) {
    (void)phase; (void)tid;
    const repack_ctx *c = ctx;
    int64_t e = item / c->groups_per_expert, g = item % c->groups_per_expert, gb = group_bytes(c->type);
    const uint8_t *src = c->src + e * c->ses + g * 16 * c->srb;
    uint8_t *dst = c->dst + (e * c->groups_per_expert + g) * c->nb * gb;
    for (int64_t i = 0; i < c->nb; i++) repack_block(c->type, src, c->srb, i, dst + i * gb);
}

int ktk_r16_repack(ktk_pool *p, int type, const uint8_t *src, int64_t src_rb, int64_t src_es, int64_t n_experts,
                   int64_t rows, int64_t n, uint8_t *dst) {
    if (!src || !dst || !ktk_r16_supported(type) || n_experts < 1 || rows < 16 || rows % 16 ||
        ktk_r16_row_bytes(type, n) < 0 || src_rb != ktk_row_bytes(type, n) || src_es < rows * src_rb)
        return KTK_EINVAL;
    repack_ctx c = {type, src, src_rb, src_es, rows, n, n / ktk_type_block(type), rows / 16, dst};
    int64_t items = n_experts * c.groups_per_expert;
    if (p && ktk_pool_run_async(p, repack_item, &c, 1, &items) == KTK_OK) return ktk_pool_wait(p);
    for (int64_t i = 0; i < items; i++) repack_item(&c, 0, i, 0);
    return KTK_OK;
}

/* ---- reading one value back (dequantization, the scalar dots) ---- */

/* Value v (in the block's order) of row r of the R16 block at b, unsigned as stored: Q4_K 4 bits,
 * Q5_0 5, Q6_K 6, Q8_0 the byte (value + 128). */
static inline int r16_value(int type, const uint8_t *b, int r, int v) {
    if (type == KTK_Q8_0) return b[32 + 64 * (v / 4) + 4 * r + v % 4];
    if (type == KTK_Q2_K || type == KTK_Q3_K) {   /* Q2_K 2 bits, Q3_K 3 */
        const int c = v / 16, k = v % 16 / 4, bb = v % 4, bit = 4 * r + bb;
        const int lo = (b[(type == KTK_Q2_K ? 320 : 288) + 64 * c + 4 * r + bb] >> (2 * k)) & 3;
        return type == KTK_Q2_K ? lo : lo | ((b[1312 + 32 * c + 8 * k + bit / 8] >> (bit % 8)) & 1) << 2;
    }
    const int c = v / 8, k = v % 8 & 3, high = v % 8 >= 4;
    const int qo = type == KTK_Q4_K ? 320 : type == KTK_Q5_K ? 832 : type == KTK_Q5_0 ? 96
                 : type == KTK_Q4_0 ? 32 : type == KTK_IQ4_XS ? 160 : 288;
    const uint8_t q = b[qo + 64 * c + 4 * r + k];
    const int lo = high ? q >> 4 : q & 0xF;
    if (type == KTK_Q4_K || type == KTK_Q4_0 || type == KTK_IQ4_XS) return lo;   /* IQ4_XS: the grid index */
    if (type == KTK_Q5_0 || type == KTK_Q5_K) {
        const int bit = 4 * r + k, mo = type == KTK_Q5_0 ? 32 : 320;
        return lo | ((b[mo + 16 * c + 8 * high + bit / 8] >> (bit % 8)) & 1) << 4;
    }
    return lo | ((b[2336 + 128 * (c / 4) + 64 * high + 4 * r + k] >> (2 * (c % 4))) & 3) << 4;   /* Q6_K */
}

static inline float r16_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return ktk_f16_to_f32(h);
}

/* the scale of sub-block s: Q4_K / Q5_K (32 values, 6-bit), Q6_K / Q3_K (16 values, int8), IQ4_XS (32, int8), Q2_K
 * (16 values, 4-bit; r16_q2k_min: its 4-bit min) */
static inline int r16_scale(int type, const uint8_t *b, int r, int s) {
    if (type == KTK_Q2_K) return b[64 + 32 * (s / 2) + 2 * r + (s & 1)] & 0xF;
    return type == KTK_Q6_K || type == KTK_IQ4_XS || type == KTK_Q3_K ? (int8_t)b[32 + 32 * (s / 2) + 2 * r + (s & 1)]
                                                                       : b[64 + 16 * s + r];
}
static inline int r16_q2k_min(const uint8_t *b, int r, int s) { return b[64 + 32 * (s / 2) + 2 * r + (s & 1)] >> 4; }
static inline int r16_q4k_min(const uint8_t *b, int r, int s) { return b[192 + 32 * (s / 2) + 2 * r + (s & 1)]; }

/* rows r < 16 of a group -> dst[r * ld + k] (the grouped paths' f32 rows, tests): GGML's floats */
void ktk_r16_dequant_group(int type, const uint8_t *g, int64_t n, float *dst, int64_t ld) {
    const int gb = group_bytes(type), B = ktk_type_block(type);
    for (int64_t i = 0; i < n / B; i++, g += gb)
        for (int r = 0; r < 16; r++) {
            const float d = r16_f16(g + 2 * r);
            float *y = dst + r * ld + i * B;
            for (int v = 0; v < B; v++) {
                const int q = r16_value(type, g, r, v);
                switch (type) {
                case KTK_Q4_K: case KTK_Q5_K:
                    y[v] = d * (float)r16_scale(type, g, r, v / 32) * (float)q
                           - r16_f16(g + 32 + 2 * r) * (float)r16_q4k_min(g, r, v / 32);
                    break;
                case KTK_Q6_K: y[v] = d * (float)r16_scale(type, g, r, v / 16) * (float)(q - 32); break;
                case KTK_Q3_K: y[v] = d * (float)r16_scale(type, g, r, v / 16) * (float)(q - 4); break;
                case KTK_Q2_K:
                    y[v] = d * (float)r16_scale(type, g, r, v / 16) * (float)q - r16_f16(g + 32 + 2 * r) * (float)r16_q2k_min(g, r, v / 16);
                    break;
                case KTK_Q5_0: y[v] = d * (float)(q - 16); break;
                case KTK_Q4_0: y[v] = d * (float)(q - 8); break;
                case KTK_IQ4_XS: y[v] = d * (float)r16_scale(type, g, r, v / 32) * (float)ktk_kvalues_iq4nl[q]; break;
                default: y[v] = d * (float)(q - 128);
                }
            }
        }
}

/* ---- dots: out[p * 16 + r] = dot(row r of group g[p], activation record xq[p]) for p < P ----
 * P pairs of (group, token) per call, P <= KTK_R16_P: the blocks of every pair are read in
 * lockstep (block i of each pair, then block i + 1), so a call keeps P streams of memory in
 * flight (the hardware prefetchers then work on several pages at once; one stream at a time
 * measured no faster than the GGUF kernels however fast the arithmetic). Pairs may share a group
 * (several tokens: the block is then read again from L1). Both versions compute each block's
 * integer sums exactly and weight them in the same order. */

/* one block of row r against its activations: integer sums exactly as the SIMD kernels, the same float steps */
static float blk_scalar(int type, const uint8_t *b, int r, const ktk_q8 *xq, int64_t n, int64_t i) {
    const float d = r16_f16(b + 2 * r);
    if (type == KTK_IQ4_XS) {   /* grid values times the activations, per 32-value sub-block and scale */
        const ktk_q8k *y = ktk_act_k(xq, n) + i;
        int32_t si = 0;
        for (int s = 0; s < 8; s++) {
            int32_t dot = 0;
            for (int v = 32 * s; v < 32 * (s + 1); v++) dot += ktk_kvalues_iq4nl[r16_value(type, b, r, v)] * y->q[v];
            si += dot * r16_scale(type, b, r, s);
        }
        return (float)si * (d * y->d);
    }
    if (type == KTK_Q2_K || type == KTK_Q3_K) {   /* 16-value sub-blocks; Q2_K's mins, Q3_K's -4 through the sums */
        const ktk_q8k *y = ktk_act_k(xq, n) + i;
        int32_t si = 0, mi = 0;
        for (int s = 0; s < 16; s++) {
            int32_t dot = 0;
            for (int v = 16 * s; v < 16 * (s + 1); v++) dot += r16_value(type, b, r, v) * y->q[v];
            si += dot * r16_scale(type, b, r, s);
            mi += (type == KTK_Q2_K ? r16_q2k_min(b, r, s) : 4 * r16_scale(type, b, r, s)) * y->bsums[s];
        }
        if (type == KTK_Q3_K) return (float)(si - mi) * (d * y->d);
        return fmaf(-(float)mi, r16_f16(b + 32 + 2 * r) * y->d, (float)si * (d * y->d));
    }
    if (type == KTK_Q4_K || type == KTK_Q5_K || type == KTK_Q6_K) {
        const ktk_q8k *y = ktk_act_k(xq, n) + i;
        const int S = type == KTK_Q6_K ? 16 : 32;   /* values per sub-block */
        int32_t si = 0, mi = 0;
        for (int s = 0; s < 256 / S; s++) {
            int32_t dot = 0, bsum = 0;
            for (int v = S * s; v < S * (s + 1); v++) dot += r16_value(type, b, r, v) * y->q[v];
            for (int j = S * s / 16; j < S * (s + 1) / 16; j++) bsum += y->bsums[j];
            si += dot * r16_scale(type, b, r, s);
            mi += (type != KTK_Q6_K ? r16_q4k_min(b, r, s) : 32 * r16_scale(type, b, r, s)) * bsum;
        }
        if (type == KTK_Q6_K) return (float)(si - mi) * (d * y->d);   /* the -32 offset, as integers */
        return fmaf(-(float)mi, r16_f16(b + 32 + 2 * r) * y->d, (float)si * (d * y->d));
    }
    const ktk_q8 *x = xq + i;
    int32_t si = 0;
    for (int v = 0; v < 32; v++) si += r16_value(type, b, r, v) * x->q[v];
    si -= (type == KTK_Q5_0 ? 16 : type == KTK_Q4_0 ? 8 : 128) * (x->s[0] + x->s[1]);
    return (float)si * (d * x->d);
}

static void dot_scalar(int type, int P, const uint8_t *const *g, const ktk_q8 *const *xq, int64_t n, float *out) {
    const int gb = group_bytes(type);
    const int64_t nb = n / ktk_type_block(type);
    for (int p = 0; p < P; p++)
        for (int r = 0; r < 16; r++) {
            float acc = 0.f;
            for (int64_t i = 0; i < nb; i++) acc += blk_scalar(type, g[p] + i * gb, r, xq[p], n, i);
            out[p * 16 + r] = acc;
        }
}

#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define AVX512_INLINE AVX512_TARGET static inline __attribute__((always_inline))

/* How the kernels read memory (defaults: r16_defaults; read once by ktk_r16_init): */
enum { PF_Q4K, PF_Q5K, PF_Q4_0, PF_Q5_0, PF_Q8_0, PF_Q6K, PF_IQ4XS, PF_Q2K, PF_Q3K, PF_TYPES };
static int g_init = 0;
static int g_pf[PF_TYPES];   /* software prefetch distance in bytes per type ($KTINJECT_R16_PF: all; 0: none) */
static int g_l2 = 0;         /* 1: prefetch into L2 (prefetcht1), 0: into L1 ($KTINJECT_R16_PF_L2) */
#define KTK_R16_SPLIT 4
static int g_split = 2;      /* segments per pair ($KTINJECT_R16_SPLIT, 1..KTK_R16_SPLIT) */

AVX512_INLINE __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

AVX512_INLINE void pf_block(const uint8_t *b, int gb, int pf) {
    if (pf <= 0) return;
    const uintptr_t a = (uintptr_t)b + (uintptr_t)pf;   /* past the group's end: harmless, never dereferenced */
    if (g_l2)
        for (int o = 0; o < gb; o += 64) _mm_prefetch((const char *)(a + (uintptr_t)o), _MM_HINT_T1);
    else
        for (int o = 0; o < gb; o += 64) _mm_prefetch((const char *)(a + (uintptr_t)o), _MM_HINT_T0);
}

/* the mins term of a Q4_K / Q5_K block (their layouts agree there) and the block's weighted sum */
AVX512_INLINE __m512 r16_k45_finish(const uint8_t *g, const ktk_q8k *y, __m512i acc, __m512 accf) {
    __m512i macc = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int p = 0; p < 4; p++) {
        const uint32_t pair = (uint16_t)(y->bsums[4 * p] + y->bsums[4 * p + 1]) |
                              (uint32_t)(uint16_t)(y->bsums[4 * p + 2] + y->bsums[4 * p + 3]) << 16;
        macc = _mm512_dpwssd_epi32(macc, _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(g + 192 + 32 * p))),
                                   _mm512_set1_epi32((int)pair));
    }
    const __m512 yd = _mm512_set1_ps(y->d);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)g));
    const __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + 32)));
    return _mm512_fnmadd_ps(_mm512_cvtepi32_ps(macc), _mm512_mul_ps(dm, yd),
                            _mm512_mul_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(d, yd))) + accf;
}

/* one block of one pair: the block's sum, weighted, added to acc (16 rows) */
AVX512_INLINE __m512 r16_q4k(const uint8_t *g, const ktk_q8k *y, __m512 accf) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512i acc = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int s = 0; s < 8; s++) {
        __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int c = 4 * s; c < 4 * s + 4; c++) {
            const __m512i v = _mm512_loadu_si512((const void *)(g + 320 + 64 * c));
            lo = _mm512_dpbusd_epi32(lo, _mm512_and_si512(v, m4), bcast4(y->q + 8 * c));
            hi = _mm512_dpbusd_epi32(hi, _mm512_andnot_si512(m4, v), bcast4(y->q + 8 * c + 4));
        }
        const __m512i si = _mm512_add_epi32(lo, _mm512_srai_epi32(hi, 4));   /* hi: 16 x the nibbles' dot */
        acc = _mm512_add_epi32(acc, _mm512_mullo_epi32(si, _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(g + 64 + 16 * s)))));
    }
    return r16_k45_finish(g, y, acc, accf);
}

/* one chunk of 5-bit values (their nibbles at q, their fifth bits in the two 64-bit masks at h: a
 * masked byte add each) against the 8 activations at y: lo and hi take the low and high nibbles' dots */
AVX512_INLINE void r16_chunk5(const uint8_t *h, const uint8_t *q, const int8_t *y, __m512i *lo, __m512i *hi) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), x10 = _mm512_set1_epi8(0x10);
    uint64_t ml, mh;
    memcpy(&ml, h, 8); memcpy(&mh, h + 8, 8);
    const __m512i v = _mm512_loadu_si512((const void *)q);
    const __m512i l = _mm512_and_si512(v, m4), u = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    *lo = _mm512_dpbusd_epi32(*lo, _mm512_mask_add_epi8(l, (__mmask64)ml, l, x10), bcast4(y));
    *hi = _mm512_dpbusd_epi32(*hi, _mm512_mask_add_epi8(u, (__mmask64)mh, u, x10), bcast4(y + 4));
}

/* Q5_K: Q4_K's sums with each chunk's fifth bits added to its bytes (as Q5_0) */
AVX512_INLINE __m512 r16_q5k(const uint8_t *g, const ktk_q8k *y, __m512 accf) {
    __m512i acc = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int s = 0; s < 8; s++) {
        __m512i a = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int c = 4 * s; c < 4 * s + 4; c++) r16_chunk5(g + 320 + 16 * c, g + 832 + 64 * c, y->q + 8 * c, &a, &a);
        const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(g + 64 + 16 * s)));
        acc = _mm512_add_epi32(acc, _mm512_mullo_epi32(a, sc));
    }
    return r16_k45_finish(g, y, acc, accf);
}

AVX512_INLINE __m512 r16_q6k(const uint8_t *g, const ktk_q8k *y, __m512 accf) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    __m512i acc = _mm512_setzero_si512(), cacc = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int G = 0; G < 8; G++) {
        const __m512i HL = _mm512_loadu_si512((const void *)(g + 2336 + 128 * G));
        const __m512i HH = _mm512_loadu_si512((const void *)(g + 2336 + 128 * G + 64));
        const __m512i scp = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(g + 32 + 32 * G)));   /* (sc 2G, sc 2G+1) */
        __m512i s[2];
#pragma GCC unroll 2
        for (int half = 0; half < 2; half++) {
            __m512i a = _mm512_setzero_si512();
#pragma GCC unroll 2
            for (int k = 2 * half; k < 2 * half + 2; k++) {
                const int c = 4 * G + k;
                const __m512i v = _mm512_loadu_si512((const void *)(g + 288 + 64 * c));
                /* bits 2k, 2k+1 to bits 4, 5 (16-bit shifts: what crosses a byte is masked off) */
                const __m512i tl = _mm512_and_si512(k == 0 ? _mm512_slli_epi16(HL, 4) : k == 1 ? _mm512_slli_epi16(HL, 2)
                                                    : k == 2 ? HL : _mm512_srli_epi16(HL, 2), m30);
                const __m512i th = _mm512_and_si512(k == 0 ? _mm512_slli_epi16(HH, 4) : k == 1 ? _mm512_slli_epi16(HH, 2)
                                                    : k == 2 ? HH : _mm512_srli_epi16(HH, 2), m30);
                const __m512i lo = _mm512_ternarylogic_epi32(v, tl, m4, 0xEC);                           /* (v & m4) | tl */
                const __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), th, m4, 0xEC);
                a = _mm512_dpbusd_epi32(a, lo, bcast4(y->q + 8 * c));
                a = _mm512_dpbusd_epi32(a, hi, bcast4(y->q + 8 * c + 4));
            }
            s[half] = a;
        }
        const __m512i sc0 = _mm512_srai_epi32(_mm512_slli_epi32(scp, 16), 16), sc1 = _mm512_srai_epi32(scp, 16);
        acc = _mm512_add_epi32(acc, _mm512_add_epi32(_mm512_mullo_epi32(s[0], sc0), _mm512_mullo_epi32(s[1], sc1)));
        const uint32_t pair = (uint16_t)y->bsums[2 * G] | (uint32_t)(uint16_t)y->bsums[2 * G + 1] << 16;
        cacc = _mm512_dpwssd_epi32(cacc, scp, _mm512_set1_epi32((int)pair));
    }
    const __m512i si = _mm512_sub_epi32(acc, _mm512_slli_epi32(cacc, 5));
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)g));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(si), _mm512_mul_ps(d, _mm512_set1_ps(y->d))) + accf;
}

/* Q2_K / Q3_K (three: 1): per sub-block c one vector of 2-bit values, one shift and mask per 4 values of each
 * row (Q3_K: its third bits added by a masked byte add); a sub-block's sums fit in i16 (|sum| <= 16 * 7 * 127),
 * so a pair's two sums go into one vector of i16 pairs and one dpwssd weights them by the pair's scales. The
 * offsets come off through the activation sums: Q2_K's mins (x dmin), Q3_K's -4 (as integers). */
AVX512_INLINE __m512 r16_q23k(const int three, const uint8_t *g, const ktk_q8k *y, __m512 accf) {
    const __m512i m3 = _mm512_set1_epi8(3), x4 = _mm512_set1_epi8(4);
    const int qo = three ? 288 : 320;
    __m512i acc = _mm512_setzero_si512(), cacc = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int p = 0; p < 8; p++) {   /* sub-blocks 2p and 2p + 1 */
        const __m512i sp = three ? _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(g + 32 + 32 * p)))
                                 : _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(g + 64 + 32 * p)));
        __m512i a[2];
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const int c = 2 * p + h;
            const __m512i v = _mm512_loadu_si512((const void *)(g + qo + 64 * c));
            a[h] = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                __m512i q = _mm512_and_si512(k ? _mm512_srli_epi16(v, 2 * k) : v, m3);
                if (three) {
                    uint64_t m;
                    memcpy(&m, g + 1312 + 32 * c + 8 * k, 8);
                    q = _mm512_mask_add_epi8(q, (__mmask64)m, q, x4);
                }
                a[h] = _mm512_dpbusd_epi32(a[h], q, bcast4(y->q + 16 * c + 4 * k));
            }
        }
        const __m512i pk = _mm512_mask_blend_epi16(0xAAAAAAAAu, a[0], _mm512_slli_epi32(a[1], 16));
        const uint32_t pair = (uint16_t)y->bsums[2 * p] | (uint32_t)(uint16_t)y->bsums[2 * p + 1] << 16;
        if (three) {
            acc = _mm512_dpwssd_epi32(acc, pk, sp);
            cacc = _mm512_dpwssd_epi32(cacc, sp, _mm512_set1_epi32((int)pair));
        } else {
            acc = _mm512_dpwssd_epi32(acc, pk, _mm512_and_si512(sp, _mm512_set1_epi16(0x0F)));
            cacc = _mm512_dpwssd_epi32(cacc, _mm512_srli_epi16(sp, 4), _mm512_set1_epi32((int)pair));
        }
    }
    const __m512 yd = _mm512_set1_ps(y->d);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)g));
    if (three)
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc, _mm512_slli_epi32(cacc, 2))), _mm512_mul_ps(d, yd)) + accf;
    const __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + 32)));
    return _mm512_fnmadd_ps(_mm512_cvtepi32_ps(cacc), _mm512_mul_ps(dm, yd),
                            _mm512_mul_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(d, yd))) + accf;
}
AVX512_INLINE __m512 r16_q2k(const uint8_t *g, const ktk_q8k *y, __m512 accf) { return r16_q23k(0, g, y, accf); }
AVX512_INLINE __m512 r16_q3k(const uint8_t *g, const ktk_q8k *y, __m512 accf) { return r16_q23k(1, g, y, accf); }

AVX512_INLINE __m512 r16_q5_0(const uint8_t *g, const ktk_q8 *x, __m512 accf) {
    __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) r16_chunk5(g + 32 + 16 * c, g + 96 + 64 * c, x->q + 8 * c, &a0, &a1);
    const __m512i si = _mm512_sub_epi32(_mm512_add_epi32(a0, a1), _mm512_set1_epi32(16 * (x->s[0] + x->s[1])));
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)g));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(si), _mm512_mul_ps(d, _mm512_set1_ps(x->d))) + accf;
}

AVX512_INLINE __m512 r16_q4_0(const uint8_t *g, const ktk_q8 *x, __m512 accf) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        const __m512i v = _mm512_loadu_si512((const void *)(g + 32 + 64 * c));
        a0 = _mm512_dpbusd_epi32(a0, _mm512_and_si512(v, m4), bcast4(x->q + 8 * c));
        a1 = _mm512_dpbusd_epi32(a1, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4), bcast4(x->q + 8 * c + 4));
    }
    const __m512i si = _mm512_sub_epi32(_mm512_add_epi32(a0, a1), _mm512_set1_epi32(8 * (x->s[0] + x->s[1])));
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)g));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(si), _mm512_mul_ps(d, _mm512_set1_ps(x->d))) + accf;
}

/* IQ4_XS: the grid as unsigned bytes (+128) looked up by vpshufb, so the dot takes them as vpdpbusd's
 * unsigned operand; the +128 comes off as 128 * sum_s scale_s * (the sub-block's activation sum) */
AVX512_INLINE __m512 r16_iq4xs(const uint8_t *g, const ktk_q8k *y, __m512 accf) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i grid = _mm512_broadcast_i32x4(_mm_xor_si128(_mm_loadu_si128((const __m128i *)ktk_kvalues_iq4nl),
                                                              _mm_set1_epi8((char)0x80)));   /* + 128 */
    __m512i acc = _mm512_setzero_si512(), cacc = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int p = 0; p < 4; p++) {   /* sub-blocks 2p and 2p + 1 */
        const __m512i scp = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(g + 32 + 32 * p)));
        __m512i a[2];
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            a[h] = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int c = 8 * p + 4 * h; c < 8 * p + 4 * h + 4; c++) {
                const __m512i v = _mm512_loadu_si512((const void *)(g + 160 + 64 * c));
                a[h] = _mm512_dpbusd_epi32(a[h], _mm512_shuffle_epi8(grid, _mm512_and_si512(v, m4)), bcast4(y->q + 8 * c));
                a[h] = _mm512_dpbusd_epi32(a[h], _mm512_shuffle_epi8(grid, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4)),
                                           bcast4(y->q + 8 * c + 4));
            }
        }
        const __m512i sc0 = _mm512_srai_epi32(_mm512_slli_epi32(scp, 16), 16), sc1 = _mm512_srai_epi32(scp, 16);
        acc = _mm512_add_epi32(acc, _mm512_add_epi32(_mm512_mullo_epi32(a[0], sc0), _mm512_mullo_epi32(a[1], sc1)));
        const uint32_t pair = (uint16_t)(y->bsums[4 * p] + y->bsums[4 * p + 1]) |
                              (uint32_t)(uint16_t)(y->bsums[4 * p + 2] + y->bsums[4 * p + 3]) << 16;
        cacc = _mm512_dpwssd_epi32(cacc, scp, _mm512_set1_epi32((int)pair));
    }
    const __m512i si = _mm512_sub_epi32(acc, _mm512_slli_epi32(cacc, 7));
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)g));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(si), _mm512_mul_ps(d, _mm512_set1_ps(y->d))) + accf;
}

AVX512_INLINE __m512 r16_q8_0(const uint8_t *g, const ktk_q8 *x, __m512 accf) {
    __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int c = 0; c < 8; c += 2) {
        a0 = _mm512_dpbusd_epi32(a0, _mm512_loadu_si512((const void *)(g + 32 + 64 * c)), bcast4(x->q + 4 * c));
        a1 = _mm512_dpbusd_epi32(a1, _mm512_loadu_si512((const void *)(g + 96 + 64 * c)), bcast4(x->q + 4 * c + 4));
    }
    const __m512i si = _mm512_sub_epi32(_mm512_add_epi32(a0, a1), _mm512_set1_epi32(128 * (x->s[0] + x->s[1])));
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)g));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(si), _mm512_mul_ps(d, _mm512_set1_ps(x->d))) + accf;
}

/* Each pair's blocks are read as g_split segments side by side (block i of every segment, then
 * i + 1): more streams in flight per call; the segments' sums are added in order at the end. */
#define R16_DRIVER(NAME, BLK, GB, BLOCK, PFT, ACT)                                                        \
    AVX512_TARGET static void NAME(int P, const uint8_t *const *g, const ktk_q8 *const *xq, int64_t n, float *out) { \
        const int64_t nb = n / (BLOCK);                                                               \
        const int S = g_split > 1 && nb % g_split == 0 ? g_split : 1;                                 \
        const int64_t seg = nb / S;                                                                   \
        const int pf = g_pf[PFT];                                                                     \
        __m512 acc[KTK_R16_P * KTK_R16_SPLIT];                                                        \
        for (int j = 0; j < P * S; j++) acc[j] = _mm512_setzero_ps();                                 \
        for (int64_t i = 0; i < seg; i++)                                                             \
            for (int p = 0; p < P; p++)                                                               \
                for (int s = 0; s < S; s++) {                                                         \
                    const int64_t bi = s * seg + i;                                                   \
                    const uint8_t *b = g[p] + bi * (GB);                                              \
                    pf_block(b, GB, pf);                                                              \
                    acc[p * S + s] = BLK(b, ACT, acc[p * S + s]);                                     \
                }                                                                                     \
        for (int p = 0; p < P; p++) {                                                                 \
            __m512 t = acc[p * S];                                                                    \
            for (int s = 1; s < S; s++) t = _mm512_add_ps(t, acc[p * S + s]);                         \
            _mm512_storeu_ps(out + 16 * p, t);                                                        \
        }                                                                                             \
    }
R16_DRIVER(dot_q4k_avx512, r16_q4k, 2368, 256, PF_Q4K, ktk_act_k(xq[p], n) + bi)
R16_DRIVER(dot_q5k_avx512, r16_q5k, 2880, 256, PF_Q5K, ktk_act_k(xq[p], n) + bi)
R16_DRIVER(dot_q4_0_avx512, r16_q4_0, 288, 32, PF_Q4_0, xq[p] + bi)
R16_DRIVER(dot_q5_0_avx512, r16_q5_0, 352, 32, PF_Q5_0, xq[p] + bi)
R16_DRIVER(dot_q8_0_avx512, r16_q8_0, 544, 32, PF_Q8_0, xq[p] + bi)
R16_DRIVER(dot_q6k_avx512, r16_q6k, 3360, 256, PF_Q6K, ktk_act_k(xq[p], n) + bi)
R16_DRIVER(dot_iq4xs_avx512, r16_iq4xs, 2208, 256, PF_IQ4XS, ktk_act_k(xq[p], n) + bi)
R16_DRIVER(dot_q2k_avx512, r16_q2k, 1344, 256, PF_Q2K, ktk_act_k(xq[p], n) + bi)
R16_DRIVER(dot_q3k_avx512, r16_q3k, 1824, 256, PF_Q3K, ktk_act_k(xq[p], n) + bi)
#undef R16_DRIVER

/* The knobs, read once from the environment (by ktk_moe_new and ktk_r16_gemv, before any worker
 * runs a kernel: the workers only read them). */
/* Defaults by vendor, as measured (docs/native.md). The lent Xeon (Sapphire Rapids): every type
 * 1 KiB ahead into L1, two segments per pair (seventh session). A Zen 4: one segment, and into L2
 * 4 KiB ahead for the types with the most arithmetic per byte (Q4_K, Q5_K, Q4_0, Q5_0, Q6_K, IQ4_XS: 1.4-2.3x their
 * phases at one thread), none for Q8_0, which read fastest with none (twenty-fifth session). Other
 * vendors get Intel's. */
static void r16_defaults(int pf[PF_TYPES], int *l2, int *split) {
    const int amd = ktk_cpu_vendor() == KTK_VENDOR_AMD;
    for (int t = 0; t < PF_TYPES; t++) pf[t] = amd ? (t == PF_Q8_0 ? 0 : 4096) : 1024;
    *l2 = amd;
    *split = amd ? 1 : 2;
}

/* $name as a whole decimal number in [lo, hi], else dflt (unset, empty, other text or out of range) */
static int env_int(const char *name, int lo, int hi, int dflt) {
    const char *s = getenv(name);
    if (!s) return dflt;
    while (*s == ' ') s++;
    char *end;
    long v = strtol(s, &end, 10);
    while (*end == ' ') end++;
    return end == s || *end || v < lo || v > hi ? dflt : (int)v;
}

void ktk_r16_init(void) {
    if (g_init) return;
    int pf[PF_TYPES], l2, split;
    r16_defaults(pf, &l2, &split);
    g_split = env_int("KTINJECT_R16_SPLIT", 1, KTK_R16_SPLIT, split);
    g_l2 = env_int("KTINJECT_R16_PF_L2", 0, 1, l2);
    for (int t = 0; t < PF_TYPES; t++) g_pf[t] = env_int("KTINJECT_R16_PF", 0, 65536, pf[t]);
    g_init = 1;
}

int ktk_r16_stream(int type, int *pf_bytes, int *l2, int *split) {
    const int t = type == KTK_Q4_K ? PF_Q4K : type == KTK_Q5_K ? PF_Q5K : type == KTK_Q4_0 ? PF_Q4_0
                : type == KTK_Q5_0 ? PF_Q5_0 : type == KTK_Q8_0 ? PF_Q8_0 : type == KTK_Q6_K ? PF_Q6K
                : type == KTK_IQ4_XS ? PF_IQ4XS : type == KTK_Q2_K ? PF_Q2K : type == KTK_Q3_K ? PF_Q3K : -1;
    if (t < 0) return KTK_EINVAL;
    ktk_r16_init();
    if (pf_bytes) *pf_bytes = g_pf[t];
    if (l2) *l2 = g_l2;
    if (split) *split = g_split;
    return KTK_OK;
}

/* The kernels take KTK_ISA_AVX512 / AMX (VNNI is part of ktinject's AVX-512 path), scalar otherwise. */
void ktk_r16_dot(int isa, int type, int P, const uint8_t *const *g, const ktk_q8 *const *xq, int64_t n, float *out) {
    if (isa >= KTK_ISA_AVX512) {
        switch (type) {
        case KTK_Q4_K: dot_q4k_avx512(P, g, xq, n, out); return;
        case KTK_Q5_K: dot_q5k_avx512(P, g, xq, n, out); return;
        case KTK_Q4_0: dot_q4_0_avx512(P, g, xq, n, out); return;
        case KTK_Q5_0: dot_q5_0_avx512(P, g, xq, n, out); return;
        case KTK_Q8_0: dot_q8_0_avx512(P, g, xq, n, out); return;
        case KTK_Q6_K: dot_q6k_avx512(P, g, xq, n, out); return;
        case KTK_IQ4_XS: dot_iq4xs_avx512(P, g, xq, n, out); return;
        case KTK_Q2_K: dot_q2k_avx512(P, g, xq, n, out); return;
        case KTK_Q3_K: dot_q3k_avx512(P, g, xq, n, out); return;
        default: break;
        }
    }
    dot_scalar(type, P, g, xq, n, out);
}

/* ---- checked entry points for tests and tools ---- */

int ktk_r16_dequant(int type, const uint8_t *w, int64_t rows, int64_t n, float *dst) {
    if (!w || !dst || !ktk_r16_supported(type) || rows < 0 || rows % 16 || ktk_r16_row_bytes(type, n) < 0)
        return KTK_EINVAL;
    const int64_t rb = ktk_r16_row_bytes(type, n);
    for (int64_t r = 0; r < rows; r += 16) ktk_r16_dequant_group(type, w + r * rb, n, dst + r * n, n);
    return KTK_OK;
}

int ktk_r16_gemv(int isa, int type, const uint8_t *w, int64_t rows, int64_t n, int64_t T, const float *x, float *y) {
    if (!ktk_kernels_for(isa)) return KTK_EISA;
    if (!w || !x || !y || !ktk_r16_supported(type) || rows < 0 || rows % 16 || T < 1 || T > KTK_R16_NT ||
        ktk_r16_row_bytes(type, n) < 0)
        return KTK_EINVAL;
    const ktk_kernels *K = ktk_kernels_for(isa);
    ktk_r16_init();
    const size_t ab = ktk_act_bytes(n);
    uint8_t *rec = malloc(ab * (size_t)T + 64);
    if (!rec) return KTK_ENOMEM;
    const ktk_q8 *xq[KTK_R16_NT];
    for (int64_t t = 0; t < T; t++) {
        K->quant_act(x + t * n, (ktk_q8 *)(rec + t * ab), n);
        xq[t] = (const ktk_q8 *)(rec + t * ab);
    }
    const int64_t rb = ktk_r16_row_bytes(type, n);
    float out[16 * KTK_R16_NT];
    const uint8_t *gs[KTK_R16_NT];
    for (int64_t r = 0; r < rows; r += 16) {
        for (int64_t t = 0; t < T; t++) gs[t] = w + r * rb;
        ktk_r16_dot(isa, type, (int)T, gs, xq, n, out);
        for (int64_t t = 0; t < T; t++) memcpy(y + t * rows + r, out + 16 * t, 16 * sizeof(float));
    }
    free(rec);
    return KTK_OK;
}
