/* Helpers of the C check drivers (sanitize_driver.c, amx_emulate_check.c): a xorshift generator
 * and random valid rows of every type (block scales small and positive, so dots stay finite). */
#ifndef KTK_CHECK_UTIL_H
#define KTK_CHECK_UTIL_H
#include "ktk_int.h"
#include <math.h>
#include <string.h>

static uint32_t rng = 12345;
static uint32_t rnd(void) { rng ^= rng << 13; rng ^= rng >> 17; rng ^= rng << 5; return rng; }
static float frand(void) { return (float)(rnd() % 20001) / 10000.f - 1.f; }

static uint16_t f16(float f) {            /* small positive normal floats only */
    int e = 0; float m = frexpf(f, &e);    /* f = m * 2^e, m in [0.5, 1) */
    return (uint16_t)(((e - 1 + 15) << 10) | ((int)((m * 2.f - 1.f) * 1024.f) & 0x3ff));
}

static void fill(int type, uint8_t *p, int64_t rows, int64_t n) {
    int64_t rb = ktk_row_bytes(type, n);
    int bs = ktk_type_block(type), ts = ktk_type_size(type);
    for (int64_t i = 0; i < rows * rb; i++) p[i] = (uint8_t)rnd();
    if (type == KTK_F32) {
        for (int64_t i = 0; i < rows * n; i++) { float f = frand() * 0.05f; memcpy(p + 4 * i, &f, 4); }
        return;
    }
    if (type == KTK_F16) {
        for (int64_t i = 0; i < rows * n; i++) { uint16_t h = f16(0.001f + 0.05f * (float)(rnd() % 1000) / 1000.f); if (rnd() & 1) h |= 0x8000; memcpy(p + 2 * i, &h, 2); }
        return;
    }
    if (type == KTK_BF16) {
        for (int64_t i = 0; i < rows * n; i++) { float f = frand() * 0.05f; uint32_t u; memcpy(&u, &f, 4); uint16_t h = (uint16_t)(u >> 16); memcpy(p + 2 * i, &h, 2); }
        return;
    }
    for (int64_t b = 0; b < rows * (n / bs); b++) {
        uint8_t *blk = p + b * ts;
        uint16_t d = f16(0.002f + 0.01f * (float)(rnd() % 1000) / 1000.f);
        if (type == KTK_Q6_K || type == KTK_Q3_K) memcpy(blk + ts - 2, &d, 2);
        else if (type == KTK_Q2_K) { memcpy(blk + ts - 4, &d, 2); memcpy(blk + ts - 2, &d, 2); }
        else { memcpy(blk, &d, 2); if (type == KTK_Q4_K || type == KTK_Q5_K) memcpy(blk + 2, &d, 2); }
    }
}

#endif
