/* CPU feature detection (cpuid + xgetbv), AMX tile permission, ISA -> kernel table. */
#include "ktk_int.h"
#include <cpuid.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/syscall.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int g_features = -1;
static int g_amx_perm = 0;
static int g_amx_int8 = 0;   /* AMX-INT8 (TDPBSSD), for the I8 copies' tile GEMM */
static int g_avx512bf16 = 0;   /* AVX512-BF16 (vdpbf16ps), for the AVX-512 path's BF16 grouped work */

static uint64_t xgetbv0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

static int detect(void) {
    unsigned a, b, c, d;
    int f = 1 << KTK_ISA_SCALAR;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
    int osxsave = (c >> 27) & 1, fma = (c >> 12) & 1, f16c = (c >> 29) & 1, avx = (c >> 28) & 1;
    if (!osxsave || !avx) return f;
    uint64_t xcr0 = xgetbv0();
    if ((xcr0 & 6) != 6) return f;                       /* XMM + YMM state */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
    int avx2 = (b >> 5) & 1, avx512f = (b >> 16) & 1, avx512dq = (b >> 17) & 1, avx512bw = (b >> 30) & 1,
        avx512vl = (b >> 31) & 1, vnni = (c >> 11) & 1;
    int amx_bf16 = (d >> 22) & 1, amx_tile = (d >> 24) & 1;
    g_amx_int8 = (d >> 25) & 1;
    if (avx2 && fma && f16c) f |= 1 << KTK_ISA_AVX2;
    int zmm = (xcr0 & 0xe0) == 0xe0;                     /* opmask + ZMM state */
    if ((f & (1 << KTK_ISA_AVX2)) && zmm && avx512f && avx512dq && avx512bw && avx512vl && vnni)
        f |= 1 << KTK_ISA_AVX512;
    /* the AMX path also converts to bf16 with AVX512-BF16 (every AMX CPU so far has it) */
    unsigned a1 = 0, b1, c1, d1;
    int avx512bf16 = __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) && ((a1 >> 5) & 1);
    g_avx512bf16 = avx512bf16;
    if ((f & (1 << KTK_ISA_AVX512)) && amx_tile && amx_bf16 && avx512bf16) {
#ifdef __linux__
        if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0) g_amx_perm = 1;
#endif
        if (g_amx_perm) f |= 1 << KTK_ISA_AMX;
    }
    return f;
}

int ktk_compiled_isas(void) {
    return (1 << KTK_ISA_SCALAR) | (1 << KTK_ISA_AVX2) | (1 << KTK_ISA_AVX512) | (1 << KTK_ISA_AMX);
}

int ktk_cpu_features(void) {
    if (g_features < 0) g_features = detect() & ktk_compiled_isas();
    return g_features;
}

int ktk_amx_permission(void) { ktk_cpu_features(); return g_amx_perm; }

int ktk_cpu_vendor(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return KTK_VENDOR_OTHER;
    char v[13];
    memcpy(v, &b, 4); memcpy(v + 4, &d, 4); memcpy(v + 8, &c, 4);
    v[12] = 0;
    if (!strcmp(v, "GenuineIntel")) return KTK_VENDOR_INTEL;
    if (!strcmp(v, "AuthenticAMD") || !strcmp(v, "HygonGenuine")) return KTK_VENDOR_AMD;
    return KTK_VENDOR_OTHER;
}
int ktk_amx_usable(void) { return (ktk_cpu_features() >> KTK_ISA_AMX) & 1; }
int ktk_amx_int8_usable(void) { return ktk_amx_usable() && g_amx_int8; }
int ktk_avx512bf16_usable(void) { return (ktk_cpu_features() >> KTK_ISA_AVX512 & 1) && g_avx512bf16; }
/* AMD only by default, as measured: 2.18x the f32 panels on Zen 4 (one 512-bit FMA a cycle, so twice the products
 * an instruction doubles its rate), 0.78-0.92x on the lent Sapphire Rapids-class Xeon (two 512-bit FMA ports):
 * docs/native.md. $KTINJECT_AVX512_BF16_GROUPED=1 / 0 decides anywhere. */
int ktk_avx512bf16_grouped(void) {
    if (!ktk_avx512bf16_usable()) return 0;
    const char *s = getenv("KTINJECT_AVX512_BF16_GROUPED");
    if (s && *s) return s[0] != '0';
    return ktk_cpu_vendor() == KTK_VENDOR_AMD;
}

int ktk_best_isa(void) {
    int f = ktk_cpu_features();
    for (int i = KTK_ISA_AMX; i > 0; i--)
        if (f & (1 << i)) return i;
    return KTK_ISA_SCALAR;
}

const ktk_kernels *ktk_kernels_for(int isa) {
    if (isa < 0 || isa > KTK_ISA_AMX || !((ktk_cpu_features() >> isa) & 1)) return NULL;
    switch (isa) {
    case KTK_ISA_AVX2: return &ktk_kernels_avx2;
    case KTK_ISA_AVX512: case KTK_ISA_AMX: return &ktk_kernels_avx512;
    default: return &ktk_kernels_scalar;
    }
}

unsigned ktk_grouped_int8_types(int isa) {
    const ktk_kernels *K = isa == KTK_ISA_AMX ? NULL : ktk_kernels_for(isa);
    const char *s = getenv("KTINJECT_VNNI_GROUPED"), *pf = getenv("KTINJECT_PACKED_F32");   /* the 8-bit path needs packed tokens */
    if (!K || !K->gemm_q8 || (s && s[0] == '0') || (pf && pf[0] == '0')) return 0;
    return K->u8_types;
}
