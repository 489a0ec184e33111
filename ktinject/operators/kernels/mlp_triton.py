"""The shared-expert SiLU MLP in three kernels (the `moe` operator's fused shared experts).

transformers' `DeepseekV2MLP` and kin are five kernels per call (gate_proj, up_proj, silu, mul,
down_proj), and at decode each is mostly launch latency. Here gate_proj's and up_proj's weights
are stored as one `[2I, D]` tensor (the two Parameters become views of its halves: no second copy,
state-dict names unchanged), so the call is one GEMM into `[T, 2I]`, `silu_mul` (one Triton kernel:
`silu(gate) * up`) and down_proj.

`silu_mul` keeps both roundings of the original: `silu` in float32 (libdevice's exp, IEEE
division: what torch's CUDA kernel computes) rounded to the activation dtype, times `up` rounded
again; given the same gate and up it is bit-identical. The one GEMM may sum in another order than
the two (cuBLAS picks its kernel by shape), which can move gate or up by an ulp.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import nn

from ...errors import ModelError
from . import tl_dtype
from .router_triton import FLOAT_DTYPES, precise_math

MLP_CLASSES = ("DeepseekV2MLP", "DeepseekV3MLP", "Qwen2MoeMLP", "Qwen3MoeMLP")
SILU_CLASSES = ("SiLUActivation", "SiLU")
BLOCK = 1024


@functools.lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def silu_mul(x_ptr, out_ptr, I, stride_x, stride_out,
                 BLOCK: tl.constexpr, DTYPE: tl.constexpr, PRECISE: tl.constexpr):
        # x: [T, 2I] = [gate | up]   out: [T, I] = silu(gate) * up, both in DTYPE
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < I
        g = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * stride_x + I + offs, mask=ok, other=0.0).to(tl.float32)
        if PRECISE:
            e = libdevice.exp(-g)
        else:                                   # Triton's interpreter has no libdevice
            e = tl.exp(-g)
        a = tl.math.div_rn(g, 1.0 + e).to(DTYPE).to(tl.float32)        # the original's act_fn(gate)
        tl.store(out_ptr + row * stride_out + offs, (a * u).to(DTYPE), mask=ok)

    return silu_mul


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[..., :I]) * x[..., I:]` for x [..., 2I] (bf16/f16/f32, last dim contiguous): one
    launch, no host synchronisation."""
    if x.shape[-1] % 2 or x.dtype not in FLOAT_DTYPES:
        raise ModelError(f"silu_mul: needs [..., 2I] bf16/f16/f32 input, got {list(x.shape)} {x.dtype}")
    I = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * I)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], I), dtype=x.dtype, device=x.device)
    if rows.shape[0] and I:
        import triton
        _kernel()[(rows.shape[0], triton.cdiv(I, BLOCK))](rows, out, I, rows.stride(0), out.stride(0), BLOCK=BLOCK,
                                                         DTYPE=tl_dtype(x.dtype), PRECISE=precise_math(),
                                                         num_warps=4)
    return out.view(*x.shape[:-1], I)


def fusable_mlp(mlp: nn.Module, device: Optional[torch.device] = None) -> Optional[str]:
    """Why `mlp` cannot take the fused path (None: it can): a known SiLU MLP class whose gate_proj
    and up_proj are plain bias-free `nn.Linear`s with frozen weights of one float dtype and shape
    on one device (`device`, when given). Anything else (quantized linears, a bias, another
    activation) keeps its forward."""
    if type(mlp).__name__ not in MLP_CLASSES:
        return f"{type(mlp).__name__} is not one of {', '.join(MLP_CLASSES)}"
    gate, up = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
    if type(gate) is not nn.Linear or type(up) is not nn.Linear:
        return "gate_proj/up_proj are not plain nn.Linear"
    if gate.bias is not None or up.bias is not None:
        return "gate_proj/up_proj have a bias"
    if type(getattr(mlp, "act_fn", None)).__name__ not in SILU_CLASSES:
        return f"act_fn is {type(getattr(mlp, 'act_fn', None)).__name__}, not SiLU"
    g, u = gate.weight, up.weight
    if g.shape != u.shape or g.dtype != u.dtype or g.device != u.device or g.dtype not in FLOAT_DTYPES:
        return (f"gate_proj {list(g.shape)} {g.dtype} {g.device} and up_proj {list(u.shape)} {u.dtype} "
                f"{u.device} differ or are not float")
    if g.is_meta or g.requires_grad or u.requires_grad:
        return "weights not loaded or requiring grad"
    if device is not None and g.device != device:
        return f"weights on {g.device}, not {device}"
    return None


def gate_up_views(mlp: nn.Module, gate_up: Optional[torch.Tensor]) -> bool:
    """True while gate_proj.weight and up_proj.weight are still the two halves of `gate_up` (a
    module `.to()` copies Parameters one by one and breaks that)."""
    if gate_up is None or fusable_mlp(mlp) is not None:
        return False
    g, u = mlp.gate_proj.weight, mlp.up_proj.weight
    return (g.device == gate_up.device and g.dtype == gate_up.dtype and g.is_contiguous() and u.is_contiguous()
            and g.data_ptr() == gate_up.data_ptr()
            and u.data_ptr() == gate_up.data_ptr() + g.numel() * g.element_size()
            and gate_up.shape == (2 * g.shape[0], g.shape[1]))


def fuse_gate_up(mlp: nn.Module, device: Optional[torch.device] = None) -> Optional[torch.Tensor]:
    """Store gate_proj's and up_proj's weights as one [2I, D] tensor (gate first) and make the two
    Parameters views of its halves; returns it (None when `fusable_mlp` says no). Allocates: call
    it before a CUDA graph capture, never during one."""
    if fusable_mlp(mlp, device) is not None:
        return None
    g, u = mlp.gate_proj.weight, mlp.up_proj.weight
    # normal tensors even when the first call comes from generation's inference mode (as the
    # weights loaded outside it are), so later calls outside inference mode can use them
    with torch.inference_mode(False), torch.no_grad():
        gate_up = torch.cat([g, u])
        rows = g.shape[0]
        mlp.gate_proj.weight = nn.Parameter(gate_up[:rows], requires_grad=False)
        mlp.up_proj.weight = nn.Parameter(gate_up[rows:], requires_grad=False)
    return gate_up


def fused_mlp(mlp: nn.Module, gate_up: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`mlp(x)` as down_proj(silu_mul(x @ gate_up^T)): three kernels instead of five."""
    return mlp.down_proj(silu_mul(torch.nn.functional.linear(x, gate_up)))
