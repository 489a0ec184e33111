"""`gpu_experts`: routed experts on the GPU, all of them or the N hottest per layer.

Keeps the transformers `*Experts` call: `forward(hidden [T, H], top_k_index [T, k],
top_k_weights [T, k]) -> [T, H]`. Experts chosen for the GPU live there in bf16 (or the
`linear_int4` format); the others stay on the CPU and run the reference torch math; both
results are summed. Which experts go to the GPU is a strategy (a table, below):

* `uniform`: N experts in every MoE layer (the hottest of the profile if one is given, else ids 0..N-1);
* `frequency`: the N most used experts of each layer, from a profile written by `ktinject profile`;
* `front-loading`: the same total budget (N x MoE layers), spent layer by layer from the first:
  early layers get all their experts on the GPU, later ones none.

GPU paths: at decode sizes (T*k <= `decode_max_slots`) every (token, expert) slot runs at once
with no host synchronisation (bf16: gathered weights + `bmm`; int4: the per-slot Triton GEMV),
so a layer with all its experts on the GPU is CUDA-graph safe; larger batches group tokens
by expert (one sort, two GEMMs per active expert). With CPU experts the module reports
`supports_cuda_graph = False` and the generation engine decodes eagerly. The CPU share starts
after the GPU kernels are queued, so the two overlap.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelError
from .base import BuildContext, Operator
from .experts import EXPERT_CLASSES, fused_expert_shape, grouped_experts
from .kernels import int4_pack
from .registry import register

log = logging.getLogger(__name__)

_ACTS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu,
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
QUANTS = ("bf16", "int4")


# ---- which experts go to the GPU ------------------------------------------------------------
def _ranked(counts: Optional[list], num_experts: int) -> list[int]:
    if counts is None:
        return list(range(num_experts))
    return sorted(range(num_experts), key=lambda e: (-counts[e], e))


def _uniform(n, pos, n_layers, num_experts, counts):
    return _ranked(counts, num_experts)[:n]


def _frequency(n, pos, n_layers, num_experts, counts):
    if counts is None:
        raise ModelError("strategy 'frequency' needs a profile with counts for this layer (ktinject profile)")
    return _ranked(counts, num_experts)[:n]


def _front_loading(n, pos, n_layers, num_experts, counts):
    budget = n * n_layers - pos * num_experts
    return _ranked(counts, num_experts)[:max(0, min(num_experts, budget))]


STRATEGIES: dict[str, Callable] = {"uniform": _uniform, "frequency": _frequency, "front-loading": _front_loading}


def _deepseek_moe_layers(c):
    return [i for i in range(c.num_hidden_layers) if i >= getattr(c, "first_k_dense_replace", 0)]


def _qwen_moe_layers(c):
    step, only = getattr(c, "decoder_sparse_step", 1) or 1, set(getattr(c, "mlp_only_layers", []) or [])
    return [i for i in range(c.num_hidden_layers) if i not in only and (i + 1) % step == 0]


MOE_LAYERS: dict[str, Callable] = {"deepseek_v2": _deepseek_moe_layers, "deepseek_v3": _deepseek_moe_layers,
                                   "qwen2_moe": _qwen_moe_layers, "qwen3_moe": _qwen_moe_layers}


def moe_layers(config) -> list[int]:
    fn = MOE_LAYERS.get(getattr(config, "model_type", ""), lambda c: list(range(c.num_hidden_layers)))
    return fn(config)


def load_profile(path: str) -> dict[str, list[int]]:
    """{experts module name: per-expert use counts} from a `ktinject profile` JSON file."""
    try:
        data = json.loads(Path(path).read_text())
        counts = data["counts"]
        if not isinstance(counts, dict):
            raise TypeError("'counts' must map module names to lists")
        return {str(k): [int(c) for c in v] for k, v in counts.items()}
    except FileNotFoundError:
        raise ModelError(f"{path}: expert profile not found (write one with `ktinject profile`)") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelError(f"{path}: not an expert profile ({exc})") from None


def select_gpu_experts(name: str, config, num_experts: int, options) -> list[int]:
    """Sorted expert ids of module `name` that the options place on the GPU."""
    if options.gpu_experts < 0:
        return list(range(num_experts))
    counts = None
    if options.profile:
        counts = load_profile(options.profile).get(name)
        if counts is not None and len(counts) != num_experts:
            raise ModelError(f"{options.profile}: {name} has {len(counts)} counts, the model {num_experts} experts")
    m = re.search(r"layers\.(\d+)\.", name)
    layers = moe_layers(config) if config is not None else []
    layer = int(m.group(1)) if m else 0
    pos = layers.index(layer) if layer in layers else 0
    chosen = STRATEGIES[options.strategy](options.gpu_experts, pos, max(len(layers), 1), num_experts, counts)
    return sorted(chosen)


@dataclass(frozen=True)
class GpuExpertsOptions:
    gpu_experts: int = -1             # experts per MoE layer on the GPU (-1: all)
    strategy: str = "uniform"         # uniform | frequency | front-loading
    profile: Optional[str] = None     # JSON from `ktinject profile` (required by `frequency`)
    quant: str = "bf16"               # bf16 | int4 (GPU share)
    group_size: int = 128             # int4 group size along the input dimension
    decode_max_slots: int = 64        # T*k up to which the per-slot, graph-safe path runs

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if self.quant not in QUANTS:
            raise ValueError(f"quant must be one of {', '.join(QUANTS)}, got {self.quant!r}")
        if self.gpu_experts < -1:
            raise ValueError(f"gpu_experts must be -1 (all) or >= 0, got {self.gpu_experts}")
        if self.strategy == "frequency" and not self.profile:
            raise ValueError("strategy 'frequency' needs profile: <file written by ktinject profile>")
        if self.group_size < 8 or self.group_size & (self.group_size - 1):
            raise ValueError(f"group_size must be a power of two >= 8, got {self.group_size}")


@register("gpu_experts")
class GpuExperts(Operator):
    Options = GpuExpertsOptions
    replaces = EXPERT_CLASSES
    device_types = ("cuda", "cpu")
    summary = "routed experts on the GPU (all, or N hot ones per layer with the rest on the CPU), bf16 or int4"

    def __init__(self, num_experts: int, hidden: int, inter: int, act: str, options: GpuExpertsOptions,
                 gpu_ids: list[int], device: torch.device, dtype: torch.dtype, name: str = ""):
        super().__init__()
        if act not in _ACTS:
            raise ModelError(f"gpu_experts: unsupported activation {act!r} (supported: {', '.join(sorted(_ACTS))})")
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.act_name, self.act, self.options, self.name = act, _ACTS[act], options, name
        self.device, self.dtype = torch.device(device), dtype
        self.gpu_ids = list(gpu_ids)
        self.cpu_ids = [e for e in range(num_experts) if e not in set(gpu_ids)]
        slot = torch.full((num_experts,), -1, dtype=torch.long)
        slot[self.gpu_ids] = torch.arange(len(self.gpu_ids))
        cslot = torch.full((num_experts,), -1, dtype=torch.long)
        cslot[self.cpu_ids] = torch.arange(len(self.cpu_ids))
        self.register_buffer("gpu_slot", slot.to(self.device), persistent=False)   # [E] local id or -1
        self.cpu_slot = cslot                                                       # [E] on the CPU
        self.weights: dict[str, Any] = {}

    @property
    def supports_cuda_graph(self) -> bool:
        return not self.cpu_ids

    @classmethod
    def build(cls, original: nn.Module, ctx: BuildContext) -> nn.Module:
        e, h, i = fused_expert_shape(original, ctx, "gpu_experts")
        ids = select_gpu_experts(ctx.name, ctx.config, e, ctx.options)
        act = getattr(ctx.config, "hidden_act", "silu")
        return cls(e, h, i, act, ctx.options, ids, ctx.device, ctx.dtype or original.gate_up_proj.dtype, ctx.name)

    @classmethod
    def planned_bytes(cls, original: nn.Module, ctx: BuildContext) -> dict[str, int]:
        e, two_i, h = (int(s) for s in original.gate_up_proj.shape)
        n_gpu = len(select_gpu_experts(ctx.name, ctx.config, e, ctx.options))
        per = 3 * (two_i // 2) * h
        item = (ctx.dtype or original.gate_up_proj.dtype).itemsize
        gpu_per = per // 2 + 3 * (two_i // 2) * 4 * -(-h // ctx.options.group_size) if ctx.options.quant == "int4" \
            else per * item
        out = {str(ctx.device): n_gpu * gpu_per}
        if e - n_gpu:
            out["cpu"] = (e - n_gpu) * per * item
        return out

    # ---- loading ------------------------------------------------------------------------
    def load_weights(self, prefix: str, source: Mapping[str, Any]) -> set[str]:
        from ..load import fetch_dense
        e, h, i = self.num_experts, self.hidden, self.inter
        gu = fetch_dense(source, prefix + "gate_up_proj", (e, 2 * i, h), self.dtype, "cpu")   # [E, 2I, H]
        dn = fetch_dense(source, prefix + "down_proj", (e, h, i), self.dtype, "cpu")          # [E, H, I]
        g = torch.tensor(self.gpu_ids, dtype=torch.long)
        c = torch.tensor(self.cpu_ids, dtype=torch.long)
        w: dict[str, Any] = {"cpu_gu": gu[c].contiguous(), "cpu_dn": dn[c].contiguous()}
        if self.options.quant == "int4":
            for key, full in (("gu", gu), ("dn", dn)):
                packs = [int4_pack.quantize(full[j].to(self.device, torch.float32), self.options.group_size)
                         for j in self.gpu_ids]
                w[key] = int4_pack.Int4Weight(
                    torch.stack([p.qweight for p in packs]) if packs else torch.empty(0, dtype=torch.int32),
                    torch.stack([p.scales for p in packs]) if packs else torch.empty(0),
                    torch.stack([p.mins for p in packs]) if packs else torch.empty(0),
                    min(self.options.group_size, full.shape[-1]))
        else:
            w["gu"], w["dn"] = gu[g].to(self.device), dn[g].to(self.device)
        self.weights = w
        return {prefix + "gate_up_proj", prefix + "down_proj"}

    # ---- compute ------------------------------------------------------------------------
    def _dense(self, key: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        w = self.weights[key]
        if isinstance(w, int4_pack.Int4Weight):
            one = int4_pack.Int4Weight(w.qweight[e], w.scales[e], w.mins[e], w.group_size)
            if one.qweight.is_cuda:
                from .kernels.int4_triton import int4_dequantize
                return int4_dequantize(one.qweight, one.scales, one.mins, one.group_size, dtype)
            return int4_pack.dequantize(one, dtype)
        return w[e]

    def _gpu_slots(self, x, idx, wts) -> torch.Tensor:
        # x: [T, H]  idx, wts: [T, k] -> [T, H]; no host synchronisation
        t, k = idx.shape
        local = self.gpu_slot[idx].reshape(-1)                         # [S = T*k]
        gu, dn = self.weights["gu"], self.weights["dn"]
        if isinstance(gu, int4_pack.Int4Weight):
            from .kernels.int4_triton import int4_expert_gemv
            y = int4_expert_gemv(x, local, k, gu.qweight, gu.scales, gu.mins, gu.group_size)        # [S, 2I]
            gate, up = y.chunk(2, dim=-1)
            a = (self.act(gate) * up).contiguous()                                                     # [S, I]
            o = int4_expert_gemv(a, local, 1, dn.qweight, dn.scales, dn.mins, dn.group_size)         # [S, H]
        else:
            sel = local.clamp(min=0)
            xs = x.repeat_interleave(k, dim=0).unsqueeze(-1)                                           # [S, H, 1]
            gate, up = torch.bmm(gu[sel], xs).squeeze(-1).chunk(2, dim=-1)                             # [S, I]
            o = torch.bmm(dn[sel], (self.act(gate) * up).unsqueeze(-1)).squeeze(-1)                    # [S, H]
        wt = (wts.reshape(-1) * (local >= 0)).to(o.dtype)
        return (o * wt[:, None]).view(t, k, -1).sum(1)

    def path(self, slots: int) -> str:
        return "slots" if self.device.type == "cuda" and slots <= self.options.decode_max_slots else "grouped"

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        # hidden_states: [T, H]  top_k_index: [T, k]  top_k_weights: [T, k]
        if self.cpu_ids:   # copy the CPU share's inputs first, so the CPU math overlaps the GPU kernels
            h_cpu, i_cpu, w_cpu = (t.to("cpu") for t in (hidden_states, top_k_index, top_k_weights))
        x = hidden_states.to(self.device, self.dtype)
        idx, wts = top_k_index.to(self.device), top_k_weights.to(self.device)
        if not self.gpu_ids:
            out = torch.zeros_like(x)
        elif self.path(idx.numel()) == "slots":
            out = self._gpu_slots(x, idx, wts)
        else:
            out = grouped_experts(x, idx, wts, self.gpu_slot, lambda v, e: F.linear(v, self._dense("gu", e, v.dtype)),
                           lambda v, e: F.linear(v, self._dense("dn", e, v.dtype)), self.act, len(self.gpu_ids))
        if self.cpu_ids:
            cw_gu, cw_dn = self.weights["cpu_gu"], self.weights["cpu_dn"]
            out_cpu = grouped_experts(h_cpu.to(self.dtype), i_cpu, w_cpu, self.cpu_slot,
                               lambda v, e: F.linear(v, cw_gu[e]), lambda v, e: F.linear(v, cw_dn[e]), self.act,
                               len(self.cpu_ids))
            out = out + out_cpu.to(out.device)
        return out.to(hidden_states.device, hidden_states.dtype)

    def extra_repr(self) -> str:
        return (f"op=gpu_experts, experts={self.num_experts} ({len(self.gpu_ids)} on {self.device} as "
                f"{self.options.quant}, {len(self.cpu_ids)} on cpu), strategy={self.options.strategy}, "
                f"decode=slots (T*k <= {self.options.decode_max_slots}), prefill=grouped")
