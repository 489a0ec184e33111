/* The AMX grouped path's tile loop on any x86 CPU with AVX2: built with -DKTK_AMX_EMULATE, where
 * amx.c's tile intrinsics run on a software tile unit and the rows are converted by the scalar
 * dequantization (tests/test_amx_emulated.py; the real unit is checked on an AMX machine by
 * tests/test_native_kernels.py). For every type, K from one k-step to 72, and 1-50 tokens (odd and
 * even token tile counts, counts not a multiple of 16), at two C strides:
 *   - ktk_amx_rows_bf16's tile-major layout, value by value, against the same dequantization
 *     rounded to bf16;
 *   - ktk_amx_gemm against a double-precision dot of those bf16 rows and tokens, the padding
 *     columns zero and the columns past them untouched; for BF16, ktk_amx_gemm_rows (the rows
 *     read in place) bit for bit against it.
 * Then the SiLU epilogue against libm (huge, infinite and NaN inputs too), and the fused MoE layer
 * (moe.c) at 48 and 100 tokens, whose grouped experts take the AMX path in this build when isa is
 * AVX2 (token packing, the SiLU epilogue, h packing, the down projection's weighted sums), against
 * the scalar path. Built with -DKTK_AMX_EMULATE_WRITERS as well (on CPUs with AVX-512
 * F/BW/VL/DQ), the rows go through the real AVX-512 writers and the SiLU through exp512, the BF16
 * conversions emulated. Exit status 0 = all good. */
#include "check_util.h"
#include <stdio.h>
#include <stdlib.h>

static float bf16_round(float f) { return ktk_bf16_to_f32(ktk_f32_to_bf16(f)); }

/* The C stride: the padded token count, or one spare tile more (gemm must keep to its columns) */
static int check_gemm(int t, int64_t n, const float *w, const float *x, const uint16_t *wt, const uint16_t *pk,
                      int64_t nt, int64_t ldc, float *C) {
    const int64_t pad = (nt + 15) / 16 * 16;
    for (int64_t i = 0; i < 32 * ldc; i++) C[i] = NAN;
    ktk_amx_gemm(wt, n, pk, nt, C, ldc);
    double worst = 0;
    int bad = 0;
    for (int r = 0; r < 32; r++)
        for (int64_t j = 0; j < ldc; j++) {
            const float c = C[r * ldc + j];
            if (j >= pad) { bad += !isnan(c); continue; }   /* not ours to write */
            double ref = 0, mag = 0;
            if (j < nt)
                for (int64_t k = 0; k < n; k++) { ref += (double)w[r * n + k] * x[j * n + k]; mag += fabs((double)w[r * n + k] * x[j * n + k]); }
            double e = fabs(c - ref) / (mag > 0 ? mag : 1.0);
            if (!(e <= 1e-5)) bad++;   /* (NaN too: every column up to pad is written) */
            if (e > worst) worst = e;
        }
    if (bad)
        printf("FAIL gemm type %d n %lld tokens %lld ldc %lld: %d of %lld outputs off (worst %.3g)\n", t, (long long)n,
               (long long)nt, (long long)ldc, bad, (long long)(32 * ldc), worst);
    return bad != 0;
}

/* the SiLU epilogues against libm: AMX's (exp512 in the -DKTK_AMX_EMULATE_WRITERS build) and the
 * packed f32 path's AVX2 one (exp256) */
static int check_silu(void (*silu_mul)(float *, const float *, int64_t, int), const char *name) {
    enum { NV = 2 * 1024, LDC = 64 };
    static float g[NV], u[NV], g0[NV];
    for (int i = 0; i < NV; i++) { g[i] = g0[i] = (float)(i - NV / 2) / 9.f; u[i] = 1.f + frand() * 0.5f; }
    const float extreme[] = {1e30f, -1e30f, 3e38f, -3e38f, 100.f, -100.f, 0.f, -0.f, 88.f, -88.f, 89.f, -89.f,
                             103.f, -103.f, 105.f, -105.f, 1e4f, -1e4f, INFINITY, -INFINITY, NAN, -NAN};
    const int ne = (int)(sizeof extreme / sizeof *extreme);
    for (int i = 0; i < ne; i++) { g[3 * i] = g0[3 * i] = extreme[i]; u[3 * i] = 1.f; }   /* spread over lanes */
    silu_mul(g, u, LDC, NV / LDC);
    int bad = 0;
    for (int i = 0; i < NV; i++) {
        const double ref = (double)g0[i] / (1.0 + exp(-(double)g0[i])) * u[i];   /* -inf: NaN, as libm's */
        const int ok = isnan(ref) ? isnan(g[i]) : isinf(ref) ? g[i] == ref : fabs(g[i] - ref) <= 1e-6 * fabs(ref) + 1e-30;
        if (!ok && bad++ < 3) printf("FAIL %s: silu(%g) * %g = %g, want %g\n", name, g0[i], u[i], g[i], ref);
    }
    return bad != 0;
}

static double rel_err(const float *out, const float *ref, int64_t n) {   /* |out - ref| / |ref|, 2-norms */
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) { num += (out[i] - ref[i]) * (double)(out[i] - ref[i]); den += (double)ref[i] * ref[i]; }
    return sqrt(num / (den > 0 ? den : 1e-30));
}

/* The I8 (bits 8) or I4 (bits 4) copies (i8.c) and the AMX-INT8 tile GEMM: every value of the
 * repack's copy within half a step of the f32 dequantization (I4: of its sub-group's step, but for values
 * past the clipped ends of its range), the dequant reading back the layout, every token within half a step of its
 * packing, and ktk_amx_gemm_i8 / ktk_amx_gemm_i4 against a double-precision dot of the copy's
 * and the packed tokens' values, the padding columns zero and the columns past them untouched. */
#define XB(r, n, G) (bits == 4 ? ktk_i4_expert_bytes(r, n, G) : ktk_i8_expert_bytes(r, n, G))
#define XR(...) (bits == 4 ? ktk_i4_repack(__VA_ARGS__) : ktk_i8_repack(__VA_ARGS__))
#define XD(...) (bits == 4 ? ktk_i4_dequant(__VA_ARGS__) : ktk_i8_dequant(__VA_ARGS__))
static void gemm_ix(int bits, const uint8_t *cp, int64_t R, int64_t blk, int64_t n, int64_t G, const int8_t *pk,
                    const float *ts, int64_t nt, float *C, int64_t ldc, int32_t *ci, uint8_t *a8, int pf, int overlap,
                    int ahead) {   /* block blk of the expert copy at cp */
    const int64_t NG = n / G;
    const float *ws = (const float *)(cp + R * n * bits / 8);
    if (bits == 4)
        ktk_amx_gemm_i4(cp + blk * 32 * n / 2, ws + blk * 32 * NG, cp + R * n / 2 + R * NG * 4 + blk * 32 * (n / 64), n, G,
                        pk, ts, nt, C, ldc, ci, a8, pf, overlap, ahead);
    else
        ktk_amx_gemm_i8((const int8_t *)cp + blk * 32 * n, ws + blk * 32 * NG, n, G, pk, ts, nt, C, ldc, ci, pf, overlap);
}

static int check_ix(int bits) {
    static const int types[] = {KTK_Q4_K, KTK_Q5_0, KTK_Q8_0, KTK_BF16, KTK_Q6_K};
    static const int64_t ns[][2] = {{256, 0}, {1408, 0}, {1408, 128}, {1408, 64}, {2048, 0}, {2048, 512}, {192, 0}, {192, 64}};   /* n, G */
    static const int64_t nts[] = {1, 17, 33, 48};
    const ktk_kernels *K = ktk_kernels_for(KTK_ISA_SCALAR);
    const int64_t E = 2, R = 64;
    int fails = 0;
    ktk_pool *pool = ktk_pool_new(2, 0);
    for (size_t ti = 0; ti < sizeof types / sizeof *types; ti++)
        for (size_t ni = 0; ni < sizeof ns / sizeof *ns; ni++) {
            const int t = types[ti];
            const int64_t n = ns[ni][0], rb = ktk_row_bytes(t, n), es = XB(R, n, ns[ni][1]);
            const int64_t G = ns[ni][1] ? ns[ni][1] : ktk_ix_group(n, bits);
            if (rb < 0) continue;
            uint8_t *rows = malloc((size_t)(E * R * rb)), *cp = aligned_alloc(64, (size_t)(E * es));
            float *w = malloc((size_t)(R * n) * 4), *wq = malloc((size_t)(R * n) * 4), *x = malloc((size_t)(48 * n) * 4);
            float *xq = malloc((size_t)(48 * n) * 4), *C = aligned_alloc(64, (size_t)32 * 64 * 4);
            int8_t *pk = aligned_alloc(64, (size_t)(48 * n)); float *ts = malloc((size_t)(48 * n / G) * 4);
            int32_t *ci = aligned_alloc(64, 6144);
            uint8_t *a8 = aligned_alloc(64, (size_t)(32 * n));
            const float *xp[48];
            fill(t, rows, E * R, n);
            int rc = XR(pool, t, rows, rb, R * rb, E, R, n, ns[ni][1], cp);
            int bad = rc != KTK_OK;
            if (rc) printf("FAIL i%d_repack type %d n %lld: rc %d\n", bits, t, (long long)n, rc);
            for (int64_t e = 0; !rc && e < E; e++) {
                XD(cp + e * es, R, n, G, wq);
                const float *ws = (const float *)(cp + e * es + R * n * bits / 8);
                const uint8_t *wk = cp + e * es + R * n / 2 + R * (n / G) * 4;   /* (I4) */
                for (int64_t r = 0; r < R; r++) {
                    K->dequant(t, rows + (e * R + r) * rb, w + r * n, n);
                    for (int64_t k = 0; k < n; k++) {
                        double step = ws[r * (n / G) + k / G];
                        if (bits == 4) {   /* the sub-group's step; a value past the range's ends: that end */
                            step *= (wk[((r / 32) * (n / 64) + k / 64) * 32 + r % 32] & 15) + 1;
                            if (w[r * n + k] > 7.5 * step || w[r * n + k] < -8.5 * step) {
                                const double end = w[r * n + k] > 0 ? 7 * step : -8 * step;
                                if (!(fabs(wq[r * n + k] - end) <= 1e-6 * fabs(end)) && bad++ < 3)
                                    printf("FAIL i4 type %d n %lld row %lld value %lld: %g clipped to %g, want %g\n", t,
                                           (long long)n, (long long)r, (long long)k, w[r * n + k], wq[r * n + k], end);
                                continue;
                            }
                        }
                        if (!(fabs((double)wq[r * n + k] - w[r * n + k]) <= 0.5 * step * (1 + 1e-5) + 1e-30) && bad++ < 3)
                            printf("FAIL i%d type %d n %lld expert %lld row %lld value %lld: %g, want %g (step %g)\n", bits, t,
                                   (long long)n, (long long)e, (long long)r, (long long)k, wq[r * n + k], w[r * n + k], step);
                    }
                }
            }
            fails += bad != 0;
            for (int64_t i = 0; i < 48 * n; i++) x[i] = frand() * (i % 97 == 0 ? 8.f : 1.f);
            for (int j = 0; j < 48; j++) xp[j] = x + j * n;
            for (size_t ci_ = 0; !rc && ci_ < sizeof nts / sizeof *nts; ci_++) {
                const int64_t nt = nts[ci_], pad = (nt + 15) / 16 * 16, ldc = pad + 16;
                ktk_amx_pack_x_i8(xp, nt, n, G, pk, ts);
                int badx = 0;
                for (int64_t j = 0; j < pad; j++)   /* the packed tokens read back */
                    for (int64_t k = 0; k < n; k++) {
                        const int64_t tt = j / 16, tj = j % 16;
                        const float sc = ts[(tt * (n / G) + k / G) * 16 + tj];
                        const float v = (float)pk[(tt * (n / 64) + k / 64) * 1024 + (k % 64) / 4 * 64 + tj * 4 + k % 4] * sc;
                        const float want = j < nt ? x[j * n + k] : 0.f;
                        if (j < nt) xq[j * n + k] = v;
                        /* half a step, and the float roundings of 127 / amax, w * that, amax / 127 and q * sc:
                         * up to ~4 * 127 * 2^-24 steps (a near tie measured 0.5000066 steps) */
                        if (!(fabsf(v - want) <= 0.5f * sc * (1 + 1e-4f)) && badx++ < 3)
                            printf("FAIL pack_x_i8 n %lld token %lld value %lld: %g, want %g\n", (long long)n, (long long)j,
                                   (long long)k, v, want);
                    }
                fails += badx != 0;
                for (int64_t blk = 0; blk < R / 32; blk++) {   /* expert 1's blocks: the scales' offsets */
                    XD(cp + es, R, n, G, wq);
                    for (int64_t i = 0; i < 32 * ldc; i++) C[i] = NAN;
                    /* prefetch 0 and 3; both orders; I4 nibbles widened 0-4 k-steps ahead (past K where n is 192) */
                    gemm_ix(bits, cp + es, R, blk, n, G, pk, ts, nt, C, ldc, ci, a8, (int)(blk * 3), (int)(nt & 1),
                            (int)((2 * blk + nt) % 5));
                    int badg = 0;
                    double worst = 0;
                    for (int r = 0; r < 32; r++)
                        for (int64_t j = 0; j < ldc; j++) {
                            const float c = C[r * ldc + j];
                            if (j >= pad) { badg += !isnan(c); continue; }
                            double ref = 0, mag = 0;
                            for (int64_t k = 0; j < nt && k < n; k++) {
                                const double pr = (double)wq[(blk * 32 + r) * n + k] * xq[j * n + k];
                                ref += pr; mag += fabs(pr);
                            }
                            const double e = fabs(c - ref) / (mag > 0 ? mag : 1.0);
                            if (!(e <= 1e-5)) badg++;
                            if (e > worst) worst = e;
                        }
                    if (badg) printf("FAIL gemm_i%d type %d n %lld tokens %lld block %lld: %d outputs off (worst %.3g)\n", bits, t,
                                     (long long)n, (long long)nt, (long long)blk, badg, worst);
                    fails += badg != 0;
                }
            }
            free(rows); free(cp); free(w); free(wq); free(x); free(xq); free(C); free(pk); free(ts); free(ci); free(a8);
        }
    {   /* a NaN among a token's values (or a weight row's): that token's (row's) outputs are NaN, the others not */
        const int64_t n = 256, rb = ktk_row_bytes(KTK_BF16, n), es = XB(32, n, 0);
        uint8_t *rows = malloc((size_t)(32 * rb)), *cp = aligned_alloc(64, (size_t)es), *a8 = aligned_alloc(64, 32 * 256);
        float *x = malloc((size_t)(17 * n) * 4), *C = aligned_alloc(64, (size_t)32 * 32 * 4), *ts = malloc(2 * 16 * 4);
        int8_t *pk = aligned_alloc(64, (size_t)(32 * n));
        int32_t *ci = aligned_alloc(64, 6144);
        const float *xp[17];
        fill(KTK_BF16, rows, 32, n);
        const uint16_t qnan = 0x7fc0;
        memcpy(rows + 7 * rb + 2 * 100, &qnan, 2);   /* row 7, value 100 */
        for (int64_t i = 0; i < 17 * n; i++) x[i] = frand();
        x[3 * n + 5] = NAN;                          /* token 3, value 5 */
        for (int j = 0; j < 17; j++) xp[j] = x + j * n;
        int bad = XR(NULL, KTK_BF16, rows, rb, 32 * rb, 1, 32, n, 0, cp) != KTK_OK;
        ktk_amx_pack_x_i8(xp, 17, n, 256, pk, ts);
        gemm_ix(bits, cp, 32, 0, n, 256, pk, ts, 17, C, 32, ci, a8, 0, 1, 2);
        for (int r = 0; r < 32 && !bad; r++)
            for (int j = 0; j < 17 && !bad; j++) bad = (r == 7 || j == 3) != (isnan(C[r * 32 + j]) != 0);
        if (bad) { printf("FAIL i%d: a NaN token or weight does not give NaN outputs (only)\n", bits); fails++; }
        free(rows); free(cp); free(x); free(C); free(ts); free(pk); free(ci); free(a8);
    }
    if (ktk_amx_pack_once_usable()) {   /* the tokens quantized once, then packed per expert: pack_x_i8's bytes and scales */
        static const int64_t kg[][2] = {{2048, 256}, {1408, 704}, {192, 64}};
        static const int64_t cnts[] = {1, 17, 48};
        const int64_t T = 40;
        for (size_t ki = 0; ki < sizeof kg / sizeof *kg; ki++)
            for (size_t ci2 = 0; ci2 < sizeof cnts / sizeof *cnts; ci2++) {
                const int64_t n = kg[ki][0], G = kg[ki][1], nt = cnts[ci2], NG = n / G, sz = (nt + 15) / 16 * 16;
                float *x = malloc((size_t)(T * n) * 4), *qs = malloc((size_t)(T * NG) * 4);
                int8_t *q = malloc((size_t)(T * n)), *p0 = aligned_alloc(64, (size_t)(sz * n)), *p1 = aligned_alloc(64, (size_t)(sz * n));
                float *s0 = malloc((size_t)(sz * NG) * 4), *s1 = malloc((size_t)(sz * NG) * 4);
                const float *xp[48];
                int64_t idx[48];
                for (int64_t i = 0; i < T * n; i++) x[i] = frand() * (i % 97 == 0 ? 30.f : 1.f);
                for (int64_t j = 0; j < nt; j++) { idx[j] = (j * 7 + 3) % T; xp[j] = x + idx[j] * n; }   /* a gather, a token twice */
                ktk_amx_pack_x_i8(xp, nt, n, G, p0, s0);
                ktk_amx_quant_rows_i8(x, n, T, n, G, q, qs);
                ktk_amx_pack_q_i8(q, qs, idx, nt, n, G, p1, s1);
                if (memcmp(p0, p1, (size_t)(sz * n)) || memcmp(s0, s1, (size_t)(sz * NG) * 4)) {
                    printf("FAIL i%d: packing from tokens quantized once differs, n %lld, %lld tokens\n", bits, (long long)n, (long long)nt);
                    fails++;
                }
                free(x); free(qs); free(q); free(p0); free(p1); free(s0); free(s1);
            }
    }
    /* bad input: shapes the layout does not take */
    if (XB(48, 256, 0) != -1 || XB(64, 96, 0) != -1 || ktk_i8_group(1408) != 704 ||
        XB(64, 1408, 256) != -1 || XB(64, 2048, 2048) != -1 ||   /* G must divide n, <= 1024 */
        XB(64, 2048, 96) != -1 || XB(64, 2048, -64) != -1 ||     /* G % 64, G > 0 */
        XB(64, 2048, 1024) != (bits == 4 ? 64 * 2048 / 2 + 64 * 2 * 4 + 64 * 32 : 64 * 2048 + 64 * 2 * 4) ||
        ktk_i8_group(2048) != 256 || ktk_i8_group(192) != 192 || ktk_i8_group(2944) != 128 || ktk_i8_group(32) != -1 ||
        ktk_i4_group(2048) != 1024 || ktk_i4_group(1408) != 704 || ktk_i4_group(7168) != 1024 ||
        ktk_i4_group(192) != 192 || ktk_i4_group(2944) != 128 || ktk_i4_group(96) != -1) {
        printf("FAIL i%d shape rules\n", bits);
        fails++;
    }
    ktk_pool_free(pool);
    return fails;
}

#define I4_LAYER_TOL 0.25   /* measured 0.08-0.17 here (random valid blocks: Q4_K 0.08, Q5_0 and Q8_0 0.16-0.17, BF16 0.12) */
static int check_moe(void) {
    static const int moe_types[] = {KTK_Q4_K, KTK_Q5_0, KTK_Q8_0, KTK_BF16};
    const int64_t E = 4, H = 256, I = 1408, k = 2;
    int fails = 0;
    ktk_pool *pool = ktk_pool_new(3, 1);
    if (!pool) { printf("FAIL pool\n"); return 1; }
    for (size_t ti = 0; ti < sizeof moe_types / sizeof *moe_types; ti++) {
        const int gt = moe_types[ti], dt = gt == KTK_Q4_K ? KTK_Q5_0 : gt;   /* V2-Lite: Q4_K gate/up, Q5_0 down */
        const int64_t rbh = ktk_row_bytes(gt, H), rbi = ktk_row_bytes(dt, I);
        uint8_t *g = malloc((size_t)(E * I * rbh)), *u = malloc((size_t)(E * I * rbh)), *dn = malloc((size_t)(E * H * rbi));
        fill(gt, g, E * I, H); fill(gt, u, E * I, H); fill(dt, dn, E * H, I);
        ktk_moe_desc d = {gt, gt, dt, E, H, I, g, u, dn, rbh, rbh, rbi, 0, 0, 0};
        int err = 0;
        ktk_moe *m = ktk_moe_new(&d, &err);
        if (!m) { fails++; printf("FAIL moe_new %d\n", err); }
        /* the same layer with h written in f32 rows by the gate/up epilogue and packed apart (KTINJECT_AMX_FUSE_H=0):
         * the same bits as the epilogue's own packing */
        const char *fuse = getenv("KTINJECT_AMX_FUSE_H");
        char *fuse_was = fuse ? strdup(fuse) : NULL;
        setenv("KTINJECT_AMX_FUSE_H", fuse && fuse[0] == '0' ? "1" : "0", 1);
        ktk_moe *mf = ktk_moe_new(&d, &err);
        if (fuse_was) { setenv("KTINJECT_AMX_FUSE_H", fuse_was, 1); free(fuse_was); } else unsetenv("KTINJECT_AMX_FUSE_H");
        if (!mf) { fails++; printf("FAIL moe_new (the other h packing) %d\n", err); }
        /* the same layer with I8 copies of gate, up and down: the AMX-INT8 path in this build */
        const int64_t dg = ti % 2 ? 128 : 0;   /* the down's group: the default (704) or 128 */
        const int64_t esg = ktk_i8_expert_bytes(I, H, 0), esd = ktk_i8_expert_bytes(H, I, dg);
        uint8_t *gi = aligned_alloc(64, (size_t)(E * esg)), *ui = aligned_alloc(64, (size_t)(E * esg)),
                *di = aligned_alloc(64, (size_t)(E * esd));
        ktk_moe_desc d8 = d;
        d8.gate_i8 = gi; d8.up_i8 = ui; d8.down_i8 = di; d8.down_i8_group = dg;
        if (ktk_i8_repack(pool, gt, g, rbh, I * rbh, E, I, H, 0, gi) || ktk_i8_repack(pool, gt, u, rbh, I * rbh, E, I, H, 0, ui) ||
            ktk_i8_repack(pool, dt, dn, rbi, H * rbi, E, H, I, dg, di)) { fails++; printf("FAIL i8_repack for the layer\n"); }
        ktk_moe *m8 = ktk_moe_new(&d8, &err);
        if (!m8) { fails++; printf("FAIL moe_new (I8) %d\n", err); }
        /* and with I4 copies (asymmetric 4 bits per row and group; the same tiles) */
        const int64_t esg4 = ktk_i4_expert_bytes(I, H, 0), esd4 = ktk_i4_expert_bytes(H, I, dg);
        uint8_t *gi4 = aligned_alloc(64, (size_t)(E * esg4)), *ui4 = aligned_alloc(64, (size_t)(E * esg4)),
                *di4 = aligned_alloc(64, (size_t)(E * esd4));
        ktk_moe_desc d4 = d8;
        d4.gate_i8 = gi4; d4.up_i8 = ui4; d4.down_i8 = di4; d4.i8_bits = 4;
        if (ktk_i4_repack(pool, gt, g, rbh, I * rbh, E, I, H, 0, gi4) || ktk_i4_repack(pool, gt, u, rbh, I * rbh, E, I, H, 0, ui4) ||
            ktk_i4_repack(pool, dt, dn, rbi, H * rbi, E, H, I, dg, di4)) { fails++; printf("FAIL i4_repack for the layer\n"); }
        ktk_moe *m4 = ktk_moe_new(&d4, &err);
        if (!m4) { fails++; printf("FAIL moe_new (I4) %d\n", err); }
        /* BF16: and with tile copies of gate, up and down (ktk_bt_repack), each block ktk_amx_rows_bf16's own */
        ktk_moe *mb = NULL, *md = NULL;   /* tile copies of all three matrices; of the down only */
        uint8_t *gb = NULL, *ub = NULL, *db = NULL;
        if (gt == KTK_BF16) {
            gb = aligned_alloc(64, (size_t)(E * ktk_bt_expert_bytes(I, H))); ub = aligned_alloc(64, (size_t)(E * ktk_bt_expert_bytes(I, H)));
            db = aligned_alloc(64, (size_t)(E * ktk_bt_expert_bytes(H, I)));
            if (ktk_bt_repack(pool, gt, g, rbh, I * rbh, E, I, H, gb) || ktk_bt_repack(NULL, gt, u, rbh, I * rbh, E, I, H, ub) ||
                ktk_bt_repack(pool, dt, dn, rbi, H * rbi, E, H, I, db)) { fails++; printf("FAIL bt_repack for the layer\n"); }
            const ktk_kernels *K = ktk_kernels_for(KTK_ISA_SCALAR);
            uint16_t *blk = malloc((size_t)(32 * I) * 2);
            float *tmp = malloc((size_t)I * 4);
            for (int64_t e = 0; e < E; e++)   /* the down's blocks: rows of I values, as the GEMM multiplies them */
                for (int64_t b = 0; b < H / 32; b++) {
                    ktk_amx_rows_bf16(K, KTK_BF16, dn + (e * H + b * 32) * rbi, rbi, 32, I, blk, tmp);
                    if (memcmp(blk, db + (e * H + b * 32) * I * 2, (size_t)(32 * I) * 2)) {
                        fails++;
                        printf("FAIL bt_repack: expert %lld block %lld is not ktk_amx_rows_bf16's\n", (long long)e, (long long)b);
                        e = E;
                        break;
                    }
                }
            free(blk); free(tmp);
            if (ktk_bt_repack(NULL, KTK_Q8_0, g, rbh, I * rbh, E, I, H, gb) != KTK_EINVAL ||     /* BF16 rows only */
                ktk_bt_repack(NULL, gt, g, rbh, I * rbh, E, 48, H, gb) != KTK_EINVAL ||        /* rows % 32 */
                ktk_bt_repack(NULL, gt, g, rbh + 2, I * rbh, E, I, H, gb) != KTK_EINVAL ||     /* row bytes */
                ktk_bt_repack(NULL, gt, g, rbh, rbh, E, I, H, gb) != KTK_EINVAL ||             /* overlapping experts */
                ktk_bt_expert_bytes(I, 48) != -1 || ktk_bt_expert_bytes(I, H) != I * H * 2) {
                fails++;
                printf("FAIL bt_repack shape rules\n");
            }
            ktk_moe_desc db_ = d;
            db_.gate_bt = gb; db_.up_bt = ub; db_.down_bt = db;
            mb = ktk_moe_new(&db_, &err);
            if (!mb) { fails++; printf("FAIL moe_new (BF16 tile copies) %d\n", err); }
            db_.gate_bt = db_.up_bt = NULL;
            md = ktk_moe_new(&db_, &err);
            if (!md) { fails++; printf("FAIL moe_new (the down's tile copy only) %d\n", err); }
            db_.gate_bt = gb;
            db_.up_bt = NULL;   /* gate and up both or neither */
            ktk_moe *bad = ktk_moe_new(&db_, &err);
            if (bad || err != KTK_EINVAL) { fails++; printf("FAIL moe_new took a gate tile copy without the up's\n"); }
            ktk_moe_free(bad);
        }
        for (int64_t T = 48; m && T <= 100; T += 52) {
            float *x = malloc((size_t)(T * H) * 4), *w = malloc((size_t)(T * k) * 4);
            float *ref = malloc((size_t)(T * H) * 4), *out = malloc((size_t)(T * H) * 4);
            int64_t *ids = malloc((size_t)(T * k) * sizeof *ids);
            for (int64_t i = 0; i < T * H; i++) x[i] = frand();
            for (int64_t i = 0; i < T; i++) {
                ids[2 * i] = rnd() % E; ids[2 * i + 1] = (ids[2 * i] + 1 + rnd() % (E - 1)) % E;
                w[2 * i] = frand(); w[2 * i + 1] = frand();
            }
            int rc = ktk_moe_forward(m, pool, KTK_ISA_SCALAR, T, k, x, ids, w, ref) ||
                     ktk_moe_forward(m, pool, KTK_ISA_AVX2, T, k, x, ids, w, out);
            double e = rel_err(out, ref, T * H);
            if (rc || !(e < 2e-2)) {   /* bf16 weights and tokens on the tile path */
                fails++;
                printf("FAIL moe types %d/%d, %lld tokens: rc %d, relative error %.3g\n", gt, dt, (long long)T, rc, e);
            }
            for (int only_down = 0; only_down < 2; only_down++) {   /* the same values in the same tiles: the same bits */
                ktk_moe *mc = only_down ? md : mb;
                if (!mc) continue;
                float *out2 = malloc((size_t)(T * H) * 4);
                rc = ktk_moe_forward(mc, pool, KTK_ISA_AVX2, T, k, x, ids, w, out2);
                if (rc || memcmp(out, out2, (size_t)(T * H) * 4)) {
                    fails++;
                    printf("FAIL moe BF16, %lld tokens: the tile copies%s and the rows in place differ (rc %d)\n",
                           (long long)T, only_down ? " (the down's only)" : "", rc);
                }
                free(out2);
            }
            if (mf) {
                float *out2 = malloc((size_t)(T * H) * 4);
                rc = ktk_moe_forward(mf, pool, KTK_ISA_AVX2, T, k, x, ids, w, out2);
                if (rc || memcmp(out, out2, (size_t)(T * H) * 4)) {
                    fails++;
                    printf("FAIL moe types %d/%d, %lld tokens: h packed by the epilogue and apart differ (rc %d)\n", gt, dt,
                           (long long)T, rc);
                }
                free(out2);
            }
            if (m8) {   /* int8 weights (per row and group) and tokens (per token and group) */
                rc = ktk_moe_forward(m8, pool, KTK_ISA_AVX2, T, k, x, ids, w, out);
                e = rel_err(out, ref, T * H);
                if (rc || !(e < 4e-2)) {   /* as tests/test_i8.py (8-bit tokens) */
                    fails++;
                    printf("FAIL moe (I8) types %d/%d, %lld tokens: rc %d, relative error %.3g\n", gt, dt, (long long)T, rc, e);
                }
            }
            if (m4) {   /* 4-bit weights: each value within (max - min) / 30 of its group's, on top of the 8-bit tokens */
                rc = ktk_moe_forward(m4, pool, KTK_ISA_AVX2, T, k, x, ids, w, out);
                e = rel_err(out, ref, T * H);
                if (getenv("KTK_CHECK_VERBOSE")) printf("moe (I4) types %d/%d, %lld tokens: relative error %.4f\n", gt, dt, (long long)T, e);
                if (rc || !(e < I4_LAYER_TOL)) {
                    fails++;
                    printf("FAIL moe (I4) types %d/%d, %lld tokens: rc %d, relative error %.3g\n", gt, dt, (long long)T, rc, e);
                }
            }
            free(x); free(w); free(ref); free(out); free(ids);
        }
        ktk_moe_free(m); ktk_moe_free(mf); ktk_moe_free(m8); ktk_moe_free(m4); ktk_moe_free(mb); ktk_moe_free(md);
        free(g); free(u); free(dn); free(gi); free(ui); free(di); free(gi4); free(ui4); free(di4); free(gb); free(ub); free(db);
    }
    ktk_pool_free(pool);
    return fails;
}

/* ktk_amx_pack_x against its two steps (ktk_amx_rows_to_bf16, ktk_amx_pack_b: the layer's tokens converted once),
 * tokens gathered, one twice, a NaN and values that round: the same bits */
static int check_pack_b(void) {
    static const int64_t ks[] = {32, 1408, 2048};
    static const int64_t cnts[] = {1, 17, 48};
    const int64_t T = 40;
    int fails = 0;
    for (size_t ki = 0; ki < sizeof ks / sizeof *ks; ki++)
        for (size_t ci = 0; ci < sizeof cnts / sizeof *cnts; ci++) {
            const int64_t n = ks[ki], nt = cnts[ci], sz = ktk_amx_pack_x_elems(nt, n);
            float *x = malloc((size_t)(T * n) * 4);
            uint16_t *xb = malloc((size_t)(T * n) * 2), *p0 = aligned_alloc(64, (size_t)(sz * 2 + 63) / 64 * 64);
            uint16_t *p1 = aligned_alloc(64, (size_t)(sz * 2 + 63) / 64 * 64);
            const float *xp[48];
            int64_t idx[48];
            for (int64_t i = 0; i < T * n; i++) x[i] = frand() * 3.f;
            x[5 * n + 3] = NAN;
            for (int64_t j = 0; j < nt; j++) { idx[j] = (j * 7 + 5) % T; xp[j] = x + idx[j] * n; }
            ktk_amx_pack_x(xp, nt, n, p0);
            ktk_amx_rows_to_bf16(x, n, T, n, xb);
            ktk_amx_pack_b(xb, idx, nt, n, p1);
            if (memcmp(p0, p1, (size_t)sz * 2)) {
                printf("FAIL pack_b n %lld, %lld tokens: not ktk_amx_pack_x's bits\n", (long long)n, (long long)nt);
                fails++;
            }
            free(x); free(xb); free(p0); free(p1);
        }
    return fails;
}

/* ktk_amx_c_to_pack (the gate/up epilogue's h packed for the down GEMM, one k-step a call) against ktk_amx_pack_x on
 * the same values as token rows: a NaN, values that round, the C columns past the tokens holding garbage, the same
 * bits for every token count */
static int check_c_to_pack(void) {
    static const int64_t cnts[] = {1, 7, 16, 17, 33, 48};
    const int64_t KS = 3, K = 32 * KS;
    int fails = 0;
    for (size_t ci = 0; ci < sizeof cnts / sizeof *cnts; ci++) {
        const int64_t nt = cnts[ci], ldc = (nt + 15) / 16 * 16 + (ci % 2) * 16, sz = ktk_amx_pack_x_elems(nt, K);
        float *C = malloc((size_t)(KS * 32 * ldc) * 4), *x = malloc((size_t)(nt * K) * 4);
        uint16_t *p0 = aligned_alloc(64, (size_t)(sz * 2 + 63) / 64 * 64), *p1 = aligned_alloc(64, (size_t)(sz * 2 + 63) / 64 * 64);
        const float *xp[48];
        for (int64_t ks = 0; ks < KS; ks++)
            for (int64_t r = 0; r < 32; r++)
                for (int64_t t = 0; t < ldc; t++)
                    C[(ks * 32 + r) * ldc + t] = t < nt ? frand() * 3.f : (t % 2 ? NAN : 1e30f);
        C[(1 * 32 + 5) * ldc + 0] = NAN;
        for (int64_t t = 0; t < nt; t++) {
            for (int64_t i = 0; i < K; i++) x[t * K + i] = C[((i / 32) * 32 + i % 32) * ldc + t];
            xp[t] = x + t * K;
        }
        ktk_amx_pack_x(xp, nt, K, p0);
        memset(p1, 0xab, (size_t)sz * 2);
        for (int64_t ks = 0; ks < KS; ks++) ktk_amx_c_to_pack(C + ks * 32 * ldc, ldc, nt, KS, ks, p1);
        if (memcmp(p0, p1, (size_t)sz * 2)) {
            printf("FAIL c_to_pack %lld tokens, ldc %lld: not ktk_amx_pack_x's bits\n", (long long)nt, (long long)ldc);
            fails++;
        }
        free(C); free(x); free(p0); free(p1);
    }
    return fails;
}

int main(void) {
    static const int types[] = {KTK_F32, KTK_F16, KTK_BF16, KTK_Q8_0, KTK_Q4_0, KTK_Q5_0, KTK_Q4_K, KTK_Q5_K, KTK_Q6_K,
                                KTK_IQ4_XS, KTK_Q2_K, KTK_Q3_K};
    static const int64_t ns[] = {32, 256, 1408, 2048, 2304};
    static const int64_t nts[] = {1, 7, 16, 17, 33, 48, 50};
    const ktk_kernels *K = ktk_kernels_for(KTK_ISA_SCALAR);
    int fails = 0, cases = 0;
    for (size_t ti = 0; ti < sizeof types / sizeof *types; ti++)
        for (size_t ni = 0; ni < sizeof ns / sizeof *ns; ni++) {
            const int t = types[ti];
            const int64_t n = ns[ni], rb = ktk_row_bytes(t, n);
            if (rb < 0) continue;   /* 32 and 1408 are not multiples of a K-quant block */
            uint8_t *rows = malloc((size_t)(32 * rb));
            float *w = malloc((size_t)(32 * n) * 4), *x = malloc((size_t)(50 * n) * 4), *tmp = malloc((size_t)n * 4);
            uint16_t *wt = aligned_alloc(64, (size_t)(32 * n) * 2);
            uint16_t *pk = aligned_alloc(64, ((size_t)ktk_amx_pack_x_elems(50, n) * 2 + 63) / 64 * 64);
            float *C = aligned_alloc(64, (size_t)32 * 80 * 4), *C2 = aligned_alloc(64, (size_t)32 * 80 * 4);
            const float *xp[50];
            fill(t, rows, 32, n);
            for (int r = 0; r < 32; r++) {
                K->dequant(t, rows + r * rb, w + r * n, n);
                for (int64_t k = 0; k < n; k++) w[r * n + k] = bf16_round(w[r * n + k]);
            }
            for (int64_t i = 0; i < 50 * n; i++) x[i] = bf16_round(frand());
            for (int j = 0; j < 50; j++) xp[j] = x + j * n;
            /* the rows: value k of row r at wt[(k / 32 * 32 + r) * 32 + k % 32] */
            ktk_amx_rows_bf16(K, t, rows, rb, 32, n, wt, tmp);
            int bad = 0;
            for (int r = 0; r < 32; r++)
                for (int64_t k = 0; k < n; k++) {
                    const float v = ktk_bf16_to_f32(wt[(k / 32 * 32 + r) * 32 + k % 32]);
                    if (memcmp(&v, &w[r * n + k], 4) && bad++ < 3)
                        printf("FAIL rows type %d n %lld: row %d value %lld is %g, want %g\n", t, (long long)n, r,
                               (long long)k, v, w[r * n + k]);
                }
            cases++;
            fails += bad != 0;
            for (size_t ci = 0; ci < sizeof nts / sizeof *nts; ci++) {
                const int64_t nt = nts[ci], pad = (nt + 15) / 16 * 16;
                ktk_amx_pack_x(xp, nt, n, pk);
                for (int64_t ldc = pad; ldc <= pad + 16; ldc += 16) {
                    cases++;
                    fails += check_gemm(t, n, w, x, wt, pk, nt, ldc, C);
                    if (t == KTK_BF16) {   /* BF16 rows read in place by the tiles: ktk_amx_gemm's bits */
                        for (int64_t i = 0; i < 32 * ldc; i++) C2[i] = NAN;
                        ktk_amx_gemm_rows(rows, rb, n, pk, nt, C2, ldc);
                        cases++;
                        if (memcmp(C, C2, (size_t)(32 * ldc) * 4)) {
                            fails++;
                            printf("FAIL gemm_rows n %lld tokens %lld ldc %lld: not ktk_amx_gemm's bits\n", (long long)n,
                                   (long long)nt, (long long)ldc);
                        }
                    }
                }
            }
            free(rows); free(w); free(x); free(tmp); free(wt); free(pk); free(C); free(C2);
        }
    cases += 2;
    fails += check_silu(ktk_amx_silu_mul, "ktk_amx_silu_mul");
    fails += check_silu(ktk_silu_mul_avx2, "ktk_silu_mul_avx2");
    cases += 24;
    fails += check_moe();
    cases += 2;
    fails += check_ix(8) + check_ix(4);
    cases += 9;
    fails += check_pack_b();
    cases += 6;
    fails += check_c_to_pack();
    printf("%s (%d cases, %d failures)\n", fails ? "FAILED" : "OK", cases, fails);
    return fails != 0;
}
