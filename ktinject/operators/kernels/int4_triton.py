"""Triton kernels for the 4-bit format of `int4_pack`.

* `int4_gemv_tiled` / `int4_dequantize_tiled` (second half of this file): the decode GEMV of
  `linear_int4` and its prefill dequantize, on the tiled layout `int4_pack.Int4Tiled`, with launch
  configs by shape class (`tiled_config`).
* `int4_gemv` / `int4_expert_gemv` / `int4_dequantize` (first half): the older split-K GEMV on the
  plain `[N, K/8]` layout, still used by `gpu_experts` (per-slot expert GEMV over stacked experts)
  and by a `linear_int4` moved to CUDA after loading on the CPU.

Older GEMV, plain layout. One program owns BLOCK_N output rows of W and one K slice. Per step it loads a
`[BLOCK_N, BLOCK_KW]` tile of packed int32 words (contiguous along K: 16-byte vector loads) and
handles the 8 nibbles of every word as 8 separate `[BLOCK_N, BLOCK_KW]` tensors matched with
8 strided views of x, so no reshape or layout shuffle is ever needed (the dot product does not
care in which order k is visited).

Nibble to float without the slow int->float converter: the nibble is moved to mantissa bits
19..22 and or-ed with the bits of 1.0, giving `f = 1 + q/16` exactly (one shift, one lop3).

* FMA path (M == 1 by default): `t += f * x` element-wise in registers, reduced once at the end;
  `sum q x = 16 (sum f x - sum x)` per word, then the group scale and min:
  `sum_k x (q s + m) = s * 16 (t - xs) + m * xs`. About three instructions per weight.
* dot path (2 <= M <= 16): each nibble slice is dequantized (`w = 16 s f + (m - 16 s)`, one FMA)
  to the activation dtype and fed to `tl.dot` against the matching x slice (M padded to 16),
  so the cost per weight does not grow with M.

When the grid over N alone is too small to fill the GPU (N = 2048, K = 10944, say) K is split
and the slices meet through fp32 atomics in a zeroed buffer.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from . import int4_cuda

MAX_M = 16


@functools.lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def int4_gemv(x_ptr, qw_ptr, s_ptr, m_ptr, b_ptr, out_ptr, e_ptr,
                  M, N, K, NG, stride_xm, stride_om, WORDS_PER_SPLIT, stride_qe, stride_se, X_DIV,
                  G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
                  USE_DOT: tl.constexpr, HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr, HAS_EXPERT: tl.constexpr):
        # x: [M, K] bf16/fp16   qw: int32 [N, K/8]   s, m: fp16 [N, NG]   out: [M, N]
        # expert mode (grid axis 2 = slot s): qw/s/m are stacked [E, ...], e_ptr: int32 [S] local expert
        # of each slot (-1: none, the row stays zero), x row = s // X_DIV, out row = s, M = 1.
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                 # [BN]
        n_mask = offs_n < N
        if HAS_EXPERT:
            slot = tl.program_id(2)
            e = tl.load(e_ptr + slot)
            n_mask = n_mask & ((offs_n * 0 + e) >= 0)
            e = tl.maximum(e, 0).to(tl.int64)
            qw_ptr += e * stride_qe
            s_ptr += e * stride_se
            m_ptr += e * stride_se
            x_ptr += (slot // X_DIV).to(tl.int64) * stride_xm
            out_ptr += slot.to(tl.int64) * stride_om
        offs_m = tl.arange(0, BLOCK_M)                                   # [BM]
        m_mask = offs_m < M
        offs_j = tl.arange(0, BLOCK_KW)                                  # [BKW] word in tile
        K8 = K // 8
        if USE_DOT:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_KW), dtype=tl.float32)
        w_begin = pid_k * WORDS_PER_SPLIT
        for kk in range(0, WORDS_PER_SPLIT, BLOCK_KW):
            wcol = w_begin + kk + offs_j                                 # [BKW] word column
            w_ok = wcol < K8
            tile_mask = n_mask[:, None] & w_ok[None, :]
            packed = tl.load(qw_ptr + offs_n[:, None] * K8 + wcol[None, :], mask=tile_mask, other=0)
            g = (wcol * 8) // G                                          # [BKW] group of each word
            s = tl.load(s_ptr + offs_n[:, None] * NG + g[None, :], mask=tile_mask, other=0.0).to(tl.float32)
            mn = tl.load(m_ptr + offs_n[:, None] * NG + g[None, :], mask=tile_mask, other=0.0).to(tl.float32)
            s16 = s * 16.0
            if not USE_DOT:
                t = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_KW), dtype=tl.float32)
                xs = tl.zeros((BLOCK_M, BLOCK_KW), dtype=tl.float32)
            else:
                c = mn - s16
            x_mask = m_mask[:, None] & w_ok[None, :]
            for i in tl.static_range(8):
                xi = tl.load(x_ptr + offs_m[:, None] * stride_xm + (wcol * 8 + i)[None, :], mask=x_mask,
                             other=0.0)                                  # [BM, BKW] = x[:, 8j + i]
                if i <= 4:
                    bits = (packed << (19 - 4 * i)) & 0x780000
                else:
                    bits = (packed >> (4 * i - 19)) & 0x780000
                f = (bits | 0x3F800000).to(tl.float32, bitcast=True)     # [BN, BKW] = 1 + q/16
                if USE_DOT:
                    w = (f * s16 + c).to(xi.dtype)                       # [BN, BKW] dequantized
                    acc = tl.dot(xi, tl.trans(w), acc)                   # [BM, BN]
                else:
                    xf = xi.to(tl.float32)
                    t += f[None, :, :] * xf[:, None, :]
                    xs += xf
            if not USE_DOT:
                acc += (t - xs[:, None, :]) * s16[None, :, :] + xs[:, None, :] * mn[None, :, :]
        if USE_DOT:
            res = acc
        else:
            res = tl.sum(acc, axis=2)                                    # [BM, BN]
        if HAS_BIAS:
            bias = tl.load(b_ptr + offs_n, mask=n_mask & ((offs_n * 0 + pid_k) == 0), other=0.0).to(tl.float32)
            res = res + bias[None, :]
        o_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        o_mask = m_mask[:, None] & n_mask[None, :]
        if ATOMIC:
            tl.atomic_add(o_ptrs, res, mask=o_mask)
        else:
            tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=o_mask)

    return int4_gemv


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 32
    block_k: int = 512              # inputs per step (BLOCK_KW = block_k / 8 packed words)
    num_warps: int = 4
    target_programs: int = 528      # split K until the grid holds about this many programs (4 per SM)
    use_dot: bool = False           # tensor-core path (pads M to 16)
    num_stages: int = 3


FMA_DEFAULT = GemvConfig(32, 512, 4, 528, False)
DOT_DEFAULT = GemvConfig(64, 256, 4, 528, True)


def _next_pow2(v: int) -> int:
    return 1 << max(v - 1, 0).bit_length()


def default_config(m: int, n: int, k: int) -> GemvConfig:
    """Launch shape by problem size: FMA path for one row, tensor-core path for 2..16 rows."""
    return _CONFIG_OVERRIDE.get((m > 1, n, k)) or (FMA_DEFAULT if m == 1 else DOT_DEFAULT)


_CONFIG_OVERRIDE: dict[tuple[bool, int, int], GemvConfig] = {}


def plan_launch(m: int, n: int, k: int, cfg: GemvConfig):
    """(grid, WORDS_PER_SPLIT, BLOCK_M, BLOCK_KW) for one call."""
    kw = cfg.block_k // 8
    if cfg.block_k % 8 or kw & (kw - 1) or (cfg.use_dot and kw < 16):
        raise ValueError(f"block_k {cfg.block_k} must be 8 x a power of two (>= 128 on the dot path)")
    n_blocks = -(-n // cfg.block_n)
    k_steps = -(-(k // 8) // kw)
    split = max(1, min(k_steps, -(-cfg.target_programs // n_blocks)))
    steps_per_split = -(-k_steps // split)
    split = -(-k_steps // steps_per_split)
    block_m = 16 if cfg.use_dot else max(1, _next_pow2(m))
    return (n_blocks, split), steps_per_split * kw, block_m, kw


def int4_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
              group_size: int, bias: torch.Tensor | None = None, cfg: GemvConfig | None = None) -> torch.Tensor:
    """y = x @ W.T (+ bias) for x: [M, K] (M <= 16), W in the int4 format; returns [M, N] in x.dtype."""
    m, k = x.shape
    n = qweight.shape[0]
    if m > MAX_M:
        raise ValueError(f"int4_gemv takes at most {MAX_M} rows, got {m}")
    if group_size % 8:
        raise ValueError(f"group size {group_size} must be a multiple of 8")
    cfg = cfg or default_config(m, n, k)
    grid, words_per_split, block_m, kw = plan_launch(m, n, k, cfg)
    atomic = grid[1] > 1
    x = x.contiguous()
    if atomic:
        out = torch.zeros((m, n), device=x.device, dtype=torch.float32)
    else:
        out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    _kernel()[grid](x, qweight, scales, mins, bias if bias is not None else scales, out, scales,
                    m, n, k, scales.shape[1], x.stride(0), out.stride(0), words_per_split, 0, 0, 1,
                    G=group_size, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_KW=kw, USE_DOT=cfg.use_dot,
                    HAS_BIAS=bias is not None, ATOMIC=atomic, HAS_EXPERT=False, num_warps=cfg.num_warps,
                    num_stages=cfg.num_stages)
    return out.to(x.dtype) if atomic else out


def int4_expert_gemv(x: torch.Tensor, slot_expert: torch.Tensor, x_div: int, qweight: torch.Tensor,
                     scales: torch.Tensor, mins: torch.Tensor, group_size: int,
                     cfg: GemvConfig | None = None) -> torch.Tensor:
    """Per-slot GEMV over stacked experts: out[s] = x[s // x_div] @ W[slot_expert[s]].T.

    x: [T, K]   slot_expert: int32 [S] (-1: slot not handled here, its row is zero)
    qweight: int32 [E, N, K/8]   scales, mins: fp16 [E, N, NG]   -> [S, N] in x.dtype.
    No host synchronisation: safe inside a CUDA graph.
    """
    s_count = slot_expert.shape[0]
    _, n, k8 = qweight.shape
    k = k8 * 8
    cfg = cfg or FMA_DEFAULT
    if cfg.use_dot:
        raise ValueError("the expert GEMV runs on the FMA path")
    grid, words_per_split, _, kw = plan_launch(1, n, k, GemvConfig(cfg.block_n, cfg.block_k, cfg.num_warps,
                                                                   max(1, cfg.target_programs // max(s_count, 1))))
    atomic = grid[1] > 1
    x = x.contiguous()
    out = torch.zeros((s_count, n), device=x.device, dtype=torch.float32 if atomic else x.dtype)
    _kernel()[(grid[0], grid[1], s_count)](
        x, qweight, scales, mins, scales, out, slot_expert.to(torch.int32).contiguous(),
        1, n, k, scales.shape[2], x.stride(0), out.stride(0), words_per_split, qweight.stride(0), scales.stride(0),
        x_div, G=group_size, BLOCK_M=1, BLOCK_N=cfg.block_n, BLOCK_KW=kw, USE_DOT=False, HAS_BIAS=False,
        ATOMIC=atomic, HAS_EXPERT=True, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out.to(x.dtype) if atomic else out


@functools.lru_cache(maxsize=1)
def _dequant_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def int4_dequant(qw_ptr, s_ptr, m_ptr, out_ptr, N, K, NG, G: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # qw: int32 [N, K/8] -> out: [N, K] in out's dtype
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
        word = tl.load(qw_ptr + offs_n[:, None] * (K // 8) + offs_k[None, :] // 8, mask=mask, other=0)
        q = ((word >> ((offs_k[None, :] % 8) * 4)) & 0xF).to(tl.float32)
        g = offs_k[None, :] // G
        s = tl.load(s_ptr + offs_n[:, None] * NG + g, mask=mask, other=0.0).to(tl.float32)
        mn = tl.load(m_ptr + offs_n[:, None] * NG + g, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs_n[:, None] * K + offs_k[None, :], (q * s + mn).to(out_ptr.dtype.element_ty), mask=mask)

    return int4_dequant


def int4_dequantize(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """Dense [N, K] of `dtype` on the GPU (the prefill path: dequantize, then one matmul)."""
    n, k = qweight.shape[0], qweight.shape[1] * 8
    out = torch.empty((n, k), device=qweight.device, dtype=dtype)
    grid = (-(-n // 32), -(-k // 256))
    _dequant_kernel()[grid](qweight, scales, mins, out, n, k, scales.shape[1], G=group_size,
                            BLOCK_N=32, BLOCK_K=256, num_warps=4)
    return out


# ==== tiled GEMV: the decode kernel of linear_int4 ===================================================
#
# Weight layout `int4_pack.Int4Tiled` (made at load): tiles of 8P inputs, word j of a tile holds input
# P*i + j in nibble i, scales/mins transposed to [NG, N]. One program owns BLOCK_N rows and a run of
# tiles (a K slice); per tile it loads a [BLOCK_N, P] block of words (16-byte loads, each row's P words
# contiguous), the scale/min vectors of the tile's group(s) once, and for nibble i the contiguous slice
# x[8P t + P i : 8P t + P (i + 1)]. No reshape or layout shuffle anywhere.
#
# Nibble to float: the two nibbles of byte a are shifted to bits 15..22 (one shift per two nibbles)
# and each is or-ed under the exponent of 1.0: f = 1 + q/256 (even nibble) or 1 + q/16 (odd), so
# q = 256 (f - 1) or 16 (f - 1) exactly, with no int-to-float conversion.
#
# Modes (`TiledConfig.mode`):
# * "fma" (M <= 4), per group: t = sum_i f_i * (C_i x_i) (C_i = 256 or 16 applied to x, shared by all
#   rows), acc += s * t per element; per row cor += m * sum(x) - s * sum(C x) (one cross-thread sum per
#   group and tile, not per row). Per weight: half a shift, one lop3, one FMA, plus the per-tile x work
#   shared by the rows a thread holds: 3.5 SASS instructions per weight at block_n 256 / 4 warps
#   (sm_90, counted in the compiled loop). Past four groups a tile (G = 32 with P = 32) it dequantizes
#   instead ("fma_dq": w = f * C s + (m - C s); acc += w * x). Cost grows with M: for one row.
# * "dot" (M <= 16): w dequantized as above to the activation dtype and fed to tensor cores,
#   acc[BN, 16] += W_i[BN, P] @ x_i^T[P, 16] ("dot_x": acc[16, BN] += x_i @ W_i^T): about 4.5
#   instructions per weight for all 16 rows.
#
# Split K: when the N blocks alone do not fill the GPU, K is split over grid axis 1. Each slice
# writes an fp32 partial to a workspace; the last slice to arrive (per-block counter, acq_rel atomic
# after a CTA barrier: the CUTLASS semaphore pattern) sums them in a fixed order, adds the bias,
# writes the output and resets the counter: one launch, no zero-fill, deterministic. ("atomic"
# reduce: fp32 atomics into a zeroed buffer, then a cast: three launches.)

TILED_MODES = {"fma": 0, "fma_dq": 1, "dot": 2, "dot_x": 3, "rows": 4, "cuda": 5, "mma": 6, "diag": 7, "ksplit": 8}
CUDA_MODES = ("cuda", "mma", "diag", "ksplit")      # the NVRTC kernels of int4_cuda (Triton configs back them up)
_PER_CHANNEL_SHIFT = 30


@dataclass(frozen=True)
class TiledConfig:
    mode: str = "fma"               # fma | fma_dq | rows (M <= 4) | dot | dot_x (M <= 16, bf16/fp16 activations)
    #                                 cuda (M = 1: the NVRTC kernel of int4_cuda; block_n / num_warps rows a warp)
    #                                 mma (M <= 16: int4_cuda's tensor-core kernel; block_n = 8 x num_warps)
    #                                 diag (M <= 16: as mma, scale work once per super-step; block_n = 8 x warps)
    #                                 ksplit (M <= 16: int4_cuda's K-split tensor-core kernel; chunk warps share
    #                                   a 16-row tile, each a slice of K; block_n = 16 x num_warps / chunk)
    block_n: int = 64               # rows per program
    num_warps: int = 4
    num_stages: int = 1             # (Triton does not software-pipeline this loop: stages change nothing)
    #                                 mode diag: >= 2 sends the weights through a cp.async ring this deep
    target_programs: int = 1056     # split K until the grid holds about this many programs (8 per SM)
    split: int = 0                  # fixed K split instead (0: from target_programs)
    pack: int = 16                  # P of the weight layout this config was tuned for (16 or 32)
    prefetch: bool = False          # load the next tile's words before computing this one
    reduce: str = "serial"          # split-K sums: serial (fixed order) | atomic (fp32 atomics; any order)
    chunk: int = 16                 # mode rows: tiles per load wave (power of two); rows never splits K
    #                                 mode cuda: 128-word steps per load batch; mma, diag: 16-word steps
    ctas: int = 0                   # modes mma, diag: blocks per SM of a persistent grid (0: a warp per 8 rows)
    dequant: bool | None = None     # mode ksplit: the weights scaled in x's type before the mma (None: with
    #                                 several groups a 128-input step, where it measured faster)
    kblocks: int = 1                # mode ksplit: blocks splitting K too (grid y), their fp32 parts then summed
    occupancy: int = 32             # mode ksplit: warps an SM its launch bound asks for (16: up to 128 registers)


try:       # the tiled kernels live at module level (Triton resolves helper functions through globals)
    import triton
    import triton.language as tl
except ImportError:                                               # CPU-only installs: the launchers are unused
    triton = None

if triton is not None:

    @triton.jit
    def _nibble(w, I: tl.constexpr, MLO, MHI, EXP):
        # Nibble I of every word as fp32: f = 1 + q/256 (I even) or 1 + q/16 (I odd), so q = C (f - 1)
        # with C = 256 or 16. The pair of nibbles 2a, 2a+1 is shifted to bits 15..22 (4 shifts per 8
        # nibbles) and each is or-ed under the exponent of 1.0. (Three shifts, with a third slot at bits
        # 11..14, measured 4% fewer instructions but more registers and 10x the rounding error.)
        # MLO = 0x78000, MHI = 0x780000 and EXP = 0x3F800000 arrive as kernel arguments: as literals
        # ptxas re-materializes them before every lop3 (~0.6 extra instructions per weight in the SASS).
        if I // 2 == 0:
            v = w << 15
        elif I // 2 == 1:
            v = w << 7
        elif I // 2 == 2:
            v = w >> 1
        else:
            v = w >> 9
        if I % 2 == 0:
            v = (v & MLO) | EXP
        else:
            v = (v & MHI) | EXP
        return v.to(tl.float32, bitcast=True)

    @triton.jit
    def _xload(ptrs, kx, K, EVEN_K: tl.constexpr):
        if EVEN_K:
            return tl.load(ptrs)
        else:
            return tl.load(ptrs, mask=kx < K, other=0.0)

    @triton.jit(do_not_specialize=["M", "N", "G_SHIFT", "NG", "n_tiles", "tiles_per_split", "stride_om",
                                   "MLO", "MHI", "EXP"])
    def _k_gemv_tiled(x_ptr, qw_ptr, s_ptr, m_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr,
                      M, N, K, KW, G_SHIFT, NG, n_tiles, tiles_per_split, stride_xm, stride_om, MLO, MHI, EXP,
                      P: tl.constexpr, NSUB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                      MODE: tl.constexpr, EVEN_K: tl.constexpr, PREFETCH: tl.constexpr,
                      HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr, RED_UNROLL: tl.constexpr):
        # x: [M, K]   qw: int32 [N, KW] (KW = Kp / 8)   s, m: fp16 [NG, N]   out: [M, N]
        # ws: fp32 [split * BLOCK_M * N] partials   cnt: int32 [N blocks] arrival counters (zero between calls)
        # MODE 0: FMA, per-group sums; 1: FMA on dequantized w; 2: dot W @ x^T; 3: dot x @ W^T
        SUB: tl.constexpr = 8 // NSUB                                     # nibbles per group in a tile
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                  # [BN]
        rows = tl.minimum(offs_n, N - 1)                                  # clamped: loads need no mask
        offs_j = tl.arange(0, P)                                          # [P] word of the tile
        offs_m = tl.arange(0, BLOCK_M)                                    # [BM]
        w_ptrs = qw_ptr + rows[:, None] * KW + offs_j[None, :]            # [BN, P]
        t_begin = pid_k * tiles_per_split
        t_end = tl.minimum(t_begin + tiles_per_split, n_tiles)
        # x rows past M repeat row M-1 (no masks); their results are never stored
        x0_ptr = x_ptr
        if MODE >= 2:
            xrows = tl.minimum(offs_m, M - 1) * stride_xm                 # [BM]
            if MODE == 2:
                accd = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            else:
                accd = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        else:
            acc0 = tl.zeros((BLOCK_N, P), dtype=tl.float32)
            cor0 = tl.zeros((BLOCK_N,), dtype=tl.float32)
            if BLOCK_M > 1:
                x1_ptr = x_ptr + tl.minimum(pid_n * 0 + 1, M - 1) * stride_xm
                acc1 = tl.zeros((BLOCK_N, P), dtype=tl.float32)
                cor1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
            if BLOCK_M > 2:
                x2_ptr = x_ptr + tl.minimum(pid_n * 0 + 2, M - 1) * stride_xm
                x3_ptr = x_ptr + tl.minimum(pid_n * 0 + 3, M - 1) * stride_xm
                acc2 = tl.zeros((BLOCK_N, P), dtype=tl.float32)
                cor2 = tl.zeros((BLOCK_N,), dtype=tl.float32)
                acc3 = tl.zeros((BLOCK_N, P), dtype=tl.float32)
                cor3 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if PREFETCH:
            w_next = tl.load(w_ptrs + t_begin * P)
        for t in range(t_begin, t_end):
            if PREFETCH:                                                  # issue the next tile's loads first
                w = w_next
                w_next = tl.load(w_ptrs + (t + 1) * P, mask=(offs_j * 0 + t + 1) < t_end, other=0)
            else:
                w = tl.load(w_ptrs + t * P)                               # [BN, P] int32
            k0 = t * (8 * P)
            for sg in tl.static_range(NSUB):                              # the groups of this tile
                g = tl.minimum((k0 + sg * SUB * P) >> G_SHIFT, NG - 1)    # (clamped: K padding, where x = 0)
                s = tl.load(s_ptr + g * N + rows).to(tl.float32)          # [BN]
                mn = tl.load(m_ptr + g * N + rows).to(tl.float32)
                if MODE == 0:
                    t0 = tl.zeros((BLOCK_N, P), dtype=tl.float32)
                    xs0 = tl.zeros((P,), dtype=tl.float32)
                    xe0 = tl.zeros((P,), dtype=tl.float32)
                    if BLOCK_M > 1:
                        t1 = tl.zeros((BLOCK_N, P), dtype=tl.float32)
                        xs1 = tl.zeros((P,), dtype=tl.float32)
                        xe1 = tl.zeros((P,), dtype=tl.float32)
                    if BLOCK_M > 2:
                        t2 = tl.zeros((BLOCK_N, P), dtype=tl.float32)
                        xs2 = tl.zeros((P,), dtype=tl.float32)
                        xe2 = tl.zeros((P,), dtype=tl.float32)
                        t3 = tl.zeros((BLOCK_N, P), dtype=tl.float32)
                        xs3 = tl.zeros((P,), dtype=tl.float32)
                        xe3 = tl.zeros((P,), dtype=tl.float32)
                    for ii in tl.static_range(SUB):
                        f = _nibble(w, sg * SUB + ii, MLO, MHI, EXP)  # [BN, P]
                        kx = k0 + (sg * SUB + ii) * P + offs_j            # [P] inputs of this nibble
                        c = 16.0 + 240.0 * ((sg * SUB + ii + 1) % 2)      # C of _nibble: 256 or 16
                        x0 = _xload(x0_ptr + kx, kx, K, EVEN_K).to(tl.float32)
                        e0 = x0 * c
                        t0 += f * e0[None, :]
                        xs0 += x0
                        xe0 += e0
                        if BLOCK_M > 1:
                            x1 = _xload(x1_ptr + kx, kx, K, EVEN_K).to(tl.float32)
                            e1 = x1 * c
                            t1 += f * e1[None, :]
                            xs1 += x1
                            xe1 += e1
                        if BLOCK_M > 2:
                            x2 = _xload(x2_ptr + kx, kx, K, EVEN_K).to(tl.float32)
                            e2 = x2 * c
                            t2 += f * e2[None, :]
                            xs2 += x2
                            xe2 += e2
                            x3 = _xload(x3_ptr + kx, kx, K, EVEN_K).to(tl.float32)
                            e3 = x3 * c
                            t3 += f * e3[None, :]
                            xs3 += x3
                            xe3 += e3
                    # sum_k x (q s + m) = s * (t - sum c x) + m * sum x over the group
                    acc0 += t0 * s[:, None]
                    cor0 += mn * tl.sum(xs0, axis=0) - s * tl.sum(xe0, axis=0)
                    if BLOCK_M > 1:
                        acc1 += t1 * s[:, None]
                        cor1 += mn * tl.sum(xs1, axis=0) - s * tl.sum(xe1, axis=0)
                    if BLOCK_M > 2:
                        acc2 += t2 * s[:, None]
                        cor2 += mn * tl.sum(xs2, axis=0) - s * tl.sum(xe2, axis=0)
                        acc3 += t3 * s[:, None]
                        cor3 += mn * tl.sum(xs3, axis=0) - s * tl.sum(xe3, axis=0)
                else:
                    s256 = s * 256.0
                    c256 = mn - s256
                    s16 = s * 16.0
                    c16 = mn - s16
                    for ii in tl.static_range(SUB):
                        f = _nibble(w, sg * SUB + ii, MLO, MHI, EXP)
                        if (sg * SUB + ii) % 2 == 0:                      # w = q * s + m = f * C s + (m - C s)
                            wv = f * s256[:, None] + c256[:, None]        # [BN, P]
                        else:
                            wv = f * s16[:, None] + c16[:, None]
                        kx = k0 + (sg * SUB + ii) * P + offs_j
                        if MODE == 1:
                            acc0 += wv * _xload(x0_ptr + kx, kx, K, EVEN_K).to(tl.float32)[None, :]
                            if BLOCK_M > 1:
                                acc1 += wv * _xload(x1_ptr + kx, kx, K, EVEN_K).to(tl.float32)[None, :]
                            if BLOCK_M > 2:
                                acc2 += wv * _xload(x2_ptr + kx, kx, K, EVEN_K).to(tl.float32)[None, :]
                                acc3 += wv * _xload(x3_ptr + kx, kx, K, EVEN_K).to(tl.float32)[None, :]
                        elif MODE == 2:
                            xt = _xload(x_ptr + xrows[None, :] + kx[:, None], kx[:, None], K, EVEN_K)   # [P, BM]
                            accd = tl.dot(wv.to(xt.dtype), xt, accd)
                        else:
                            xm = _xload(x_ptr + xrows[:, None] + kx[None, :], kx[None, :], K, EVEN_K)   # [BM, P]
                            accd = tl.dot(xm, tl.trans(wv.to(xm.dtype)), accd)
        # ---- result [BN, BM] ----
        if MODE == 2:
            res = accd
        elif MODE == 3:
            res = tl.trans(accd)
        else:
            r0 = tl.sum(acc0, axis=1) + cor0
            if BLOCK_M == 1:
                res = r0[:, None]
            else:
                res = tl.where(offs_m[None, :] == 0, r0[:, None], 0.0)
                res += tl.where(offs_m[None, :] == 1, (tl.sum(acc1, axis=1) + cor1)[:, None], 0.0)
                if BLOCK_M > 2:
                    res += tl.where(offs_m[None, :] == 2, (tl.sum(acc2, axis=1) + cor2)[:, None], 0.0)
                    res += tl.where(offs_m[None, :] == 3, (tl.sum(acc3, axis=1) + cor3)[:, None], 0.0)
        mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
        o_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
        n_split = tl.num_programs(1)
        if n_split == 1:
            if HAS_BIAS:
                res += tl.load(b_ptr + rows).to(tl.float32)[:, None]
            tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            # ws: ATOMIC: fp32 [BLOCK_M, N] sums, zero between calls; else fp32 [split, BLOCK_M, N] partials
            if ATOMIC:
                tl.atomic_add(ws_ptr + offs_m[None, :] * N + offs_n[:, None], res, mask=mask, sem="relaxed")
            else:
                tl.store(ws_ptr + (pid_k * BLOCK_M + offs_m[None, :]) * N + offs_n[:, None], res, mask=mask)
            tl.debug_barrier()                                            # all of this CTA's writes, then release
            arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == n_split - 1:                                    # the last slice of this block finishes
                if ATOMIC:
                    tot = tl.load(ws_ptr + offs_m[None, :] * N + offs_n[:, None], mask=mask, other=0.0,
                                  cache_modifier=".cg")
                    tl.store(ws_ptr + offs_m[None, :] * N + offs_n[:, None], tl.zeros_like(tot), mask=mask)
                else:                                                     # fixed order: deterministic
                    tot = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                    for s0 in range(0, n_split, RED_UNROLL):              # RED_UNROLL loads in flight at once
                        for u in tl.static_range(RED_UNROLL):
                            tot += tl.load(ws_ptr + ((s0 + u) * BLOCK_M + offs_m[None, :]) * N + offs_n[:, None],
                                           mask=mask & (offs_n[:, None] * 0 + (s0 + u) < n_split), other=0.0,
                                           cache_modifier=".cg")
                if HAS_BIAS:
                    tot += tl.load(b_ptr + rows).to(tl.float32)[:, None]
                tl.store(o_ptrs, tot.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(cnt_ptr + pid_n, 0)

    @triton.jit(do_not_specialize=["N", "G_SHIFT", "NG"])
    def _k_dequant_tiled(qw_ptr, s_ptr, m_ptr, out_ptr, N, K, KW, G_SHIFT, NG, P: tl.constexpr,
                         BLOCK_N: tl.constexpr):
        # qw: int32 [N, KW] tiled -> out: [N, K] in out's dtype, w = q * s + m
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        t = tl.program_id(1)
        rows = tl.minimum(offs_n, N - 1)
        offs_j = tl.arange(0, P)
        w = tl.load(qw_ptr + rows[:, None] * KW + t * P + offs_j[None, :])
        k0 = t * (8 * P)
        for i in tl.static_range(8):
            g = tl.minimum((k0 + i * P) >> G_SHIFT, NG - 1)
            s = tl.load(s_ptr + g * N + rows).to(tl.float32)
            mn = tl.load(m_ptr + g * N + rows).to(tl.float32)
            q = ((w >> (4 * i)) & 0xF).to(tl.float32)
            kx = k0 + i * P + offs_j
            tl.store(out_ptr + offs_n.to(tl.int64)[:, None] * K + kx[None, :],
                     (q * s[:, None] + mn[:, None]).to(out_ptr.dtype.element_ty),
                     mask=(offs_n < N)[:, None] & (kx < K)[None, :])


    # ---- mode "rows": whole-row chunks, no K split -----------------------------------------------------
    # One program owns BLOCK_N rows and walks K in chunks of CT tiles; per chunk it issues the loads of the
    # whole [BLOCK_N, CT, P] block of words at once (BLOCK_N x CT x P x 4 bytes, 16 KiB at 16 x 16 x 16),
    # so every SM has many independent 16-byte loads in flight and no loop-carried latency stands between
    # them; a row block whose K fits in one chunk is one load wave, one reduction and one store. No split-K
    # partials, counters or second pass: the launch is one kernel with N / BLOCK_N programs.
    # Per weight: half a shift, one lop3, one FMA (the nibble trick of `_nibble`); per (row, tile, group):
    # the scale and min; per chunk the x slices are loaded once and shared by all rows.

    @triton.jit
    def _rows_part(w, xp, kb, offs_j, s, mn, K, MLO, MHI, EXP, SG: tl.constexpr, SUB: tl.constexpr,
                   P: tl.constexpr, BLOCK_N: tl.constexpr, CT: tl.constexpr, EVEN: tl.constexpr):
        # sum over the chunk's tiles of x . w for one row of x, nibbles SG*SUB .. SG*SUB+SUB-1 (one group per
        # tile): [BLOCK_N]. kb: [CT] first input of each tile; s, mn: [BLOCK_N, CT] the group's scale and min.
        t = tl.zeros((BLOCK_N, CT, P), dtype=tl.float32)
        xs = tl.zeros((CT, P), dtype=tl.float32)
        xe = tl.zeros((CT, P), dtype=tl.float32)
        for ii in tl.static_range(SUB):
            f = _nibble(w, SG * SUB + ii, MLO, MHI, EXP)                  # [BN, CT, P] = 1 + q / C
            kx = kb[:, None] + (SG * SUB + ii) * P + offs_j[None, :]      # [CT, P]
            xv = _xload(xp + kx, kx, K, EVEN).to(tl.float32)
            e = xv * (16.0 + 240.0 * ((SG * SUB + ii + 1) % 2))           # C x
            t += f * e[None, :, :]
            xs += xv
            xe += e
        # sum_k x (q s + m) = s (sum f C x - sum C x) + m sum x, per (row, tile)
        tg = tl.sum(t, axis=2)                                            # [BN, CT]
        return tl.sum(s * (tg - tl.sum(xe, axis=1)[None, :]) + mn * tl.sum(xs, axis=1)[None, :], axis=1)

    @triton.jit(do_not_specialize=["M", "N", "G_SHIFT", "NG", "n_tiles", "stride_om", "MLO", "MHI", "EXP"])
    def _k_gemv_rows(x_ptr, qw_ptr, s_ptr, m_ptr, b_ptr, out_ptr,
                     M, N, K, KW, G_SHIFT, NG, n_tiles, stride_xm, stride_om, MLO, MHI, EXP,
                     P: tl.constexpr, NSUB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                     CT: tl.constexpr, EVEN: tl.constexpr, HAS_BIAS: tl.constexpr):
        # x: [M, K] (M <= 4)   qw: int32 [N, KW]   s, m: fp16 [NG, N]   out: [M, N]
        # EVEN: K == n_tiles * 8P and n_tiles % CT == 0 (no masks anywhere)
        SUB: tl.constexpr = 8 // NSUB
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.minimum(offs_n, N - 1)                                  # clamped: loads need no mask
        offs_t = tl.arange(0, CT)
        offs_j = tl.arange(0, P)
        w_ptrs = qw_ptr + rows.to(tl.int64)[:, None, None] * KW + (offs_t[:, None] * P + offs_j[None, :])[None, :, :]
        x1_ptr = x_ptr + tl.minimum(1, M - 1) * stride_xm                 # rows past M repeat row M-1
        x2_ptr = x_ptr + tl.minimum(2, M - 1) * stride_xm
        x3_ptr = x_ptr + tl.minimum(3, M - 1) * stride_xm
        r0 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        r1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        r2 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        r3 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for c in range(0, n_tiles, CT):
            tt = c + offs_t                                               # [CT] tiles of this chunk
            if EVEN:
                w = tl.load(w_ptrs + c * P, eviction_policy="evict_first")
            else:
                w = tl.load(w_ptrs + c * P, mask=(tt < n_tiles)[None, :, None], other=0,
                            eviction_policy="evict_first")                # [BN, CT, P]; w = 0 past the end:
            kb = tt * (8 * P)                                             # there x = 0 (kx >= K), adds nothing
            for sg in tl.static_range(NSUB):
                g = tl.minimum((kb + sg * SUB * P) >> G_SHIFT, NG - 1)    # [CT] group of each tile's part sg
                s = tl.load(s_ptr + g[None, :] * N + rows[:, None]).to(tl.float32)      # [BN, CT]
                mn = tl.load(m_ptr + g[None, :] * N + rows[:, None]).to(tl.float32)
                r0 += _rows_part(w, x_ptr, kb, offs_j, s, mn, K, MLO, MHI, EXP, sg, SUB, P, BLOCK_N, CT, EVEN)
                if BLOCK_M > 1:
                    r1 += _rows_part(w, x1_ptr, kb, offs_j, s, mn, K, MLO, MHI, EXP, sg, SUB, P, BLOCK_N, CT, EVEN)
                if BLOCK_M > 2:
                    r2 += _rows_part(w, x2_ptr, kb, offs_j, s, mn, K, MLO, MHI, EXP, sg, SUB, P, BLOCK_N, CT, EVEN)
                    r3 += _rows_part(w, x3_ptr, kb, offs_j, s, mn, K, MLO, MHI, EXP, sg, SUB, P, BLOCK_N, CT, EVEN)
        if HAS_BIAS:
            bias = tl.load(b_ptr + rows).to(tl.float32)
            r0 += bias
            r1 += bias
            r2 += bias
            r3 += bias
        n_ok = offs_n < N
        ty = out_ptr.dtype.element_ty
        tl.store(out_ptr + offs_n, r0.to(ty), mask=n_ok)
        if BLOCK_M > 1:
            tl.store(out_ptr + stride_om + offs_n, r1.to(ty), mask=n_ok & (offs_n * 0 + 1 < M))
        if BLOCK_M > 2:
            tl.store(out_ptr + 2 * stride_om + offs_n, r2.to(ty), mask=n_ok & (offs_n * 0 + 2 < M))
            tl.store(out_ptr + 3 * stride_om + offs_n, r3.to(ty), mask=n_ok & (offs_n * 0 + 3 < M))


def _tiled_kernels():
    if triton is None:
        raise RuntimeError("the int4 GEMV needs triton")
    return _k_gemv_tiled, _k_dequant_tiled


def tiled_groups(w) -> tuple[int, int]:
    """(groups per tile, log2 of the group size) of an `Int4Tiled` (per channel: 1 and 30)."""
    g, k, p = w.group_size, w.in_features, w.pack
    if g >= k:
        return 1, _PER_CHANNEL_SHIFT
    if g & (g - 1) or g % p:
        raise ValueError(f"group size {g} must be a power of two and a multiple of pack {p}")
    return max(1, 8 * p // g), g.bit_length() - 1


def plan_tiled(m: int, n: int, n_tiles: int, cfg: TiledConfig) -> tuple[tuple[int, int], int, int]:
    """(grid, tiles per K slice, BLOCK_M) of one call."""
    if cfg.mode not in TILED_MODES:
        raise ValueError(f"mode must be one of {', '.join(TILED_MODES)}, got {cfg.mode!r}")
    if cfg.mode in ("mma", "diag"):
        return (-(-n // (8 * cfg.num_warps)), 1), n_tiles, _next_pow2(m)
    if cfg.mode == "ksplit":
        return (-(-n // (16 * max(1, cfg.num_warps // max(1, cfg.chunk)))), 1), n_tiles, m
    if cfg.mode == "cuda":
        _check_cuda_config(cfg)
        if m != 1:
            raise ValueError(f"mode 'cuda' takes one row, got {m}")
        return (-(-n // cfg.block_n), 1), n_tiles, 1
    if cfg.mode.startswith("fma") or cfg.mode == "rows":
        block_m = _next_pow2(m)
        if block_m > 4:
            raise ValueError(f"mode {cfg.mode!r} takes at most 4 rows, got {m}")
    else:
        block_m = 16
        if m > 16:
            raise ValueError(f"mode {cfg.mode!r} takes at most 16 rows, got {m}")
    n_blocks = -(-n // cfg.block_n)
    if cfg.mode == "rows":
        if cfg.chunk < 1 or cfg.chunk & (cfg.chunk - 1):
            raise ValueError(f"chunk must be a power of two, got {cfg.chunk}")
        return (n_blocks, 1), n_tiles, block_m
    split = cfg.split if cfg.split > 0 else -(-cfg.target_programs // n_blocks)
    split = max(1, min(split, n_tiles))
    per = -(-n_tiles // split)
    return (n_blocks, -(-n_tiles // per)), per, block_m


_WORKSPACE: dict = {}


def _device_key(device) -> str:
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


def reserve_workspace(device, floats: int, counters: int, acc: int = 0
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The shared split-K workspace of `device`, grown to fit: fp32 partials (`floats`), zeroed int32
    arrival counters, and a zeroed fp32 accumulator (`acc`) for the atomic reduction.

    The kernels leave counters and accumulator at zero, and calls on one stream never overlap, so one
    workspace per device serves every weight. Callers reserve before any CUDA-graph capture
    (linear_int4 does at load): a graph keeps the addresses it saw, and capture must not allocate.
    """
    key = _device_key(device)
    ws, cnt, ac = _WORKSPACE.get(key, (None, None, None))
    if ws is None or ws.numel() < floats or cnt.numel() < counters or ac.numel() < acc:
        old = (ws, cnt, ac)
        floats = max(floats, ws.numel() if ws is not None else 0, 1 << 16)
        counters = max(counters, cnt.numel() if cnt is not None else 0, 1024)
        acc = max(acc, ac.numel() if ac is not None else 0, 1 << 12)
        ws = old[0] if old[0] is not None and old[0].numel() >= floats else \
            torch.empty(floats, dtype=torch.float32, device=device)
        cnt = old[1] if old[1] is not None and old[1].numel() >= counters else \
            torch.zeros(counters, dtype=torch.int32, device=device)
        ac = old[2] if old[2] is not None and old[2].numel() >= acc else \
            torch.zeros(acc, dtype=torch.float32, device=device)
        _WORKSPACE[key] = (ws, cnt, ac)
    return ws, cnt, ac


def tiled_workspace_need(m: int, n: int, n_tiles: int, cfg: TiledConfig) -> tuple[int, int, int]:
    """(fp32 partials, counters, fp32 accumulator) one call needs."""
    (n_blocks, split), _, block_m = plan_tiled(m, n, n_tiles, cfg)
    if split == 1:
        return 0, 0, 0
    return (0, n_blocks, block_m * n) if cfg.reduce == "atomic" else (split * block_m * n, n_blocks, 0)


def tiled_kernel_mode(cfg: TiledConfig, w) -> int:
    """The kernel's MODE for a config on a weight ("fma" turns into the dequantizing FMA past 4 groups a tile)."""
    mode = TILED_MODES[cfg.mode]
    return 1 if mode == 0 and tiled_groups(w)[0] > 4 else mode


def int4_gemv_tiled(x: torch.Tensor, w, bias: torch.Tensor | None = None,
                    cfg: TiledConfig | None = None) -> torch.Tensor:
    """y = x @ W.T (+ bias) for x: [M, K] (M <= 16), `w` an `int4_pack.Int4Tiled`; [M, N] in x.dtype."""
    m, k = x.shape
    n = w.qweight.shape[0]
    if k != w.in_features:
        raise ValueError(f"x has {k} columns, the weight {w.in_features}")
    if m == 0:
        return x.new_empty((0, n))
    cfg = cfg or tiled_config(m, n, k, w.group_size)
    if cfg.mode in CUDA_MODES:
        if cfg.mode == "cuda":
            _check_cuda_config(cfg)
        run = runnable_config(cfg, w, m, n, k, x.device, x.dtype)
        if run is cfg:
            if cfg.mode == "cuda":
                return int4_cuda.gemv(x, w, bias, rows_per_warp=cfg.block_n // cfg.num_warps,
                                      warps=cfg.num_warps, step_batch=cfg.chunk)
            if cfg.mode == "ksplit":
                return int4_cuda.gemv_ksplit(x, w, bias, ksplit=cfg.chunk, warps=cfg.num_warps, dequant=cfg.dequant,
                                             kblocks=cfg.kblocks, occupancy=cfg.occupancy)
            if cfg.mode == "diag":
                return int4_cuda.gemv_diag(x, w, bias, warps=cfg.num_warps, batch=cfg.chunk, ctas_per_sm=cfg.ctas,
                                           stages=cfg.num_stages if cfg.num_stages > 1 else 0)
            return int4_cuda.gemv_mma(x, w, bias, warps=cfg.num_warps, batch=cfg.chunk, ctas_per_sm=cfg.ctas)
        cfg = run
    if cfg.mode in ("dot", "dot_x") and (w.pack < 16 or x.dtype not in (torch.bfloat16, torch.float16)):
        raise ValueError(f"mode {cfg.mode!r} needs pack >= 16 and bf16/fp16 activations")
    nsub, g_shift = tiled_groups(w)
    grid, per, block_m = plan_tiled(m, n, w.n_tiles, cfg)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if cfg.mode == "rows":                         # one kernel, no K split, no workspace
        _tiled_kernels()                           # (says so when triton is missing)
        out = torch.empty((m, n), device=x.device, dtype=x.dtype)
        _k_gemv_rows[grid](x, w.qweight, w.scales, w.mins, bias if bias is not None else w.scales, out,
                           m, n, k, w.qweight.shape[1], g_shift, w.scales.shape[0], w.n_tiles, x.stride(0),
                           out.stride(0), 0x78000, 0x780000, 0x3F800000,
                           P=w.pack, NSUB=nsub, BLOCK_N=cfg.block_n, BLOCK_M=block_m, CT=cfg.chunk,
                           EVEN=k == w.n_tiles * 8 * w.pack and w.n_tiles % cfg.chunk == 0,
                           HAS_BIAS=bias is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return out
    atomic = cfg.reduce == "atomic"
    split = grid[1] > 1
    need = (block_m * n if atomic else grid[1] * block_m * n) if split else 0
    ws, cnt, acc = _WORKSPACE.get(_device_key(x.device), (None, None, None))
    if ws is None or (acc if atomic else ws).numel() < need or cnt.numel() < grid[0] * split:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            if ws is None:
                raise RuntimeError("int4_gemv_tiled: call reserve_workspace() before capturing a CUDA graph")
            grid, per = (grid[0], 1), w.n_tiles     # never allocate inside a capture: no K split then
        else:
            ws, cnt, acc = reserve_workspace(x.device, 0 if atomic else need, grid[0] * split, need if atomic else 0)
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    per_thread = cfg.block_n * block_m // (32 * cfg.num_warps)
    kern, _ = _tiled_kernels()
    kern[grid](x, w.qweight, w.scales, w.mins, bias if bias is not None else w.scales, out,
               acc if atomic else ws, cnt,
               m, n, k, w.qweight.shape[1], g_shift, w.scales.shape[0], w.n_tiles, per, x.stride(0), out.stride(0),
               0x78000, 0x780000, 0x3F800000,
               P=w.pack, NSUB=nsub, BLOCK_N=cfg.block_n, BLOCK_M=block_m, MODE=tiled_kernel_mode(cfg, w),
               EVEN_K=k % (8 * w.pack) == 0, PREFETCH=cfg.prefetch, HAS_BIAS=bias is not None, ATOMIC=atomic,
               RED_UNROLL=max(1, min(16, 32 // max(1, per_thread))),
               num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def _check_cuda_config(cfg: TiledConfig) -> None:
    if cfg.block_n < cfg.num_warps or cfg.block_n % cfg.num_warps:
        raise ValueError(f"mode 'cuda' needs block_n a multiple of num_warps, got {cfg.block_n} and {cfg.num_warps}")


def runnable_config(cfg: TiledConfig, w, m: int, n: int, k: int, device, dtype: torch.dtype) -> TiledConfig:
    """The config the dispatcher runs for `cfg` (the same object where it runs as is): a CUDA mode where its
    kernel runs here, else the shape class's Triton config (no NVRTC here, doctor says why, or not this
    shape), with `fma` for the tensor-core modes at <= 4 rows of fp32 activations."""
    if cfg.mode not in CUDA_MODES or cuda_mode_runs(cfg, w, m, device, dtype):
        return cfg
    cfg = class_config(m, n, k)
    if cfg.mode in ("dot", "dot_x") and dtype not in (torch.bfloat16, torch.float16) and m <= 4:
        cfg = replace(cfg, mode="fma")
    return cfg


def cuda_mode_runs(cfg: TiledConfig, w, m: int, device, dtype: torch.dtype) -> bool:
    """Whether a cuda/mma config runs its CUDA kernel for `m` rows of `dtype` on `device` (else the shape
    class's Triton config runs): NVRTC usable there, half activations, and the shape fits the GPU."""
    if cfg.mode not in CUDA_MODES or torch.device(device).type != "cuda" or \
            dtype not in (torch.bfloat16, torch.float16) or not int4_cuda.available(device):
        return False
    idx = int4_cuda.device_index(device)
    if cfg.mode == "ksplit":
        return int4_cuda.ksplit_fits(w, m, cfg.chunk, cfg.num_warps, idx, cfg.kblocks) is None
    fits = int4_cuda.cuda_fits if cfg.mode == "cuda" else int4_cuda.mma_fits
    return fits(w, m, idx) is None


def warm_up(w, rows: int, cfg: TiledConfig, with_bias: bool = False) -> None:
    """Run the GEMV on zeros for every binary a call of this rows bucket can need (bf16 and fp16, with a
    bias if the layer has one, and for the tensor-core kernels every rows variant of the bucket): this compiles
    the NVRTC kernels of modes cuda/mma/diag/ksplit and runs their self-test. linear_int4 calls it at load, as a CUDA-graph
    capture must neither compile nor synchronize."""
    if not (w.qweight.is_cuda and not torch.cuda.is_current_stream_capturing()):
        return
    if cfg.mode == "diag":        # one binary per power of two of rows: every one the bucket holds
        counts = {m for m in (1, 2, 4, 8, 16) if rows_bucket(m) == rows_bucket(rows)}
    elif cfg.mode == "ksplit":    # per power of two of rows, one binary for exactly that many and one for fewer
        counts = {m for m in (1, 2, 3, 4, 5, 8, 9, 16) if rows_bucket(m) == rows_bucket(rows)}
    else:                         # mma: one binary up to 8 rows, one past 8; cuda: one row
        counts = {rows, min(rows, 8)} if cfg.mode != "cuda" else {rows}
    with torch.cuda.device(w.qweight.device):      # (loading need not make the layer's GPU current)
        for dtype in (torch.bfloat16, torch.float16):
            for m in sorted(counts):
                x = torch.zeros(m, w.in_features, device=w.qweight.device, dtype=dtype)
                bias = torch.zeros(w.qweight.shape[0], device=x.device, dtype=dtype) if with_bias else None
                int4_gemv_tiled(x, w, bias, cfg)


def int4_dequantize_tiled(w, dtype: torch.dtype) -> torch.Tensor:
    """Dense [N, K] of `dtype` from an `Int4Tiled` on the GPU (the prefill path)."""
    n, k = w.shape
    out = torch.empty((n, k), device=w.qweight.device, dtype=dtype)
    _, g_shift = tiled_groups(w)
    block_n = 32 if w.pack == 16 else 16
    _, kern = _tiled_kernels()
    kern[(-(-n // block_n), w.n_tiles)](w.qweight, w.scales, w.mins, out, n, k, w.qweight.shape[1], g_shift,
                                        w.scales.shape[0], P=w.pack, BLOCK_N=block_n, num_warps=4)
    return out


# ---- launch configs by shape class ---------------------------------------------------------------
# scripts/int4_sweep.py measures the grid on the GPU and prints entries to paste here (docs/gpu.md).
# TUNED: exact shapes, (N, K, group, rows bucket) -> config; group is K for per-channel weights;
# rows bucket: 1, 4 (2..4 rows) or 16 (5..16 rows). All buckets of one shape must share `pack` (the
# layout is made once, at load, with the pack of the 1-row config).
TUNED: dict[tuple[int, int, int, int], TiledConfig] = {
    # measured on the H200 on 2026-12-02 (scripts/int4_sweep.py --quick; diag: SWEEP_DIAG_WIDE=1, device runs
    # 1-7 of the tenth session): us ours / bf16 / tinygemm, a range where several runs measured the config
    (102400, 2048, 128, 1): TiledConfig("diag", block_n=80, num_warps=10, chunk=4, ctas=2, pack=16),   # 40.4-41.8 / 117.5-129.7 / 61.8-64.4
    (102400, 2048, 128, 4): TiledConfig("diag", block_n=80, num_warps=10, num_stages=2, chunk=4, ctas=2, pack=16),   # 58.6 / 113.1 / 85.8 (cp.async ring; 66.8-71.4 without)
    # 5-16 rows: K split over blocks too (kblocks), 8 tiles a block, a warp a tile; measured on an H100 on 2026-12-06
    # (scripts/int4_ksplit_probe.py --rows 16|8|5 --kblocks ..., thirty-third session): us ours / bf16 / the config
    # before, at 16 rows, then at 8 (and 5) where measured
    (102400, 2048, 128, 16): TiledConfig("ksplit", block_n=128, num_warps=8, chunk=1, kblocks=4, occupancy=16, pack=16),   # 95.09 / 182.19 / 135.81 (dot_x); 8 rows 65.85 / 181.62 / 133.05
    (102400, 2048, 32, 16): TiledConfig("ksplit", block_n=128, num_warps=8, chunk=1, kblocks=8, occupancy=16, pack=16),   # 126.65 / 179.86 / 224.06 (dot_x; tinygemm 238.87); 8 rows 91.16 / 178.98 / 220.14 (tinygemm 144.05)
    (2048, 10944, 64, 16): TiledConfig("ksplit", block_n=128, num_warps=8, chunk=1, kblocks=43, pack=16),   # 17.88 / 21.33 / 37.34 (dot_x); 8 rows 12.58 / 20.94 / 35.51
    (4096, 4096, 128, 16): TiledConfig("ksplit", block_n=128, num_warps=8, chunk=1, kblocks=16, pack=16),   # 11.65 / 17.01 / 13.75; 8 rows 8.39 / 16.88 / 10.25; 5 rows 8.91 / 17.54 / 9.82
    (21888, 2048, 128, 16): TiledConfig("ksplit", block_n=128, num_warps=8, chunk=1, kblocks=8, pack=16),   # 25.13 / 37.03 / 34.30; 8 rows 15.97 / 37.64 / 22.89; 5 rows 16.52 / 36.24 / 22.62
    (10944, 2048, 128, 16): TiledConfig("ksplit", block_n=128, num_warps=8, chunk=1, kblocks=16, pack=16),   # 14.21 / 19.52 / 20.58
    (4096, 2048, 128, 16): TiledConfig("ksplit", block_n=128, num_warps=8, chunk=1, kblocks=16, pack=16),   # 7.25 / 8.71 / 8.20
    (2048, 2048, 128, 16): TiledConfig("ksplit", block_n=128, num_warps=8, chunk=1, kblocks=16, pack=16),   # 5.61 / 6.46 / 7.28; 8 rows 5.17 / 6.41 / 4.94
    (21888, 2048, 128, 4): TiledConfig("ksplit", block_n=128, num_warps=8, chunk=1, kblocks=8, occupancy=16, pack=16),   # 17.05 / 35.89 / 18.79
    # the dense down (K = 10944, groups of 64: two a step), measured on an H100 on 2026-12-06
    # (scripts/int4_ksplit_probe.py --group 64 [--rows 4], thirty-first session): us ours / bf16 / the config before;
    # since the thirty-second session the weights are scaled before the mma there (dequant, `--dequant`: us then /
    # bf16 / the same config without it, on another H100)
    (2048, 10944, 64, 1): TiledConfig("ksplit", block_n=16, num_warps=8, chunk=8, kblocks=8, pack=16),   # 13.28 / 20.28 / 13.13 (fma, pack 32); 11.87 / 20.74 / 13.46; K over 8 blocks (thirty-third session) 11.38 / 20.69 / 12.09
    (2048, 10944, 64, 4): TiledConfig("ksplit", block_n=16, num_warps=32, chunk=32, pack=16),   # 15.87 / 20.76 / 34.25 (dot_x); 14.67 / 20.70 / 16.16
    # groups of 32 (the GGUF Q4_0 / Q4_K repack) with the weights scaled before the mma (dequant), measured on an
    # H100 on 2026-12-06 (scripts/int4_ksplit_probe.py --group 32 --dequant, thirty-second session): us ours / bf16 /
    # tinygemm (which runs at groups of 32 elsewhere)
    (2048, 2048, 32, 1): TiledConfig("ksplit", block_n=16, num_warps=16, chunk=16, pack=16),   # 3.97 / 6.35 / 4.32
    # the lm_head at groups of 32, four rows, measured on an H100 on 2026-12-06 (scripts/int4_ksplit_probe.py
    # --group 32 --rows 4 --shapes 102400x2048, thirty-fourth session): us ours / bf16 / tinygemm (the config before:
    # us); one row of it is SMALL_GROUPS_WIDE's (the class)
    (102400, 2048, 32, 4): TiledConfig("ksplit", block_n=32, num_warps=8, chunk=4, occupancy=16, pack=16),   # 88.58-89.27 / 168.45 / 91.51-92.25 (dot_x 209.96)
    # one row, K split (ksplit): measured on the H200 on 2026-12-04 (scripts/int4_ksplit_probe.py, twentieth
    # session, device run 1): us ours / bf16 / tinygemm (the config before: us)
    (21888, 2048, 128, 1): TiledConfig("ksplit", block_n=16, num_warps=8, chunk=8, pack=16),   # 12.11 / 25.40 / 15.28 (diag 12.63)
    (10944, 2048, 128, 1): TiledConfig("ksplit", block_n=16, num_warps=8, chunk=8, pack=16),   # 7.57 / 14.35 / 8.95 (diag 8.29)
    (7168, 2048, 128, 1): TiledConfig("ksplit", block_n=16, num_warps=8, chunk=8, pack=16),   # 5.69 / 10.51 / 7.01 (diag 7.10)
    (4096, 4096, 128, 1): TiledConfig("ksplit", block_n=16, num_warps=16, chunk=16, pack=16),   # 6.32 / 13.47 / 6.97 (rows 8.12)
    (4096, 2048, 128, 1): TiledConfig("ksplit", block_n=16, num_warps=8, chunk=8, pack=16),   # 4.23 / 7.29 / 4.47 (cuda 5.05)
    (3072, 2048, 128, 1): TiledConfig("ksplit", block_n=16, num_warps=8, chunk=8, pack=16),   # 4.07 / 6.53 / 4.00 (rows 4.53)
    (2048, 2048, 128, 1): TiledConfig("ksplit", block_n=16, num_warps=8, chunk=8, pack=16),   # 3.36 / 6.09 / 3.78 (rows 3.88)
    # four rows (device run 2)
    (4096, 2048, 128, 4): TiledConfig("ksplit", block_n=32, num_warps=32, chunk=16, pack=16),   # 5.24 / 7.32 / 5.82 (dot_x 12.77)
    (2048, 2048, 128, 4): TiledConfig("ksplit", block_n=16, num_warps=16, chunk=16, pack=16),   # 4.12 / 6.19 / 4.77 (dot_x 6.33)
    # (16 rows, device run 5, before the thirty-third session's entries above, H200: 4096 x 2048 7.87 / 7.50, 4096 x
    # 4096 13.21 / 13.72, 10944 x 2048 19.15 / 15.18, 21888 x 2048 33.36 / 27.84, 2048 x 2048 7.19 / 6.15)
    (3072, 2048, 2048, 1): TiledConfig("rows", block_n=8, num_warps=4, pack=16),   # 4.5 / 6.6 / rejects per-channel
}

# Shape classes: (largest bf16 size of the weight in MB, {rows bucket: config}); the first that holds it.
# Only Triton modes here: the CUDA modes (cuda, mma, diag) fall back to these where NVRTC is missing.
# One row, K <= 4096 and <= 70 MB: `rows` (it won every such shape measured on 2026-12-02); past that K it
# was not measured, and with no K split a tall-K matrix gets few programs: the split-K `fma` stays there.
ROWS_CLASS = TiledConfig("rows", block_n=8, num_warps=4, pack=16)
ROWS_CLASS_MAX_K = 4096
ROWS_CLASS_MAX_MB = 70.0
CLASS_CONFIGS: list[tuple[float, dict[int, TiledConfig]]] = [
    (24.0, {1: TiledConfig("fma", block_n=64, num_warps=4, num_stages=1, target_programs=1056, pack=16),
            4: TiledConfig("dot_x", block_n=64, num_warps=4, num_stages=1, target_programs=1056, pack=16),
            16: TiledConfig("dot_x", block_n=64, num_warps=4, num_stages=1, target_programs=1056, pack=16)}),
    (70.0, {1: TiledConfig("fma", block_n=128, num_warps=4, num_stages=1, target_programs=1056, pack=16),
            4: TiledConfig("dot_x", block_n=128, num_warps=4, num_stages=1, target_programs=1056, pack=16),
            16: TiledConfig("dot_x", block_n=128, num_warps=4, num_stages=1, target_programs=1056, pack=16)}),
    (float("inf"), {1: TiledConfig("fma", block_n=256, num_warps=4, num_stages=1, target_programs=1056, pack=16),
                    4: TiledConfig("dot_x", block_n=128, num_warps=4, num_stages=1, target_programs=528, pack=16),
                    16: TiledConfig("dot_x", block_n=128, num_warps=4, num_stages=1, target_programs=528, pack=16)}),
]

# The CUDA class: the tensor-core kernel `diag` won every measured one- and four-row shape from 45 MB of
# bf16 up (10944, 21888 and 102400 rows of 2048 inputs; the 4-row config was measured on the lm_head
# only; since the eleventh session with a 2-deep cp.async ring, 58.6 vs 66.8-71.4 us); it falls back to the Triton class above where NVRTC is missing, and needs groups of >= 128.
# Taller K was not measured with it (a longer super-step loop), so it holds to K <= 2048.
CUDA_CLASS = {1: TiledConfig("diag", block_n=80, num_warps=10, chunk=4, ctas=2, pack=16),
              4: TiledConfig("diag", block_n=80, num_warps=10, num_stages=2, chunk=4, ctas=2, pack=16)}
CUDA_CLASS_MIN_MB = 40.0
CUDA_CLASS_MAX_K = 2048
# 1-16 rows below that: the K-split kernel (ksplit). At one row it beat rows, cuda, diag and tinygemm
# on every measured shape from 8 to 90 MB of bf16 but 3072 x 2048 (a tie with tinygemm) (twentieth session:
# 2048 to 21888 rows of 2048 inputs, 4096 x 4096, 1536 x 7168, 7168 x 1536; not the 420 MB lm_head, where
# diag stays 3% faster); at four rows it beat dot_x, diag and tinygemm on all three shapes measured (2048,
# 4096, 21888 x 2048); at 8 and 16 rows it beat dot_x and tinygemm on every shape measured (2048 and 4096
# x 2048, 4096 x 4096, 10944 and 21888 x 2048; 2048 x 2048 at 16 rows: 7.19 against dot_x's 7.02 us). The
# class config gives each warp two 128-input steps of a 16-row tile (K split = steps / 2), one tile a
# block at 1-4 rows; KSPLIT_CLASS_MAX_MB and KSPLIT_CLASS_MAX_K bound where it was measured and where a
# block stays within 32 warps.
# 5-16 rows (thirty-third session, H100): K split over blocks too (`kblocks`), 8 tiles a block and a warp a
# tile, so x is staged once for 128 rows of the weight and a block stages only its own steps. Staging all of
# x in every block of one or two tiles had cost more than the weights' loads (16 rows of 4096 inputs are
# 128 KiB, staged by each of 128 blocks). One step a warp up to 16 steps (K <= 2048), two past that, and no
# more blocks over K than leave KSPLIT_PARTS_MAX_BYTES of fp32 parts at 16 rows (the parts go through the L2;
# the lm_head's 102400 rows: 4 blocks). It beat the configs before on every shape measured, by 1.13-2.2x at
# 16 rows (the dense down 37.3 -> 17.9 us; groups of 32 on 4096 x 4096 30.5 -> 14.0, tinygemm 23.0), and at
# 8 rows everywhere but 2048 x 2048 (5.17 against 4.94 us): docs/gpu.md "The K split over blocks".
KSPLIT_CLASS_MAX_MB = 100.0
KSPLIT_CLASS_MAX_K = 8192
KSPLIT_MIN_GROUP = 32       # the smallest group it takes (4 a step: the GGUF Q4_0 / Q4_K repack's)
KSPLIT_PARTS_MAX_BYTES = 32e6


def ksplit_class_config(k: int, bucket: int = 1, n: int = 0, group: int | None = None) -> TiledConfig:
    """The K-split config of the class for an [N, K] weight of `group` and a rows bucket: at 1-4 rows two
    128-input steps a warp and one 16-row tile a block; at 5-16 rows K over blocks too, 8 tiles a block, one step
    a warp up to 16 steps and two past that, no more blocks over K than KSPLIT_PARTS_MAX_BYTES of parts allow
    (`n` rows; where that leaves more than 4 steps a warp, the warps of a tile split them), and with several groups
    a step (the weights scaled before the mma) 16 warps an SM (128 registers a thread: it measured faster there)."""
    steps = -(-k // 128)
    if bucket == 16:
        kb = steps if steps <= 16 else -(-steps // 2)
        if n:
            kb = max(1, min(kb, int(KSPLIT_PARTS_MAX_BYTES // (16 * n * 4))))
        spb = -(-steps // kb)                        # steps a block
        ks = min(32, -(-spb // 4))                   # (past 4 steps a warp, the tile's warps split them)
        tiles = max(1, min(8, 32 // ks))
        several = group is not None and group < min(k, 128)
        return TiledConfig("ksplit", block_n=16 * tiles, num_warps=ks * tiles, chunk=ks, kblocks=kb,
                           occupancy=16 if several else 32, pack=16)
    ks = max(1, min(32, steps // 2))
    return TiledConfig("ksplit", block_n=16, num_warps=ks, chunk=ks, pack=16)

# With groups below this size tinygemm runs at 1-4 rows where it can (bf16, K % 128 == 0): measured on an
# H100 on 2026-12-06 (scripts/int4_ksplit_probe.py --group 32 [--rows 4|16], thirty-first session), us of the
# best K-split config against tinygemm's at groups of 32: one row 2048 x 2048 4.59 / 4.37, 3072 x 2048 5.88 /
# 4.81, 4096 x 4096 10.29 / 8.00, 10944 x 2048 12.56 / 10.85; four rows 2048 x 2048 5.71 / 4.46, 4096 x 4096
# 11.47 / 10.11; 16 rows 2048 x 2048 8.37 / 7.88 (dot_x 10.47), 4096 x 4096 21.22 / 22.99 (dot_x 30.35; the
# K-split config there needs 128 registers a thread, which the class does not give it). Groups of 64 on
# 2048 x 2048: one row 3.89 / 3.94, 16 rows 7.69 / 7.45. The 102400 x 2048 lm_head at groups of 32
# (`python -m ktinject.bench_gpu --only int4`): 1 row tinygemm 78.2 against fma's 86.7, 4 rows 91.3 / 216.3 (dot_x),
# 16 rows 238.3 / 222.5 (dot_x). Since the thirty-third session the K split over blocks takes 5-16 rows: at 16
# rows 2048 x 2048 6.45-6.79 against tinygemm's 7.87, 4096 x 4096 14.01 / 22.98, the lm_head 126.65 / 238.87 (at 8
# rows 5.84-5.89 / 5.48, 91.16 / 144.05: tinygemm wins 2048 x 2048 at 8 rows only).
# Since the thirty-fourth session the wide lm_heads (K = 2048) at groups of 32 run the K split at one row: 4 warps a
# tile at 16 warps an SM (128 registers a thread) measured 17% faster than tinygemm on both measured (H100,
# scripts/int4_ksplit_probe.py --group 32: 102400 x 2048 64.43 against 77.71 us, fma before 85.44, bf16 168.03;
# 151936 x 2048 92.26 against 128.93, fma 111.09, bf16 244.90), and on 21888 x 2048 a tie (18.76 against 18.84 us),
# so the class starts at SMALL_GROUPS_WIDE_MIN_MB; K = 7168 (DeepSeek-V3's 129280 x 7168) lost (407.7 against 328.6).
TINYGEMM_SMALL_GROUPS = 128
TINYGEMM_SMALL_GROUPS_16_ROWS_MAX_MB = 70.0   # (without the CUDA kernels: the lm_head's 420 MB ran dot_x at 16 rows)
SMALL_GROUPS_WIDE = TiledConfig("ksplit", block_n=16, num_warps=4, chunk=4, occupancy=16, pack=16)   # (one row)
SMALL_GROUPS_WIDE_MIN_MB = 400.0   # bf16 MB of [N, K]
SMALL_GROUPS_WIDE_MAX_K = 2048

# Where torch's tinygemm measured faster than ours: exact shape (N, K) or shape class (CLASS_CONFIGS'
# first column) -> rows buckets; there `linear_int4` (backend auto) keeps a tinygemm copy and runs it.
TINYGEMM_FASTER: dict = {   # measured on the H200 on 2026-12-02 (same sweeps); 1-16 rows: 2026-12-04
    (3072, 2048): {4},           # (H200, four rows: 5.33 us against ksplit's 5.38; one row was a tie, 3.99-4.03 against
                                 # 4.05-4.07, until the nibble pairs' single LOP3: 3.98-4.05 against 4.12 on an H100, 2026-12-07)
    24.0: {1, 4}, 70.0: {1},     # classes: tinygemm won every measured shape of <= 40 MB at one row before the
}                                # K split; where the CUDA class holds a config (ksplit, diag) that runs instead


def tinygemm_buckets(n: int, k: int, group: int | None = None, cuda_ok: bool = True) -> set:
    """Rows buckets in which tinygemm runs for an [N, K] weight of `group` under backend auto (small groups first,
    then the exact shape, then its class). A class entry does not cover a bucket the CUDA class takes (the tensor-core kernel beat tinygemm
    there) unless the CUDA kernels cannot run (`cuda_ok` False: no NVRTC, KTINJECT_INT4_CUDA=0, ...). With groups
    smaller than TINYGEMM_SMALL_GROUPS (the GGUF Q4_0 / Q4_K repack's 32) tinygemm takes 1-4 rows but no bucket
    TUNED holds and not one row of a wide lm_head (`small_groups_wide`): it beat ours there on every other shape
    measured (where it cannot run, the K-split kernel does);
    5-16 rows go to the K split over blocks. Without the CUDA kernels (their Triton fallbacks run) it takes every
    bucket, 5-16 rows up to 70 MB of bf16 (past that dot_x measured faster)."""
    if group is not None and group < k and group < TINYGEMM_SMALL_GROUPS:
        if not cuda_ok:
            return {1, 4, 16} if n * k * 2 / 1e6 <= TINYGEMM_SMALL_GROUPS_16_ROWS_MAX_MB else {1, 4}
        return {b for b in (1, 4) if (n, k, group, b) not in TUNED   # (a tuned small-group entry beat it)
                and not (b == 1 and small_groups_wide(n, k, group))}
    hit = TINYGEMM_FASTER.get((n, k))
    if hit is not None:                              # (without the CUDA kernels the class entry stands beside it)
        return set(hit) | (set() if cuda_ok else set(TINYGEMM_FASTER.get(shape_class(n, k), ())))
    return {b for b in TINYGEMM_FASTER.get(shape_class(n, k), ())
            if not (cuda_ok and cuda_class_config(b, n, k, group) is not None)}


def small_groups_wide(n: int, k: int, group: int | None) -> bool:
    """Whether one row of an [N, K] weight of `group` takes SMALL_GROUPS_WIDE: groups of 32 (four a 128-input step)
    on a wide matrix of K <= 2048 (an lm_head), where it beat tinygemm."""
    return (group is not None and KSPLIT_MIN_GROUP <= group < min(k, 64) and k <= SMALL_GROUPS_WIDE_MAX_K
            and n * k * 2 / 1e6 >= SMALL_GROUPS_WIDE_MIN_MB)


def rows_bucket(m: int) -> int:
    return 1 if m <= 1 else 4 if m <= 4 else 16


def shape_class(n: int, k: int) -> float:
    mb = n * k * 2 / 1e6
    return next(limit for limit, _ in CLASS_CONFIGS if mb <= limit)


def class_config(m: int, n: int, k: int) -> TiledConfig:
    """The Triton config of the shape class of [N, K] for `m` rows (`rows` for one row where it measured best)."""
    limit = shape_class(n, k)
    if rows_bucket(m) == 1 and limit <= ROWS_CLASS_MAX_MB and k <= ROWS_CLASS_MAX_K:
        return ROWS_CLASS
    return next(c for lim, c in CLASS_CONFIGS if lim == limit)[rows_bucket(m)]


def cuda_class_config(m: int, n: int, k: int, group: int | None = None) -> TiledConfig | None:
    """The CUDA-kernel config of the shape class of [N, K] for `m` rows, or None (then the Triton class):
    None too where the kernel refuses the group (ksplit: below 32; diag: below a tile, 8 x pack inputs). 5-16 rows:
    the K split over blocks on any shape (a block stages x for its own few steps only)."""
    bucket = rows_bucket(m)
    if bucket == 1 and small_groups_wide(n, k, group):
        return SMALL_GROUPS_WIDE
    if bucket == 16 or (k <= KSPLIT_CLASS_MAX_K and n * k * 2 / 1e6 <= KSPLIT_CLASS_MAX_MB):
        cfg = ksplit_class_config(k, bucket, n, group)   # (pack 16: groups of 32 and 64 too, several a step)
        return cfg if group is None or group >= min(k, KSPLIT_MIN_GROUP) else None
    if k <= CUDA_CLASS_MAX_K and n * k * 2 / 1e6 >= CUDA_CLASS_MIN_MB:
        cfg = CUDA_CLASS.get(rows_bucket(m))
        if cfg is not None and (group is None or group >= min(k, 8 * cfg.pack)):
            return cfg
    return None


def tiled_config(m: int, n: int, k: int, group: int) -> TiledConfig:
    """The launch config for `m` rows on an [N, K] weight: the exact tuned shape, else its class (the CUDA
    class where it holds one; where the CUDA kernels cannot run, the dispatcher takes the Triton class)."""
    return TUNED.get((n, k, group, rows_bucket(m))) or cuda_class_config(m, n, k, group) or class_config(m, n, k)


def tiled_pack(n: int, k: int, group: int) -> int:
    """The P to lay a weight out with: what its single-row config was tuned for, if the group allows it."""
    p = tiled_config(1, n, k, group).pack
    while p > 8 and group < k and group % p:
        p //= 2
    return p
