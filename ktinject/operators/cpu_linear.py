"""`cpu_linear`: a linear layer on the CPU whose weight stays in GGML blocks.

A GGUF weight of a type the native kernels read (Q4_0, Q5_0, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
IQ4_XS, BF16, F16, F32) is kept as the file stores it (memory-mapped, no copy); float weights (a
safetensors model, or the few dense tensors a GGUF reader rebuilds) keep their float type by
default (`quant: auto`, exact) or are converted at load (`quant: q8_0`, ...).

Up to `gemv_max_tokens` tokens (decode, prompts) the native kernels run over the CPU experts'
thread pool: each 64-row chunk of the weight is read once, in its quantized form, for all the
tokens, as llama.cpp does on the CPU, with multi-row dot products per token below 16 tokens and,
from 16 tokens on for the types the 8-bit grouped kernels take (Q4_0, Q5_0, Q8_0, Q2_K, Q3_K, Q4_K,
Q5_K, Q6_K, IQ4_XS on AVX-512; all but Q8_0 and IQ4_XS on AVX2), the MoE layer's grouped 8-bit GEMM (tokens packed in panels
of 16); while that pool is busy with the routed experts (the `moe` operator runs the shared
experts meanwhile) the calling thread computes alone. Longer inputs dequantize the rows in chunks of `chunk_mb` and multiply with
torch (float weights: the dots only up to 8 tokens, where they beat torch's own kernels), in
bfloat16 where the CPU multiplies it natively (AMX-BF16 or AVX512-BF16: `prefill_dtype: auto`),
else in float32. The maths is `y = x W^T + b` with W the dequantized weight; on the dot path the
quantized types take 8-bit activations (one scale per 32 values, per 256 for the K-quants: the
native dots' format), on the bfloat16 path both operands and the result are rounded to bfloat16
(8-bit significands, as fine as the dots' 8-bit activations; torch sums in float32).
"""
from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
from torch import nn

from ..errors import LoadError
from .base import BuildContext, Operator, source_weight, stored_bytes, whole_block_rows
from .cpu_experts import CONVERT_BITS, NATIVE_TYPES
from .registry import register

log = logging.getLogger(__name__)

# quant option -> (GGML type id, bits per weight for the plan's byte count): cpu_experts' tables
QUANTS = {q: (NATIVE_TYPES[q], {**CONVERT_BITS, "f16": 16.0}[q])
          for q in ("q8_0", "q4_k", "q6_k", "bf16", "f16", "f32")}
_FLOAT = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
_ELEMENT = {NATIVE_TYPES[name]: dtype for dtype, name in _FLOAT.items()}   # GGML float types -> torch dtype
ELEMENT_GEMV_MAX = 8        # float weights: the native dots beat torch only up to here (2 AVX2 cores)
# gemv_max_tokens when not set: where dequantize + torch's GEMM overtakes the native kernels (measured
# with scripts/cpu_linear_crossover.py on V2-Lite's dense shapes; docs/operators.md). The per-token
# dots: about 128 tokens with bf16 GEMMs (16-core Xeon with AMX, 2-core Zen 4), about 300 with
# float32 ones (2 AVX2 cores). The grouped 8-bit GEMM: past 1024 tokens on the Zen 4 (0.3-0.8x the
# bf16 path's time at 256-1024); on the Xeon not yet measured.
GEMV_MAX_BF16, GEMV_MAX_F32, GEMV_MAX_GROUPED = 128, 256, 1024
PREFILL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_SCRATCH = threading.local()  # one dequantization buffer per thread, shared by the layers


@functools.lru_cache(maxsize=1)
def cpu_multiplies_bf16() -> bool:
    """Whether this CPU has bfloat16 dot-product instructions (AMX-BF16 or AVX512-BF16), so that
    torch's bfloat16 GEMM runs faster than its float32 one (2.0-2.6x at 512 tokens on the lent Xeon);
    without them torch emulates bfloat16 and is slower."""
    from ..cli.doctor import cpu_flags
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags()[1])


@dataclass(frozen=True)
class CpuLinearOptions:
    quant: str = "auto"          # weights not already GGML rows the kernels read: auto keeps their float
                                 # type (exact); q8_0, q4_k, q6_k, bf16, f16, f32 convert at load
    threads: int = 0             # the native pool (0: all CPUs; the CPU experts' pool of the same size)
    gemv_max_tokens: Optional[int] = None   # above: dequantize in chunks and multiply with torch (None:
                                 # 1024 where the grouped 8-bit GEMM takes the type, else 128 where
                                 # torch multiplies in bfloat16, 256 in float32)
    chunk_mb: int = 64           # float32 megabytes dequantized at a time on that path
    prefill_dtype: str = "auto"  # that path's GEMM: bfloat16, float32, or auto (bfloat16 where the CPU
                                 # has AMX-BF16 or AVX512-BF16, unless the weight is float32 / float16)

    def __post_init__(self):
        if self.quant != "auto" and self.quant not in QUANTS:
            raise ValueError(f"quant must be auto or one of {', '.join(QUANTS)}, got {self.quant!r}")
        if self.threads < 0 or (self.gemv_max_tokens is not None and self.gemv_max_tokens < 0) or self.chunk_mb < 1:
            raise ValueError("threads and gemv_max_tokens must be >= 0, chunk_mb >= 1")
        if self.prefill_dtype != "auto" and self.prefill_dtype not in PREFILL_DTYPES:
            raise ValueError(f"prefill_dtype must be auto, {' or '.join(PREFILL_DTYPES)}, got {self.prefill_dtype!r}")

    def resolved(self, element: Optional[torch.dtype] = None, grouped: bool = False) -> tuple[int, torch.dtype]:
        """(gemv_max_tokens, the prefill GEMM's dtype) with `auto` / None decided for this CPU and a
        weight whose rows are GGML blocks (element None) or floats of `element`: float32 and float16
        weights keep float32 (their precision was asked for), blocks and bfloat16 rows take bfloat16.
        grouped: the native grouped 8-bit GEMM takes the weight's type (`native.linear_grouped_from`)."""
        name = self.prefill_dtype
        if name == "auto":
            exact = element in (torch.float32, torch.float16)
            name = "bfloat16" if cpu_multiplies_bf16() and not exact else "float32"
        dtype = PREFILL_DTYPES[name]
        limit = self.gemv_max_tokens
        if limit is None:
            limit = GEMV_MAX_GROUPED if grouped else GEMV_MAX_BF16 if dtype == torch.bfloat16 else GEMV_MAX_F32
        return limit, dtype


@register("cpu_linear")
class CpuLinear(Operator):
    Options = CpuLinearOptions
    replaces = ("Linear",)
    device_types = ("cpu",)
    summary = "linear on the CPU with GGML-block weights (as the GGUF stores them): native dots, grouped 8-bit GEMM for prompts"
    # decode: the native pool does the work; torch's OpenMP threads spinning between the small
    # ops left would take its workers' cores (2 cores, V2-Lite: 16.5 -> 24.0 tok/s)
    decode_torch_threads = 1

    def __init__(self, in_features: int, out_features: int, bias: bool, options: CpuLinearOptions, name: str):
        super().__init__()
        self.in_features, self.out_features, self.options, self.name = in_features, out_features, options, name
        self.has_bias = bias
        self.ggml_type = -1
        self._pool = None                 # set at load: the native pool (None: the calling thread)
        self.register_buffer("qweight", torch.empty(0, dtype=torch.uint8, device="meta"), persistent=False)
        self.register_buffer("bias", torch.empty(out_features, device="meta") if bias else torch.empty(0),
                             persistent=False)

    @classmethod
    def build(cls, original: nn.Module, ctx: BuildContext) -> nn.Module:
        return cls(original.in_features, original.out_features, original.bias is not None,
                   ctx.options or CpuLinearOptions(), ctx.name)

    @classmethod
    def planned_bytes(cls, original: nn.Module, ctx: BuildContext) -> dict[str, int]:
        """With `quant: auto`: the file's bytes where the plan sees a GGUF file and the weight is of a type the
        kernels read (kept as stored, zero copy); else the float size, an upper bound (a GGUF weight kept in
        its blocks is 2-7x smaller)."""
        opts = ctx.options or CpuLinearOptions()
        bias = original.out_features * 4 if original.bias is not None else 0
        kept = stored_bytes(ctx, ctx.name + ".weight", NATIVE_TYPES.values()) if opts.quant == "auto" else None
        if kept is not None:
            return {"cpu": kept + bias}
        n = original.weight.numel()
        bits = QUANTS[opts.quant][1] if opts.quant != "auto" else (ctx.dtype or original.weight.dtype).itemsize * 8
        return {"cpu": int(n * bits / 8) + bias}

    def load_weights(self, prefix: str, source: Mapping[str, Any]) -> set[str]:
        from .. import native
        from ..weights.kquant import quantize_rows
        from ..weights.tensor import GGMLTensor, as_dense
        key = prefix + "weight"
        t = source_weight(source, key, (self.out_features, self.in_features))
        if isinstance(t, GGMLTensor) and t.ggml_type in NATIVE_TYPES.values():
            self.ggml_type, data = int(t.ggml_type), t.data.reshape(self.out_features, -1)
        else:
            from gguf import GGMLQuantizationType as QT
            dense = as_dense(t)
            if self.options.quant != "auto":
                wanted = [self.options.quant, "q8_0", "bf16"]
            elif isinstance(t, GGMLTensor):       # blocks the kernels cannot read (Q4_1, IQ2...)
                wanted = ["q8_0", "bf16"]
            else:                                 # a float weight: kept exact
                wanted = [_FLOAT.get(dense.dtype, "f32")]
            quant = next(q for q in wanted if native.row_bytes_or_none(QUANTS[q][0], self.in_features) is not None)
            if quant != wanted[0] or isinstance(t, GGMLTensor):
                log.info("%s: %s stored as %s (%d inputs)", key,
                         t.type_name if isinstance(t, GGMLTensor) else wanted[0], quant, self.in_features)
            self.ggml_type = QUANTS[quant][0]
            try:
                data = quantize_rows(dense, QT(self.ggml_type))
            except ValueError as exc:          # NaN / Inf, or past the type's fp16 block scale
                raise LoadError(f"{key}: cannot be stored as {quant}: {exc}") from None
        self.qweight = whole_block_rows(data, self.ggml_type, self.in_features, key)
        keys = {key}
        if self.has_bias:
            from ..load import fetch_dense
            keys.add(prefix + "bias")
            self.bias = fetch_dense(source, prefix + "bias", (self.out_features,), torch.float32, torch.device("cpu"))
        self._pool = native.default_pool(self.options.threads)
        self._isa = native.isa_index()                    # resolved once: forward runs per token
        element = _ELEMENT.get(self.ggml_type)
        self._element = element
        limit, self._mm_dtype = self.options.resolved(
            element, grouped=element is None and native.linear_grouped_from(self.ggml_type, self._isa) > 0)
        self._gemv_limit = min(limit, ELEMENT_GEMV_MAX) if element is not None else limit
        return keys

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .. import native
        # x: [..., in] -> [..., out], returned on x's device and dtype
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.name or 'cpu_linear'}: input of {x.shape[-1]} features, the layer takes "
                             f"{self.in_features}")
        x2 = x.detach().reshape(-1, self.in_features).to("cpu", torch.float32).contiguous()
        T = x2.shape[0]
        if T <= self._gemv_limit:            # the weight was checked at load (and C checks again)
            y = native.linear_checked_rows(self._pool, self._isa, self.ggml_type, self.qweight, self.in_features, x2)
        elif self._element == torch.float32 and self._mm_dtype == torch.float32:   # float32 rows already
            y = x2 @ self.qweight.view(torch.float32).view(self.out_features, self.in_features).T
        elif self._element == self._mm_dtype:    # bf16 rows multiplied in bf16 as they are
            w = self.qweight.view(self._element).view(self.out_features, self.in_features)
            y = (x2.to(self._mm_dtype) @ w.T).float()
        else:
            y = torch.empty(T, self.out_features, dtype=torch.float32)
            step = max(1, (self.options.chunk_mb << 20) // (4 * self.in_features))
            need = min(step, self.out_features) * self.in_features
            scratch = getattr(_SCRATCH, "buf", None)
            if scratch is None or scratch.numel() < need:
                scratch = _SCRATCH.buf = torch.empty(need, dtype=torch.float32)
            xm = x2.to(self._mm_dtype)
            for r0 in range(0, self.out_features, step):
                r1 = min(r0 + step, self.out_features)
                w = native.dequant_rows(self._pool, self.ggml_type, self.qweight[r0:r1], self.in_features, out=scratch)
                y[:, r0:r1] = xm @ w.T if self._mm_dtype == torch.float32 else (xm @ w.to(self._mm_dtype).T).float()
        if self.has_bias:
            y += self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.device, x.dtype)

    def extra_repr(self) -> str:
        from gguf import GGMLQuantizationType as QT
        kind = QT(self.ggml_type).name if self.ggml_type >= 0 else self.options.quant
        return f"op=cpu_linear, in={self.in_features}, out={self.out_features}, weight={kind}"
