"""`linear_int4`: 4-bit weight-only linear for bf16/fp16 activations.

Weights (format in `kernels/int4_pack.py`) come from GGUF Q4_0 / Q4_K blocks by exact repack
(32-wide groups), or from any other source (Q8_0, BF16, F16, safetensors) through `as_dense`
and a min-max requantization with group size 128, 64, 32, ... or per channel.

Paths, chosen per call by the number of rows and recorded in `extra_repr` (so in the plan):

* `tinygemm` (CUDA, bf16 activations, rows <= `gemv_max_batch`, K % 128 == 0, group 32..256):
  torch's own int4 kernel (`aten._weight_int4pack_mm`) on a copy of the weight repacked to
  its layout at load (about 2x faster than our Triton GEMV on the H200, see docs/gpu.md; costs
  a second int4 copy of the weight);
* `gemv` (CUDA, rows <= `gemv_max_batch`, at most 16, where tinygemm cannot run, e.g.
  K = 10944): the Triton split-K GEMV of `kernels/int4_triton.py`;
* `dequant+matmul` (CUDA, more rows): a Triton dequantize into a temporary, then one matmul;
* `torch` (CPU, or `backend: torch`): the same math in plain torch, for CI and for checking.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
from torch import nn

from ..errors import LoadError, PlacementError, WeightError
from ..weights import GGMLTensor, as_dense
from .base import BuildContext, Operator
from .kernels import int4_pack
from .kernels.int4_pack import Int4Weight
from .registry import register

log = logging.getLogger(__name__)

# GGML types repacked without requantization (group size 32), by gguf.GGMLQuantizationType value.
_DIRECT_REPACK = {2: int4_pack.from_q4_0, 12: int4_pack.from_q4_k}
BACKENDS = ("auto", "tinygemm", "triton", "torch")
TINYGEMM_GROUPS = (32, 64, 128, 256)


@dataclass(frozen=True)
class Int4Options:
    # Group size along in_features: 32, 64, 128, 256 ...; -1 = one group per output channel.
    # None: 32 for GGUF Q4_0 / Q4_K weights (exact repack), 128 for everything else.
    group_size: Optional[int] = None
    gemv_max_batch: int = 16        # rows up to which the GEMV kernel runs (<= 16)
    backend: str = "auto"           # auto: tinygemm where it runs, else Triton, on CUDA; torch on CPU

    def __post_init__(self):
        g = self.group_size
        if g is not None and g != -1 and (g < 8 or g & (g - 1)):
            raise ValueError(f"group_size must be a power of two >= 8 or -1 (per channel), got {g}")
        if not 0 <= self.gemv_max_batch <= 16:
            raise ValueError(f"gemv_max_batch must be in 0..16, got {self.gemv_max_batch}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")


def _triton_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("triton") is not None


@register("linear_int4")
class Int4Linear(Operator):
    Options = Int4Options
    replaces = ("Linear",)
    device_types = ("cuda", "cpu")
    summary = "4-bit weight-only linear (Triton GEMV at decode, dequantize+matmul at prefill)"

    def __init__(self, in_features: int, out_features: int, bias: bool, options: Int4Options,
                 device: torch.device, dtype: Optional[torch.dtype] = None):
        super().__init__()
        if in_features % 8:
            raise ValueError(f"linear_int4 needs in_features divisible by 8, got {in_features}")
        self.in_features, self.out_features, self.options = in_features, out_features, options
        self.group_size = self._group_for(None)
        self.compute_dtype = dtype
        ng = -(-in_features // self.group_size)
        # qweight: int32 [N, K/8]   scales, mins: fp16 [N, NG]   bias: [N]
        self.register_buffer("qweight", torch.empty(out_features, in_features // 8, dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.empty(out_features, ng, dtype=torch.float16, device=device))
        self.register_buffer("mins", torch.empty(out_features, ng, dtype=torch.float16, device=device))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype or torch.float32, device=device)
                             if bias else None)
        self.tg_weight = self.tg_scale_zero = None     # tinygemm copy (CUDA only), made at load

    def _group_for(self, ggml_type: Optional[int]) -> int:
        g = self.options.group_size
        if g is None:
            g = 32 if ggml_type in _DIRECT_REPACK else 128
        return self.in_features if g == -1 else g

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def build(cls, original: nn.Module, ctx: BuildContext) -> nn.Module:
        if ctx.device.type not in cls.device_types:
            raise PlacementError(f"{ctx.name}: linear_int4 runs on cuda or cpu, not {ctx.device}")
        mod = cls(original.in_features, original.out_features, original.bias is not None, ctx.options,
                  torch.device("meta"), ctx.dtype)
        mod.target_device = torch.device(ctx.device)        # load_weights places the tensors there
        return mod

    @classmethod
    def planned_bytes(cls, original: nn.Module, ctx: BuildContext) -> dict[str, int]:
        n, k = original.out_features, original.in_features
        g = k if ctx.options.group_size == -1 else (ctx.options.group_size or 32)
        total = n * k // 2 + 4 * n * -(-k // g)
        if ctx.device.type == "cuda" and ctx.options.backend in ("auto", "tinygemm") and k % 128 == 0 \
                and g in TINYGEMM_GROUPS:
            total *= 2                      # the tinygemm copy
        if original.bias is not None:
            total += n * (ctx.dtype or torch.float32).itemsize
        return {str(ctx.device): total}

    @classmethod
    def from_weight(cls, weight: Any, bias: Optional[torch.Tensor] = None, options: Int4Options = Int4Options(),
                    device: Any = "cpu", dtype: Optional[torch.dtype] = None, name: str = "weight") -> "Int4Linear":
        """Build directly from a weight (tensor, GGMLTensor ...) [N, K]; for tests and benches."""
        n, k = (int(s) for s in weight.shape)
        mod = cls(k, n, bias is not None, options, torch.device("meta"), dtype)
        mod.target_device = torch.device(device)
        mod._set_weight(weight, name)
        if bias is not None:
            mod.bias = bias.to(device=device, dtype=dtype or bias.dtype)
        return mod

    def _set_weight(self, w: Any, name: str) -> None:
        shape = tuple(int(s) for s in w.shape)
        if shape != (self.out_features, self.in_features):
            raise WeightError(f"shape {list(shape)} does not match linear [{self.out_features}, {self.in_features}]",
                              tensor=name)
        dev = getattr(self, "target_device", torch.device("cpu"))
        ggml_type = w.ggml_type if isinstance(w, GGMLTensor) else None
        self.group_size = self._group_for(ggml_type)
        if ggml_type in _DIRECT_REPACK and self.group_size == 32:
            packed = _DIRECT_REPACK[ggml_type](w.data, self.out_features, self.in_features, name or w.name)
        else:
            work = dev if dev.type == "cuda" else torch.device("cpu")
            packed = int4_pack.quantize(as_dense(w, torch.float32, work), self.group_size)
        packed = packed.to(dev)
        self.qweight, self.scales, self.mins = packed.qweight, packed.scales, packed.mins
        self.tg_weight = self.tg_scale_zero = None
        if dev.type == "cuda" and self.options.backend in ("auto", "tinygemm") and self._tinygemm_fits():
            self.tg_weight, self.tg_scale_zero = tinygemm_pack(packed)
        elif self.options.backend == "tinygemm":
            raise PlacementError(f"{name}: backend 'tinygemm' needs CUDA, K % 128 == 0 and group size in "
                                 f"{TINYGEMM_GROUPS} (have K={self.in_features}, group={self.group_size}, {dev})")

    def _tinygemm_fits(self) -> bool:
        return (self.in_features % 128 == 0 and self.out_features % 8 == 0 and self.group_size in TINYGEMM_GROUPS
                and hasattr(torch.ops.aten, "_weight_int4pack_mm"))

    def load_weights(self, prefix: str, source: Mapping[str, Any]) -> set[str]:
        used = set()
        key = prefix + "weight"
        if key not in source:
            raise LoadError("tensor not found in the weights", missing=[key])
        self._set_weight(source[key], key)
        used.add(key)
        if self.bias is not None:
            bkey = prefix + "bias"
            if bkey not in source:
                raise LoadError("tensor not found in the weights", missing=[bkey])
            self.bias = as_dense(source[bkey], self.compute_dtype or torch.float32, self.target_device)
            used.add(bkey)
        return used

    # ---- compute ------------------------------------------------------------------------
    @property
    def weight_int4(self) -> Int4Weight:
        return Int4Weight(self.qweight, self.scales, self.mins, self.group_size)

    def path(self, rows: int, dtype: torch.dtype = torch.bfloat16) -> str:
        """Which implementation runs for `rows` input rows of `dtype` on this module's device."""
        if self.qweight.device.type != "cuda" or self.options.backend == "torch":
            return "torch"
        small = rows <= self.options.gemv_max_batch
        if small and getattr(self, "tg_weight", None) is not None and dtype == torch.bfloat16:
            return "tinygemm"
        if self.options.backend == "auto" and not _triton_available():
            return "torch"
        return "gemv" if small else "dequant+matmul"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)                              # [M, K]
        path = self.path(x2.shape[0], x2.dtype)
        if path == "tinygemm":
            y = torch.ops.aten._weight_int4pack_mm(x2.contiguous(), self.tg_weight, self.group_size,
                                                   self.tg_scale_zero)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
        elif path == "gemv":
            from .kernels.int4_triton import int4_gemv
            bias = self.bias.to(x2.dtype) if self.bias is not None else None
            y = int4_gemv(x2, self.qweight, self.scales, self.mins, self.group_size, bias)
        else:
            if path == "dequant+matmul":
                from .kernels.int4_triton import int4_dequantize
                w = int4_dequantize(self.qweight, self.scales, self.mins, self.group_size, x2.dtype)
            else:
                w = int4_pack.dequantize(self.weight_int4, x2.dtype)      # [N, K]
            y = nn.functional.linear(x2, w, self.bias.to(x2.dtype) if self.bias is not None else None)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        dev = self.qweight.device.type
        small = self.path(1)
        paths = ("torch dequantize+matmul" if small == "torch" else
                 f"{small} (bf16 rows <= {self.options.gemv_max_batch}), dequant+matmul above")
        g = "per-channel" if self.group_size == self.in_features else str(self.group_size)
        return (f"op=linear_int4, in={self.in_features}, out={self.out_features}, group={g}, "
                f"bias={self.bias is not None}, device={dev}, path={paths}")


def tinygemm_pack(w: Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """Our int4 weight in the layout of `aten._weight_int4pack_mm` (same values, no requantization).

    tinygemm computes `(q - 8) * scale + zero` per group, so zero = min + 8 * scale.
    """
    q = int4_pack.unpack_nibbles(w.qweight)                                      # [N, K] uint8
    packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).contiguous(), 8)
    s = w.scales.to(torch.bfloat16)
    z = (w.mins.float() + 8 * w.scales.float()).to(torch.bfloat16)
    return packed, torch.stack([s, z], -1).transpose(0, 1).contiguous()          # [NG, N, 2]
