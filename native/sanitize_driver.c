/* Self-check driver for AddressSanitizer / UBSan builds (tests/test_native_sanitize.py) and for
 * quick checks on a new machine: random valid blocks of every type, every usable ISA path,
 * GEMV and the fused MoE layer at batch 1 and 48 (row-dot and grouped paths), compared with
 * the scalar path; bad arguments must be refused. Exit status 0 = all good. */
#include "ktk_int.h"   /* the kernel tables too (to_bf16 check) */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_util.h"   /* rnd, frand, f16, fill: random valid blocks of every type */

static double rel(const float *a, const float *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) { num += (a[i] - b[i]) * (double)(a[i] - b[i]); den += (double)b[i] * b[i]; }
    return sqrt(num / (den > 0 ? den : 1e-30));
}

/* a batch-48 layer's input: 48 tokens of 256 values, each routed to two distinct experts of E with random weights */
static void layer_input(int64_t E, float *x, int64_t *ids, float *w) {
    for (int i = 0; i < 48 * 256; i++) x[i] = frand();
    for (int i = 0; i < 48; i++) {
        ids[2 * i] = rnd() % E; ids[2 * i + 1] = (ids[2 * i] + 1 + rnd() % (E - 1)) % E;
        w[2 * i] = frand(); w[2 * i + 1] = frand();
    }
}

static void claim_item_fn(void *ctx, int phase, int64_t item, int tid) {
    (void)tid;
    _Atomic int (*seen)[100] = ctx;
    seen[phase][item]++;
}

int main(void) {
    static const int types[] = {KTK_Q4_0, KTK_Q5_0, KTK_Q8_0, KTK_Q2_K, KTK_Q3_K, KTK_Q4_K, KTK_Q5_K, KTK_Q6_K, KTK_IQ4_XS,
                                KTK_BF16, KTK_F16, KTK_F32};
    const int64_t E = 4, H = 256, I = 512, k = 2;
    int feats = ktk_cpu_features(), fails = 0;
    ktk_pool *pool = ktk_pool_new(3, 1);
    if (!pool) { fprintf(stderr, "pool\n"); return 2; }
    for (size_t ti = 0; ti < sizeof types / sizeof *types; ti++) {
        int t = types[ti];
        int64_t rbh = ktk_row_bytes(t, H), rbi = ktk_row_bytes(t, I);
        uint8_t *g = malloc((size_t)(E * I * rbh)), *u = malloc((size_t)(E * I * rbh)), *dn = malloc((size_t)(E * H * rbi));
        fill(t, g, E * I, H); fill(t, u, E * I, H); fill(t, dn, E * H, I);
        float x[48 * 256], ref[48 * 256], out[48 * 256], y0[512], y1[512];
        for (int i = 0; i < 48 * 256; i++) x[i] = frand();
        int64_t ids[48 * 2]; float w[48 * 2];
        for (int i = 0; i < 48; i++) { ids[2 * i] = rnd() % E; ids[2 * i + 1] = (ids[2 * i] + 1 + rnd() % (E - 1)) % E; w[2 * i] = frand(); w[2 * i + 1] = frand(); }
        ktk_moe_desc d = {t, t, t, E, H, I, g, u, dn, rbh, rbh, rbi, 0, 0, 0};
        int err = 0;
        ktk_moe *m = ktk_moe_new(&d, &err);
        if (!m) { fprintf(stderr, "type %d: moe_new %d\n", t, err); fails++; continue; }
        ktk_gemv(KTK_ISA_SCALAR, t, g, rbh, I, H, x, y0);
        for (int isa = 0; isa <= KTK_ISA_AMX; isa++) {
            if (isa && !(feats >> isa & 1)) continue;
            /* dense layer (linear.c), over the pool and on this thread: each token's results equal
             * the single-thread gemv of that token, bitwise; rows that end the buffer (no overread)
             * and a last chunk shorter than 64 rows; dequantized rows equal ktk_dequant_row's */
            const int R = I - 3;
            const uint8_t *gl = g + (E * I - R) * rbh;
            static float yp[3 * 512], ya[3 * 512], yt[512], dr[256];
            int bad = ktk_linear(pool, isa, t, gl, rbh, R, H, 3, x, yp) || ktk_linear(NULL, isa, t, gl, rbh, R, H, 3, x, ya);
            for (int tt = 0; tt < 3 && !bad; tt++) {
                ktk_gemv(isa, t, gl, rbh, R, H, x + tt * H, yt);
                bad = memcmp(yt, yp + tt * R, (size_t)R * sizeof(float)) || memcmp(yt, ya + tt * R, (size_t)R * sizeof(float));
            }
            float *dq = malloc((size_t)(R * H) * sizeof(float));
            bad = bad || !dq || ktk_dequant_rows(pool, isa, t, gl, rbh, R, H, dq);
            for (int r = 0; r < R && !bad; r += 7) {
                ktk_dequant_row_isa(isa, t, gl + r * rbh, dr, H);
                bad = memcmp(dr, dq + r * H, (size_t)H * sizeof(float)) != 0;
            }
            free(dq);
            if (bad) { fprintf(stderr, "MISMATCH type %d isa %d: ktk_linear / ktk_dequant_rows\n", t, isa); fails++; }
            if (ktk_linear_grouped_types(isa) >> t & 1) {   /* 20 tokens: the grouped 8-bit GEMM, R % 4 == 1 */
                static float yg[20 * 512], yn[20 * 512];
                double worst = 0;
                bad = ktk_linear(pool, isa, t, gl, rbh, R, H, 20, x, yg) || ktk_linear(NULL, isa, t, gl, rbh, R, H, 20, x, yn) ||
                      memcmp(yg, yn, sizeof(float) * 20 * (size_t)R);
                for (int tt = 0; tt < 20 && !bad; tt++) {
                    ktk_gemv(KTK_ISA_SCALAR, t, gl, rbh, R, H, x + tt * H, yt);
                    double mx = 0, d = 0;   /* the largest difference against the largest output */
                    for (int r = 0; r < R; r++) {
                        mx = fabs(yt[r]) > mx ? fabs(yt[r]) : mx;
                        d = fabs(yg[tt * R + r] - yt[r]) > d ? fabs(yg[tt * R + r] - yt[r]) : d;
                    }
                    const double e = d / (mx > 0 ? mx : 1);
                    worst = e > worst ? e : worst;
                }
                if (bad || !(worst < 0.02)) {   /* (8-bit activations per 32 values: 0.005-0.007 here) */
                    fprintf(stderr, "MISMATCH type %d isa %d: grouped ktk_linear (error %.4f)\n", t, isa, worst);
                    fails++;
                }
            }
        }
        for (int T = 1; T <= 48; T += 47) {
            if (ktk_moe_forward(m, pool, KTK_ISA_SCALAR, T, k, x, ids, w, ref)) { fails++; continue; }
            for (int isa = 1; isa <= KTK_ISA_AMX; isa++) {
                if (!(feats >> isa & 1)) continue;
                ktk_gemv(isa, t, g, rbh, I, H, x, y1);
                double eg = rel(y1, y0, I);
                {   /* multi-row dots: any start and row count (short passes) give the values of the
                     * whole-matrix call, bitwise; the last expert's rows end the buffer (no overread) */
                    const int sub[][2] = {{0, 1}, {1, 2}, {2, 3}, {3, 5}, {5, 7}, {9, 6}, {I - 3, 3}, {I - 1, 1}};
                    const uint8_t *gl = g + (E - 1) * I * rbh;
                    float yl[512], ys[8];
                    ktk_gemv(isa, t, gl, rbh, I, H, x, yl);
                    for (size_t si = 0; si < sizeof sub / sizeof *sub; si++) {
                        int o = sub[si][0], c = sub[si][1];
                        if (ktk_gemv(isa, t, gl + o * rbh, rbh, c, H, x, ys) || memcmp(ys, yl + o, (size_t)c * sizeof(float))) {
                            fprintf(stderr, "MISMATCH type %d isa %d: rows %d..%d alone differ\n", t, isa, o, o + c - 1);
                            fails++;
                        }
                    }
                }
                int rc = ktk_moe_forward(m, pool, isa, T, k, x, ids, w, out);
                double em = rel(out, ref, T * H);
                printf("type %2d isa %d T %2d gemv %.4f moe %.4f\n", t, isa, T, eg, em);
                if (rc || !(eg <= 0.05) || !(em <= 0.2)) { fprintf(stderr, "MISMATCH type %d isa %d T %d\n", t, isa, T); fails++; }
            }
        }
        ids[3] = E;                                       /* out of range: refused */
        if (ktk_moe_forward(m, pool, KTK_ISA_SCALAR, 48, k, x, ids, w, out) != KTK_ERANGE) { fprintf(stderr, "ERANGE not reported\n"); fails++; }
        ids[3] = -1;
        if (ktk_moe_forward(m, pool, KTK_ISA_SCALAR, 48, k, x, ids, w, out) != KTK_ERANGE) { fprintf(stderr, "ERANGE (neg) not reported\n"); fails++; }
        ktk_moe_free(m);
        d.gate_rb += 1;                                   /* wrong row bytes: refused */
        if (ktk_moe_new(&d, &err) || err != KTK_EINVAL) { fprintf(stderr, "bad row bytes accepted\n"); fails++; }
        free(g); free(u); free(dn);
    }
    /* float rows of lengths that end in every tail of the four-row kernel (16-value steps, an
     * 8-value step, single values), over more than one 64-row chunk of the spread order: each
     * buffer exactly as long as its rows (an overread is an ASan finding), every ISA against scalar */
    for (int ti = 0; ti < 3; ti++) {
        static const int ft[] = {KTK_BF16, KTK_F16, KTK_F32};
        static const int64_t lens[] = {8, 24, 37, 1000};
        for (size_t li = 0; li < sizeof lens / sizeof *lens; li++) {
            const int t = ft[ti];
            const int64_t n = lens[li], R = 150, rb = ktk_row_bytes(t, n);
            uint8_t *wr = malloc((size_t)(R * rb));
            float *xv = malloc((size_t)n * sizeof(float)), ya[150], yb[150];
            fill(t, wr, R, n);
            for (int64_t i = 0; i < n; i++) xv[i] = frand();
            if (ktk_gemv(KTK_ISA_SCALAR, t, wr, rb, R, n, xv, ya)) { fprintf(stderr, "float gemv type %d\n", t); fails++; }
            for (int isa = 1; isa <= KTK_ISA_AMX; isa++) {
                if (!(feats >> isa & 1)) continue;
                if (ktk_gemv(isa, t, wr, rb, R, n, xv, yb) || !(rel(yb, ya, R) <= 1e-5)) {
                    fprintf(stderr, "MISMATCH float rows type %d isa %d n %lld\n", t, isa, (long long)n);
                    fails++;
                }
            }
            free(wr); free(xv);
        }
    }
    if (ktk_row_bytes(KTK_Q4_K, 100) != -1 || ktk_gemv(KTK_ISA_SCALAR, 99, NULL, 0, 0, 32, NULL, NULL) != KTK_EINVAL) fails++;
    if (ktk_linear(pool, KTK_ISA_SCALAR, KTK_Q8_0, NULL, 34, 4, 32, 1, NULL, NULL) != KTK_EINVAL ||
        ktk_linear(pool, KTK_ISA_SCALAR, KTK_Q8_0, (const uint8_t *)"", 30, 0, 32, 1, NULL, NULL) != KTK_EINVAL ||
        ktk_dequant_rows(pool, KTK_ISA_SCALAR, KTK_Q8_0, (const uint8_t *)"", 34, 1, 32, NULL) != KTK_EINVAL) fails++;
    /* K-quant quantizers: exact-size outputs (an overrun is an ASan finding), edge values */
    {
        const int types[3] = {KTK_Q4_K, KTK_Q5_K, KTK_Q6_K};
        float *xq = malloc(6 * 256 * sizeof(float));
        for (int i = 0; i < 256; i++) {
            xq[i] = frand();                  /* ordinary */
            xq[256 + i] = 0.f;                /* zeros */
            xq[512 + i] = 3e-9f * frand();    /* scales below fp16's normal range */
            xq[768 + i] = -0.25f;             /* constant, negative */
            xq[1024 + i] = i == 7 ? 2.f : 0.f;
            xq[1280 + i] = 1e9f * frand();    /* scales past fp16's range: refused */
        }
        for (int t = 0; t < 3; t++) {
            int64_t rb = ktk_row_bytes(types[t], 256);
            uint8_t *q = malloc((size_t)(6 * rb));
            if (ktk_quantize_k(types[t], xq, 5, q) != KTK_OK) { fprintf(stderr, "quantize %d\n", types[t]); fails++; }
            float back[256];
            for (int b = 0; b < 5; b++)       /* every block comes back close (the constant one too) */
                if (ktk_dequant_row(types[t], q + b * rb, back, 256) != KTK_OK ||
                    fabsf(back[7] - xq[256 * b + 7]) > 0.25f) { fprintf(stderr, "block %d of %d\n", b, types[t]); fails++; }
            if (ktk_quantize_k(types[t], xq + 1280, 1, q) != KTK_ERANGE) { fprintf(stderr, "overflow %d\n", types[t]); fails++; }
            xq[3] = NAN;
            if (ktk_quantize_k(types[t], xq, 1, q) != KTK_ERANGE) { fprintf(stderr, "NaN %d\n", types[t]); fails++; }
            xq[3] = frand();
            free(q);
        }
        if (ktk_quantize_k(KTK_Q8_0, xq, 1, (uint8_t *)xq) != KTK_EINVAL || ktk_quantize_k(KTK_Q4_K, NULL, 1, NULL) != KTK_EINVAL)
            fails++;
        const int legacy[3] = {KTK_Q4_0, KTK_Q5_0, KTK_Q8_0};
        for (int t = 0; t < 3; t++) {               /* 40 blocks of 32: the first five super-blocks */
            int64_t rb = ktk_row_bytes(legacy[t], 32);
            uint8_t *q = malloc((size_t)(40 * rb));
            float back[32];
            if (ktk_quantize_legacy(legacy[t], xq, 40, q) != KTK_OK) { fprintf(stderr, "legacy %d\n", legacy[t]); fails++; }
            for (int b = 0; b < 40; b++)
                if (ktk_dequant_row(legacy[t], q + b * rb, back, 32) != KTK_OK ||
                    fabsf(back[7] - xq[32 * b + 7]) > 0.3f) { fprintf(stderr, "legacy block %d of %d\n", b, legacy[t]); fails++; }
            if (ktk_quantize_legacy(legacy[t], xq + 1280, 1, q) != KTK_ERANGE) fails++;   /* 1e9: past fp16 */
            free(q);
        }
        if (ktk_quantize_legacy(KTK_Q4_K, xq, 1, (uint8_t *)xq) != KTK_EINVAL) fails++;
        free(xq);
    }
    {   /* float -> bf16 of every SIMD path equals the scalar rule, NaN, Inf and rounding ties included */
        const uint32_t special[] = {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu, 0xffffffffu,
                                    0xffff8000u, 0x7f800000u, 0xff800000u, 0x7f7fffffu, 0x00000001u, 0x80000000u,
                                    0x3f808000u, 0x3f818000u};
        enum { NB = 1027 };
        float xb[NB];
        uint16_t yb[NB];
        for (int i = 0; i < NB; i++) {
            uint32_t u = i % 5 == 0 ? special[(i / 5) % 14] : (uint32_t)rnd() * 2654435761u;
            memcpy(&xb[i], &u, 4);
        }
        for (int isa = KTK_ISA_AVX2; isa <= KTK_ISA_AVX512; isa++) {
            const ktk_kernels *K = (feats >> isa & 1) ? ktk_kernels_for(isa) : NULL;
            if (!K) continue;
            K->to_bf16(xb, yb, NB);
            for (int i = 0; i < NB; i++)
                if (yb[i] != ktk_f32_to_bf16(xb[i])) { fprintf(stderr, "to_bf16 isa %d value %d\n", isa, i); fails++; break; }
        }
    }
    {   /* R16 copies (r16.c), exact-size buffers: repack keeps every value; each ISA's dots equal
         * the scalar loop's (same integer sums); the layer on R16 copies agrees with GGUF rows at
         * decode (row dots) and at batch 48 (grouped path on GGUF rows); bad descriptors refused */
        const int rtypes[9] = {KTK_Q4_K, KTK_Q5_K, KTK_Q4_0, KTK_Q5_0, KTK_Q8_0, KTK_Q6_K, KTK_IQ4_XS, KTK_Q2_K, KTK_Q3_K};
        for (int ti = 0; ti < 9; ti++) {
            int t = rtypes[ti];
            int64_t rbh = ktk_row_bytes(t, H), rbi = ktk_row_bytes(t, I), r16h = ktk_r16_row_bytes(t, H), r16i = ktk_r16_row_bytes(t, I);
            uint8_t *g = malloc((size_t)(E * I * rbh)), *u = malloc((size_t)(E * I * rbh)), *dn = malloc((size_t)(E * H * rbi));
            uint8_t *g16 = malloc((size_t)(E * I * r16h)), *u16 = malloc((size_t)(E * I * r16h)), *d16 = malloc((size_t)(E * H * r16i));
            float *dq = malloc((size_t)(I * H) * sizeof(float)), row[256];
            fill(t, g, E * I, H); fill(t, u, E * I, H); fill(t, dn, E * H, I);
            int bad = ktk_r16_repack(pool, t, g, rbh, I * rbh, E, I, H, g16) || ktk_r16_repack(NULL, t, u, rbh, I * rbh, E, I, H, u16) ||
                      ktk_r16_repack(pool, t, dn, rbi, H * rbi, E, H, I, d16) ||
                      ktk_r16_dequant(t, g16 + (E - 1) * I * r16h, I, H, dq);   /* the last expert: ends the buffer */
            for (int r = 0; r < I && !bad; r++) {
                ktk_dequant_row(t, g + ((E - 1) * I + r) * rbh, row, H);
                bad = memcmp(row, dq + r * H, (size_t)H * sizeof(float)) != 0;
            }
            if (bad) { fprintf(stderr, "R16 type %d: repack / dequant\n", t); fails++; }
            static float xs4[4 * 256], ys[4 * 512], yv[4 * 512];
            for (int i = 0; i < 4 * 256; i++) xs4[i] = frand();
            ktk_r16_gemv(KTK_ISA_SCALAR, t, g16 + (E - 1) * I * r16h, I, H, 4, xs4, ys);
            for (int isa = 1; isa <= KTK_ISA_AMX; isa++)
                if (feats >> isa & 1 && (ktk_r16_gemv(isa, t, g16 + (E - 1) * I * r16h, I, H, 4, xs4, yv) || !(rel(yv, ys, 4 * I) <= 1e-5))) {
                    fprintf(stderr, "R16 type %d isa %d: gemv differs from the scalar loop\n", t, isa); fails++;
                }
            float x[48 * 256], ref[48 * 256], out[48 * 256];
            int64_t ids[48 * 2]; float w[48 * 2];
            layer_input(E, x, ids, w);
            ktk_moe_desc d = {t, t, t, E, H, I, g, u, dn, rbh, rbh, rbi, 0, 0, 0, g16, u16, d16};
            ktk_moe_desc plain = {t, t, t, E, H, I, g, u, dn, rbh, rbh, rbi, 0, 0, 0, NULL, NULL, NULL};
            int err = 0;
            ktk_moe *m = ktk_moe_new(&d, &err), *mp = ktk_moe_new(&plain, &err);
            for (int T = 1; m && mp && T <= 48; T += 47)
                for (int isa = 0; isa <= KTK_ISA_AMX; isa++) {
                    if (isa && !(feats >> isa & 1)) continue;
                    if (ktk_moe_forward(mp, pool, isa, T, k, x, ids, w, ref) || ktk_moe_forward(m, pool, isa, T, k, x, ids, w, out) ||
                        !(rel(out, ref, T * H) <= (isa ? 0.2 : 0.05))) {
                        fprintf(stderr, "R16 type %d isa %d T %d: layer differs\n", t, isa, T); fails++;
                    }
                }
            if (!m || !mp) { fprintf(stderr, "R16 type %d: moe_new %d\n", t, err); fails++; }
            if (m && mp && ti == 0) {   /* the chain: its call 2 is mp on routing 0 again; bad ids and counts refused */
                ktk_moe *ms[2] = {mp, m};
                int64_t badids[2] = {0, E};
                const int64_t *idr[2] = {ids, ids}, *idb[2] = {ids, badids};
                const float *wr[2] = {w, w};
                double sec = 0;
                if (ktk_moe_chain(ms, 2, pool, KTK_ISA_SCALAR, 1, k, x, idr, wr, 2, out, 3, &sec) || !(sec > 0) ||
                    ktk_moe_forward(mp, pool, KTK_ISA_SCALAR, 1, k, x, ids, w, ref) ||
                    memcmp(out, ref, (size_t)H * sizeof(float)) ||
                    ktk_moe_chain(ms, 2, pool, KTK_ISA_SCALAR, 1, k, x, idb, wr, 2, out, 1, &sec) != KTK_ERANGE ||
                    ktk_moe_chain(ms, 0, pool, KTK_ISA_SCALAR, 1, k, x, idr, wr, 2, out, 1, &sec) != KTK_EINVAL ||
                    ktk_moe_chain(ms, 2, pool, KTK_ISA_SCALAR, 1, k, x, idr, wr, 2, out, 0, &sec) != KTK_EINVAL) {
                    fprintf(stderr, "moe_chain\n"); fails++;
                }
            }
            ktk_moe_free(m); ktk_moe_free(mp);
            d.up_r16 = NULL;                              /* gate without up: refused */
            if (ktk_moe_new(&d, &err) || err != KTK_EINVAL) { fprintf(stderr, "R16 gate without up accepted\n"); fails++; }
            if (ktk_r16_repack(NULL, t, g, rbh, I * rbh, E, 8, H, g16) != KTK_EINVAL ||          /* rows % 16 */
                ktk_r16_repack(NULL, t, g, rbh + 1, I * rbh, E, I, H, g16) != KTK_EINVAL ||      /* row bytes */
                ktk_r16_repack(NULL, t, g, rbh, rbh, E, I, H, g16) != KTK_EINVAL ||              /* overlapping experts */
                ktk_r16_gemv(KTK_ISA_SCALAR, t, g16, I, H, 5, xs4, ys) != KTK_EINVAL) {          /* T > 4 */
                fprintf(stderr, "R16 type %d: bad arguments accepted\n", t); fails++;
            }
            free(g); free(u); free(dn); free(g16); free(u16); free(d16); free(dq);
        }
        if (ktk_r16_supported(KTK_BF16) || ktk_r16_row_bytes(KTK_Q4_K, 100) != -1) {   /* no layout; a partial block */
            fprintf(stderr, "R16: a type without the layout, or a row of no whole blocks, accepted\n"); fails++;
        }
    }
    /* I8 and I4 copies (i8.c), exact-size buffers: every value of the last expert within half a step
     * of GGML's (I4: within its largest step); the token packing of 33 tokens (3 tiles); on AMX-INT8 the layer on the copies near
     * the GGUF rows' at batch 48 (I4: within its coarser steps); bad arguments and descriptors refused */
#define XB(r, n, G) (bits == 4 ? ktk_i4_expert_bytes(r, n, G) : ktk_i8_expert_bytes(r, n, G))
#define XR(...) (bits == 4 ? ktk_i4_repack(__VA_ARGS__) : ktk_i8_repack(__VA_ARGS__))
#define XD(...) (bits == 4 ? ktk_i4_dequant(__VA_ARGS__) : ktk_i8_dequant(__VA_ARGS__))
    for (int bits = 8; bits >= 4; bits -= 4) {
        const int itypes[3] = {KTK_Q4_K, KTK_Q8_0, KTK_BF16};
        for (int ti = 0; ti < 3; ti++) {
            int t = itypes[ti];
            const int64_t dg = ti == 1 ? 64 : 0;   /* the down's group: the default, or 64 */
            const int64_t esg = XB(I, H, 0), esd = XB(H, I, dg);
            int64_t rbh = ktk_row_bytes(t, H), rbi = ktk_row_bytes(t, I);
            uint8_t *g = malloc((size_t)(E * I * rbh)), *u = malloc((size_t)(E * I * rbh)), *dn = malloc((size_t)(E * H * rbi));
            uint8_t *gi = malloc((size_t)(E * esg)), *ui = malloc((size_t)(E * esg)), *di = malloc((size_t)(E * esd));
            float *dq = malloc((size_t)(I * H) * sizeof(float)), row[256];
            fill(t, g, E * I, H); fill(t, u, E * I, H); fill(t, dn, E * H, I);
            int bad = XR(pool, t, g, rbh, I * rbh, E, I, H, 0, gi) || XR(NULL, t, u, rbh, I * rbh, E, I, H, 0, ui) ||
                      XR(pool, t, dn, rbi, H * rbi, E, H, I, dg, di) || XD(gi + (E - 1) * esg, I, H, 0, dq);
            const float *ws = (const float *)(gi + (E - 1) * esg + I * H * bits / 8);
            for (int r = 0; r < I && !bad; r++) {
                ktk_dequant_row(t, g + ((E - 1) * I + r) * rbh, row, H);
                for (int64_t c = 0; c < H && !bad; c++)   /* I4: within its largest step, 16 S (clipped values by less) */
                    bad = !(fabsf(row[c] - dq[r * H + c]) <= (bits == 4 ? 16.f : 0.5f) * ws[r] * 1.0001f);
            }
            if (bad) { fprintf(stderr, "I%d type %d: repack / dequant\n", bits, t); fails++; }
            {
                int8_t *pk = malloc(48 * 256);
                float *ts = malloc(48 * sizeof(float)), x[33 * 256];
                const float *xp[33];
                for (int i = 0; i < 33 * 256; i++) x[i] = frand();
                for (int j = 0; j < 33; j++) xp[j] = x + j * 256;
                ktk_amx_pack_x_i8(xp, 33, 256, 256, pk, ts);
                if (ts[2 * 16 + 1] != 0.f || pk[2 * 4096 + 5] != 0) { fprintf(stderr, "pack_x_i8 padding\n"); fails++; }
                free(pk); free(ts);
            }
            ktk_moe_desc d = {t, t, t, E, H, I, g, u, dn, rbh, rbh, rbi, 0, 0, 0, NULL, NULL, NULL, gi, ui, di, 0, dg, bits};
            ktk_moe_desc plain = {t, t, t, E, H, I, g, u, dn, rbh, rbh, rbi, 0, 0, 0, NULL, NULL, NULL, NULL, NULL, NULL, 0, 0};
            int err = 0;
            ktk_moe *m = ktk_moe_new(&d, &err), *mp = ktk_moe_new(&plain, &err);
            if (!m || !mp) { fprintf(stderr, "I%d type %d: moe_new %d\n", bits, t, err); fails++; }
            float x[48 * 256], ref[48 * 256], out[48 * 256], w[48 * 2];
            int64_t ids[48 * 2];
            for (int i = 0; i < 48 * 256; i++) x[i] = frand();
            for (int i = 0; i < 48; i++) { ids[2 * i] = rnd() % E; ids[2 * i + 1] = (ids[2 * i] + 1 + rnd() % (E - 1)) % E; w[2 * i] = frand(); w[2 * i + 1] = frand(); }
            if (m && mp && ktk_amx_int8_usable() &&
                (ktk_moe_forward(mp, pool, KTK_ISA_AMX, 48, k, x, ids, w, ref) || ktk_moe_forward(m, pool, KTK_ISA_AMX, 48, k, x, ids, w, out) ||
                 !(rel(out, ref, 48 * H) <= (bits == 4 ? 0.25 : 0.05)))) {
                fprintf(stderr, "I%d type %d: layer differs (%g)\n", bits, t, rel(out, ref, 48 * H)); fails++;
            }
            ktk_moe_free(m); ktk_moe_free(mp);
            d.down_i8_group = 96;                          /* a group that does not fit the down's rows: refused */
            if (ktk_moe_new(&d, &err) || err != KTK_EINVAL) { fprintf(stderr, "I8 down group 96 accepted\n"); fails++; }
            d.down_i8_group = dg;
            d.up_i8 = NULL;                                /* gate without up: refused */
            if (ktk_moe_new(&d, &err) || err != KTK_EINVAL) { fprintf(stderr, "I8 gate without up accepted\n"); fails++; }
            d.up_i8 = ui; d.i8_bits = 5;                   /* no such width: refused */
            if (ktk_moe_new(&d, &err) || err != KTK_EINVAL) { fprintf(stderr, "i8_bits 5 accepted\n"); fails++; }
            if (XR(NULL, t, g, rbh, I * rbh, E, 16, H, 0, gi) != KTK_EINVAL ||          /* rows % 32 */
                XR(NULL, t, g, rbh + 1, I * rbh, E, I, H, 0, gi) != KTK_EINVAL ||      /* row bytes */
                XR(NULL, t, g, rbh, rbh, E, I, H, 0, gi) != KTK_EINVAL ||              /* overlapping experts */
                XR(NULL, 99, g, rbh, I * rbh, E, I, H, 0, gi) != KTK_EINVAL ||         /* no such type */
                XR(NULL, t, g, rbh, I * rbh, E, I, H, 192, gi) != KTK_EINVAL ||    /* G does not divide H */
                XD(gi, I, H, 2048, dq) != KTK_EINVAL ||                           /* G longer than the row */
                XD(gi, 16, H, 0, dq) != KTK_EINVAL) {
                fprintf(stderr, "I%d type %d: bad arguments accepted\n", bits, t); fails++;
            }
            free(g); free(u); free(dn); free(gi); free(ui); free(di); free(dq);
        }
    }
#undef XB
#undef XR
#undef XD
    {   /* BF16 tile copies (amx.c), exact-size buffers: the last expert's last block ends the buffer; the layer on
         * the copies equals the layer on the rows, bit for bit, on every ISA here (only AMX reads the copies); bad
         * arguments and descriptors refused */
        const int64_t rbh = ktk_row_bytes(KTK_BF16, H), rbi = ktk_row_bytes(KTK_BF16, I);
        const int64_t esg = ktk_bt_expert_bytes(I, H), esd = ktk_bt_expert_bytes(H, I);
        uint8_t *g = malloc((size_t)(E * I * rbh)), *u = malloc((size_t)(E * I * rbh)), *dn = malloc((size_t)(E * H * rbi));
        uint8_t *gb = malloc((size_t)(E * esg)), *ub = malloc((size_t)(E * esg)), *db = malloc((size_t)(E * esd));
        fill(KTK_BF16, g, E * I, H); fill(KTK_BF16, u, E * I, H); fill(KTK_BF16, dn, E * H, I);
        int bad = esg != I * H * 2 || ktk_bt_repack(pool, KTK_BF16, g, rbh, I * rbh, E, I, H, gb) ||
                  ktk_bt_repack(NULL, KTK_BF16, u, rbh, I * rbh, E, I, H, ub) ||
                  ktk_bt_repack(pool, KTK_BF16, dn, rbi, H * rbi, E, H, I, db) ||
                  memcmp(gb + E * esg - 64, g + (E * I - 1) * rbh + (H - 32) * 2, 64);   /* the last row's last k-step */
        if (bad) { fprintf(stderr, "BF16 tile copies: repack\n"); fails++; }
        float x[48 * 256], ref[48 * 256], out[48 * 256];
        int64_t ids[48 * 2]; float w[48 * 2];
        layer_input(E, x, ids, w);
        ktk_moe_desc plain = {KTK_BF16, KTK_BF16, KTK_BF16, E, H, I, g, u, dn, rbh, rbh, rbi, 0, 0, 0};
        ktk_moe_desc d = plain;
        d.gate_bt = gb; d.up_bt = ub; d.down_bt = db;
        int err = 0;
        ktk_moe *m = ktk_moe_new(&d, &err), *mp = ktk_moe_new(&plain, &err);
        for (int T = 1; m && mp && T <= 48; T += 47)
            for (int isa = 0; isa <= KTK_ISA_AMX; isa++) {
                if (isa && !(feats >> isa & 1)) continue;
                if (ktk_moe_forward(mp, pool, isa, T, k, x, ids, w, ref) || ktk_moe_forward(m, pool, isa, T, k, x, ids, w, out) ||
                    memcmp(out, ref, (size_t)(T * H) * sizeof(float))) {
                    fprintf(stderr, "BF16 tile copies isa %d T %d: layer differs\n", isa, T); fails++;
                }
            }
        if (!m || !mp) { fprintf(stderr, "BF16 tile copies: moe_new %d\n", err); fails++; }
        ktk_moe_free(m); ktk_moe_free(mp);
        d.up_bt = NULL;                                   /* gate without up: refused */
        if (ktk_moe_new(&d, &err) || err != KTK_EINVAL) { fprintf(stderr, "BF16 tile copy of gate without up accepted\n"); fails++; }
        ktk_moe_desc q = plain;                           /* a copy beside rows of another type: refused */
        q.down_type = KTK_Q8_0; q.down_rb = ktk_row_bytes(KTK_Q8_0, I); q.down_bt = db;
        if (ktk_moe_new(&q, &err) || err != KTK_EINVAL) { fprintf(stderr, "BF16 tile copy of a Q8_0 down accepted\n"); fails++; }
        if (ktk_bt_repack(NULL, KTK_Q8_0, g, ktk_row_bytes(KTK_Q8_0, H), I * rbh, E, I, H, gb) != KTK_EINVAL ||   /* BF16 only */
            ktk_bt_repack(NULL, KTK_BF16, g, rbh, I * rbh, E, 16, H, gb) != KTK_EINVAL ||       /* rows % 32 */
            ktk_bt_repack(NULL, KTK_BF16, g, rbh + 2, I * rbh, E, I, H, gb) != KTK_EINVAL ||    /* row bytes */
            ktk_bt_repack(NULL, KTK_BF16, g, rbh, rbh, E, I, H, gb) != KTK_EINVAL ||            /* overlapping experts */
            ktk_bt_repack(NULL, KTK_BF16, g, rbh, I * rbh, 0, I, H, gb) != KTK_EINVAL ||        /* no experts */
            ktk_bt_repack(NULL, KTK_BF16, NULL, rbh, I * rbh, E, I, H, gb) != KTK_EINVAL ||
            ktk_bt_expert_bytes(I, 48) != -1 || ktk_bt_expert_bytes(INT64_MAX / 64 * 32, 64) != -1) {
            fprintf(stderr, "BF16 tile copies: bad arguments accepted\n"); fails++;
        }
        free(g); free(u); free(dn); free(gb); free(ub); free(db);
    }
    double bw = ktk_probe_read_gbps(pool, KTK_ISA_SCALAR, 8 << 20, 1);
    if (bw <= 0) fails++;
    ktk_probe *pr = ktk_probe_new(pool, (8 << 20) + 3);   /* kept buffer: two whole chunks, passes reuse it */
    if (!pr || ktk_probe_bytes(pr) != (8 << 20) || !(ktk_probe_pass(pr, pool, KTK_ISA_SCALAR, 2) > 0) ||
        !(ktk_probe_pass(pr, pool, KTK_ISA_SCALAR, 1) > 0) || ktk_probe_pass(pr, pool, KTK_ISA_SCALAR, 0) != -1.0 ||
        ktk_probe_new(NULL, 1 << 20) != NULL) {
        fprintf(stderr, "probe object\n"); fails++;
    }
    ktk_probe_free(pr);
    {   /* per-phase claims: every item of every phase runs once, whatever each phase claims at a time */
        static _Atomic int seen[3][100];
        memset((void *)seen, 0, sizeof seen);
        const int64_t items[3] = {37, 100, 5}, claims[3] = {3, 0, 64}, bad[3] = {1, 65, 1};
        int rc = ktk_pool_run_async_claims(pool, claim_item_fn, (void *)seen, 3, items, claims);
        rc = rc ? rc : ktk_pool_wait(pool);
        for (int ph = 0; ph < 3; ph++)
            for (int64_t i = 0; i < 100; i++) rc |= seen[ph][i] != (i < items[ph]);
        rc |= ktk_pool_run_async_claims(pool, claim_item_fn, (void *)seen, 3, items, bad) != KTK_EINVAL;
        if (rc) { fprintf(stderr, "pool claims\n"); fails++; }
    }
    {   /* the pool's CPU order: siblings numbered (0, 1) spread one per core first */
        int cpus[8] = {0, 1, 2, 3, 4, 5, 6, 7}, pkg[8] = {0}, core[8] = {0, 0, 1, 1, 2, 2, 3, 3};
        const int want[8] = {0, 2, 4, 6, 1, 3, 5, 7};
        ktk_cpu_spread(8, cpus, pkg, core);
        if (memcmp(cpus, want, sizeof want)) { fprintf(stderr, "cpu_spread\n"); fails++; }
        ktk_pool *half = ktk_pool_new(1, 1);          /* fewer workers than CPUs: the spread path */
        if (!half) { fprintf(stderr, "pool of 1\n"); fails++; }
        ktk_pool_free(half);
    }
    ktk_pool_free(pool);
    printf("%s (%d failures)\n", fails ? "FAIL" : "OK", fails);
    return fails ? 1 : 0;
}
