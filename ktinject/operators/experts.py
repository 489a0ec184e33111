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


# The transformers 5 fused routed-expert modules of the five families (3-D gate_up_proj / down_proj).
EXPERT_CLASSES = ("DeepseekV2Experts", "DeepseekV3Experts", "Qwen2MoeExperts", "Qwen3MoeExperts", "MixtralExperts")


def grouped_experts(x, idx, wts, slot_of, linear_gu, linear_dn, act, n_local) -> torch.Tensor:
    """Routed experts grouped by expert with one sort: x [T, H], idx/wts [T, k], slot_of [E] (the
    local slot of each expert, -1 for experts computed elsewhere) -> [T, H]. `linear_gu(v, slot)`
    and `linear_dn(v, slot)` apply one expert's fused gate/up and down projections."""
    t, k = idx.shape
    local = slot_of[idx].reshape(-1)                                   # [T*k]
    out = torch.zeros_like(x)
    keep = (local >= 0).nonzero().squeeze(1)
    if keep.numel() == 0:
        return out
    order = keep[torch.argsort(local[keep], stable=True)]              # slots grouped by expert
    counts = torch.bincount(local[order], minlength=n_local).tolist()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        slots = order[start:start + n]
        tok = slots // k                                               # [n] token of each slot
        gate, up = linear_gu(x[tok], e).chunk(2, dim=-1)               # [n, I] each
        y = linear_dn(act(gate) * up, e) * wts.reshape(-1)[slots, None].to(x.dtype)   # [n, H]
        out.index_add_(0, tok, y.to(out.dtype))
        start += n
    return out


def fused_expert_shape(original: nn.Module, ctx: BuildContext, op: str) -> tuple[int, int, int]:
    """(E, H, I) of a transformers fused `*Experts` module (gate_up_proj [E, 2I, H], down_proj
    [E, H, I]); a ModelError naming the module when it has no such weights."""
    gu, down = getattr(original, "gate_up_proj", None), getattr(original, "down_proj", None)
    if not (isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.dim() == 3 and down.dim() == 3):
        raise ModelError(f"{ctx.name}: {op} needs 3-D gate_up_proj [E, 2I, H] and down_proj [E, H, I]; "
                         f"{type(original).__name__} has none")
    e, two_i, h = (int(s) for s in gu.shape)
    return e, h, two_i // 2


@register("experts")
class TorchExperts(Operator):
    Options = NoOptions
    replaces = EXPERT_CLASSES
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
        e, h, i = fused_expert_shape(original, ctx, "the experts operator")
        act = getattr(ctx.config, "hidden_act", "silu")
        return cls(e, h, i, act, ctx.device, ctx.dtype or original.gate_up_proj.dtype)

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
        every = torch.arange(self.num_experts, device=self.device)    # all experts are local
        out = grouped_experts(x, idx, wts, every, lambda v, e: F.linear(v, self.gate_up_proj[e]),
                              lambda v, e: F.linear(v, self.down_proj[e]), self.act, self.num_experts)
        return out.to(hidden_states.device, hidden_states.dtype)

    def extra_repr(self) -> str:
        return (f"op=experts, experts={self.num_experts}, hidden={self.hidden}, inter={self.inter}, "
                f"act={self.act_name}, device={self.device}, dtype={self.dtype}")
