"""CUDA C decode GEMVs of `linear_int4` (modes "cuda", "mma", "diag", "ksplit"), compiled at first use with NVRTC.

Why CUDA C next to the Triton kernels: on the H200 the Triton GEMVs stop at ~1.9 TB/s on a 100 MB
int4 weight while a Triton read of the same bytes runs at ~4 TB/s; the unpacking, not the memory, is
the limit (scripts/int4_probe.py: 8 nibbles per word halve the read rate, one nibble does not), and
Triton adds to it: it spreads the rows of a [rows, tiles, words] block over the lanes, so the x slice
each nibble multiplies is re-laid-out through shared memory, with a barrier, for every nibble of every
tile (a `convert_layout` in the TTGIR). CUDA C controls the layout:

* `gemv` (mode "cuda", one row): a warp owns whole rows; lane l reads the 16 bytes at word 4l of every
  128-word step of its rows (512 coalesced bytes per warp load); the x values its 4 words need are
  staged once per block in shared memory, already multiplied by the nibble constant, and reused by all
  rows of the warp. Math (the `_nibble` trick of int4_triton): nibble i placed under the exponent of 1.0
  is f = 1 + q/C (C = 256 for even i, 16 for odd), so with e = C x, sum_k x (q s + m) =
  s (sum f e - sum e) + m sum x per group. Per weight: half a shift, one lop3, one FMA.
* `gemv_mma` (mode "mma", 1-16 rows): tensor cores. Two nibbles become an exact bf16 (fp16) pair
  128 + q (1024 + q) with one lop3 and are the B fragment of an m16n8k16 mma as they are; x is the A
  fragment. Per 8 weights: 3 shifts, 4 lop3 and a quarter of an mma, for any number of rows up to 16.

* `gemv_diag` (mode "diag", 1-16 rows): as `gemv_mma`, but the 16 A rows of the mma hold (x row, step
  of a super-step of 16 / rows steps), so each step's sum stays apart in the accumulator for a whole
  super-step and the scale work runs once per super-step instead of once per step (PTX per 16-word
  step 97 -> 64). scripts/int4_diag_emulate.py checks the fragment design lane by lane in numpy.
* `gemv_ksplit` (mode "ksplit", 1-16 rows): the mma's roles swapped, weights as A (16 rows a tile, no zero
  fragments: per 16 weights a lane 14 unpacking instructions, one shared load and two mma) and x as B, and
  K split over the warps of a block (a few warps a 16-row tile, each a slice of K, sums added in a fixed
  order in shared memory): the small and mid-size matrices get every SM busy with all their loads in flight.
  Groups of 32 and 64 (pack 16) too: each mma then runs on the low and on the high halves of its pairs apart.
  `kblocks` > 1 splits K over blocks as well (5-16 rows): a block of many tiles stages x for its own steps
  only, leaves fp32 parts, and `ktk_int4_ksplit_sum` adds them in order (docs/gpu.md "The K split over blocks").
  On sm_90+ the sum kernel, and a K split over blocks, launch as programmatic dependents of the kernel before
  them (`pdl_mode`, `KTINJECT_INT4_PDL`: the weights' loads issued before griddepcontrol.wait; docs/gpu.md
  "Programmatic dependent launch"); so does any K split that a CUDA graph captures right after a kernel that
  lets it start early (`pdl.py`; `KTINJECT_INT4_PDL=sum` keeps to the first two).

Measured (docs/gpu.md): `cuda` and `mma` reach ~2.0 TB/s on the lm_head, like the Triton kernels
(Nsight Compute: ~190 warp instructions per 1024 weights for mma, of which its inner loop needs 36);
`diag` with a persistent grid reaches 2.6-2.8 TB/s (0.57-0.60 of the read roofline, 2.8-3.2x bf16),
and 0.74-0.80 with its math removed (scripts/int4_diag_probe.py).

Compilation: `torch.cuda._compile_kernel` (NVRTC, shipped with every CUDA build of torch; no nvcc,
no build step at install). One binary per compile-time shape (`CudaGemvShape`, `MmaShape`), cached per
process. Where that API is missing or the self-test fails, `available()` is False and `linear_int4`
runs its Triton kernels instead (`ktinject doctor` says which and why).
"""
from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass

import torch

from .pdl import PDL_MODES, after_release, env_mode, note_releasing

_PRELUDE = r"""
typedef unsigned short u16;
typedef unsigned int u32;
#define NT (WARPS * 32)

__device__ __forceinline__ float to_f32(u16 v) {
#if XBF16
    return __int_as_float(((u32)v) << 16);
#else
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v)); return f;
#endif
}
__device__ __forceinline__ u16 from_f32(float f) {
    u16 h;
#if XBF16
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
#endif
    return h;
}
__device__ __forceinline__ float h2f(u16 v) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v)); return f; }

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {      // read once: keep it out of L1
    uint4 v;
#if PDL && __CUDA_ARCH__ >= 900                      // (ptxas puts griddepcontrol.wait before every .nc load, so the
    asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"      //  weights' loads that should run
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));         //  under it take the coherent path)
#else
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
#endif
    return v;
}

// Programmatic dependent launch (sm_90+; a binary built with PDL may be launched with the stream-serialization
// attribute): the grid may then start while the kernel before it in the stream still runs. grid_wait() returns
// once that grid has finished and its writes are visible (nothing may read what it wrote, or write what it reads,
// before; launched plainly, at once); grid_release() lets a dependent grid after this one start launching
// (otherwise each block's exit does).
__device__ __forceinline__ void grid_wait() {
#if PDL && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_release() {
#if PDL && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

"""

_SOURCE = _PRELUDE + r"""
#define SUB (8 / NSUB)

// nibble i of w as 1 + q/C (C = 256 for even i, 16 for odd): the nibble pair (2a, 2a+1) is shifted to
// bits 15..22 and each nibble is or-ed under the exponent of 1.0 (one lop3)
__device__ __forceinline__ float nib(u32 w, int i) {
    u32 v = (i >> 1) == 0 ? (w << 15) : (i >> 1) == 1 ? (w << 7) : (i >> 1) == 2 ? (w >> 1) : (w >> 9);
    v = (i & 1) ? ((v & 0x780000u) | 0x3F800000u) : ((v & 0x78000u) | 0x3F800000u);
    return __int_as_float(v);
}

extern "C" __global__ void __launch_bounds__(NT)
ktk_int4_gemv(const u16* __restrict__ x, const uint4* __restrict__ qw, const u16* __restrict__ sc,
              const u16* __restrict__ mn, const u16* __restrict__ bias, u16* __restrict__ out,
              int N, int K, int KW, int g_shift, int NG)
{
    // x: [K] bf16/fp16; qw: [N, KW] int32 as quads of 4 words; sc, mn: fp16 [NG, N]; out: [N]
    extern __shared__ float smem[];
    const int NQ = KW / 4;                       // quads per row (KW is a multiple of P >= 8)
    float* xc = smem;                            // [KW * 8] C_i * x, zero past K
    float* qe = smem + KW * 8;                   // [NQ * NSUB] sum of C x per quad and group part
    float* qs = qe + NQ * NSUB;                  // [NQ * NSUB] sum of x
    const int tid = threadIdx.x;
    for (int q = tid; q < NQ; q += NT) {
        const int wi = q * 4, t = wi / P, j0 = wi % P;
        float se[NSUB], ss[NSUB];
#pragma unroll
        for (int g = 0; g < NSUB; g++) { se[g] = 0.f; ss[g] = 0.f; }
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const float c = (i & 1) ? 16.f : 256.f;
            const int k = t * 8 * P + i * P + j0;
            float v[4];
#pragma unroll
            for (int u = 0; u < 4; u++) v[u] = k + u < K ? to_f32(x[k + u]) : 0.f;
            *(float4*)&xc[k] = make_float4(c * v[0], c * v[1], c * v[2], c * v[3]);
            ss[i / SUB] += (v[0] + v[1]) + (v[2] + v[3]);
            se[i / SUB] += c * ((v[0] + v[1]) + (v[2] + v[3]));
        }
#pragma unroll
        for (int g = 0; g < NSUB; g++) { qe[q * NSUB + g] = se[g]; qs[q * NSUB + g] = ss[g]; }
    }
    __syncthreads();

    const int warp = tid >> 5, lane = tid & 31;
    const int row0 = (blockIdx.x * WARPS + warp) * R;
    size_t rbase[R];
    int rows[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        rows[r] = min(row0 + r, N - 1);          // clamped: loads need no mask, stores are masked
        rbase[r] = (size_t)rows[r] * NQ;
    }
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = 0.f;

#pragma unroll
    for (int s0 = 0; s0 < S; s0 += SB) {
        uint4 W[R][SB];
#pragma unroll
        for (int b = 0; b < SB; b++) {           // every load of the batch first
            const int q = (s0 + b) * 32 + lane;
#pragma unroll
            for (int r = 0; r < R; r++)
                W[r][b] = (s0 + b < S && q < NQ) ? ld_stream(qw + rbase[r] + q) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int b = 0; b < SB; b++) {
            const int q = (s0 + b) * 32 + lane;
            if (s0 + b >= S || q >= NQ) continue;
            const int wi = q * 4, t = wi / P, j0 = wi % P;
            float4 X[8];
#pragma unroll
            for (int i = 0; i < 8; i++) X[i] = *(const float4*)&xc[t * 8 * P + i * P + j0];
#pragma unroll
            for (int g = 0; g < NSUB; g++) {
                const float e = qe[q * NSUB + g], xs = qs[q * NSUB + g];
                const int grp = min((t * 8 * P + g * SUB * P) >> g_shift, NG - 1);
                const u16* scg = sc + (size_t)grp * N;
                const u16* mng = mn + (size_t)grp * N;
#pragma unroll
                for (int r = 0; r < R; r++) {
                    float t0 = 0.f, t1 = 0.f, t2 = 0.f, t3 = 0.f;
#pragma unroll
                    for (int ii = 0; ii < SUB; ii++) {
                        const int i = g * SUB + ii;
                        t0 = fmaf(nib(W[r][b].x, i), X[i].x, t0);
                        t1 = fmaf(nib(W[r][b].y, i), X[i].y, t1);
                        t2 = fmaf(nib(W[r][b].z, i), X[i].z, t2);
                        t3 = fmaf(nib(W[r][b].w, i), X[i].w, t3);
                    }
                    const float s = h2f(__ldg(scg + rows[r])), m = h2f(__ldg(mng + rows[r]));
                    acc[r] = fmaf(s, ((t0 + t1) + (t2 + t3)) - e, fmaf(m, xs, acc[r]));
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        float v = acc[r];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
        if (lane == 0 && row0 + r < N) {
#if HAS_BIAS
            v += to_f32(bias[row0 + r]);
#endif
            out[row0 + r] = from_f32(v);
        }
    }
}
"""

# the tensor-core kernels' shared part: the nibble-pair constant, the x-sum staging and the m16n8k16 mma
_TC_PRELUDE = _PRELUDE + r"""
#define NB (NSTEP / V)                               // load batches per 8-row tile (NSTEP % V == 0)
#if XBF16
#define MAGIC 0x43004300u                            // bf16 128 + q: exact (spacing 1 on [128, 256))
#define MAGIC_V 128.f
#else
#define MAGIC 0x64006400u                            // fp16 1024 + q
#define MAGIC_V 1024.f
#endif

// xsum[m * NSTEP + st] = the sum of x row m over the 128 inputs of step st (for the min term):
// one warp per (row, step), 4 inputs a lane, then a warp sum
__device__ __forceinline__ void stage_xsum(const u16* __restrict__ x, int stride_xm, int K, int M, float* xsum,
                                           int warp, int lane) {
    for (int i = warp; i < M * NSTEP; i += WARPS) {
        const int m = i / NSTEP, st = i - m * NSTEP;
        const int wc = st * 16 + (lane & 15), a = (lane >> 4) * 2;
        const int t = wc / P, j = wc % P;
        const u16* xm = x + (size_t)m * stride_xm;
        float acc = 0.f;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int k = t * 8 * P + (a + (e & 1) + (e >> 1) * 4) * P + j;
            acc += k < K ? to_f32(xm[k]) : 0.f;
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
        if (lane == 0) xsum[i] = acc;
    }
}

// (w & mask) | magic in one LOP3, for a nibble pair as the exact pair MAGIC_V + q. A LOP3 takes one immediate; given
// the mask and MAGIC as two, ptxas splits the expression into two LOP3s. Here both come in registers (held once).
__device__ __forceinline__ u32 qpair(u32 w, u32 mask, u32 magic) {
    u32 r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(w), "r"(mask), "r"(magic));
    return r;
}
template <typename T> __device__ __forceinline__ const T* opaque(const T* p) {   // a base the compiler keeps whole
    const T* r; asm("mov.b64 %0, %1;" : "=l"(r) : "l"(p)); return r;              // (offsets off it fold into loads)
}
__device__ __forceinline__ u32 in_reg(u32 v) { u32 r; asm volatile("mov.b32 %0, %1;" : "=r"(r) : "r"(v)); return r; }

__device__ __forceinline__ void mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if XBF16
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};" : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};" : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}
"""

_MMA_SOURCE = _TC_PRELUDE + r"""

// One warp computes 8 output rows (an "n tile") for up to 16 rows of x with tensor cores. Lane L = 4 g + c
// reads the 16 bytes at words 16 s + 4 c .. +3 of row 8 nt + g for every step s of 16 words (the 4 lanes
// of a row read 64 contiguous bytes). The nibbles a and a + 4 of a word, masked and or-ed under the
// exponent of MAGIC (one lop3), are the pair (MAGIC_V + q_a, MAGIC_V + q_{a+4}) exactly: the pairs a = 0, 1
// are the B fragment (k = 2c, 2c+1 | 2c+8, 2c+9; n = g) of one m16n8k16 mma, a = 2, 3 of a second. The A
// fragment (row g of x at the same k slots) is the matching pair of x values, staged in shared memory in
// that order, 4 pairs of a word in one 16-byte load (rows past M read a row of zeros; 16 bytes of padding
// every 8 words keep the 4 lanes of a row on distinct banks). A step's inputs share one scale group (P % 16 == 0, G >= 8P), so after the 8 mma of a step
// sum_k (MAGIC_V + q) x = D, and the step adds s (D - MAGIC_V X) + m X, X = sum of x over the step.
extern "C" __global__ void __launch_bounds__(NT)
ktk_int4_mma(const u16* __restrict__ x, const uint4* __restrict__ qw, const u16* __restrict__ sc,
             const u16* __restrict__ mn, const u16* __restrict__ bias, u16* __restrict__ out,
             int N, int K, int KW, int g_shift, int NG, int M, int stride_xm, int stride_om)
{
    extern __shared__ u32 smem[];
    const u32 qmask = in_reg(0x000F000Fu), qmagic = in_reg(MAGIC);   // (qpair's operands, in registers)
    const int KWP = KW * 4 + (KW / 8) * 4;           // padded row of x pairs
    u32* xp = smem;                                  // [M + 1][KWP] x pairs (nibble a, a + 4) per word; row M = 0
    float* xsum = (float*)(smem + (M + 1) * KWP);    // [M][NSTEP] sum of x over each step's inputs
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
    const int KQ = KW / 4;                           // uint4 per row
    const int n_tiles = (N + 7) / 8;
    int nt = blockIdx.x * WARPS + warp;
    const int nt_step = gridDim.x * WARPS;

    // first batch of weights in flight before the x staging
    uint4 wcur[V];
    {
        const uint4* wp = qw + (size_t)min(nt * 8 + g, N - 1) * KQ + c;
#pragma unroll
        for (int v = 0; v < V; v++) wcur[v] = nt < n_tiles ? ld_stream(wp + 4 * v) : make_uint4(0, 0, 0, 0);
    }
    for (int i = tid; i < KWP; i += NT) xp[M * KWP + i] = 0u;
    for (int i = tid; i < M * KW * 4; i += NT) {
        const int m = i / (KW * 4), r = i - m * KW * 4, wc = r >> 2, a = r & 3;
        const int k0 = (wc / P) * 8 * P + a * P + (wc % P), k1 = k0 + 4 * P;
        const u16* xm = x + (size_t)m * stride_xm;
        const u32 v0 = k0 < K ? xm[k0] : 0u, v1 = k1 < K ? xm[k1] : 0u;
        xp[m * KWP + wc * 4 + (wc >> 3) * 4 + a] = v0 | (v1 << 16);
    }
    stage_xsum(x, stride_xm, K, M, xsum, warp, lane);
    __syncthreads();

    const bool arow0 = g < M;
#if M16
    const bool arow1 = g + 8 < M;
#endif
    const int lo = 16 * c + 4 * (c >> 1);            // word 4 c (+ its padding) within a step
    const u32* xa_row = xp + (arow0 ? g : M) * KWP + lo;
#if M16
    const u32* xb_row = xp + (arow1 ? g + 8 : M) * KWP + lo;
#endif
    while (nt < n_tiles) {
        const int nt_next = nt + nt_step;
        const uint4* wp = qw + (size_t)min(nt * 8 + g, N - 1) * KQ + c;
        const uint4* wpn = qw + (size_t)min(nt_next * 8 + g, N - 1) * KQ + c;
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        const int n0 = nt * 8 + 2 * c;               // this lane's outputs n0, n0 + 1 (rows g, g + 8 of x)
        const u16* sc0 = sc + min(n0, N - 1);
        const u16* sc1 = sc + min(n0 + 1, N - 1);
        const u16* mn0 = mn + min(n0, N - 1);
        const u16* mn1 = mn + min(n0 + 1, N - 1);
#pragma unroll UNROLL_B
        for (int b = 0; b < NB; b++) {
            uint4 wnext[V];                          // the next batch (or the next tile's first) in flight
#pragma unroll
            for (int v = 0; v < V; v++) {
                if (b + 1 < NB) wnext[v] = ld_stream(wp + 4 * ((b + 1) * V + v));
                else wnext[v] = nt_next < n_tiles ? ld_stream(wpn + 4 * v) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int v = 0; v < V; v++) {
                const int st = b * V + v;
                float d[4] = {0.f, 0.f, 0.f, 0.f}, e[4] = {0.f, 0.f, 0.f, 0.f};   // two chains of mma
                const u32 wv[4] = {wcur[v].x, wcur[v].y, wcur[v].z, wcur[v].w};
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    const u32 w = wv[u];
                    const u32 q0 = qpair(w, qmask, qmagic), q1 = qpair(w >> 4, qmask, qmagic);
                    const u32 q2 = qpair(w >> 8, qmask, qmagic), q3 = qpair(w >> 12, qmask, qmagic);
                    const int wo = (st * 16 + u) * 4 + st * 8;  // word 16 st + 4 c + u (with lo)
                    const uint4 xa = *(const uint4*)&xa_row[wo];
#if M16
                    const uint4 xb = *(const uint4*)&xb_row[wo];
#else
                    const uint4 xb = make_uint4(0, 0, 0, 0);
#endif
                    mma((u & 1) ? e : d, xa.x, xb.x, xa.y, xb.y, q0, q1);
                    mma((u & 1) ? e : d, xa.z, xb.z, xa.w, xb.w, q2, q3);
                }
#pragma unroll
                for (int i = 0; i < 4; i++) d[i] += e[i];
                const size_t go = (size_t)min(((st * 16 / P) * 8 * P) >> g_shift, NG - 1) * N;
                const float s0 = h2f(__ldg(sc0 + go)), s1 = h2f(__ldg(sc1 + go));
                const float m0 = h2f(__ldg(mn0 + go)), m1 = h2f(__ldg(mn1 + go));
                if (arow0) {
                    const float X = xsum[g * NSTEP + st];
                    acc[0] += s0 * (d[0] - MAGIC_V * X) + m0 * X;
                    acc[1] += s1 * (d[1] - MAGIC_V * X) + m1 * X;
                }
#if M16
                if (arow1) {
                    const float X = xsum[(g + 8) * NSTEP + st];
                    acc[2] += s0 * (d[2] - MAGIC_V * X) + m0 * X;
                    acc[3] += s1 * (d[3] - MAGIC_V * X) + m1 * X;
                }
#endif
            }
#pragma unroll
            for (int v = 0; v < V; v++) wcur[v] = wnext[v];
        }
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int m = g + (e >> 1) * 8, n = n0 + (e & 1);
            if (m < M && n < N) {
                float y = acc[e];
#if HAS_BIAS
                y += to_f32(bias[n]);
#endif
                out[(size_t)m * stride_om + n] = from_f32(y);
            }
        }
        nt = nt_next;
    }
}
"""

_DIAG_SOURCE = _TC_PRELUDE + r"""
#define GS (16 / MR)                                 // steps per super-step: A row r = m * GS + j

#if CPA
#define RP (4 * V + ((V & 1) ? 0 : 4))               // ring row pitch in 16-byte quads (== 4 mod 8: no bank conflicts)
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(s), "l"(src));
}
// one stage: batch b (V steps, 4V quads a row) of the 8 rows of tile `tile` into a ring slot [8][RP]; lane l
// copies quads l, l + 32, ...: each instruction covers 512 contiguous bytes of one or more whole row runs
__device__ __forceinline__ void issue_stage(uint4* slot, const uint4* __restrict__ qw, int tile, int b, int N,
                                            int KQ, int n_tiles, int lane) {
    if (tile < n_tiles) {
#pragma unroll
        for (int i = 0; i < V; i++) {
            const int q = i * 32 + lane, r = q / (4 * V), col = q - r * (4 * V);
            cp_async16(slot + r * RP + col, qw + (size_t)min(tile * 8 + r, N - 1) * KQ + b * 4 * V + col);
        }
    }
    asm volatile("cp.async.commit_group;\n" ::);   // (an empty group past the last tile keeps the count)
}
#endif

// As ktk_int4_mma, but the 16 rows of the mma's A are (x row m, step j of a super-step of GS = 16 / MR
// steps): A row m * GS + j holds x row m on the mma of step j and zeros on the others, so D row
// m * GS + j collects step j's sum for x row m and the 8 rows of the tile, across the whole super-step,
// with no reset. The scale of each step is applied once per super-step, by the lane that holds that D row:
// per 16 steps, not per step, and by all lanes, not 4 of 32. At the end the lanes of one x row add up.
extern "C" __global__ void __launch_bounds__(NT)
ktk_int4_diag(const u16* __restrict__ x, const uint4* __restrict__ qw, const u16* __restrict__ sc,
              const u16* __restrict__ mn, const u16* __restrict__ bias, u16* __restrict__ out,
              int N, int K, int KW, int g_shift, int NG, int M, int stride_xm, int stride_om)
{
    extern __shared__ u32 smem[];
    const u32 qmask = in_reg(0x000F000Fu), qmagic = in_reg(MAGIC);   // (qpair's operands, in registers)
    const int KWP = KW * 4 + (KW / 8) * 4;           // padded row of x pairs (as ktk_int4_mma)
    u32* xp = smem;                                  // [M][KWP] x pairs, then 64 + 8 zero words
    u32* zero = smem + M * KWP;
    float* xsum = (float*)(zero + 72);               // [M][NSTEP]
#if CPA   // weights through a per-warp ring of CPA stages in shared memory (cp.async), after xsum (16-byte aligned)
    uint4* ring = (uint4*)(smem + ((M * KWP + 72 + M * NSTEP + 3) & ~3)) + (threadIdx.x >> 5) * (CPA * 8 * RP);
#endif
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
    const int KQ = KW / 4;
    const int n_tiles = (N + 7) / 8;
    int nt = blockIdx.x * WARPS + warp;
    const int nt_step = gridDim.x * WARPS;

#if CPA
#pragma unroll
    for (int s = 0; s < CPA - 1; s++)                // prologue: stages 0 .. CPA - 2 (NB % CPA == 0: slot = b % CPA)
        issue_stage(ring + s * 8 * RP, qw, nt + (s / NB) * nt_step, s % NB, N, KQ, n_tiles, lane);
#else
    uint4 wcur[V];
    {
        const uint4* wp = qw + (size_t)min(nt * 8 + g, N - 1) * KQ + c;
#pragma unroll
        for (int v = 0; v < V; v++) wcur[v] = nt < n_tiles ? ld_stream(wp + 4 * v) : make_uint4(0, 0, 0, 0);
    }
#endif
    for (int i = tid; i < 72; i += NT) zero[i] = 0u;
    for (int m = 0; m < M; m++) {
        const u16* xm = x + (size_t)m * stride_xm;
        for (int wc = tid; wc < KW; wc += NT) {
            const int k0 = (wc / P) * 8 * P + (wc % P);
#pragma unroll
            for (int a = 0; a < 4; a++) {
                const int ka = k0 + a * P, kb = ka + 4 * P;
                const u32 v0 = ka < K ? xm[ka] : 0u, v1 = kb < K ? xm[kb] : 0u;
                xp[m * KWP + wc * 4 + (wc >> 3) * 4 + a] = v0 | (v1 << 16);
            }
        }
    }
    stage_xsum(x, stride_xm, K, M, xsum, warp, lane);
    __syncthreads();

    // this lane's two A rows: r0 = g (x row mA, step jA of each super-step), r1 = g + 8 (mB, jB)
    const int mA = g / GS, jA = g % GS, mB = (g + 8) / GS, jB = (g + 8) % GS;
    const int lo = 16 * c + 4 * (c >> 1);
    const u32* xrowA = xp + min(mA, M - 1) * KWP + lo;
    const u32* xrowB = xp + min(mB, M - 1) * KWP + lo;
    const u32* zrow = zero + lo;                     // zeros for every word of a step (lo + 15 < 72)
    while (nt < n_tiles) {
        const int nt_next = nt + nt_step;
#if !CPA
        const uint4* wp = qw + (size_t)min(nt * 8 + g, N - 1) * KQ + c;
        const uint4* wpn = qw + (size_t)min(nt_next * 8 + g, N - 1) * KQ + c;
#endif
        const int n0 = nt * 8 + 2 * c;
        const u16* sc0 = sc + min(n0, N - 1);
        const u16* sc1 = sc + min(n0 + 1, N - 1);
        const u16* mn0 = mn + min(n0, N - 1);
        const u16* mn1 = mn + min(n0 + 1, N - 1);
        float acc[4] = {0.f, 0.f, 0.f, 0.f};         // rows r0 (n0, n0 + 1), r1 (n0, n0 + 1)
        float d[4] = {0.f, 0.f, 0.f, 0.f}, e[4] = {0.f, 0.f, 0.f, 0.f};
        u32 ssA = 0u, smA = 0u, ssB = 0u, smB = 0u;  // scale and min pairs (n0, n0 + 1) of the lane's two steps
#pragma unroll UNROLL_B
        for (int b = 0; b < NB; b++) {
#if CPA   // stage b of this tile has landed (all but the CPA - 2 newest groups); the warp sees every lane's
          // copies; the slot read one stage ago is free again: refill it with the stage CPA - 1 ahead
            asm volatile("cp.async.wait_group %0;\n" :: "n"(CPA - 2));
            __syncwarp();
            {
                const int b2 = b + CPA - 1;
                issue_stage(ring + (b2 % CPA) * 8 * RP, qw, nt + (b2 / NB) * nt_step, b2 % NB, N, KQ, n_tiles, lane);
            }
            const uint4* cur = ring + (b % CPA) * 8 * RP + g * RP + c;
#else
            uint4 wnext[V];
#pragma unroll
            for (int v = 0; v < V; v++) {
                if (b + 1 < NB) wnext[v] = ld_stream(wp + 4 * ((b + 1) * V + v));
                else wnext[v] = nt_next < n_tiles ? ld_stream(wpn + 4 * v) : make_uint4(0, 0, 0, 0);
            }
#endif
#pragma unroll
            for (int v = 0; v < V; v++) {
                const int st = b * V + v, j = st % GS;
                if (j == 0) {                                // a super-step starts: load the scales and mins
#pragma unroll                                               // its end needs, so that their latency hides
                    for (int h = 0; h < 2; h++) {            // behind its steps (not a stall per super-step)
                        const int sst = min(st + (h ? jB : jA), NSTEP - 1);
                        const size_t go = (size_t)min(((sst * 16 / P) * 8 * P) >> g_shift, NG - 1) * N;
                        const u32 ss = __ldg(sc0 + go) | ((u32)__ldg(sc1 + go) << 16);
                        const u32 sm = __ldg(mn0 + go) | ((u32)__ldg(mn1 + go) << 16);
                        if (h) { ssB = ss; smB = sm; } else { ssA = ss; smA = sm; }
                    }
                }
                const int so = st * 72;                      // (st * 16) * 4 + st * 8: the step's x pairs
                const u32* pa = (j == jA && mA < M) ? xrowA + so : zrow;
                const u32* pb = (j == jB && mB < M) ? xrowB + so : zrow;
                // one x row (GS 16): A rows 0-7 are steps 0-7 and rows 8-15 steps 8-15, so on steps 0-7 every
                // lane's second A row is zero and on steps 8-15 its first: no shared load for that half
                const bool needA = GS < 16 || j < 8, needB = GS < 16 || j >= 8;
#if CPA
                const uint4 wq = cur[4 * v];
                const u32 wv[4] = {wq.x, wq.y, wq.z, wq.w};
#else
                const u32 wv[4] = {wcur[v].x, wcur[v].y, wcur[v].z, wcur[v].w};
#endif
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    const u32 w = wv[u];
#if NOMATH                                           // (probe: the loads and the loop alone)
                    d[u & 3] += __int_as_float(w & 0x3FFFFFFFu);
                    continue;
#endif
                    const u32 q0 = qpair(w, qmask, qmagic), q1 = qpair(w >> 4, qmask, qmagic);
                    const u32 q2 = qpair(w >> 8, qmask, qmagic), q3 = qpair(w >> 12, qmask, qmagic);
                    const uint4 xa = needA ? *(const uint4*)(pa + u * 4) : make_uint4(0u, 0u, 0u, 0u);
                    const uint4 xb = needB ? *(const uint4*)(pb + u * 4) : make_uint4(0u, 0u, 0u, 0u);
                    mma((u & 1) ? e : d, xa.x, xb.x, xa.y, xb.y, q0, q1);
                    mma((u & 1) ? e : d, xa.z, xb.z, xa.w, xb.w, q2, q3);
                }
                if (j == GS - 1 || st == NSTEP - 1) {        // super-step done: each lane corrects its rows
                    const int s0 = st - j;                   // first step of this super-step
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const int mm = h ? mB : mA, jj = h ? jB : jA, sst = s0 + jj;
                        if (mm < M && sst < NSTEP) {
                            const float X = xsum[mm * NSTEP + sst];
                            const u32 ss = h ? ssB : ssA, sm = h ? smB : smA;
                            const float S0 = h2f((u16)(ss & 0xFFFFu)), S1 = h2f((u16)(ss >> 16));
                            const float M0 = h2f((u16)(sm & 0xFFFFu)), M1 = h2f((u16)(sm >> 16));
                            acc[2 * h] += S0 * (d[2 * h] + e[2 * h] - MAGIC_V * X) + M0 * X;
                            acc[2 * h + 1] += S1 * (d[2 * h + 1] + e[2 * h + 1] - MAGIC_V * X) + M1 * X;
                        }
                    }
#pragma unroll
                    for (int i = 0; i < 4; i++) { d[i] = 0.f; e[i] = 0.f; }
                }
            }
#if !CPA
#pragma unroll
            for (int v = 0; v < V; v++) wcur[v] = wnext[v];
#endif
        }
        // add up the lanes of one x row: those with the same m (g differs in its step bits)
#if GS == 16
        acc[0] += acc[2];
        acc[1] += acc[3];
#endif
#pragma unroll
        for (int i = 0; i < 4; i++) {
#pragma unroll
            for (int off = 4; off < 4 * (GS < 8 ? GS : 8); off <<= 1)
                acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], off);
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int mm = h ? mB : mA, jj = h ? jB : jA;
            if (jj == 0 && mm < M && !(GS == 16 && h == 1)) {
#pragma unroll
                for (int t2 = 0; t2 < 2; t2++) {
                    const int n = n0 + t2;
                    if (n < N) {
                        float y = acc[2 * h + t2];
#if HAS_BIAS
                        y += to_f32(bias[n]);
#endif
                        out[(size_t)mm * stride_om + n] = from_f32(y);
                    }
                }
            }
        }
        nt = nt_next;
    }
#if CPA
    asm volatile("cp.async.wait_all;\n" ::);
#endif
}
"""

_KSPLIT_SOURCE = _TC_PRELUDE + r"""
#define SPB ((NSTEP + KB - 1) / KB)                  // steps a block takes (KB blocks split K, blockIdx.y)
#define SPW ((SPB + KS - 1) / KS)                    // steps a warp takes
#define KWC (SPB * 16)                               // words of a row a block stages
#define KWP (KWC * 4 + (KWC / 8) * 4)                // padded row of x pairs (as ktk_int4_mma)
#define TR 16                                        // rows a tile (the mma's 16 A rows)
// ONE_TILE: a tile a block and as many blocks along N as tiles (ksplit_launch), so a warp's tile is always in range
// and its loads need no bounds check; taken over blocks only (KB > 1), where it measured 7% faster on the dense
// down's one row; at one block over K it was a wash (docs/gpu.md "The scales unjoined, the parameters reordered")
#define ONE_TILE (WARPS == KS && !PERSIST && KB > 1)
#define NG8 ((MR + 7) / 8)                           // groups of 8 x rows (the 8 B columns of an mma)
#define CH (GPS == 2 ? 2 : 1)                        // chains of mma a scale group (GPS > 1)
#define MAGIC_LO (MAGIC & 0xFFFFu)                   // the low half of a pair only (the high half bf16 / fp16 0)
#define MAGIC_HI (MAGIC & 0xFFFF0000u)
#if EXACT
#define MLIVE MR                                     // rows stored: all MR (compile-time: tighter code)
#else
#define MLIVE M                                      // rows stored: the call's M < MR
#endif

#if DQ
// DQ: the weights scaled in x's type before the mma, (q - 8) s a pair with each half's own group's scale (rounded
// once), so D holds sum (q - 8) s x for any groups a step with one mma a pair; the mins, m + 8 s, stay in fp32
// (+ (m + 8 s) X a group and step, X the step sums of x). Centred on 8, the rounded values are half the size of
// q s: a bf16 output's error (against float64, random weights) 0.0022 where q s gives 0.0054 (bf16-rounded weights:
// 0.0017; docs/gpu.md). dq_pairs: the scale pairs (lo, hi half) of one row for the pairs of nibbles (0, 1 | 4, 5)
// [0] and (2, 3 | 6, 7) [1]
__device__ __forceinline__ u32 pack_half2(u32 lo, u32 hi) {       // two fp16 (low 16 bits each) as x's half type
#if XBF16
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(h2f((u16)hi)), "f"(h2f((u16)lo)));
    return r;
#else
    return (lo & 0xFFFFu) | (hi << 16);
#endif
}
__device__ __forceinline__ void dq_pairs(const u32 (&p)[GPS], u32 (&S2)[2]) {
#pragma unroll
    for (int k = 0; k < 2; k++) {                    // nibble n < 4 lies in group n / (4 / GPS) .. of the step
        const int lo = GPS == 4 ? k : 0, hi = GPS == 4 ? k + 2 : (GPS == 2 ? 1 : 0);
        S2[k] = pack_half2(p[lo] & 0xFFFFu, p[hi] & 0xFFFFu);
    }
}
__device__ __forceinline__ u32 dq(u32 t, u32 S2) {                // pair MAGIC_V + q -> (q - 8) s pair, rounded once
    u32 r;
#if XBF16
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(t) : "r"(t), "r"(0x3F803F80u), "r"(0xC308C308u));   // - 136: exact
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(t), "r"(S2), "r"(0x80008000u));
#else
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(t) : "r"(t), "r"(0x3C003C00u), "r"(0xE408E408u));     // - 1032: exact
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(t), "r"(S2), "r"(0x80008000u));
#endif
    return r;
}
#endif

// One output of the tile: y (+ bias) in x's type, or (KB > 1) the block's fp32 part of it, ws[blockIdx.y][m][n]
// (ktk_int4_ksplit_sum then adds the KB parts in order, and the bias)
__device__ __forceinline__ void store(u16* __restrict__ out, float* __restrict__ ws, const u16* __restrict__ bias,
                                      int n, int m, int N, int M, int stride_om, float y) {
#if KB > 1
    ws[((size_t)blockIdx.y * M + m) * N + n] = y;
#else
#if HAS_BIAS
    y += to_f32(bias[n]);
#endif
    out[(size_t)m * stride_om + n] = from_f32(y);
#endif
}

// The words of rows ra = 16 nt + g and rb = ra + 8 of tile nt for the warp's steps (zeros past the tiles or the
// block's steps), and their scales (pa, pb) and mins (na, nb) per step and group, each in the low half of a word
__device__ __forceinline__ void tile_loads(const uint4* __restrict__ qw, const u16* __restrict__ sc,
                                           const u16* __restrict__ mn, int nt, int n_tiles, int N, int NG,
                                           int g_shift, int s0, int nsb, int s_lo, int g, int c,
                                           uint4 (&wa)[SPW], uint4 (&wb)[SPW], u32 (&pa)[SPW][GPS],
                                           u32 (&pb)[SPW][GPS], u32 (&na)[SPW][GPS], u32 (&nb)[SPW][GPS]) {
    const int KQ = NSTEP * 4;                        // 16-byte words of a row
#if N16 && ONE_TILE                                  // (one tile a block and a block a tile: nt < n_tiles always, so
    const int ra = nt * TR + g;                      //  the weights' addresses wait on no parameter but their base)
    const int rb = ra + 8;
#elif N16                                            // (N % 16 == 0: rb = ra + 8 always, so the loads of row rb are
    const int ra = min(nt, n_tiles - 1) * TR + g;    //  those of ra at a constant offset, folded into the loads)
    const int rb = ra + 8;
#else
    const int ra = min(nt * TR + g, N - 1), rb = min(nt * TR + g + 8, N - 1);
#endif
    const uint4* qa = opaque(qw + (size_t)ra * KQ + 4 * (s0 + s_lo) + c);
    const uint4* qb = N16 ? qa + 8 * KQ : opaque(qw + (size_t)rb * KQ + 4 * (s0 + s_lo) + c);
#pragma unroll
    for (int s = 0; s < SPW; s++) {
        const bool ok = (ONE_TILE || nt < n_tiles) && s_lo + s < nsb;
        wa[s] = ok ? ld_stream(qa + 4 * s) : make_uint4(0u, 0u, 0u, 0u);
        wb[s] = ok ? ld_stream(qb + 4 * s) : make_uint4(0u, 0u, 0u, 0u);
    }
    const u16 *sa = opaque(sc + ra), *ma = opaque(mn + ra);
    const u16 *sb = opaque(N16 ? sa + 8 : sc + rb), *mb = opaque(N16 ? ma + 8 : mn + rb);
#pragma unroll
    for (int s = 0; s < SPW; s++) {
        const int st = s0 + min(s_lo + s, nsb - 1);
        const int g0 = ((st * 16 / P) * 8 * P) >> g_shift;
#pragma unroll
        for (int j = 0; j < GPS; j++) {
            const int go = min(g0 + j, NG - 1) * N;  // (< 2^31: the scales' count, checked at launch)
            pa[s][j] = __ldg(sa + go);               // (every lane: the same sectors as the lanes that hold x
            na[s][j] = __ldg(ma + go);               //  columns, and no zeroing of the others' registers)
            pb[s][j] = __ldg(sb + go);
            nb[s][j] = __ldg(mb + go);
        }
    }
}

// The small matrices' GEMV (mode "ksplit", 1-16 rows of x). The mma's roles are those of ktk_int4_mma
// swapped: the weights are A (16 rows: lane L = 4 g + c holds rows 16 nt + g and + 8, words 16 st + 4 c ..
// + 3 of step st, each word's nibble pairs (a, a + 4) as exact bf16 (fp16) pairs MAGIC_V + q) and x is B
// (column g = x row g, the same staged pairs as ktk_int4_mma), so every mma does 16 rows x 16 inputs of
// useful work with no zero fragments, and the D column m holds x row m (past 8 rows, a second mma on the
// same unpacked A takes x rows 8..15). K is split over the warps of a
// block: KS warps share one 16-row tile, warp w taking the steps (w % KS) * SPW .. + SPW - 1, so a matrix
// of a few hundred tiles still has every SM busy with all of its loads in flight at once. Each warp issues
// the loads of all its steps (and their scales) before the x staging, whose barrier then waits under the
// weights' latency. Per step, the lanes that hold x columns (2 c < MR) add s (D - MAGIC_V X) + m X; the KS
// warps' sums meet in shared memory and are added in a fixed order (deterministic). MR (the rows of x
// rounded up to 1, 2, 4, 8 or 16; rows M..MR-1 are staged as copies of row M-1 and not stored) and the
// steps of a row are compile-time constants.
// GPS scale groups a step (1; with pack 16, 2 for groups of 64 and 4 for groups of 32, the GGUF Q4_0 / Q4_K
// repack): nibbles 0-3 of a word are the tile's inputs 0-63 and nibbles 4-7 its inputs 64-127, so the pair
// (a, a + 4) of an mma mixes two groups. Then each mma runs twice, once on the low halves of the pairs (the
// high half a bf16 zero) and once on the high halves: the first mma of a word (nibbles 0, 1 | 4, 5) and the
// second (2, 3 | 6, 7) each give one group of 32 a half, and D is kept per group (the tensor cores have the
// time: the weights' loads bound the kernel). X is staged per group.
// KB > 1 splits K over blocks too (blockIdx.y takes SPB consecutive steps): a block then stages x for its own
// steps only, so at 8-16 rows a block can hold many tiles (x staged once for all of them) and the grid still
// fills the GPU; each block leaves fp32 parts that ktk_int4_ksplit_sum adds.
// The parameters the prologue reads (the weights' and scales' addresses, N, NG, g_shift) come first, so that they
// share one 64-byte line of the constant bank with the memory descriptor: one constant-cache miss before the
// weights' loads issue instead of two (docs/gpu.md "The scales unjoined, the parameters reordered").
extern "C" __global__ void __launch_bounds__(NT, MINB)
ktk_int4_ksplit(const uint4* __restrict__ qw, const u16* __restrict__ sc, const u16* __restrict__ mn, int N, int NG,
                int g_shift, int K, int KW_, const u16* __restrict__ x, const u16* __restrict__ bias,
                u16* __restrict__ out, float* __restrict__ ws, int M, int stride_xm, int stride_om, int xvec)
{
    extern __shared__ u32 smem[];
    const u32 qmask = in_reg(0x000F000Fu), qmagic = in_reg(MAGIC);   // (qpair's operands, in registers)
    u32* xp = smem;                                  // [MR][KWP] x pairs of the block's steps
    float* xsum = (float*)(smem + MR * KWP);         // [MR][SPB][GPS] sum of x over each step's groups
    float* part = xsum + MR * SPB * GPS;             // [WARPS][TR][MR] each warp's sums (KS > 1)
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
    const int n_tiles = (N + TR - 1) / TR;
#if PERSIST
    const int nt0 = blockIdx.x * (WARPS / KS) + warp / KS, nt_step = gridDim.x * (WARPS / KS);
    int nt = nt0;                                    // (the tile of this round; the rounds' loop below)
#else
    const int nt = blockIdx.x * (WARPS / KS) + warp / KS;
#endif
#if KB > 1
    const int s0 = blockIdx.y * SPB, nsb = min(SPB, NSTEP - s0);   // the block's first step, its step count
#else
    const int s0 = 0, nsb = NSTEP;                   // (compile-time: the one-block code as before)
#endif
    const int s_lo = (warp % KS) * SPW;              // the warp's first step (of the block's)

    uint4 wa[SPW], wb[SPW];                          // the words of rows ra and rb, per step
    u32 pa[SPW][GPS], pb[SPW][GPS];                  // scales of rows ra and rb, per step and group (low half)
    u32 na[SPW][GPS], nb[SPW][GPS];                  // their mins
    tile_loads(qw, sc, mn, nt, n_tiles, N, NG, g_shift, s0, nsb, s_lo, g, c, wa, wb, pa, pb, na, nb);
    grid_wait();                                     // PDL: the weights above are in flight; x (and out) from here
    grid_release();                                  // the next grid (the parts' sum) may launch now

    // x pairs and step sums: 16 threads a (row of x, step), thread r of them the 8 consecutive inputs
    // j0 .. j0 + 7 of slice i = r / 2 of its tile (j0 = the step's first word in the tile + 8 (r % 2)): one
    // 16-byte load where x allows (xvec), 8 two-byte stores 16 bytes apart (words j0 .. j0 + 7 of the pair
    // array, pair slot a = i % 4, half i / 4), and the 16 threads' sums added by shuffles
    for (int base = warp * 32; base < MR * SPB * 16; base += NT) {
        const unsigned idx = base + lane, m = idx / (SPB * 16), sl = (idx / 16) % SPB, r = idx % 16;
        const bool ok = idx < MR * SPB * 16 && (int)sl < nsb;
        const unsigned st = s0 + sl, i = r / 2, tile = st * 16 / P, j0 = st * 16 % P + (r % 2) * 8;
        const int k0 = tile * 8 * P + i * P + j0;
#if EXACT                                            // (M == MR: no clamp; the staging compiles tighter without it)
        const u16* xm = x + (size_t)(ok ? m : 0) * stride_xm;
#else
        const u16* xm = x + (size_t)min((int)m, M - 1) * stride_xm;   // rows M..MR-1: copies of row M-1
#endif
        u32 v[4] = {0u, 0u, 0u, 0u};
        if (ok && xvec && k0 + 8 <= K) {
            const uint4 q = __ldg((const uint4*)(xm + k0));
            v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
        } else if (ok) {
#pragma unroll
            for (int e = 0; e < 8; e++)
                v[e / 2] |= (k0 + e < K ? (u32)xm[k0 + e] : 0u) << (16 * (e % 2));
        }
        float sum = 0.f;
        if (ok) {
            const unsigned wc0 = sl * 16 + (r % 2) * 8;   // (tile * P + j0 - 16 s0: the block's own words)
            u16* dst = (u16*)(xp + m * KWP + wc0 * 4 + (wc0 >> 3) * 4 + (i % 4)) + (i / 4);
#pragma unroll
            for (int e = 0; e < 8; e++) {
                const u16 h = (u16)(v[e / 2] >> (16 * (e % 2)));
                dst[e * 8] = h;                      // word wc0 + e: 4 pairs (16 bytes) later
                sum += to_f32(h);
            }
        }
#pragma unroll                                       // (a group's sum: its 16 / GPS threads, 8 / GPS slices)
        for (int off = 8 / GPS; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        if (ok && r % (16 / GPS) == 0) xsum[(m * SPB + sl) * GPS + r / (16 / GPS)] = sum;
    }
    __syncthreads();

    // x rows in groups of 8 (NG8 = 1 or 2), one mma's B columns each: group h, column g = x row 8 h + g
    const u32* xrow[NG8];
    int m0[NG8], m1[NG8];                            // this lane's two x rows of group h (clamped copies past MR)
#pragma unroll
    for (int h = 0; h < NG8; h++) {
        xrow[h] = xp + (8 * h + g < MR ? 8 * h + g : 0) * KWP + 16 * c + 4 * (c >> 1);
        m0[h] = 8 * h + 2 * c < MR ? 8 * h + 2 * c : 0;
        m1[h] = 8 * h + 2 * c + 1 < MR ? 8 * h + 2 * c + 1 : m0[h];
    }
#if PERSIST
    // PERSIST (probe): a grid of a few blocks an SM; each stages x once and takes the rounds of tiles nt0,
    // nt0 + nt_step, ... (a round: the block's tiles), the next round's words and scales loaded into registers
    // before this round's math, the warps' sums in two alternating buffers (one barrier a round)
    float* const ring = part;
    for (int round = 0; nt0 - warp / KS + round * nt_step < n_tiles; round++) {
    float* part = ring + (round & 1) * (WARPS * TR * MR);
    uint4 wa2[SPW], wb2[SPW];
    u32 pa2[SPW][GPS], pb2[SPW][GPS], na2[SPW][GPS], nb2[SPW][GPS];
    tile_loads(qw, sc, mn, nt + nt_step, n_tiles, N, NG, g_shift, s0, nsb, s_lo, g, c, wa2, wb2, pa2, pb2, na2, nb2);
#endif
    float acc[NG8][4];                               // per group: (ra, m0), (ra, m1), (rb, m0), (rb, m1)
#pragma unroll
    for (int h = 0; h < NG8; h++) acc[h][0] = acc[h][1] = acc[h][2] = acc[h][3] = 0.f;
#if DQ
    float acc2[NG8][4];                              // the second chain of mma
#pragma unroll
    for (int h = 0; h < NG8; h++) acc2[h][0] = acc2[h][1] = acc2[h][2] = acc2[h][3] = 0.f;
#endif
#pragma unroll
    for (int s = 0; s < SPW; s++) {
        const int st = s_lo + s;                     // (of the block's steps)
#if DQ
        if (st < nsb) {
            u32 Sa[2], Sb[2];                        // rows ra, rb: the scale pairs
            dq_pairs(pa[s], Sa);
            dq_pairs(pb[s], Sb);
            const u32 va[4] = {wa[s].x, wa[s].y, wa[s].z, wa[s].w};
            const u32 vb[4] = {wb[s].x, wb[s].y, wb[s].z, wb[s].w};
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const u32 A = va[u], B = vb[u];
                const u32 a0 = dq(qpair(A, qmask, qmagic), Sa[0]), b0 = dq(qpair(B, qmask, qmagic), Sb[0]);
                const u32 a1 = dq(qpair(A >> 4, qmask, qmagic), Sa[0]), b1 = dq(qpair(B >> 4, qmask, qmagic), Sb[0]);
                const u32 a2 = dq(qpair(A >> 8, qmask, qmagic), Sa[1]), b2 = dq(qpair(B >> 8, qmask, qmagic), Sb[1]);
                const u32 a3 = dq(qpair(A >> 12, qmask, qmagic), Sa[1]), b3 = dq(qpair(B >> 12, qmask, qmagic), Sb[1]);
#pragma unroll
                for (int h = 0; h < NG8; h++) {
                    const uint4 xv = *(const uint4*)&xrow[h][(st * 16 + u) * 4 + st * 8];   // pairs a = 0..3
                    mma((u & 1) ? acc2[h] : acc[h], a0, b0, a1, b1, xv.x, xv.y);
                    mma((u & 1) ? acc2[h] : acc[h], a2, b2, a3, b3, xv.z, xv.w);
                }
            }
#pragma unroll
            for (int h = 0; h < NG8; h++) {          // the mins: + (m + 8 s) X per group, in fp32
                if (8 * h + 2 * c < MR) {
#pragma unroll
                    for (int j = 0; j < GPS; j++) {
                        const float X0 = xsum[(m0[h] * SPB + st) * GPS + j];
                        const float X1 = xsum[(m1[h] * SPB + st) * GPS + j];
                        const float Ma = h2f((u16)na[s][j]) + 8.f * h2f((u16)pa[s][j]);
                        const float Mb = h2f((u16)nb[s][j]) + 8.f * h2f((u16)pb[s][j]);
                        acc[h][0] += Ma * X0; acc[h][1] += Ma * X1;
                        acc[h][2] += Mb * X0; acc[h][3] += Mb * X1;
                    }
                }
            }
        }
#else
        if (st < nsb) {
#if GPS == 1
            float d[NG8][4], e[NG8][4];              // two chains of mma per group
#pragma unroll
            for (int h = 0; h < NG8; h++)
#pragma unroll
                for (int i = 0; i < 4; i++) d[h][i] = e[h][i] = 0.f;
#else
            float d[GPS * CH][NG8][4];               // per scale group, CH chains of mma each
#pragma unroll
            for (int j = 0; j < GPS * CH; j++)
#pragma unroll
                for (int h = 0; h < NG8; h++)
#pragma unroll
                    for (int i = 0; i < 4; i++) d[j][h][i] = 0.f;
#endif
            const u32 va[4] = {wa[s].x, wa[s].y, wa[s].z, wa[s].w};
            const u32 vb[4] = {wb[s].x, wb[s].y, wb[s].z, wb[s].w};
#pragma unroll
            for (int u = 0; u < 4; u++) {
#if NOMATH                                           // (probe: the loads and the loop alone)
#if GPS == 1
                d[0][u & 3] += __int_as_float((va[u] ^ vb[u]) & 0x3FFFFFFFu);
#else
                d[0][0][u & 3] += __int_as_float((va[u] ^ vb[u]) & 0x3FFFFFFFu);
#endif
                continue;
#endif
                const u32 A = va[u], B = vb[u];      // (the nibble pairs' lop3s are shared by the groups)
#pragma unroll
                for (int h = 0; h < NG8; h++) {
                    const uint4 xv = *(const uint4*)&xrow[h][(st * 16 + u) * 4 + st * 8];   // pairs a = 0..3
#if GPS == 1
                    mma((u & 1) ? e[h] : d[h], qpair(A, qmask, qmagic), qpair(B, qmask, qmagic),
                        qpair(A >> 4, qmask, qmagic), qpair(B >> 4, qmask, qmagic), xv.x, xv.y);
                    mma((u & 1) ? e[h] : d[h], qpair(A >> 8, qmask, qmagic), qpair(B >> 8, qmask, qmagic),
                        qpair(A >> 12, qmask, qmagic), qpair(B >> 12, qmask, qmagic), xv.z, xv.w);
#else
                    const int ch = CH == 2 ? (u & 1) : 0;   // low halves: nibbles 0, 1 (| 2, 3); high: 4, 5 (| 6, 7)
                    mma(d[0 * CH + ch][h], (A & 0xFu) | MAGIC_LO, (B & 0xFu) | MAGIC_LO,
                        ((A >> 4) & 0xFu) | MAGIC_LO, ((B >> 4) & 0xFu) | MAGIC_LO, xv.x, xv.y);
                    mma(d[(GPS / 2) * CH + ch][h], (A & 0xF0000u) | MAGIC_HI, (B & 0xF0000u) | MAGIC_HI,
                        ((A >> 4) & 0xF0000u) | MAGIC_HI, ((B >> 4) & 0xF0000u) | MAGIC_HI, xv.x, xv.y);
                    mma(d[(GPS == 4 ? 1 : 0) * CH + ch][h], ((A >> 8) & 0xFu) | MAGIC_LO, ((B >> 8) & 0xFu) | MAGIC_LO,
                        ((A >> 12) & 0xFu) | MAGIC_LO, ((B >> 12) & 0xFu) | MAGIC_LO, xv.z, xv.w);
                    mma(d[(GPS == 4 ? 3 : 1) * CH + ch][h], ((A >> 8) & 0xF0000u) | MAGIC_HI,
                        ((B >> 8) & 0xF0000u) | MAGIC_HI, ((A >> 12) & 0xF0000u) | MAGIC_HI,
                        ((B >> 12) & 0xF0000u) | MAGIC_HI, xv.z, xv.w);
#endif
                }
            }
#pragma unroll
            for (int h = 0; h < NG8; h++) {
                if (8 * h + 2 * c < MR) {
#pragma unroll
                    for (int j = 0; j < GPS; j++) {
                        const float X0 = xsum[(m0[h] * SPB + st) * GPS + j], X1 = xsum[(m1[h] * SPB + st) * GPS + j];
                        const float Sa = h2f((u16)pa[s][j]), Ma = h2f((u16)na[s][j]);
                        const float Sb = h2f((u16)pb[s][j]), Mb = h2f((u16)nb[s][j]);
#if GPS == 1
                        const float D0 = d[h][0] + e[h][0], D1 = d[h][1] + e[h][1];
                        const float D2 = d[h][2] + e[h][2], D3 = d[h][3] + e[h][3];
#else
                        float D0 = 0.f, D1 = 0.f, D2 = 0.f, D3 = 0.f;
#pragma unroll
                        for (int q = 0; q < CH; q++) {
                            D0 += d[j * CH + q][h][0]; D1 += d[j * CH + q][h][1];
                            D2 += d[j * CH + q][h][2]; D3 += d[j * CH + q][h][3];
                        }
#endif
                        acc[h][0] += Sa * (D0 - MAGIC_V * X0) + Ma * X0;
                        acc[h][1] += Sa * (D1 - MAGIC_V * X1) + Ma * X1;
                        acc[h][2] += Sb * (D2 - MAGIC_V * X0) + Mb * X0;
                        acc[h][3] += Sb * (D3 - MAGIC_V * X1) + Mb * X1;
                    }
                }
            }
        }
#endif
    }
#if DQ
#pragma unroll
    for (int h = 0; h < NG8; h++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[h][i] += acc2[h][i];
#endif
#if KS > 1
#pragma unroll
    for (int h = 0; h < NG8; h++) {
        if (8 * h + 2 * c < MR) {
            part[(warp * TR + g) * MR + m0[h]] = acc[h][0];
            part[(warp * TR + g + 8) * MR + m0[h]] = acc[h][2];
            if (8 * h + 2 * c + 1 < MR) {
                part[(warp * TR + g) * MR + m1[h]] = acc[h][1];
                part[(warp * TR + g + 8) * MR + m1[h]] = acc[h][3];
            }
        }
    }
    __syncthreads();
    if (warp % KS == 0 && nt < n_tiles) {            // the tile's first warp adds the KS sums in order
        for (int i = lane; i < TR * MR; i += 32) {
            const int r = i / MR, m = i - r * MR, n = nt * TR + r;
            if (n < N && m < MLIVE) {
                float y = 0.f;
#pragma unroll
                for (int s = 0; s < KS; s++) y += part[((warp + s) * TR + r) * MR + m];
                store(out, ws, bias, n, m, N, M, stride_om, y);
            }
        }
    }
#else
    if (nt < n_tiles) {
#pragma unroll
        for (int h = 0; h < NG8; h++) {
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int n = nt * TR + g + (q >> 1) * 8, m = 8 * h + 2 * c + (q & 1);
                if (n < N && m < MLIVE) store(out, ws, bias, n, m, N, M, stride_om, acc[h][q]);
            }
        }
    }
#endif
#if PERSIST
#pragma unroll
    for (int s = 0; s < SPW; s++) {
        wa[s] = wa2[s]; wb[s] = wb2[s];
#pragma unroll
        for (int j = 0; j < GPS; j++) {
            pa[s][j] = pa2[s][j]; pb[s][j] = pb2[s][j];
            na[s][j] = na2[s][j]; nb[s][j] = nb2[s][j];
        }
    }
    nt += nt_step;
    }
#endif
}
"""

_KSPLIT_SUM_SOURCE = _PRELUDE + r"""
// The K-split GEMV's blocks over K (KB > 1) leave fp32 parts ws[KB][M][N]: out[m][n] = their sum, in order
// (deterministic), + bias, in x's type
extern "C" __global__ void ktk_int4_ksplit_sum(const float* __restrict__ ws, const u16* __restrict__ bias,
                                               u16* __restrict__ out, int N, int M, int KB_, int stride_om)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    grid_wait();                                     // PDL: the K split's parts written
    if (i >= M * N) return;
    const int m = i / N, n = i - m * N;
    float y = 0.f;
    for (int b = 0; b < KB_; b++) y += ws[((size_t)b * M + m) * N + n];
#if HAS_BIAS
    y += to_f32(bias[n]);
#endif
    out[(size_t)m * stride_om + n] = from_f32(y);
}
"""

STEP_WORDS = 128          # words one warp load covers per row (32 lanes x 16 bytes)


@dataclass(frozen=True)
class CudaGemvShape:
    """Compile-time constants of one binary."""
    pack: int
    nsub: int
    rows_per_warp: int
    warps: int
    steps: int
    step_batch: int
    bf16: bool
    bias: bool


_LOCK = threading.Lock()
_STATE: dict = {}         # device index -> None (usable) or why not
log = logging.getLogger("ktinject.int4_cuda")


def device_index(device) -> int:
    """The index of a CUDA device (the current one for a bare "cuda")."""
    dev = torch.device(device if device is not None else "cuda")
    return dev.index if dev.index is not None else torch.cuda.current_device()


def _compile_api():
    return getattr(torch.cuda, "_compile_kernel", None)


@functools.lru_cache(maxsize=None)
def _binary(shape, device_index: int):
    """The compiled kernel of `shape` (`CudaGemvShape`, `MmaShape`, `DiagShape` or `KsplitShape`) on one GPU
    (NVRTC, once per process)."""
    api = _compile_api()
    if api is None:
        raise RuntimeError("this torch has no torch.cuda._compile_kernel (NVRTC); the CUDA int4 GEMV needs torch >= 2.8")
    name = ("ktk_int4_ksplit" if isinstance(shape, KsplitShape) else "ktk_int4_ksplit_sum"
            if isinstance(shape, KsplitSumShape) else "ktk_int4_diag" if isinstance(shape, DiagShape)
            else "ktk_int4_mma" if isinstance(shape, MmaShape) else "ktk_int4_gemv")
    with torch.cuda.device(device_index):
        return api(source(shape), name, nvcc_options=["--std=c++17"])


def source(shape) -> str:
    """The CUDA source of one binary (`CudaGemvShape`, `MmaShape`, `DiagShape` or `KsplitShape`): its constants,
    then the kernel."""
    if isinstance(shape, KsplitShape):
        consts = {"P": shape.pack, "NSTEP": shape.steps, "KS": shape.ksplit, "WARPS": shape.warps, "MR": shape.rows,
                  "EXACT": int(shape.exact), "GPS": shape.groups, "DQ": int(shape.dequant), "KB": shape.kblocks,
                  "MINB": shape.min_blocks, "XBF16": int(shape.bf16), "HAS_BIAS": int(shape.bias),
                  "NOMATH": int(shape.nomath), "PERSIST": int(shape.persist), "N16": int(shape.n16),
                  "PDL": int(shape.pdl)}
        body = _KSPLIT_SOURCE
    elif isinstance(shape, KsplitSumShape):
        consts = {"WARPS": 8, "XBF16": int(shape.bf16), "HAS_BIAS": int(shape.bias), "PDL": int(shape.pdl)}
        body = _KSPLIT_SUM_SOURCE
    elif isinstance(shape, DiagShape):
        consts = {"P": shape.pack, "NSTEP": shape.steps, "V": shape.batch, "WARPS": shape.warps,
                  "XBF16": int(shape.bf16), "HAS_BIAS": int(shape.bias),
                  "UNROLL_B": min(shape.steps // shape.batch, 8), "MR": shape.mr, "NOMATH": int(shape.nomath),
                  "CPA": shape.stages}
        body = _DIAG_SOURCE
    elif isinstance(shape, MmaShape):
        consts = {"P": shape.pack, "NSTEP": shape.steps, "V": shape.batch, "WARPS": shape.warps,
                  "XBF16": int(shape.bf16), "HAS_BIAS": int(shape.bias),
                  "UNROLL_B": min(shape.steps // shape.batch, 8), "M16": int(shape.rows16)}
        body = _MMA_SOURCE
    else:
        consts = {"P": shape.pack, "NSUB": shape.nsub, "R": shape.rows_per_warp, "WARPS": shape.warps,
                  "S": shape.steps, "SB": shape.step_batch, "XBF16": int(shape.bf16), "HAS_BIAS": int(shape.bias)}
        body = _SOURCE
    return "".join(f"#define {k} {v}\n" for k, v in consts.items()) + body


def shared_bytes(kw: int, nsub: int) -> int:
    return (kw * 8 + 2 * (kw // 4) * nsub) * 4


def _disabled() -> str | None:
    import os
    if os.environ.get("KTINJECT_INT4_CUDA", "1").strip().lower() in ("0", "off", "false", "no"):
        return "turned off by KTINJECT_INT4_CUDA=0"
    if torch.version.hip:
        return "not on ROCm (the kernels hold NVIDIA PTX)"
    return None


def available(device=None) -> bool:
    """True when the CUDA GEMVs compile and give the right answer on this GPU (checked once per device)."""
    return unavailable_reason(device) is None


def unavailable_reason(device=None) -> str | None:
    """Why the CUDA GEMVs cannot run on `device` (None when they can). Decided once per device (the
    self-test), except while a CUDA graph is captured or sync-debug mode is on: the self-test synchronizes,
    so the answer then is "not yet" and nothing is cached. Runs on every decode call: a dict hit once known."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    idx = device_index(device)
    known = _STATE.get(idx, _STATE)
    if known is not _STATE:
        return known
    if _compile_api() is None:
        why = "torch.cuda._compile_kernel (NVRTC) is missing from this torch"
    else:
        why = _disabled()
    if why is None and (torch.cuda.is_current_stream_capturing() or torch.cuda.get_sync_debug_mode() != 0):
        return "not checked yet (its self-test cannot run inside a CUDA-graph capture or in sync-debug mode)"
    with _LOCK:
        if idx not in _STATE:
            _STATE[idx] = why if why is not None else _self_test(idx)
            if _STATE[idx] is not None and why is None:
                log.warning("cuda:%d: the int4 CUDA GEMVs are off (%s); linear_int4 runs its Triton kernels",
                            idx, _STATE[idx])
        return _STATE[idx]


def _self_test(idx: int) -> str | None:
    """The kernels on small odd shapes against the dequantized weight; None when they agree."""
    from . import int4_pack
    major, minor = torch.cuda.get_device_capability(idx)
    if major < 8:
        return f"needs compute capability 8.0 or later (bf16 conversions, m16n8k16 mma), this GPU has {major}.{minor}"
    try:
        with torch.cuda.device(idx):
            g = torch.Generator(device="cpu").manual_seed(1)
            # diag twice: 2 rows on 4 steps (a partial super-step), and the lm_head's path, one row (16-step
            # super-steps, half of A skipped) on 17 steps (a whole super-step and a partial one)
            for name, (n, k), group, rows, run in (
                    ("one-row", (96, 392), 64, 1,
                     lambda x_, t_: gemv(x_, t_, None, rows_per_warp=2, warps=4, step_batch=1)),
                    ("mma", (96, 392), 128, 3, lambda x_, t_: gemv_mma(x_, t_, None, warps=2, batch=2)),
                    ("diag", (96, 392), 128, 2,
                     lambda x_, t_: gemv_diag(x_, t_, None, warps=3, batch=2, ctas_per_sm=1)),
                    ("diag one-row", (40, 2176), 128, 1,
                     lambda x_, t_: gemv_diag(x_, t_, None, warps=2, batch=4, ctas_per_sm=1)),
                    ("ksplit", (200, 1160), 128, 3, lambda x_, t_: gemv_ksplit(x_, t_, None, ksplit=3, warps=6)),
                    ("ksplit, groups of 32", (200, 1160), 32, 3,
                     lambda x_, t_: gemv_ksplit(x_, t_, None, ksplit=3, warps=6)),
                    # K over 3 blocks (10 steps: 4 + 4 + 2), 7 rows, then the kernel that adds the parts
                    ("ksplit over blocks", (200, 1160), 64, 7,
                     lambda x_, t_: gemv_ksplit(x_, t_, None, ksplit=2, warps=4, kblocks=3))):
                iw = int4_pack.quantize(torch.randn(n, k, generator=g) * 0.05, group)
                tw = int4_pack.tile(iw, 16).to(f"cuda:{idx}")
                x = torch.randn(rows, k, generator=g).to(f"cuda:{idx}", torch.bfloat16)
                ref = x.float() @ int4_pack.dequantize(iw, torch.float32).to(x.device).T
                y = run(x, tw)
                torch.cuda.synchronize()
                err = ((y.float() - ref).norm() / ref.norm()).item()
                worst = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                if not (err < 1e-2 and worst < 3e-2):
                    return f"self-test mismatch ({name} kernel, relative error {err:.3g}, worst {worst:.3g})"
        return None
    except Exception as exc:                                          # noqa: BLE001 - reported by doctor
        lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
        first_error = next((ln for ln in lines if "error" in ln.lower()), lines[0] if lines else "")
        return f"{type(exc).__name__}: {first_error[:200]}"


def _checked(x: torch.Tensor, w, bias: torch.Tensor | None):
    """The checks the kernels need (they read raw pointers): x and bias in x's dtype, contiguous, on the
    weight's GPU; the weight tensors contiguous, 16-byte aligned words. Returns (x, bias, device index)."""
    k = x.shape[1]
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"the CUDA int4 GEMV takes bf16/fp16 activations, got {x.dtype}")
    if k != w.in_features:
        raise ValueError(f"x has {k} columns, the weight {w.in_features}")
    if not (w.qweight.is_contiguous() and w.scales.is_contiguous() and w.mins.is_contiguous()):
        raise ValueError("the int4 weight tensors must be contiguous")
    if w.qweight.data_ptr() % 16 or w.pack % 4:
        raise ValueError(f"the int4 words must be 16-byte aligned with pack a multiple of 4 (pack {w.pack})")
    if not (x.is_cuda and x.device == w.qweight.device == w.scales.device == w.mins.device):
        raise ValueError(f"x ({x.device}) and the int4 weight ({w.qweight.device}) must be on one CUDA device")
    x = x.contiguous()
    if bias is not None:
        if bias.device != x.device or bias.shape != (w.qweight.shape[0],):
            raise ValueError(f"bias must be [{w.qweight.shape[0]}] on {x.device}, got {tuple(bias.shape)} on "
                             f"{bias.device}")
        bias = bias.to(x.dtype).contiguous()
    return x, bias, device_index(x.device)


@functools.lru_cache(maxsize=None)
def smem_limit(idx: int) -> int:
    """Shared memory one block may use on GPU `idx` (opt-in maximum; 48 KiB where torch cannot raise it)."""
    from torch.cuda._utils import _CudaKernel
    if not hasattr(_CudaKernel, "set_shared_memory_config"):
        return 48 * 1024
    return int(getattr(torch.cuda.get_device_properties(idx), "shared_memory_per_block_optin", 48 * 1024))


def _launch(shape, idx: int, blocks: int, warps: int, smem: int, args: list, blocks_y: int = 1,
            dependent: bool = False, releases: bool = False) -> None:
    """Launch one compiled kernel on GPU `idx`'s current stream (the capture stream inside a CUDA graph);
    `dependent`: as a programmatic dependent of the kernel before it (`pdl_launch`; the binary must wait on that
    one itself: a shape with `pdl` set); `releases`: the binary lets its dependents start early, and the call's
    mode asks that the kernels after it know (`pdl.note_releasing`)."""
    kern = _binary(shape, idx)
    with torch.cuda.device(idx):
        if smem >= 48 * 1024 and smem > getattr(kern, "_max_shared_mem_bytes", 0):
            kern.set_shared_memory_config(smem)   # once per binary and size (the warm-up's call, not a capture's)
        stream = torch.cuda.current_stream(idx)
        if releases:
            note_releasing(kern.func)
        if dependent:
            if not getattr(shape, "pdl", False):
                raise ValueError(f"{type(shape).__name__} without pdl cannot run as a programmatic dependent")
            pdl_launch(kern, (blocks, blocks_y, 1), (warps * 32, 1, 1), smem, stream, args)
        else:
            kern(grid=(blocks, blocks_y, 1), block=(warps * 32, 1, 1), args=args, shared_mem=smem, stream=stream)


def kernel_params(args: list) -> tuple:
    """(void ** array, the C values it points at) of a kernel's arguments: tensors as device pointers, Python
    ints as C ints (the kernels' `int` parameters), as torch's NVRTC launcher passes them. Keep the values
    alive until the launch returns."""
    import ctypes
    vals = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            vals.append(ctypes.c_void_p(a.data_ptr()))
        elif isinstance(a, int) and not isinstance(a, bool):
            if not -2 ** 31 <= a < 2 ** 31:
                raise ValueError(f"kernel argument {i} ({a}) does not fit a C int")
            vals.append(ctypes.c_int(a))
        else:
            raise TypeError(f"kernel arguments are tensors or ints, got {type(a).__name__} at position {i}")
    arr = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in vals])
    return arr, vals


def pdl_launch(kern, grid: tuple, block: tuple, smem: int, stream, args: list) -> None:
    """Launch an NVRTC kernel (torch's `_CudaKernel`) through cuLaunchKernelEx with programmatic stream
    serialization: it may start while the kernel before it in `stream` runs, and waits for it in its code
    (griddepcontrol.wait) before reading its input. Captured into CUDA graphs as a programmatic edge."""
    from ...native.cuda_driver import driver
    arr, _vals = kernel_params(args)
    driver().launch_programmatic(kern.func, grid, block, smem, stream.cuda_stream, arr)


def pdl_mode(idx: int, mode: str | None = None) -> str:
    """The programmatic-dependent-launch mode the K split runs with on GPU `idx`: `mode`, or None for
    `KTINJECT_INT4_PDL` (read at each call; default "auto"): "sum" launches the parts' sum kernel (K over blocks)
    as a dependent of the K split, a K split over blocks as a dependent of whatever kernel runs before it in the
    stream (both measured faster after any kernel); "auto" that, and any other K split so where, in a CUDA graph
    being captured, the kernel before it releases its dependents early (one of ours: `pdl.after_release`; with
    "auto" and "all" `rms_norm` and the MLA decode step's last kernel release early too; measured on an H100 in
    the forty-third session: q_proj 3.79 -> 3.12 us after the norm); "all" every K split so (faster behind one of
    ours, slower by 0.1-0.2 us behind a kernel that does not release it early); "off" none. "off" wherever the
    GPU or driver cannot (`pdl_unavailable_reason`). Measured: docs/gpu.md "Programmatic dependent launch"."""
    if mode is None:
        mode = env_mode()
    elif mode not in PDL_MODES:
        raise ValueError(f"pdl must be one of {PDL_MODES}, got {mode!r}")
    return mode if mode == "off" or pdl_supported(idx) else "off"


@functools.lru_cache(maxsize=None)
def pdl_unavailable_reason(idx: int) -> str | None:
    """Why GPU `idx` cannot run programmatic dependent launches (None: it can): they need compute capability
    9.0+ and a driver with cuLaunchKernelEx, bound through ctypes."""
    if torch.version.hip:
        return "not on ROCm"
    major, minor = torch.cuda.get_device_capability(idx)
    if major < 9:
        return f"needs compute capability 9.0+, this GPU has {major}.{minor}"
    from ...errors import NativeError
    from ...native.cuda_driver import driver
    try:
        return None if driver()._launch_ex is not None else "this CUDA driver has no cuLaunchKernelEx"
    except NativeError as exc:
        return str(exc)


def pdl_supported(idx: int) -> bool:
    """Whether GPU `idx` runs programmatic dependent launches (`pdl_unavailable_reason` is None)."""
    return pdl_unavailable_reason(idx) is None


def cuda_fits(w, m: int, device_index: int) -> str | None:
    """Why the one-row kernel cannot run `m` rows on `w` on GPU `device_index` (None when it can)."""
    from .int4_triton import tiled_groups
    if m != 1:
        return f"it takes one row, got {m}"
    if shared_bytes(int(w.qweight.shape[1]), tiled_groups(w)[0]) > smem_limit(device_index):
        return f"{w.in_features} inputs do not fit in shared memory"
    return None


def gemv(x: torch.Tensor, w, bias: torch.Tensor | None = None, *, rows_per_warp: int = 2, warps: int = 4,
         step_batch: int = 2) -> torch.Tensor:
    """y = x @ W.T (+ bias) for one row x: [1, K] bf16/fp16 and `w` an `int4_pack.Int4Tiled`; [1, N] in x.dtype."""
    from .int4_triton import tiled_groups
    m = x.shape[0]
    n, kw = w.qweight.shape
    if rows_per_warp < 1 or warps < 1:
        raise ValueError(f"rows_per_warp and warps must be >= 1, got {rows_per_warp} and {warps}")
    x, bias, idx = _checked(x, w, bias)
    why = cuda_fits(w, m, idx)
    if why:
        raise ValueError(f"the one-row CUDA int4 GEMV cannot run here: {why}")
    nsub, g_shift = tiled_groups(w)
    k = x.shape[1]
    steps = -(-kw // STEP_WORDS)
    shape = CudaGemvShape(w.pack, nsub, rows_per_warp, warps, steps, max(1, min(step_batch, steps)),
                          x.dtype == torch.bfloat16, bias is not None)
    out = torch.empty((1, n), device=x.device, dtype=x.dtype)
    _launch(shape, idx, -(-n // (rows_per_warp * warps)), warps, shared_bytes(kw, nsub),
            [x, w.qweight, w.scales, w.mins, bias if bias is not None else w.scales, out,
             n, k, kw, g_shift, int(w.scales.shape[0])])
    return out


MMA_MAX_ROWS = 16


@dataclass(frozen=True)
class MmaShape:
    pack: int
    steps: int            # 16-word steps per row
    batch: int            # steps per load batch (divides steps)
    warps: int
    bf16: bool
    bias: bool
    rows16: bool          # more than 8 rows of x: the mma's rows 8..15 are used too


def mma_shared_bytes(m: int, kw: int) -> int:
    return ((m + 1) * (kw * 4 + (kw // 8) * 4) + m * (kw // 16)) * 4


def mma_fits(w, m: int, device_index: int | None = None) -> str | None:
    """Why the tensor-core GEMV cannot take `m` rows on `w` (on GPU `device_index`: its shared memory) (None
    when it can)."""
    from .int4_triton import tiled_groups
    if not 1 <= m <= MMA_MAX_ROWS:
        return f"it takes 1..{MMA_MAX_ROWS} rows, got {m}"
    if w.pack % 16:
        return f"it needs pack 16 or 32, the weight has {w.pack}"
    if tiled_groups(w)[0] != 1:
        return f"it needs one scale group per tile (group size {w.group_size} < 8 x pack {w.pack})"
    if device_index is not None and mma_shared_bytes(m, int(w.qweight.shape[1])) > smem_limit(device_index):
        return f"{m} rows of {w.in_features} inputs do not fit in shared memory"
    return None


def gemv_mma(x: torch.Tensor, w, bias: torch.Tensor | None = None, *, warps: int = 4, batch: int = 2,
             ctas_per_sm: int = 0) -> torch.Tensor:
    """y = x @ W.T (+ bias) on tensor cores for x: [M, K] (M <= 16) bf16/fp16, `w` an `Int4Tiled` with pack
    16 or 32 and one group per tile; [M, N] in x.dtype. ctas_per_sm > 0: a persistent grid of that many
    blocks per SM (each warp loops over 8-row tiles), else one warp per 8-row tile."""
    from .int4_triton import tiled_groups
    m, k = x.shape
    n, kw = w.qweight.shape
    if warps < 1:
        raise ValueError(f"warps must be >= 1, got {warps}")
    x, bias, idx = _checked(x, w, bias)
    why = mma_fits(w, m, idx)
    if why:
        raise ValueError(f"the tensor-core int4 GEMV cannot run here: {why}")
    steps = kw // 16
    batch = max(1, min(batch, steps))
    while steps % batch:
        batch -= 1
    shape = MmaShape(w.pack, steps, batch, warps, x.dtype == torch.bfloat16, bias is not None, m > 8)
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    blocks = -(-(-(-n // 8)) // warps)
    if ctas_per_sm > 0:
        blocks = min(blocks, ctas_per_sm * torch.cuda.get_device_properties(idx).multi_processor_count)
    _launch(shape, idx, blocks, warps, mma_shared_bytes(m, kw),
            [x, w.qweight, w.scales, w.mins, bias if bias is not None else w.scales, out,
             n, k, kw, tiled_groups(w)[1], int(w.scales.shape[0]), m, x.stride(0), out.stride(0)])
    return out


def diag_shared_bytes(m: int, kw: int, warps: int = 0, stages: int = 0, batch: int = 0) -> int:
    """Shared memory of ktk_int4_diag: x pairs, zeros and step sums, then (stages > 0) each warp's cp.async
    ring of `stages` x 8 rows x `ring_pitch(batch)` quads."""
    head = (m * (kw * 4 + (kw // 8) * 4) + 72 + m * (kw // 16)) * 4
    return head if not stages else (head + 15) // 16 * 16 + warps * stages * 8 * ring_pitch(batch) * 16


def ring_pitch(batch: int) -> int:
    """Quads a row of the cp.async ring holds: its 4 x batch, padded to 4 mod 8 (the kernel's RP)."""
    return 4 * batch + (0 if batch & 1 else 4)


def diag_stages(stages: int, steps: int, batch: int) -> int:
    """The cp.async ring depth the kernel can take: a divisor of the batches a row (so a slot is a batch
    index mod the depth) of at least 2, at most `stages`; 0 (weights through registers) where none is."""
    nb = steps // batch
    for s in range(min(stages, nb), 1, -1):
        if nb % s == 0:
            return s
    return 0


@dataclass(frozen=True)
class DiagShape:
    pack: int
    steps: int
    batch: int
    warps: int
    bf16: bool
    bias: bool
    mr: int               # rows of x rounded up to 1, 2, 4, 8 or 16
    nomath: bool = False  # (scripts/int4_diag_probe.py: loads and loop only, no unpacking or mma)
    stages: int = 0       # weights through a cp.async ring of this many stages in shared memory (0: registers)


def gemv_diag(x: torch.Tensor, w, bias: torch.Tensor | None = None, *, warps: int = 4, batch: int = 2,
              ctas_per_sm: int = 0, stages: int = 0) -> torch.Tensor:
    """As `gemv_mma`, with the scale corrections once per super-step of 16 / rows steps (ktk_int4_diag).
    `stages` >= 2: the weights go through a per-warp cp.async ring in shared memory of that depth (each copy
    512 contiguous bytes) instead of registers (each load 64 bytes of 8 rows)."""
    from .int4_triton import tiled_groups
    m, k = x.shape
    n, kw = w.qweight.shape
    if warps < 1:
        raise ValueError(f"warps must be >= 1, got {warps}")
    x, bias, idx = _checked(x, w, bias)
    steps = kw // 16
    batch = max(1, min(batch, steps))
    while steps % batch:
        batch -= 1
    stages = diag_stages(stages, steps, batch)
    smem = diag_shared_bytes(m, kw, warps, stages, batch)
    why = mma_fits(w, m, idx) or (None if smem <= smem_limit(idx) else
                                  f"x and the weight ring ({smem} bytes) do not fit in shared memory")
    if why:
        raise ValueError(f"the tensor-core int4 GEMV cannot run here: {why}")
    shape = DiagShape(w.pack, steps, batch, warps, x.dtype == torch.bfloat16, bias is not None,
                      1 << max(m - 1, 0).bit_length(), False, stages)
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    blocks = -(-(-(-n // 8)) // warps)
    if ctas_per_sm > 0:
        blocks = min(blocks, ctas_per_sm * torch.cuda.get_device_properties(idx).multi_processor_count)
    _launch(shape, idx, blocks, warps, smem,
            [x, w.qweight, w.scales, w.mins, bias if bias is not None else w.scales, out,
             n, k, kw, tiled_groups(w)[1], int(w.scales.shape[0]), m, x.stride(0), out.stride(0)])
    return out


KSPLIT_MAX_ROWS = 16


@dataclass(frozen=True)
class KsplitShape:
    pack: int
    steps: int            # 16-word steps per row
    ksplit: int           # warps sharing one 16-row tile, each ceil(steps / ksplit) consecutive steps
    warps: int            # a multiple of ksplit: warps // ksplit tiles a block
    rows: int             # rows of x rounded up to 1, 2, 4, 8 or 16 (the binary's capacity)
    bf16: bool
    bias: bool
    min_blocks: int = 1   # __launch_bounds__ minimum blocks per SM (caps the registers a thread takes)
    nomath: bool = False  # (probe: the loads and the loop only, no unpacking or mma)
    exact: bool = True    # the call's rows are `rows` (else fewer: the staging clamps its row index)
    groups: int = 1       # scale groups a 128-input step: 1, or with pack 16 2 (groups of 64) or 4 (of 32)
    dequant: bool = False  # the weights scaled in x's type before the mma ((q - 8) s a pair; the mins in fp32)
    kblocks: int = 1      # blocks splitting K (grid y), each ceil(steps / kblocks) steps; > 1: fp32 parts, summed
    persist: bool = False  # (probe: min_blocks blocks an SM, each taking rounds of tiles, the next round's loads early)
    n16: bool = False     # N % 16 == 0 (no ragged last tile: row rb = ra + 8, its loads at constant offsets)
    pdl: bool = False     # programmatic dependent launch (sm_90+): the weights' loads issued, then griddepcontrol.wait
    #                       on the grid before (a no-op when launched plainly), then the next grid released


@dataclass(frozen=True)
class KsplitSumShape:     # ktk_int4_ksplit_sum: the K-split blocks' fp32 parts added (+ bias) in x's type
    bf16: bool
    bias: bool
    pdl: bool = False     # waits on the K split first (griddepcontrol.wait): launched as its programmatic dependent


def ksplit_kblocks(steps: int, kblocks: int) -> tuple[int, int]:
    """(blocks over K, steps a block) for `kblocks` asked on rows of `steps` 128-input steps: no block left
    without steps (10 steps in 4 blocks: 3 + 3 + 3 + 1; in 6: 2 x 5, so 5 blocks)."""
    per = -(-steps // max(1, min(kblocks, steps)))
    return -(-steps // per), per


def ksplit_shared_bytes(m: int, kw: int, warps: int, ksplit: int, groups: int = 1, kblocks: int = 1,
                        persist: bool = False) -> int:
    """Shared memory of ktk_int4_ksplit: x pairs and the steps' group sums (of a block's steps), then
    (ksplit > 1) each warp's 16 x m sums (`persist`: two such buffers)."""
    kw = ksplit_kblocks(kw // 16, kblocks)[1] * 16
    parts = (warps * 16 * m if ksplit > 1 else 0) * (2 if persist else 1)
    return (m * (kw * 4 + (kw // 8) * 4) + m * (kw // 16) * groups + parts) * 4


def ksplit_groups(w) -> int:
    """Scale groups a 16-word step of `w` holds in ktk_int4_ksplit (1, 2 or 4); a ValueError where it takes none."""
    from .int4_triton import tiled_groups
    per_tile = tiled_groups(w)[0]
    if w.pack % 16:
        raise ValueError(f"it needs pack 16 or 32, the weight has {w.pack}")
    if per_tile == 1:
        return 1
    if w.pack == 16 and per_tile in (2, 4):
        return per_tile
    raise ValueError(f"it needs groups of >= 32 inputs, and one group a tile with pack 32 (group size "
                     f"{w.group_size}, pack {w.pack})")


def ksplit_launch(w, ksplit: int, warps: int, occupancy: int = 32, kblocks: int = 1) -> tuple[int, int, int, int]:
    """(ksplit, warps, blocks along N, min blocks per SM) of ktk_int4_ksplit on `w`: ksplit clamped to the steps
    a block takes, warps a multiple of it; the launch bound asks for `occupancy` warps an SM (65536 / (32 x
    occupancy) registers a thread at most)."""
    steps = ksplit_kblocks(int(w.qweight.shape[1]) // 16, kblocks)[1]
    ksplit = max(1, min(ksplit, steps))
    tpb = max(1, warps // ksplit)
    n_tiles = -(-int(w.qweight.shape[0]) // 16)
    return ksplit, tpb * ksplit, -(-n_tiles // tpb), max(1, occupancy // (tpb * ksplit))


def ksplit_rows(m: int) -> int:
    """The rows a ktk_int4_ksplit binary holds for `m` rows of x: 1, 2, 4, 8 or 16 (one binary for exactly
    that many rows and one for fewer)."""
    return 1 << max(m - 1, 0).bit_length()


def ksplit_fits(w, m: int, ksplit: int, warps: int, device_index: int | None = None, kblocks: int = 1,
                persist: bool = False) -> str | None:
    """Why the K-split GEMV cannot take `m` rows on `w` with this split (on GPU `device_index`: its shared
    memory; `persist`: the persistent grid's) (None when it can)."""
    if kblocks < 1:
        return f"kblocks must be >= 1, got {kblocks}"
    if not 1 <= m <= KSPLIT_MAX_ROWS:
        return f"it takes 1..{KSPLIT_MAX_ROWS} rows, got {m}"
    try:
        groups = ksplit_groups(w)
    except ValueError as exc:
        return str(exc)
    if w.scales.numel() >= 2 ** 31:
        return f"its scales hold {w.scales.numel()} values, past the kernel's 32-bit offsets"
    if device_index is not None:
        ks, wps, _, _ = ksplit_launch(w, max(1, ksplit), max(1, warps), kblocks=kblocks)
        if ksplit_shared_bytes(ksplit_rows(m), int(w.qweight.shape[1]), wps, ks, groups, kblocks, persist) > \
                smem_limit(device_index):
            return (f"{m} rows of {w.in_features} inputs do not fit in shared memory"
                    f"{'' if kblocks > 1 else ' (kblocks > 1 stages a slice of them a block)'}")
    return None


def ksplit_shape(w, m: int, bf16: bool, bias: bool, *, ksplit: int, warps: int, occupancy: int = 32,
                 nomath: bool = False, dequant: bool | None = None, kblocks: int = 1,
                 persist: bool = False, pdl: bool = False) -> tuple[KsplitShape, int]:
    """The binary `gemv_ksplit` runs for `m` rows on `w` with these options (its split, warps and blocks over K as
    launched; `dequant` None: scaled before the mma where a step holds several groups), and its blocks along N."""
    n, kw = w.qweight.shape
    kblocks = ksplit_kblocks(kw // 16, kblocks)[0]
    ks, warps, blocks, min_blocks = ksplit_launch(w, ksplit, warps, occupancy, kblocks)
    mr = ksplit_rows(m)
    groups = ksplit_groups(w)
    shape = KsplitShape(w.pack, kw // 16, ks, warps, mr, bf16, bias, min_blocks, nomath, m == mr, groups,
                        groups > 1 if dequant is None else dequant, kblocks, persist, n % 16 == 0, pdl)
    return shape, blocks


def gemv_ksplit(x: torch.Tensor, w, bias: torch.Tensor | None = None, *, ksplit: int = 16, warps: int = 16,
                occupancy: int = 32, nomath: bool = False, dequant: bool | None = None,
                kblocks: int = 1, persist: bool = False, pdl: str | None = None) -> torch.Tensor:
    """y = x @ W.T (+ bias) on tensor cores for x: [M, K] (M <= 16) bf16/fp16, `w` an `Int4Tiled` with pack 16
    (groups of >= 32) or 32 (one group per tile); [M, N] in x.dtype. `ksplit` warps share one 16-row tile, each a
    slice of K (ktk_int4_ksplit); a block holds `warps` // `ksplit` tiles; `occupancy`: warps an SM the launch
    bound asks for. `dequant`: scale the weights in x's type before the mma (one mma a pair for any groups a step);
    None: where a step holds several groups (groups of 32 and 64), where it measured faster. `nomath` (probe: the
    loads and loop alone) applies to the unscaled path only. `kblocks` > 1 splits K over that many blocks as well
    (each stages x for its own steps; fp32 parts, then a second kernel adds them in order and the bias).
    `persist` (probe; kblocks 1): as many blocks as the launch bound puts on the SMs at once, each taking rounds of
    tiles with the next round's weights loaded before this round's math. `pdl`: programmatic dependent launch
    (`pdl_mode`; None: `KTINJECT_INT4_PDL`, default "auto"): "sum", the parts' sum kernel launches while the K
    split runs, and a K split over blocks while the kernel before it in the stream finishes (its weights' loads
    first); "auto", that and any K split captured right after a kernel that releases it early
    (`pdl.after_release`: our K splits, `rms_norm`, the MLA decode step's last kernel); "all", every K split so;
    "off" (docs/gpu.md "Programmatic dependent launch", "Behind our own kernels")."""
    from .int4_triton import tiled_groups
    m, k = x.shape
    n, kw = w.qweight.shape
    if ksplit < 1 or warps < ksplit or warps % ksplit:
        raise ValueError(f"warps ({warps}) must be a multiple of ksplit ({ksplit}) >= 1")
    x, bias, idx = _checked(x, w, bias)
    why = ksplit_fits(w, m, ksplit, warps, idx, kblocks, persist)
    if why:
        raise ValueError(f"the K-split int4 GEMV cannot run here: {why}")
    bf16 = x.dtype == torch.bfloat16
    pdl = pdl_mode(idx, pdl)
    shape, blocks = ksplit_shape(w, m, bf16, bias is not None, ksplit=ksplit, warps=warps, occupancy=occupancy,
                                 nomath=nomath, dequant=dequant, kblocks=kblocks, persist=persist,
                                 pdl=pdl != "off")
    kblocks, warps = shape.kblocks, shape.warps
    if nomath and shape.dequant:
        raise ValueError("nomath removes the unscaled path's math only; pass dequant=False with it")
    if persist:
        if kblocks > 1:
            raise ValueError(f"persist takes kblocks=1 (K over one block), got kblocks={kblocks}")
        blocks = min(blocks, torch.cuda.get_device_properties(idx).multi_processor_count * shape.min_blocks)
    smem = ksplit_shared_bytes(shape.rows, kw, warps, shape.ksplit, shape.groups, kblocks, persist)
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    ws = torch.empty((kblocks, m, n), device=x.device, dtype=torch.float32) if kblocks > 1 else w.scales
    _launch(shape, idx, blocks, warps, smem,
            [w.qweight, w.scales, w.mins, n, int(w.scales.shape[0]), tiled_groups(w)[1], k, kw,
             x, bias if bias is not None else w.scales, out, ws, m, x.stride(0), out.stride(0),
             int(x.data_ptr() % 16 == 0 and x.stride(0) % 8 == 0)], blocks_y=kblocks,
            releases=pdl in ("auto", "all"), dependent=pdl == "all" or (pdl != "off" and kblocks > 1) or
            (pdl == "auto" and after_release(torch.cuda.current_stream(idx))))
    if kblocks > 1:
        _launch(KsplitSumShape(bf16, bias is not None, pdl != "off"), idx, -(-(m * n) // 256), 8, 0,
                [ws, bias if bias is not None else out, out, n, m, kblocks, out.stride(0)], dependent=pdl != "off")
    return out
