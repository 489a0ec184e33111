"""`rms_norm`: the families' RMSNorm in one GPU kernel.

transformers' `*RMSNorm.forward` is six or seven elementwise and reduction kernels (to float32,
pow, mean, add, rsqrt, mul, back to the input dtype, times the weight). A decode step of a MoE
model runs a hundred norms or more (two per layer, plus MLA's latent norms and Qwen3's per-head
q/k norms), and at batch 1 every one of those kernels is a few microseconds of launch and
latency with almost no work: on the lent H200 the V2-Lite hybrid step ran 2461 kernels, ~570 of
them inside norms (scripts/profile_decode.py --torch-profile). This operator does the same math
in one Triton kernel per call (one program per row) on CUDA, and the reference torch code
elsewhere:

    y = weight * (x.float() * rsqrt(mean(x.float()^2, -1) + eps)).to(x.dtype)

Both roundings of the original are kept (to the input dtype, then the product in the result
dtype), so results equal transformers' up to the order of the float32 sum of squares (within
two ulps of the output dtype where that order moves a rounding). It replaces the RMSNorm classes
of the five families (and Llama's), with `eps` read from the module.

On sm_90+ the kernel lets the kernel after it start early (`gdc_launch_dependents` first thing;
not with `KTINJECT_INT4_PDL` "sum" or "off"): a decoder layer's projections follow its norms, and
`linear_int4`'s one-row K split, captured right after it in a CUDA graph, then loads its weights
while the norm runs (kernels/pdl.py; q_proj 3.79 -> 3.12 us on an H100).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from .base import BuildContext, Operator
from .kernels import tl_dtype, triton_available
from .kernels.pdl import note_release_of, triton_gdc_launch_dependents, triton_release
from .registry import register

RMS_NORM_CLASSES = ("DeepseekV2RMSNorm", "DeepseekV3RMSNorm", "Qwen2MoeRMSNorm", "Qwen3MoeRMSNorm",
                    "MixtralRMSNorm", "LlamaRMSNorm")
BACKENDS = ("auto", "triton", "torch")
MAX_TRITON_COLS = 65536              # one program holds a row: wider rows use the torch path


@dataclass(frozen=True)
class RMSNormOptions:
    backend: str = "auto"            # auto: Triton on CUDA when installed, else torch; triton: insist

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r} is not one of {', '.join(BACKENDS)}")


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm math: float32 statistics, rounded to x's dtype, times the weight."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


@functools.lru_cache(maxsize=1)
def _triton_kernel():
    import triton
    import triton.language as tl

    gdc_launch_dependents = triton_gdc_launch_dependents()   # (a no-op where Triton has none: RELEASE is never set)

    @triton.jit
    def rms_norm_rows(x_ptr, w_ptr, out_ptr, stride_x, stride_out, cols, eps,
                      BLOCK: tl.constexpr, X_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr, RELEASE: tl.constexpr):
        if RELEASE:                                  # the next kernel (a projection) may launch now (kernels/pdl.py)
            gdc_launch_dependents()
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < cols
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        var = tl.sum(x * x, axis=0) / cols
        y = (x * tl.rsqrt(var + eps)).to(X_DTYPE).to(tl.float32)          # the original's first rounding
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_out + offs, (w * y).to(OUT_DTYPE), mask=mask)
    return rms_norm_rows


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The same math in one Triton kernel (CUDA tensors; bf16/f16/f32; rows of up to 65536)."""
    cols = x.shape[-1]
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    rows = x.reshape(-1, cols)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    if rows.shape[0]:
        import triton
        block = triton.next_power_of_2(cols)
        release = triton_release(x.device)
        k = _triton_kernel()[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), cols, float(eps),
                                                BLOCK=block, X_DTYPE=tl_dtype(x.dtype), OUT_DTYPE=tl_dtype(out_dtype),
                                                RELEASE=release,
                                                num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16)
        if release:
            note_release_of(k)
    return out.view(*x.shape[:-1], cols)


@register("rms_norm")
class RMSNorm(Operator):
    Options = RMSNormOptions
    replaces = RMS_NORM_CLASSES
    device_types = ("cpu", "cuda")
    summary = "RMSNorm in one kernel (Triton on CUDA; transformers' math and roundings)"

    def __init__(self, hidden: int, eps: float, device: torch.device, dtype: torch.dtype,
                 options: RMSNormOptions, name: str = ""):
        super().__init__()
        self.hidden, self.eps, self.options, self.name = hidden, float(eps), options, name
        self.device, self.dtype = device, dtype
        self.weight = nn.Parameter(torch.empty(hidden, device="meta", dtype=dtype), requires_grad=False)

    @classmethod
    def build(cls, original: nn.Module, ctx: BuildContext) -> nn.Module:
        from ..errors import ModelError
        weight = getattr(original, "weight", None)
        eps = getattr(original, "variance_epsilon", getattr(original, "eps", None))
        if weight is None or weight.dim() != 1 or eps is None:
            raise ModelError(f"{ctx.name}: rms_norm needs a module with a 1-D `weight` and an epsilon "
                             f"(`variance_epsilon` or `eps`); {type(original).__name__} has "
                             f"{'no weight' if weight is None else f'weight {list(weight.shape)}'}")
        opts = ctx.options or RMSNormOptions()
        if opts.backend == "triton" and not triton_available():
            raise ModelError(f"{ctx.name}: rms_norm backend triton, but Triton is not installed")
        return cls(weight.shape[0], eps, ctx.device, ctx.dtype or weight.dtype, opts, ctx.name)

    def load_weights(self, prefix: str, source: Mapping[str, Any]) -> set[str]:
        from ..load import fetch_dense
        self.weight = nn.Parameter(fetch_dense(source, prefix + "weight", (self.hidden,), self.dtype, self.device),
                                   requires_grad=False)
        return {prefix + "weight"}

    def uses_triton(self, x: torch.Tensor) -> bool:
        b = self.options.backend
        return (b != "torch" and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
                and x.shape[-1] <= MAX_TRITON_COLS and triton_available())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., hidden] on the weight's device -> same shape, dtype promote(weight, x) as the original
        if x.shape[-1] != self.hidden:
            from ..errors import ModelError
            raise ModelError(f"{self.name or 'rms_norm'}: input has {x.shape[-1]} features, the norm {self.hidden}")
        if self.uses_triton(x):
            return rms_norm_triton(x, self.weight, self.eps)
        if self.options.backend == "triton":              # asked for the kernel: never the torch code silently
            from ..errors import ModelError
            raise ModelError(f"{self.name or 'rms_norm'}: backend triton, but the input is a {x.dtype} tensor "
                             f"on {x.device} with {x.shape[-1]} features (the kernel takes CUDA bf16/f16/f32 "
                             f"rows of up to {MAX_TRITON_COLS})")
        return rms_norm_reference(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"op=rms_norm, hidden={self.hidden}, eps={self.eps:g}, backend={self.options.backend}"
