"""`cpu_experts`: routed experts computed by the native CPU kernels, on GGUF blocks.

Replaces the transformers 5 fused `*Experts` modules with the same call signature,
`forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`; inputs may live
on another device (CUDA): they are copied to the CPU and the result goes back there. It also
offers `submit(...)` (returns at once) and `sync() -> Tensor`, which the `moe` operator uses to
overlap the CPU experts with GPU work.

Inputs on a CUDA device with at most `stream_max_tokens` tokens (decode) take the
stream-ordered path (`ktinject.native.hostfn`): the CUDA stream itself copies the inputs to
pinned buffers, starts the CPU layer and, after the work queued in between (the shared experts),
waits for it and copies the result back, through host-function nodes. Python never blocks on
the GPU, and a CUDA graph can capture the whole decode step. Larger batches (prefill) copy and
wait from Python, which costs nothing next to their compute.

Weights: GGUF experts stay as they are (memory-mapped GGML blocks, zero copy): gate and up
arrive as a `FusedTensor((gate [E, I, H], up [E, I, H]), dim=1)`, down as `[E, H, I]`. Dense
weights (safetensors) are converted once at load to `quant` (bf16 by default; q8_0, q4_0,
q4_k, q5_k, q6_k). GGML types the kernels do not handle are an error unless
`convert_unsupported` asks for a conversion to `quant`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
from torch import nn

from ..errors import LoadError, ModelError, NativeError, UnsupportedQuantError
from ..weights.tensor import FusedTensor, GGMLTensor, logical_shape
from .base import BuildContext, Operator, stored_bytes
from .experts import EXPERT_CLASSES as FUSED_EXPERT_CLASSES, fused_expert_shape
from .registry import register

log = logging.getLogger(__name__)

# GGML type ids the native kernels compute on (gguf.GGMLQuantizationType values).
NATIVE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q5_0": 6, "q8_0": 8, "q2_k": 10, "q3_k": 11, "q4_k": 12, "q5_k": 13, "q6_k": 14, "iq4_xs": 23, "bf16": 30}
# GGUF block types the layer keeps as the file stores them (float GGUF tensors are converted to `quant`)
KEPT_TYPES = frozenset(v for k, v in NATIVE_TYPES.items() if k not in ("f32", "f16", "bf16"))
# Dense-source conversions: name -> bits per weight (for the plan's byte count).
CONVERT_BITS = {"f32": 32.0, "bf16": 16.0, "q8_0": 8.5, "q4_0": 4.5, "q4_k": 4.5, "q5_k": 5.5, "q6_k": 6.5625}
ISAS = ("scalar", "avx2", "avx512", "amx")
REPACK = {"auto": None, "on": True, "off": False}   # option value -> MoEKernel(repack=...)
# the five fused expert classes, and DeepseekV3NaiveMoe (its name in some transformers 5 releases)
EXPERT_CLASSES = (*FUSED_EXPERT_CLASSES, "DeepseekV3NaiveMoe")


@dataclass(frozen=True)
class CpuExpertsOptions:
    threads: int = 0                     # workers: 0 all CPUs ($KTINJECT_THREADS), -n all but n, n
    quant: str = "bf16"                  # storage for dense (safetensors) weights
    isa: Optional[str] = None            # force an ISA path (default: best, or $KTINJECT_ISA)
    convert_unsupported: bool = False    # convert GGML types the kernels lack to `quant` (else error)
    stream_ordered: bool = True          # CUDA inputs of <= stream_max_tokens: stream-driven (graph-capturable)
    stream_max_tokens: int = 16
    repack: str = "auto"                 # R16 layout for the VNNI decode kernels: auto (AVX-512/AMX, RAM allows), on, off
    int8_prefill: bool = False           # I8 copies (requantized, 1 byte a weight) for the AMX-INT8 prefill path
    int8_group: Any = 0                  # their group sizes: 0 (default per matrix), n, or [gate/up, down]
    int8_bits: int = 8                   # 8: I8 copies; 4: I4 copies (half the bytes, coarser; docs/native.md)

    def __post_init__(self):
        if self.quant not in CONVERT_BITS:
            raise ValueError(f"quant {self.quant!r} is not one of {', '.join(CONVERT_BITS)}")
        if not isinstance(self.threads, int) or isinstance(self.threads, bool):
            raise ValueError(f"threads must be an integer (0: all CPUs, -n: all but n), got {self.threads!r}")
        if self.stream_max_tokens < 1:
            raise ValueError(f"stream_max_tokens must be >= 1, got {self.stream_max_tokens}")
        if self.isa is not None and self.isa not in ISAS:
            raise ValueError(f"isa {self.isa!r} is not one of {', '.join(ISAS)}")
        if isinstance(self.repack, bool):    # YAML 1.1 reads a bare on / off as true / false
            object.__setattr__(self, "repack", "on" if self.repack else "off")
        if self.repack not in REPACK:
            raise ValueError(f"repack {self.repack!r} is not one of {', '.join(REPACK)}")
        if not isinstance(self.int8_prefill, bool):
            raise ValueError(f"int8_prefill must be true or false, got {self.int8_prefill!r}")
        g = self.int8_group
        pair = isinstance(g, (list, tuple)) and len(g) == 2
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 and v % 64 == 0
                   for v in (g if pair else [g])):
            raise ValueError(f"int8_group must be 0 (the default for each matrix), a multiple of 64, or a pair "
                             f"[gate/up, down] of them, got {g!r}")
        if pair:
            object.__setattr__(self, "int8_group", tuple(g))
        if isinstance(self.int8_bits, bool) or self.int8_bits not in (8, 4):
            raise ValueError(f"int8_bits must be 8 (I8 copies) or 4 (I4 copies), got {self.int8_bits!r}")


def _quantize(w: torch.Tensor, quant: str, name: str) -> tuple[int, torch.Tensor]:
    """Dense [R, C] -> (ggml type, uint8 [R, row_bytes]) in the requested format."""
    import gguf

    from ..weights.kquant import quantize_rows
    qt = gguf.GGMLQuantizationType(NATIVE_TYPES[quant])
    try:
        return NATIVE_TYPES[quant], quantize_rows(w.detach().to("cpu"), qt)
    except ValueError as exc:      # rows not whole blocks, NaN / Inf, past the fp16 block scale
        raise UnsupportedQuantError(f"cannot store as {quant}: {exc}; choose quant=bf16 or q8_0", tensor=name) from None


_WARNED = False                          # the stream-ordered path's unavailability was reported


def _env_off() -> bool:
    """KTINJECT_STREAM_ORDERED=0 turns the stream-ordered path off (A/B measurements)."""
    import os
    return os.environ.get("KTINJECT_STREAM_ORDERED", "1").strip() in ("0", "false", "no", "off")


@register("cpu_experts")
class CpuExperts(Operator):
    Options = CpuExpertsOptions
    replaces = EXPERT_CLASSES
    device_types = ("cpu",)
    summary = "native routed experts on GGUF blocks (AVX2/AVX-512/AMX), async submit/sync"

    def __init__(self, num_experts: int, hidden: int, inter: int, options: CpuExpertsOptions, name: str = ""):
        super().__init__()
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.options, self.name = options, name
        self.kernel = None
        self._loaded_prefix: Optional[str] = None
        self._pending = None
        self._jobs: dict = {}                 # (device, T, k) -> hostfn.HostJob

    @classmethod
    def build(cls, original: nn.Module, ctx: BuildContext) -> nn.Module:
        e, h, i = fused_expert_shape(original, ctx, "cpu_experts")
        act = getattr(ctx.config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ModelError(f"{ctx.name}: cpu_experts computes SiLU(gate) * up; the model uses {act!r}")
        if getattr(original, "has_bias", False):
            raise ModelError(f"{ctx.name}: cpu_experts has no expert biases")
        from .. import native
        if not native.available():
            raise NativeError(f"{ctx.name}: {native.missing_reason()}")
        return cls(e, h, i, ctx.options or CpuExpertsOptions(), ctx.name)

    @classmethod
    def planned_bytes(cls, original: nn.Module, ctx: BuildContext) -> dict[str, int]:
        opts = ctx.options or CpuExpertsOptions()
        return {"cpu": cls.routed_bytes(original, ctx.name, ctx, opts.quant)}

    @staticmethod
    def routed_bytes(experts: nn.Module, name: str, ctx: BuildContext, quant: str) -> int:
        """The experts' bytes in RAM: the file's own where the plan sees a GGUF file whose blocks the
        kernels read (mapped, zero copy; load-time copies such as R16 or I8 not counted), else the
        weights converted to `quant`."""
        total = 0
        for key, layouts in (("gate_up_proj", ("plain", "gate_up")), ("down_proj", ("plain",))):
            p = getattr(experts, key, None)
            if not isinstance(p, torch.Tensor):   # (a class whose weights are named otherwise: convert all)
                return int(sum(q.numel() for q in experts.parameters()) * CONVERT_BITS[quant] / 8)
            kept = stored_bytes(ctx, f"{name}.{key}", KEPT_TYPES, layouts)
            total += kept if kept is not None else int(p.numel() * CONVERT_BITS[quant] / 8)
        return total

    # ---------------------------------------------------------------- loading

    def _matrices(self, gu: Any, down: Any, prefix: str):
        from ..native import ExpertMatrix
        E, H, I = self.num_experts, self.hidden, self.inter
        key_gu, key_d = prefix + "gate_up_proj", prefix + "down_proj"
        if logical_shape(gu) != (E, 2 * I, H):
            raise LoadError("tensor shape differs from the model",
                            mismatched=[f"{key_gu} (file {list(logical_shape(gu))}, model {[E, 2 * I, H]})"])
        if logical_shape(down) != (E, H, I):
            raise LoadError("tensor shape differs from the model",
                            mismatched=[f"{key_d} (file {list(logical_shape(down))}, model {[E, H, I]})"])
        if isinstance(gu, FusedTensor) and len(gu.parts) == 2 and gu.dim == 1:
            gate = self._one(gu.parts[0], key_gu + "[gate]", I, H)
            up = self._one(gu.parts[1], key_gu + "[up]", I, H)
        else:
            t, data = self._raw(gu, key_gu, 2 * I, H)
            gate = ExpertMatrix(t, data, E, I, H, key_gu + "[gate]", stride=2 * I, offset=0)
            up = ExpertMatrix(t, data, E, I, H, key_gu + "[up]", stride=2 * I, offset=I)
        return gate, up, self._one(down, key_d, H, I)

    def _one(self, t: Any, name: str, rows: int, cols: int):
        from ..native import ExpertMatrix
        ggml, data = self._raw(t, name, rows, cols)
        return ExpertMatrix(ggml, data, self.num_experts, rows, cols, name)

    def _raw(self, t: Any, name: str, rows: int, cols: int) -> tuple[int, torch.Tensor]:
        """(ggml type, uint8 rows [E*rows, row_bytes]) of one stacked weight, converting if needed."""
        if isinstance(t, GGMLTensor):
            if t.ggml_type in NATIVE_TYPES.values():
                data = t.data if t.data.is_contiguous() else t.data.contiguous()
                return t.ggml_type, data
            if not self.options.convert_unsupported:
                raise UnsupportedQuantError(
                    f"GGML type {t.type_name} has no native kernel (native: "
                    f"{', '.join(k for k in NATIVE_TYPES)}); set kwargs convert_unsupported: true to convert it "
                    f"to {self.options.quant} at load", file=t.file or None, tensor=t.name or name)
            log.warning("%s: converting %s to %s at load (convert_unsupported)", name, t.type_name, self.options.quant)
            dense = t.dequantize(torch.float32)
        elif isinstance(t, FusedTensor):
            dense = t.dequantize(torch.float32)
        elif isinstance(t, torch.Tensor):
            dense = t
        else:
            raise LoadError(f"unsupported weight kind {type(t).__name__}", mismatched=[name])
        return _quantize(dense.reshape(-1, cols), self.options.quant, name)

    def load_weights(self, prefix: str, source: Mapping[str, Any]) -> set[str]:
        keys = {prefix + "gate_up_proj", prefix + "down_proj"}
        if self._loaded_prefix == prefix and self.kernel is not None:
            return keys                       # already loaded (a parent `moe` asked first)
        missing = sorted(k for k in keys if k not in source)
        if missing:
            raise LoadError("tensor not found in the weights", missing=missing)
        from ..native import MoEKernel
        gate, up, down = self._matrices(source[prefix + "gate_up_proj"], source[prefix + "down_proj"], prefix)
        self.kernel = MoEKernel(gate, up, down, threads=self.options.threads, isa=self.options.isa,
                                repack=REPACK[self.options.repack],
                                int8_prefill=True if self.options.int8_prefill else None,
                                int8_group=self.options.int8_group, int8_bits=self.options.int8_bits)
        if self._jobs and torch.cuda.is_available():   # queued host functions may still use the old jobs
            for dev in {key[0] for key in self._jobs}:
                torch.cuda.synchronize(dev)
        self._jobs.clear()                    # stream-ordered jobs were bound to the previous kernel
        self._loaded_prefix = prefix
        return keys

    def decode_job_serials(self) -> list[int]:
        """The serials of the stream-ordered jobs of one-token steps (what a captured decode graph
        calls into; a new job, even at a recycled address, has a new serial)."""
        return [job.serial for (_, tokens, _), job in self._jobs.items() if tokens == 1]

    # ---------------------------------------------------------------- compute

    def _inputs(self, hidden_states, top_k_index, top_k_weights):
        if self.kernel is None:
            raise NativeError(f"{self.name or 'cpu_experts'}: weights are not loaded")
        # hidden: [T, H] -> f32 CPU; ids: [T, k] -> i64 CPU; weights: [T, k] -> f32 CPU. Dtypes are
        # converted where the tensors are (the GPU) and only then copied: a conversion on the CPU is
        # a torch parallel op whose OpenMP threads then spin against the native pool's workers.
        x = hidden_states.detach().to(torch.float32).to("cpu").contiguous()
        ids = top_k_index.detach().to(torch.int64).to("cpu").contiguous()
        w = top_k_weights.detach().to(torch.float32).to("cpu").contiguous()
        return x, ids, w

    # ---------------------------------------------------------------- stream-ordered path

    @property
    def supports_cuda_graph(self) -> bool:
        """Decode (CUDA inputs of few tokens) is captured through host-function nodes when the
        stream-ordered path is usable; the generation engine asks before capturing."""
        return self._stream_ordered_usable()

    def _stream_ordered_usable(self) -> bool:
        if not self.options.stream_ordered or _env_off():
            return False
        from ..native import hostfn
        if hostfn.available():
            return True
        if torch.cuda.is_available():         # wanted and on a GPU machine, but unusable: say why, once
            global _WARNED
            if not _WARNED:
                _WARNED = True
                try:
                    hostfn.driver()
                    why = "the native library is missing"
                except NativeError as exc:
                    why = str(exc)
                log.warning("cpu_experts: stream-ordered decode is off (%s); routed experts are handed over "
                            "from Python and decode runs without a CUDA graph", why)
        return False

    def _stream_job(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor):
        """The HostJob for these inputs, or None when they take the Python-driven path."""
        if hidden_states.device.type != "cuda" or hidden_states.dim() != 2:
            return None
        T, k = hidden_states.shape[0], top_k_index.shape[-1]
        if not 0 < T <= self.options.stream_max_tokens or not self._stream_ordered_usable():
            return None
        key = (hidden_states.device, T, k)
        job = self._jobs.get(key)
        if job is None:
            from ..native import hostfn
            job = self._jobs[key] = hostfn.HostJob(self.kernel, T, k, hidden_states.device, self.name)
        return job

    def submit(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> None:
        """Start the routed experts on the CPU pool and return at once (see `sync`)."""
        if self._pending is not None:
            raise NativeError(f"{self.name or 'cpu_experts'}: submit() twice without sync()")
        if self.kernel is None:
            raise NativeError(f"{self.name or 'cpu_experts'}: weights are not loaded")
        job = self._stream_job(hidden_states, top_k_index)
        if job is not None:
            from ..native import hostfn
            hostfn.raise_pending(self.name)
            # the stream copies exactly [T, H], [T, k], [T, k] from these tensors' memory: check first
            if hidden_states.dim() != 2 or hidden_states.shape[-1] != self.hidden or top_k_index.dim() != 2 \
                    or top_k_index.shape[0] != hidden_states.shape[0] or top_k_weights.shape != top_k_index.shape:
                raise NativeError(f"{self.name or 'cpu_experts'}: hidden_states {list(hidden_states.shape)}, "
                                  f"top_k_index {list(top_k_index.shape)} and top_k_weights "
                                  f"{list(top_k_weights.shape)} do not fit [T, {self.hidden}], [T, k], [T, k]")
            if top_k_index.device != hidden_states.device or top_k_weights.device != hidden_states.device:
                raise NativeError(f"{self.name or 'cpu_experts'}: hidden_states on {hidden_states.device}, "
                                  f"top_k_index on {top_k_index.device}, top_k_weights on {top_k_weights.device}: "
                                  f"a stream-ordered job needs them on one GPU")
            job.submit(hidden_states.detach(), top_k_index.detach(), top_k_weights.detach())
            self._pending = (job, hidden_states.dtype)
            return
        x, ids, w = self._inputs(hidden_states, top_k_index, top_k_weights)
        self.kernel.submit(x, ids, w)
        self._pending = (hidden_states.device, hidden_states.dtype)

    def sync(self, add: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Wait for the submitted work; the result [T, H] on the caller's device and dtype, plus
        `add` when given (the `moe` block's shared experts: summed in the same pass on CUDA)."""
        if self._pending is None:
            raise NativeError(f"{self.name or 'cpu_experts'}: sync() without submit()")
        where, dtype = self._pending
        self._pending = None
        if not isinstance(where, torch.device):          # a HostJob: recorded on the stream
            return where.sync(dtype, add)
        out = self.kernel.sync()
        if where.type == "cpu":
            out = out.to(dtype)
        else:
            out = out.to(device=where, non_blocking=True).to(dtype)      # copy, then convert on the device
        return out if add is None else out + add

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        self.submit(hidden_states, top_k_index, top_k_weights)
        return self.sync()

    def extra_repr(self) -> str:
        return (f"op=cpu_experts, experts={self.num_experts}, hidden={self.hidden}, inter={self.inter}, "
                f"threads={self.options.threads or 'all'}, quant={self.options.quant}"
                + (f", r16={'+'.join(self.kernel.repacked)}" if self.kernel is not None and self.kernel.repacked else "")
                + (f", int{self.kernel.int8_bits}={'+'.join(self.kernel.int8_copies)} (groups {self.kernel.int8_groups[0]}/"
                   f"{self.kernel.int8_groups[1]})" if self.kernel is not None and self.kernel.int8_copies else ""))
