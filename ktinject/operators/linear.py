"""`linear`: the reference torch linear layer, any dtype, on cpu or cuda.

It replaces an `nn.Linear` and keeps its maths (`y = x W^T + b`). Weights are stored in the
planned dtype on the planned device; inputs arriving from another device or in another dtype
are moved there and the result goes back, so a `linear` can sit anywhere in a mixed layout.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .base import BuildContext, NoOptions, Operator
from .registry import register


@register("linear")
class TorchLinear(Operator):
    Options = NoOptions
    replaces = ("Linear",)
    device_types = ("cpu", "cuda")
    summary = "reference torch linear (any dtype)"

    def __init__(self, in_features: int, out_features: int, bias: bool, device: torch.device,
                 dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.device, self.dtype = device, dtype
        # weight: [out, in]  bias: [out]
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device="meta", dtype=dtype),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, device="meta", dtype=dtype), requires_grad=False)
                     if bias else None)

    @classmethod
    def build(cls, original: nn.Module, ctx: BuildContext) -> nn.Module:
        dtype = ctx.dtype or original.weight.dtype
        return cls(original.in_features, original.out_features, original.bias is not None, ctx.device, dtype)

    def load_weights(self, prefix: str, source: Mapping[str, Any]) -> set[str]:
        from ..load import fetch_dense
        keys = {prefix + "weight"}
        self.weight = nn.Parameter(fetch_dense(source, prefix + "weight", (self.out_features, self.in_features),
                                               self.dtype, self.device), requires_grad=False)
        if self.bias is not None:
            keys.add(prefix + "bias")
            self.bias = nn.Parameter(fetch_dense(source, prefix + "bias", (self.out_features,), self.dtype,
                                                 self.device), requires_grad=False)
        return keys

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out], returned on x's device and dtype
        y = F.linear(x.to(self.device, self.dtype), self.weight, self.bias)
        return y.to(x.device, x.dtype)

    def extra_repr(self) -> str:
        return f"op=linear, in={self.in_features}, out={self.out_features}, device={self.device}, dtype={self.dtype}"
