/* AMX-BF16 tile GEMM for grouped (prefill) expert work.
 *
 * Roles: the dequantized weight rows are the A operand (16 rows x 32 bf16 per tile, plain
 * row-major, no repacking), the tokens are the B operand, packed once per expert in the
 * VNNI pair layout: for token tile tt and k-step ks (32 values), a 1 KiB block
 * B[p][t][e] = x[tt*16 + t][ks*32 + 2p + e]. C tiles are [16 weight rows][16 tokens] f32.
 * Blocking: 2 row tiles x 2 token tiles = 4 accumulators, 2 A + 2 B tiles. */
#include "ktk_int.h"
#include <immintrin.h>

int64_t ktk_amx_pack_x_elems(int64_t nt, int64_t K) { return (nt + 15) / 16 * 16 * K; }

void ktk_amx_pack_x(const float *const *X, int64_t nt, int64_t K, uint16_t *pk) {
    int64_t KS = K / 32, ntt = (nt + 15) / 16;
    const ktk_kernels *kern = ktk_kernels_for(KTK_ISA_AVX512);
    uint32_t row[4096];                         /* one token in bf16: K/2 pairs (K <= 8192) */
    uint32_t *dst = (uint32_t *)pk;             /* one bf16 pair = one u32 of a B tile row */
    for (int64_t tt = 0; tt < ntt; tt++)
        for (int t = 0; t < 16; t++) {
            int64_t tok = tt * 16 + t;
            if (K > 8192) {                     /* long rows: convert pair by pair */
                for (int64_t ks = 0; ks < KS; ks++)
                    for (int p = 0; p < 16; p++) {
                        uint16_t *b = (uint16_t *)(dst + (tt * KS + ks) * 256 + p * 16 + t);
                        b[0] = tok < nt ? ktk_f32_to_bf16(X[tok][ks * 32 + 2 * p]) : 0;
                        b[1] = tok < nt ? ktk_f32_to_bf16(X[tok][ks * 32 + 2 * p + 1]) : 0;
                    }
                continue;
            }
            if (tok < nt) {
                if (kern) kern->to_bf16(X[tok], (uint16_t *)row, K);
                else for (int64_t i = 0; i < K; i++) ((uint16_t *)row)[i] = ktk_f32_to_bf16(X[tok][i]);
            } else {
                memset(row, 0, (size_t)K * 2);
            }
            for (int64_t ks = 0; ks < KS; ks++) {
                uint32_t *blk = dst + (tt * KS + ks) * 256 + t;
                for (int p = 0; p < 16; p++) blk[p * 16] = row[ks * 16 + p];
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
void ktk_amx_gemm(const uint16_t *W, int64_t ldw, int64_t R, int64_t K, const uint16_t *pk, int64_t nt,
                  float *C, int64_t ldc) {
    if (!t_configured) amx_config();
    int64_t KS = K / 32, ntt = (nt + 15) / 16;
    float buf[4][16][16] __attribute__((aligned(64)));
    for (int64_t r0 = 0; r0 + 32 <= R; r0 += 32) {
        const uint16_t *w0 = W + r0 * ldw, *w1 = W + (r0 + 16) * ldw;
        for (int64_t tt = 0; tt < ntt; tt += 2) {
            int two = tt + 1 < ntt;
            const uint16_t *b0 = pk + tt * KS * 512, *b1 = pk + (tt + 1) * KS * 512;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            if (two) {
                for (int64_t ks = 0; ks < KS; ks++) {
                    _tile_loadd(4, w0 + ks * 32, ldw * 2);
                    _tile_loadd(5, w1 + ks * 32, ldw * 2);
                    _tile_loadd(6, b0 + ks * 512, 64);
                    _tile_loadd(7, b1 + ks * 512, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 5, 6);
                    _tile_dpbf16ps(2, 4, 7);
                    _tile_dpbf16ps(3, 5, 7);
                }
            } else {
                for (int64_t ks = 0; ks < KS; ks++) {
                    _tile_loadd(4, w0 + ks * 32, ldw * 2);
                    _tile_loadd(5, w1 + ks * 32, ldw * 2);
                    _tile_loadd(6, b0 + ks * 512, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 5, 6);
                }
            }
            _tile_stored(0, buf[0], 64);
            _tile_stored(1, buf[1], 64);
            if (two) { _tile_stored(2, buf[2], 64); _tile_stored(3, buf[3], 64); }
            for (int q = 0; q < (two ? 4 : 2); q++) {
                int64_t tbase = (tt + (q >> 1)) * 16, rbase = r0 + (q & 1) * 16;
                for (int t = 0; t < 16 && tbase + t < nt; t++) {
                    float *c = C + (tbase + t) * ldc + rbase;
                    for (int r = 0; r < 16; r++) c[r] = buf[q][r][t];
                }
            }
        }
    }
}
#else
void ktk_amx_gemm(const uint16_t *W, int64_t ldw, int64_t R, int64_t K, const uint16_t *pk, int64_t nt,
                  float *C, int64_t ldc) { (void)W; (void)ldw; (void)R; (void)K; (void)pk; (void)nt; (void)C; (void)ldc; }
#endif
