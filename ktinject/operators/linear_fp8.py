"""`linear_fp8`: FP8 (e4m3) weight linear through Hopper's scaled matmul.

Weights come from DeepSeek-V3-style FP8 safetensors (`weight`: float8_e4m3fn [N, K] plus
`weight_scale_inv`: fp32 [ceil(N/B), ceil(K/B)], one scale per B x B block, B = 128) or from any
dense weight. They are stored as e4m3 with one fp32 scale per output channel (block scales
are folded in at load: dequantize, then requantize per row), because row-wise scaling is the
form `torch._scaled_mm` runs on every Hopper build; activations are quantized per token at
run time. Paths (in `extra_repr`): on CUDA devices of compute capability >= 8.9 with Triton, up to
`gemv_max_batch` rows take `kernels/fp8_triton.fp8_gemv` (the weight widened in the kernel, x kept
in its dtype: no per-token activation quantization; measured faster than `scaled_mm` at 1-16 rows
on every shape timed, docs/gpu.md) and more rows `scaled_mm`; elsewhere `torch` (dequantize +
matmul), so CI checks the math on the CPU. `backend` forces one of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import LoadError, WeightError
from ..weights import as_dense
from .base import BuildContext, Operator
from .kernels import triton_available
from .registry import register

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BACKENDS = ("auto", "scaled_mm", "gemv", "torch")


@dataclass(frozen=True)
class Fp8Options:
    block_size: int = 128           # block edge of `weight_scale_inv` in FP8 checkpoints
    backend: str = "auto"           # auto: on sm_89+ gemv up to gemv_max_batch rows, scaled_mm above; else torch
    gemv_max_batch: int = 16        # auto / gemv: rows up to which the fp8 GEMV runs (1-16)
    gemv_split_k: int = 0           # the GEMV's K slices: 0 by the shape (fp8_triton.launch_config), 1-16 fixed

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not 1 <= self.gemv_max_batch <= 16:
            raise ValueError(f"gemv_max_batch must be 1 to 16, got {self.gemv_max_batch}")
        if not 0 <= self.gemv_split_k <= 16:
            raise ValueError(f"gemv_split_k must be 0 (by the shape) or 1 to 16, got {self.gemv_split_k}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")


def dequantize_blockwise(w: torch.Tensor, scale_inv: torch.Tensor, block: int) -> torch.Tensor:
    """w: fp8 [N, K], scale_inv: [ceil(N/B), ceil(K/B)] -> fp32 [N, K]."""
    n, k = w.shape
    s = scale_inv.float().repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return w.float() * s


def quantize_rowwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32/bf16 [N, K] -> (fp8 [N, K], fp32 scale [N]) with w ~= q * scale[:, None]."""
    amax = w.float().abs().amax(dim=1).clamp(min=1e-12)
    scale = amax / FP8_MAX
    return (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def _scaled_mm_ok(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


@register("linear_fp8")
class Fp8Linear(Operator):
    Options = Fp8Options
    replaces = ("Linear",)
    device_types = ("cuda", "cpu")
    summary = "FP8 e4m3 weight linear (torch._scaled_mm or an fp8 GEMV, row-wise scales; torch fallback math)"
    _kernels_on_cpu = False         # tests: run the Triton GEMV on CPU tensors (TRITON_INTERPRET=1)

    def __init__(self, in_features: int, out_features: int, bias: bool, options: Fp8Options,
                 device: torch.device, dtype: Optional[torch.dtype]):
        super().__init__()
        self.in_features, self.out_features, self.options = in_features, out_features, options
        self.target_device, self.compute_dtype = torch.device(device), dtype
        # weight: fp8 [N, K]   weight_scale: fp32 [N]
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8, device="meta"))
        self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32, device="meta"))
        self.register_buffer("bias", torch.empty(out_features, device="meta") if bias else None)

    @classmethod
    def build(cls, original: nn.Module, ctx: BuildContext) -> nn.Module:
        return cls(original.in_features, original.out_features, original.bias is not None, ctx.options,
                   ctx.device, ctx.dtype)

    @classmethod
    def planned_bytes(cls, original: nn.Module, ctx: BuildContext) -> dict[str, int]:
        n, k = original.out_features, original.in_features
        return {str(ctx.device): n * k + 4 * n + (2 * n if original.bias is not None else 0)}

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, scale_inv=None,
                    options: Fp8Options = Fp8Options(), device: Any = "cpu",
                    dtype: Optional[torch.dtype] = None) -> "Fp8Linear":
        n, k = weight.shape
        mod = cls(k, n, bias is not None, options, torch.device(device), dtype)
        src = {"weight": weight}
        if scale_inv is not None:
            src["weight_scale_inv"] = scale_inv
        if bias is not None:
            src["bias"] = bias
        mod.load_weights("", src)
        return mod

    def load_weights(self, prefix: str, source: Mapping[str, Any]) -> set[str]:
        key, skey = prefix + "weight", prefix + "weight_scale_inv"
        if key not in source:
            raise LoadError("tensor not found in the weights", missing=[key])
        w = source[key]
        if tuple(int(s) for s in w.shape) != (self.out_features, self.in_features):
            raise LoadError("tensor shape differs from the model",
                            mismatched=[f"{key} (file {list(w.shape)}, model {[self.out_features, self.in_features]})"])
        used = {key}
        dev = self.target_device
        if isinstance(w, torch.Tensor) and w.dtype == FP8:
            if skey not in source:
                raise WeightError("an FP8 weight needs its block scales", tensor=skey)
            s = as_dense(source[skey], torch.float32, dev)
            b = self.options.block_size
            want = (-(-self.out_features // b), -(-self.in_features // b))
            if tuple(s.shape) != want:
                raise WeightError(f"scale shape {list(s.shape)} does not match {list(want)} blocks of {b}",
                                  tensor=skey)
            dense = dequantize_blockwise(w.to(dev), s, b)
            used.add(skey)
        else:
            dense = as_dense(w, torch.float32, dev)
        self.weight, self.weight_scale = quantize_rowwise(dense)
        bkey = prefix + "bias"
        if self.bias is not None:
            if bkey not in source:
                raise LoadError("tensor not found in the weights", missing=[bkey])
            self.bias = as_dense(source[bkey], self.compute_dtype or torch.float32, dev)
            used.add(bkey)
        return used

    def path(self, rows: int = 1) -> str:
        """The path a call with `rows` rows takes: gemv, scaled_mm or torch."""
        backend, dev = self.options.backend, self.weight.device
        if backend == "torch":
            return "torch"
        if backend in ("auto", "gemv") and rows <= self.options.gemv_max_batch \
                and (_scaled_mm_ok(dev) or (backend == "gemv" and self._kernels_on_cpu)) and triton_available():
            return "gemv"
        if backend == "scaled_mm" or _scaled_mm_ok(dev):
            return "scaled_mm"
        return "torch"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)                                # [M, K]
        bias = self.bias.to(x2.dtype) if self.bias is not None else None
        path = self.path(x2.shape[0])
        if x2.shape[0] == 0:
            y = x2.new_empty((0, self.out_features))
        elif path == "gemv":
            from .kernels.fp8_triton import fp8_gemv
            y = fp8_gemv(x2, self.weight, self.weight_scale, bias, split_k=self.options.gemv_split_k)
        elif path == "scaled_mm":
            m = x2.shape[0]
            if m % 16:                  # cuBLASLt FP8 wants 16-aligned leading dimensions
                x2 = F.pad(x2, (0, 0, 0, 16 - m % 16))
            amax = x2.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
            sa = amax / FP8_MAX                                             # [M, 1]
            xq = (x2.float() / sa).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            out_dtype = x2.dtype if x2.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
            y = torch._scaled_mm(xq, self.weight.t(), scale_a=sa, scale_b=self.weight_scale.view(1, -1),
                                 out_dtype=out_dtype)
            y = y[:m].to(x.dtype)
            if bias is not None:
                y = y + bias
        else:
            w = (self.weight.float() * self.weight_scale[:, None]).to(x2.dtype)
            y = F.linear(x2, w, bias)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"op=linear_fp8, in={self.in_features}, out={self.out_features}, scales=per-channel "
                f"(blocks of {self.options.block_size} folded at load), bias={self.bias is not None}, "
                f"path={self._paths_label()}")

    def _paths_label(self) -> str:
        one, past = self.path(1), self.path(self.options.gemv_max_batch + 1)
        label = one if one == past else f"{one} at <= {self.options.gemv_max_batch} rows, {past} above"
        if one == "gemv":
            from .kernels.fp8_triton import split_note
            note = split_note(self.out_features, self.in_features, self.options.gemv_split_k, self.options.gemv_max_batch)
            label += f"; gemv {note}" if note else ""
        return label
