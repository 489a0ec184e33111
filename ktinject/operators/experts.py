"""`experts`: reference routed experts in torch, for the transformers 5 fused `*Experts` modules.

Weights keep the transformers layout: `gate_up_proj: [E, 2I, H]` (gate rows first) and
`down_proj: [E, H, I]`. The call signature is the original's:
`forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`. Inputs may come
from another device: they are moved to the operator's device and the result is moved back.
Tokens are grouped by expert with one sort, so each active expert runs two GEMMs.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelError
from .base import BuildContext, NoOptions, Operator
from .registry import register

_ACTS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu,
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


@register("experts")
class TorchExperts(Operator):
    Options = NoOptions
    replaces = ("DeepseekV2Experts", "DeepseekV3Experts", "Qwen2MoeExperts", "Qwen3MoeExperts", "MixtralExperts")
    device_types = ("cpu", "cuda")
    summary = "reference routed experts (torch, grouped by expert)"

    def __init__(self, num_experts: int, hidden: int, inter: int, act: str, device: torch.device,
                 dtype: torch.dtype):
        super().__init__()
        if act not in _ACTS:
            raise ModelError(f"experts: unsupported activation {act!r} (supported: {', '.join(sorted(_ACTS))})")
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.act_name, self.act = act, _ACTS[act]
        self.device, self.dtype = device, dtype
        # gate_up_proj: [E, 2I, H] (gate first)   down_proj: [E, H, I]
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden, device="meta", dtype=dtype),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter, device="meta", dtype=dtype),
                                      requires_grad=False)

    @classmethod
    def build(cls, original: nn.Module, ctx: BuildContext) -> nn.Module:
        gu, down = getattr(original, "gate_up_proj", None), getattr(original, "down_proj", None)
        if not (isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.dim() == 3 and down.dim() == 3):
            raise ModelError(f"{ctx.name}: the experts operator needs 3-D gate_up_proj [E, 2I, H] and "
                             f"down_proj [E, H, I]; {type(original).__name__} has none")
        e, two_i, h = gu.shape
        act = getattr(ctx.config, "hidden_act", "silu")
        return cls(int(e), int(h), int(two_i) // 2, act, ctx.device, ctx.dtype or gu.dtype)

    def load_weights(self, prefix: str, source: Mapping[str, Any]) -> set[str]:
        from ..load import fetch_dense
        e, h, i = self.num_experts, self.hidden, self.inter
        self.gate_up_proj = nn.Parameter(fetch_dense(source, prefix + "gate_up_proj", (e, 2 * i, h), self.dtype,
                                                     self.device), requires_grad=False)
        self.down_proj = nn.Parameter(fetch_dense(source, prefix + "down_proj", (e, h, i), self.dtype, self.device),
                                      requires_grad=False)
        return {prefix + "gate_up_proj", prefix + "down_proj"}

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        # hidden_states: [T, H]  top_k_index: [T, k]  top_k_weights: [T, k]
        x = hidden_states.to(self.device, self.dtype)
        idx = top_k_index.to(self.device)
        wts = top_k_weights.to(self.device)
        t, k = idx.shape
        flat = idx.reshape(-1)                                  # [T*k]
        order = torch.argsort(flat, stable=True)                # slots grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of_slot = order // k                              # [T*k] token of each sorted slot
        weight_of_slot = wts.reshape(-1)[order]                 # [T*k]
        out = torch.zeros_like(x)                               # [T, H]
        start = 0
        for e, n in enumerate(counts[:self.num_experts]):
            if n == 0:
                continue
            tok = token_of_slot[start:start + n]                # [n]
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)   # [n, I] each
            y = F.linear(self.act(gate) * up, self.down_proj[e])                 # [n, H]
            y = y * weight_of_slot[start:start + n, None].to(y.dtype)
            out.index_add_(0, tok, y.to(out.dtype))
            start += n
        return out.to(hidden_states.device, hidden_states.dtype)

    def extra_repr(self) -> str:
        return (f"op=experts, experts={self.num_experts}, hidden={self.hidden}, inter={self.inter}, "
                f"act={self.act_name}, device={self.device}, dtype={self.dtype}")
