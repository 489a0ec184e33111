"""Decode GEMV of `linear_fp8`: y = (x @ W.T) * scale (+ bias) with W float8_e4m3fn [N, K] read as is.

Why a GEMV next to `torch._scaled_mm`: at decode (1-16 rows) the scaled matmul needs the activations in
fp8 too, so every call quantizes them per token first (an amax, a divide, a cast: several small
kernels), and cuBLASLt's fp8 GEMM wants 16-aligned rows; measured 0.33-0.8x of a bf16 linear on the
H200 (docs/gpu.md). This kernel keeps x in its own dtype and converts the weight instead: every e4m3
value is exact in bf16, fp16 and fp32, so the only rounding is the weight's own (no activation
quantization), and each weight byte is read once, half the bytes of a bf16 weight.

* One row (mode `ROW`): a program owns BLOCK_N rows and walks K in BLOCK_K steps; per step a
  [BLOCK_N, BLOCK_K] tile of fp8 (16-byte loads along K) is widened to fp32 and multiplied with the
  x slice, summed along K at the end of the row.
* 2-16 rows (mode `DOT`): the widened tile goes to `tl.dot` against x (rows padded to 16), in x's
  dtype (fp32 x: IEEE fp32 dot).

The per-row scale (block scales folded at load, see linear_fp8) and the bias are applied once at the end.
A program reads whole rows, or with K split (`split_k`, `linear_fp8`'s `gemv_split_k`; by default
`launch_config` decides from the shape) one slice of them: the slices add fp32 partials with atomics, then
one cast, so the last bits of a split launch's result vary run to run (the order of the additions).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

MAX_M = 16
MAX_SPLIT = 16
ROW, DOT = 0, 1                  # kernel modes: one row; up to 16 rows by tl.dot


class Launch(NamedTuple):
    """One launch of the GEMV: the mode, the program's tile (BLOCK_M x BLOCK_N rows of W x BLOCK_K), warps,
    software-pipeline stages, and the K split (slices of whole BLOCK_K steps)."""
    mode: int
    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    split: int


@functools.lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def fp8_gemv(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, K_PER, stride_xm, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr,
                 HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, ATOMIC: tl.constexpr):
        # x: [M, K] bf16/fp16/fp32   w: fp8 e4m3 [N, K]   s: fp32 [N]   b: [N] in x's dtype
        # y: [M, N] in x's dtype, or (ATOMIC: K split) fp32 zeros that each K slice of K_PER inputs adds into
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k_lo = tl.program_id(1) * K_PER
        k_hi = tl.minimum(k_lo + K_PER, K)
        n_mask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        offs_m = tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        w_rows = w_ptr + tl.where(n_mask, offs_n, 0).to(tl.int64)[:, None] * K      # [BN, 1] (rows past N: row 0)
        if MODE == 1:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        else:
            acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            kk = k0 + offs_k
            if EVEN_K:
                w = tl.load(w_rows + kk[None, :], eviction_policy="evict_first")
            else:
                w = tl.load(w_rows + kk[None, :], mask=(kk < K)[None, :], other=0.0, eviction_policy="evict_first")
            if MODE == 0:
                x = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)           # [BK]
                acc2 += w.to(tl.float32) * x[None, :]
            else:
                x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
                            mask=m_mask[:, None] & (kk < K)[None, :], other=0.0)            # [BM, BK]
                if x.dtype == tl.float32:
                    acc += tl.dot(x, tl.trans(w.to(tl.float32)), input_precision="ieee")
                else:
                    acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        scale = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)
        if MODE == 1:
            y = acc * scale[None, :]
        else:
            y = (tl.sum(acc2, axis=1) * scale)[None, :]                                  # [1, BN]
        if HAS_BIAS:
            b = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            y += tl.where(tl.program_id(1) == 0, b, 0.0) if ATOMIC else b
        out_m = offs_m if MODE != 0 else tl.arange(0, 1)
        out_mask = (out_m < M)[:, None] & n_mask[None, :]
        if ATOMIC:
            tl.atomic_add(y_ptr + out_m[:, None] * stride_ym + offs_n[None, :], y, mask=out_mask, sem="relaxed")
        else:
            tl.store(y_ptr + out_m[:, None] * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty), mask=out_mask)

    return fp8_gemv


def launch_config(m: int, n: int, k: int, split_k: int = 0) -> Launch:
    """The launch for `m` rows of an [N, K] weight; `split_k` 0 picks the K split, 1-16 fixes it. From a sweep
    over DeepSeek-V3's fp8 shapes on the H200 (scripts/fp8_sweep.py; docs/gpu.md has the table):

    * One row: a program owns BLOCK_N rows, BLOCK_N shrinking from 16 until the grid has >= ~256 programs
      where it can. Full programs read 16 x 512 fp8 a step (a [16, 512] fp32 partial: 32 registers a thread
      over 8 warps). Where BLOCK_N had to shrink (N < 4096) the step grows to 1024 instead, to keep as many
      bytes in flight (kv_a_proj 576 x 7168: 8.6 -> 5.4 us; splitting K instead reached 6.3). Rows of
      K >= 16384 split K in 4 (o_proj 7168 x 16384: 48.7 -> 38.8 us: the grid's last wave was ragged).
    * 2-16 rows: tl.dot on 32 rows x 256 a step (rows padded to 16), K split in 4 where K >= 6144 (every
      shape of K 7168 or 16384 gained from it; those of K <= 4096 lost). Shrinking to 16 rows for a bigger
      grid, the first rule, was 1.5-2.3x slower; multiply-adds instead of tl.dot (2-8 rows) never won."""
    if m == 1:
        block_n = 16
        while block_n > 2 and -(-n // block_n) < 256:
            block_n //= 2
        block_k = 1024 if block_n < 16 and k >= 1024 else 512 if k >= 512 else 256
        split = split_k or (4 if k >= 16384 else 1)
        return Launch(ROW, 1, block_n, block_k, 8 if block_n * block_k >= 8192 or block_k > 512 else 4, 3, split)
    block_k = 256 if k >= 256 else 128
    return Launch(DOT, 16, 32, block_k, 4, 3, split_k or (4 if k >= 6144 else 1))


def slices(lc: Launch, k: int) -> tuple[int, int]:
    """(K values a slice, slices) of launch `lc` over K: whole BLOCK_K steps a slice, the last maybe shorter,
    so a split of K into fewer steps than asked for takes fewer slices."""
    k_per = -(-k // (lc.split * lc.block_k)) * lc.block_k
    return k_per, -(-k // k_per)


def split_note(n: int, k: int, split_k: int = 0, max_rows: int = MAX_M) -> str:
    """Where launches of an [N, K] weight split K (for `linear_fp8`'s repr), "" where none does: such
    results are not bit-reproducible, the slices' fp32 atomics adding in any order."""
    one, more = (slices(launch_config(m, n, k, split_k), k)[1] for m in (1, 2))
    parts = []
    if one > 1:
        parts.append(f"{one} at one row")
    if more > 1 and max_rows > 1:
        parts.append(f"{more} at 2-{max_rows} rows" if max_rows > 2 else f"{more} at 2 rows")
    return f"K slices {', '.join(parts)} (fp32 atomics: the last bits vary run to run)" if parts else ""


def fp8_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
             split_k: int = 0, launch: Launch | None = None) -> torch.Tensor:
    """y = (x @ w.float().T) * scale (+ bias) for x [M <= 16, K] bf16/fp16/fp32, w float8_e4m3fn [N, K], scale
    fp32 [N]; [M, N] in x's dtype. split_k > 1 splits K into that many slices of whole blocks, each adding its
    partial into an fp32 buffer (more programs for a small N; the order of the additions varies run to run);
    0 lets `launch_config` choose. `launch` overrides the whole launch (benchmark sweeps)."""
    m, k = x.shape
    n = w.shape[0]
    if w.dtype != torch.float8_e4m3fn or w.shape[1] != k or not w.is_contiguous():
        raise ValueError(f"w must be a contiguous float8_e4m3fn [N, {k}], got {w.dtype} {list(w.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    if not 1 <= m <= MAX_M:
        raise ValueError(f"the fp8 GEMV takes 1 to {MAX_M} rows, got {m}")
    if scale.shape != (n,) or scale.dtype != torch.float32 or not scale.is_contiguous():
        raise ValueError(f"scale must be a contiguous fp32 [{n}], got {scale.dtype} {list(scale.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {list(bias.shape)}")
    if len({x.device, w.device, scale.device} | ({bias.device} if bias is not None else set())) != 1:
        raise ValueError("x, the weight, its scales and the bias must be on one device")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if not 0 <= split_k <= MAX_SPLIT:
        raise ValueError(f"split_k must be 0 (auto) or 1 to {MAX_SPLIT}, got {split_k}")
    lc = launch or launch_config(m, n, k, split_k)
    if lc.mode not in (ROW, DOT) or lc.block_m < m or (lc.mode == ROW) != (lc.block_m == 1) \
            or not 1 <= lc.split <= MAX_SPLIT:
        raise ValueError(f"launch {lc} does not fit {m} rows")
    if any(v < 1 or v & (v - 1) for v in (lc.block_m, lc.block_n, lc.block_k, lc.warps)) or lc.stages < 1:
        raise ValueError(f"launch {lc}: blocks and warps must be powers of two, stages >= 1")
    bias = bias.to(x.dtype).contiguous() if bias is not None else None
    k_per, split = slices(lc, k)
    y = torch.zeros((m, n), device=x.device, dtype=torch.float32) if split > 1 else \
        torch.empty((m, n), device=x.device, dtype=x.dtype)
    _kernel()[(-(-n // lc.block_n), split)](x, w, scale, bias if bias is not None else scale, y, m, n, k, k_per,
                                            x.stride(0), y.stride(0), BLOCK_M=lc.block_m, BLOCK_N=lc.block_n,
                                            BLOCK_K=lc.block_k, MODE=lc.mode, HAS_BIAS=bias is not None,
                                            EVEN_K=k % lc.block_k == 0, ATOMIC=split > 1, num_warps=lc.warps,
                                            num_stages=lc.stages)
    return y.to(x.dtype) if split > 1 else y
