"""`moe`: the MoE block with CPU routed experts overlapped with GPU shared experts.

Replaces `DeepseekV2Moe`, `DeepseekV3MoE`, `Qwen2MoeSparseMoeBlock`, `Qwen3MoeSparseMoeBlock`
and `MixtralSparseMoeBlock`. It keeps the block's router (`gate`) and shared experts where the
block lives (usually the GPU), routes, hands the routed experts to an async operator
(`experts.submit(...)`, normally `cpu_experts` on the CPU), computes the shared experts
meanwhile, then `experts.sync()` and sums: the same math as the block it replaces. If the
block's `experts` child was not replaced by its own rule, the `moe` operator builds a
`cpu_experts` for it from its own kwargs.

Shared experts differ per family; they are a table (class name -> function), not an if-chain.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn

from ..errors import ModelError
from .base import BuildContext, Operator, module_matches
from .cpu_experts import CONVERT_BITS, CpuExperts, CpuExpertsOptions
from .registry import register


def _shared_deepseek(block: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return block.shared_experts(h)                                            # [T, H]


def _shared_qwen2(block: nn.Module, h: torch.Tensor) -> torch.Tensor:
    # sigmoid(shared_expert_gate(h)): [T, 1] scales shared_expert(h): [T, H]
    return torch.sigmoid(block.shared_expert_gate(h)) * block.shared_expert(h)


@dataclass(frozen=True)
class Family:
    shared: tuple[str, ...]                                      # child modules holding shared experts
    shared_fn: Optional[Callable[[nn.Module, torch.Tensor], torch.Tensor]]


FAMILIES: dict[str, Family] = {
    "DeepseekV2Moe": Family(("shared_experts",), _shared_deepseek),
    "DeepseekV3MoE": Family(("shared_experts",), _shared_deepseek),
    "Qwen2MoeSparseMoeBlock": Family(("shared_expert", "shared_expert_gate"), _shared_qwen2),
    "Qwen3MoeSparseMoeBlock": Family((), None),
    "MixtralSparseMoeBlock": Family((), None),
}


@dataclass(frozen=True)
class MoeOptions:
    # used only when the block's experts were not replaced by their own rule:
    threads: int = 0
    quant: str = "bf16"
    isa: Optional[str] = None
    convert_unsupported: bool = False

    def __post_init__(self):
        CpuExpertsOptions(self.threads, self.quant, self.isa, self.convert_unsupported)   # validates


def _family(module: nn.Module) -> tuple[str, Family]:
    for klass in type(module).__mro__:
        if klass.__name__ in FAMILIES:
            return klass.__name__, FAMILIES[klass.__name__]
    raise ModelError(f"moe: {type(module).__name__} is not a supported MoE block "
                     f"(supported: {', '.join(FAMILIES)})")


@register("moe")
class OverlappedMoe(Operator):
    Options = MoeOptions
    replaces = tuple(FAMILIES)
    device_types = ("cpu", "cuda")
    summary = "MoE block: routed experts async on the CPU, shared experts meanwhile on the block's device"

    def __init__(self, original: nn.Module, experts: nn.Module, family: Family, device: torch.device,
                 dtype: Optional[torch.dtype], name: str):
        super().__init__()
        self.family, self.device, self.dtype, self.name = family, device, dtype, name
        self.hidden = int(original.gate.weight.shape[-1])
        self.gate = original.gate
        self.experts = experts
        for child in family.shared:
            setattr(self, child, getattr(original, child))

    @classmethod
    def build(cls, original: nn.Module, ctx: BuildContext) -> nn.Module:
        _, family = _family(original)
        experts = original.experts
        if not (hasattr(experts, "submit") and hasattr(experts, "sync")):
            if not module_matches(experts, CpuExperts.replaces):
                raise ModelError(f"{ctx.name}.experts: {type(experts).__name__} can neither run async nor be "
                                 f"replaced by cpu_experts")
            opts = ctx.options or MoeOptions()
            cpu = torch.device("cpu")
            sub = BuildContext(f"{ctx.name}.experts", cpu, cpu, cpu, None, ctx.config,
                               CpuExpertsOptions(opts.threads, opts.quant, opts.isa, opts.convert_unsupported))
            experts = CpuExperts.build(experts, sub)
        return cls(original, experts, family, ctx.device, ctx.dtype, ctx.name)

    @classmethod
    def planned_bytes(cls, original: nn.Module, ctx: BuildContext) -> dict[str, int]:
        own = 0
        for name, p in original.named_parameters():
            if not name.startswith("experts."):
                own += p.numel() * (ctx.dtype or p.dtype).itemsize
        opts = ctx.options or MoeOptions()
        routed = sum(p.numel() for p in original.experts.parameters())
        out = {str(ctx.device): own}
        out["cpu"] = out.get("cpu", 0) + int(routed * CONVERT_BITS[opts.quant] / 8)
        return out

    def load_weights(self, prefix: str, source: Mapping[str, Any]) -> set[str]:
        from ..load import load_dense_tree
        used: set[str] = set()
        for name, child in self.named_children():
            if isinstance(child, Operator):
                used |= set(child.load_weights(f"{prefix}{name}.", source))
            elif any(t.is_meta for t in list(child.parameters()) + list(child.buffers())):
                used |= load_dense_tree(child, f"{prefix}{name}.", source, self.device, self.dtype, recurse=True)
            else:   # already placed by its own plan entry
                used |= {f"{prefix}{name}.{k}" for k in child.state_dict()}
        return used

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        orig_shape = hidden_states.shape
        h = hidden_states.reshape(-1, self.hidden)                            # [T, H]
        _, top_k_weights, top_k_index = self.gate(h)                          # [T, k], [T, k]
        first = self._shared_first(h)
        shared = self.family.shared_fn(self, h) if first else None
        self.experts.submit(h, top_k_index, top_k_weights)                     # CPU starts now
        if self.family.shared_fn and not first:
            shared = self.family.shared_fn(self, h)                            # meanwhile, here
        out = self.experts.sync()                                              # [T, H] on h's device
        if shared is not None:
            out = out + shared
        return out.reshape(orig_shape)

    def _shared_first(self, h: torch.Tensor) -> bool:
        """Shared experts on the CPU computed by the native pool (cpu_linear) run before the routed
        ones: overlapped, they find the pool busy and compute on this thread alone (16-core Xeon,
        V2-Lite, `cpu-linear deepseek-v2-cpu`: 6.7 tok/s overlapped, 9.8 in turn). Elsewhere (the
        GPU, torch's own threads) they overlap."""
        if h.is_cuda or not self.family.shared_fn:
            return False
        if not hasattr(self, "_shared_pool"):
            from .cpu_linear import CpuLinear
            self._shared_pool = any(isinstance(m, CpuLinear) for c in self.family.shared
                                    for m in getattr(self, c).modules())
        return self._shared_pool

    def extra_repr(self) -> str:
        return f"op=moe, shared={list(self.family.shared) or 'none'}"
