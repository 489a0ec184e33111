"""The softmax top-k MoE router in two Triton kernels (the `moe` operator's fused router).

transformers' routers are six or so kernels per layer at decode: DeepSeek-V2's casts the hidden
state to float32, runs a float32 cuBLAS GEMV (two kernels), softmax, topk and a multiply by
`routed_scaling_factor`; Qwen's and Mixtral's add a sum and a division. A decode step is
launch-bound (a few microseconds per kernel, almost no work), so this does the same math in two:

* `router_logits`: `h @ W^T` accumulated in float32, one program per (token, block of experts),
  the logits stored in the original's logits dtype (float32 for DeepSeek, the hidden dtype for
  Qwen and Mixtral: their rounding is kept). Past `GEMV_MAX_TOKENS` tokens every token re-reading
  W costs more than a GEMM, so the logits come from the original's own `F.linear` instead.
* `router_topk`: one program per token: float32 softmax over all experts, top-k by k rounds of
  max/argmax over the row in registers (ids in descending weight; ties go to the lowest id),
  optionally the k weights divided by their sum, times a scale; ids int64 [T, k] and weights
  [T, k] in the original's dtype.

`router_spec` says whether a router module computes exactly "softmax over all experts -> top-k ->
optional renorm -> optional scale" (DeepSeek-V2 `greedy`, Qwen2/Qwen3-MoE, Mixtral, whose top-k
of the logits then softmax over the k equals softmax -> top-k -> renorm); anything else (grouped
routing, DeepSeek-V3's sigmoid with a correction bias, unknown classes) gets None and keeps its
own forward. Results equal the originals up to the order of float32 sums (a few float32 ulps in
the weights; ids equal unless two experts' scores are that close).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional

import torch

from ...errors import ModelError
from . import tl_dtype

GEMV_MAX_TOKENS = 32        # more tokens: logits by cuBLAS (W read once per tile, not once per token)
MAX_TOP_K = 16              # k rounds are unrolled in the kernel
MAX_EXPERTS = 4096          # one program holds a token's scores in registers
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class RouterSpec:
    """What a supported router computes, read off the module once (see `router_spec`)."""
    weight: torch.Tensor = field(compare=False, repr=False)   # [E, D], the module's own Parameter
    top_k: int
    renorm: bool                # the k weights divided by their sum
    scale: float                # then multiplied by this (1.0: unchanged, exactly)
    logits_fp32: bool           # logits = h.float() @ W.float() (DeepSeek); else F.linear(h, W) in h's dtype
    weights_fp32: bool          # weights returned float32 (DeepSeek, Mixtral); else in the logits' dtype (Qwen)


def router_spec(module: torch.nn.Module) -> Optional[RouterSpec]:
    """The spec of a softmax top-k router, or None when `module` routes any other way (it then runs
    its own forward). Exact class names only: a subclass may have changed the math."""
    kind = type(module).__name__
    weight = getattr(module, "weight", None)
    top_k = getattr(module, "top_k", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not isinstance(top_k, int):
        return None
    if kind == "DeepseekV2TopkRouter":
        scale = getattr(module, "routed_scaling_factor", None)
        if getattr(module, "topk_method", None) != "greedy" or not isinstance(scale, (int, float)):
            return None                                               # group_limited_greedy masks groups
        spec = RouterSpec(weight, top_k, False, float(scale), True, True)
    elif kind in ("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter") and hasattr(module, "norm_topk_prob"):
        spec = RouterSpec(weight, top_k, bool(module.norm_topk_prob), 1.0, False, False)
    elif kind == "MixtralTopKRouter":
        spec = RouterSpec(weight, top_k, True, 1.0, False, True)
    else:
        return None
    if not 1 <= top_k <= min(MAX_TOP_K, weight.shape[0]) or weight.shape[0] > MAX_EXPERTS:
        return None
    return spec


@functools.lru_cache(maxsize=1)
def _kernels():
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def router_logits(h_ptr, w_ptr, out_ptr, E, D, stride_ht, stride_hd, stride_we, stride_wd,
                      BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, LOGIT_DTYPE: tl.constexpr):
        # h: [T, D]   w: [E, D]   out: [T, E] in LOGIT_DTYPE (contiguous)
        t = tl.program_id(0).to(tl.int64)
        offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
        e_ok = offs_e < E
        acc = tl.zeros((BLOCK_E, BLOCK_D), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            d_ok = offs_d < D
            x = tl.load(h_ptr + t * stride_ht + offs_d * stride_hd, mask=d_ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + offs_e[:, None] * stride_we + offs_d[None, :] * stride_wd,
                        mask=e_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            acc += w * x[None, :]
        tl.store(out_ptr + t * E + offs_e, tl.sum(acc, axis=1).to(LOGIT_DTYPE), mask=e_ok)

    @triton.jit
    def router_topk(logits_ptr, ids_ptr, weights_ptr, E, stride_lt, scale,
                    TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORM: tl.constexpr,
                    OUT_DTYPE: tl.constexpr, PRECISE: tl.constexpr):
        # logits: [T, E] (rows stride_lt apart)   ids: int64 [T, TOP_K]   weights: [T, TOP_K] OUT_DTYPE
        t = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_E)
        ok = offs < E
        x = tl.load(logits_ptr + t * stride_lt + offs, mask=ok, other=float("-inf")).to(tl.float32)
        # tl.exp is ex2.approx on float32 (several ulps), libdevice's expf what torch's kernels call;
        # Triton's interpreter has no libdevice (nor closures: no helper function here)
        if PRECISE:
            e = libdevice.exp(x - tl.max(x, axis=0))
        else:
            e = tl.exp(x - tl.max(x, axis=0))
        e = tl.where(ok, e, 0.0)
        p = tl.where(ok, tl.math.div_rn(e, tl.sum(e, axis=0)), -1.0)      # padding never wins
        ks = tl.arange(0, BLOCK_K)
        top_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
        top_i = tl.zeros((BLOCK_K,), dtype=tl.int64)
        for j in tl.static_range(TOP_K):
            best, idx = tl.max(p, axis=0, return_indices=True, return_indices_tie_break_left=True)
            top_w = tl.where(ks == j, best, top_w)
            top_i = tl.where(ks == j, idx.to(tl.int64), top_i)
            p = tl.where(offs == idx, -1.0, p)
        if RENORM:
            top_w = tl.math.div_rn(top_w, tl.sum(top_w, axis=0))             # padded lanes hold 0
        top_w = top_w * scale
        k_ok = ks < TOP_K
        tl.store(ids_ptr + t * TOP_K + ks, top_i, mask=k_ok)
        tl.store(weights_ptr + t * TOP_K + ks, top_w.to(OUT_DTYPE), mask=k_ok)

    return router_logits, router_topk


def precise_math() -> bool:
    """libdevice's accurate exp (what torch's kernels use) unless running in Triton's interpreter."""
    import triton
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return not knobs.runtime.interpret
    import os
    return os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on", "yes")


def fused_route(h: torch.Tensor, spec: RouterSpec, name: str = "router") -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k weights [T, k], expert ids int64 [T, k]) of hidden states `h` [T, D], as the router
    `spec` was read from computes them (ids in descending weight). Two kernel launches, no host
    synchronisation: CUDA-graph capturable once compiled (the first call compiles)."""
    import triton
    w = spec.weight
    E, D = w.shape
    if h.dim() != 2 or h.shape[1] != D:
        raise ModelError(f"{name}: hidden states of shape {list(h.shape)} do not fit the router weight "
                         f"{list(w.shape)} (expected [tokens, {D}])")
    if h.dtype not in FLOAT_DTYPES or w.dtype not in FLOAT_DTYPES:
        raise ModelError(f"{name}: the fused router takes bf16/f16/f32 hidden states and weights, "
                         f"got {h.dtype} and {w.dtype}")
    if not spec.logits_fp32 and h.dtype != w.dtype:
        raise ModelError(f"{name}: hidden states are {h.dtype} but the router weight is {w.dtype} "
                         f"(the router computes its logits in the hidden dtype)")
    if h.device != w.device:
        raise ModelError(f"{name}: hidden states on {h.device}, router weight on {w.device}")
    T, k = h.shape[0], spec.top_k
    logit_dtype = torch.float32 if spec.logits_fp32 else h.dtype
    ids = torch.empty((T, k), dtype=torch.int64, device=h.device)
    weights = torch.empty((T, k), dtype=torch.float32 if spec.weights_fp32 else logit_dtype, device=h.device)
    if T == 0:
        return weights, ids
    gemv, topk = _kernels()
    if T <= GEMV_MAX_TOKENS:
        logits = torch.empty((T, E), dtype=logit_dtype, device=h.device)
        # about 128 programs at one token (64 experts: one row of W each), up to 16 experts per program
        block_e = min(16, triton.next_power_of_2(E), triton.next_power_of_2(triton.cdiv(T * E, 128)))
        block_d = min(triton.next_power_of_2(D), max(64, 4096 // block_e))
        gemv[(T, triton.cdiv(E, block_e))](h, w, logits, E, D, h.stride(0), h.stride(1), w.stride(0), w.stride(1),
                                           BLOCK_E=block_e, BLOCK_D=block_d, LOGIT_DTYPE=tl_dtype(logit_dtype),
                                           num_warps=4)
    elif spec.logits_fp32:                       # DeepSeek: F.linear(h.float(), W.float()), as the original
        logits = torch.nn.functional.linear(h.float(), w.float())
    else:
        logits = torch.nn.functional.linear(h, w)
    block = triton.next_power_of_2(E)
    topk[(T,)](logits, ids, weights, E, logits.stride(0), float(spec.scale),
               TOP_K=k, BLOCK_E=block, BLOCK_K=triton.next_power_of_2(k), RENORM=spec.renorm,
               OUT_DTYPE=tl_dtype(weights.dtype), PRECISE=precise_math(),
               num_warps=1 if block <= 512 else 4)
    return weights, ids
