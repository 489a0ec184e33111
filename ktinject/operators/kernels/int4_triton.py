"""Triton split-K GEMV for the 4-bit format of `int4_pack` (decode batch sizes, M <= 16).

One program owns BLOCK_N output rows of W and one K slice. Per step it loads a
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
from dataclasses import dataclass

import torch

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
