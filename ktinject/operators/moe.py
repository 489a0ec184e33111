"""`moe`: the MoE block with CPU routed experts overlapped with GPU shared experts.

Replaces `DeepseekV2Moe`, `DeepseekV3MoE`, `Qwen2MoeSparseMoeBlock`, `Qwen3MoeSparseMoeBlock`
and `MixtralSparseMoeBlock`. It keeps the block's router (`gate`) and shared experts where the
block lives (usually the GPU), routes, hands the routed experts to an async operator
(`experts.submit(...)`, normally `cpu_experts` on the CPU), computes the shared experts
meanwhile, then `experts.sync()` and sums: the same math as the block it replaces. If the
block's `experts` child was not replaced by its own rule, the `moe` operator builds a
`cpu_experts` for it from its own kwargs.

Shared experts differ per family; they are a table (class name -> function), not an if-chain.

On CUDA with Triton two fused paths cut the kernels of a decode step, which is launch-bound
(options `fused_router`, `fused_shared`): a softmax top-k router (DeepSeek-V2 greedy, Qwen2/3-MoE,
Mixtral) runs as two Triton kernels instead of about six (`kernels/router_triton.py`), and the
shared SiLU MLP as a gate_up GEMM, one `silu_mul` kernel and down_proj: three instead of five
(`kernels/mlp_triton.py`). Other routers and MLPs, and CPU tensors, run their own forward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn

from ..errors import ModelError
from .base import BuildContext, Operator, module_matches
from .cpu_experts import CpuExperts, CpuExpertsOptions
from .kernels import triton_available
from .kernels.mlp_triton import fusable_mlp, fuse_gate_up, fused_mlp, gate_up_views
from .kernels.router_triton import FLOAT_DTYPES, RouterSpec, fused_route, router_spec
from .registry import register


def _shared_deepseek(block: "OverlappedMoe", h: torch.Tensor) -> torch.Tensor:
    return block.shared_mlp(h)                                                # [T, H]


def _shared_qwen2(block: "OverlappedMoe", h: torch.Tensor) -> torch.Tensor:
    # sigmoid(shared_expert_gate(h)): [T, 1] scales shared_expert(h): [T, H]
    return torch.sigmoid(block.shared_expert_gate(h)) * block.shared_mlp(h)


@dataclass(frozen=True)
class Family:
    shared: tuple[str, ...]                                      # child modules holding shared experts
    shared_fn: Optional[Callable[[nn.Module, torch.Tensor], torch.Tensor]]
    mlp: Optional[str] = None                                    # the child that is the shared SiLU MLP


FAMILIES: dict[str, Family] = {
    "DeepseekV2Moe": Family(("shared_experts",), _shared_deepseek, "shared_experts"),
    "DeepseekV3MoE": Family(("shared_experts",), _shared_deepseek, "shared_experts"),
    "Qwen2MoeSparseMoeBlock": Family(("shared_expert", "shared_expert_gate"), _shared_qwen2, "shared_expert"),
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
    repack: str = "auto"
    # CUDA with Triton: softmax top-k routers in 2 kernels (~6 otherwise); the shared SiLU MLP in 3 (5)
    fused_router: bool = True
    fused_shared: bool = True

    def __post_init__(self):
        CpuExpertsOptions(self.threads, self.quant, self.isa, self.convert_unsupported, repack=self.repack)   # validates


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
                 dtype: Optional[torch.dtype], name: str, options: Optional[MoeOptions] = None):
        super().__init__()
        self.family, self.device, self.dtype, self.name = family, device, dtype, name
        self.options = options or MoeOptions()
        self.hidden = int(original.gate.weight.shape[-1])
        self.gate = original.gate
        self.experts = experts
        for child in family.shared:
            setattr(self, child, getattr(original, child))
        self._router: tuple = (None, None)               # (the gate weight it was read off, its RouterSpec)
        self._gate_up: Optional[torch.Tensor] = None       # the shared MLP's [2I, D] (see _fused_gate_up)

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
                               CpuExpertsOptions(opts.threads, opts.quant, opts.isa, opts.convert_unsupported,
                                                 repack=opts.repack), ctx.stored)
            experts = CpuExperts.build(experts, sub)
        return cls(original, experts, family, ctx.device, ctx.dtype, ctx.name, ctx.options or MoeOptions())

    @classmethod
    def planned_bytes(cls, original: nn.Module, ctx: BuildContext) -> dict[str, int]:
        own = 0
        for name, p in original.named_parameters():
            if not name.startswith("experts."):
                own += p.numel() * (ctx.dtype or p.dtype).itemsize
        opts = ctx.options or MoeOptions()
        out = {str(ctx.device): own}
        out["cpu"] = out.get("cpu", 0) + CpuExperts.routed_bytes(original.experts, f"{ctx.name}.experts", ctx, opts.quant)
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
        self.prepare_fused()
        return used

    def prepare_fused(self) -> None:
        """Set up the fused paths where the weights already are on CUDA: read the router's spec and
        concatenate the shared MLP's gate/up weights. Run at the end of `load_weights`, and else at
        the first eager CUDA forward; either comes before a CUDA graph capture, which must not
        allocate weights."""
        self._router_spec()
        mlp = getattr(self, self.family.mlp) if self.family.mlp else None
        if (mlp is not None and self.options.fused_shared and triton_available()
                and not gate_up_views(mlp, self._gate_up) and fusable_mlp(mlp) is None
                and mlp.gate_proj.weight.is_cuda):
            self._gate_up = fuse_gate_up(mlp)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        orig_shape = hidden_states.shape
        h = hidden_states.reshape(-1, self.hidden)                            # [T, H]
        top_k_weights, top_k_index = self.route(h)                             # [T, k], [T, k]
        first = self._shared_first(h)
        shared = self.family.shared_fn(self, h) if first else None
        self.experts.submit(h, top_k_index, top_k_weights)                     # CPU starts now
        if self.family.shared_fn and not first:
            shared = self.family.shared_fn(self, h)                            # meanwhile, here
        if shared is not None and isinstance(self.experts, CpuExperts):
            out = self.experts.sync(add=shared)                                # the sum in one pass
        else:
            out = self.experts.sync()                                          # [T, H] on h's device
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

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k weights, expert ids) of h [T, H]: the fused kernels when they apply, else the router."""
        spec = self._fused_router(h)
        if spec is not None:
            return fused_route(h, spec, f"{self.name or 'moe'}.gate")
        _, top_k_weights, top_k_index = self.gate(h)
        return top_k_weights, top_k_index

    def shared_mlp(self, h: torch.Tensor) -> torch.Tensor:
        """The shared SiLU MLP of h [T, H]: gate_up GEMM + silu_mul + down_proj when fused, else its forward."""
        mlp = getattr(self, self.family.mlp)
        gate_up = self._fused_gate_up(mlp, h)
        return mlp(h) if gate_up is None else fused_mlp(mlp, gate_up, h)

    def _fused_router(self, h: torch.Tensor) -> Optional[RouterSpec]:
        if not (self.options.fused_router and h.is_cuda and h.dtype in FLOAT_DTYPES and triton_available()):
            return None
        spec = self._router_spec()
        return spec if spec is not None and spec.weight.device == h.device else None

    def _router_spec(self) -> Optional[RouterSpec]:
        if self._router[0] is not self.gate.weight:     # not read yet, or the router was reloaded
            self._router = (self.gate.weight, router_spec(self.gate))
        return self._router[1]

    def _fused_gate_up(self, mlp: nn.Module, h: torch.Tensor) -> Optional[torch.Tensor]:
        if not (self.options.fused_shared and h.is_cuda and triton_available()):
            return None
        if not gate_up_views(mlp, self._gate_up):       # not fused yet, or the weights were moved since
            if torch.cuda.is_current_stream_capturing():
                return None                             # no weights allocated in a graph: the module's forward
            self._gate_up = fuse_gate_up(mlp, h.device)
        gate_up = self._gate_up
        return gate_up if gate_up is not None and gate_up.device == h.device and gate_up.dtype == h.dtype else None

    def fused_paths(self) -> dict[str, bool]:
        """Which fused paths a CUDA forward takes, by the weights as they are now."""
        triton = triton_available()
        router = self._router_spec()
        mlp = getattr(self, self.family.mlp) if self.family.mlp else None
        return {"router": bool(triton and self.options.fused_router and router is not None and router.weight.is_cuda),
                "shared": bool(triton and self.options.fused_shared and mlp is not None and fusable_mlp(mlp) is None
                               and mlp.gate_proj.weight.is_cuda)}

    def extra_repr(self) -> str:
        fused = self.fused_paths()
        return (f"op=moe, shared={list(self.family.shared) or 'none'}, "
                f"fused_router={fused['router']}, fused_shared={fused['shared']}")
