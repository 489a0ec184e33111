"""`linear_int4`: 4-bit weight-only linear for bf16/fp16 activations.

Weights (format in `kernels/int4_pack.py`) come from GGUF Q4_0 / Q4_K blocks by exact repack
(32-wide groups), or from any other source (Q8_0, BF16, F16, safetensors) through `as_dense`
and a min-max requantization with group size 128, 64, 32, ... or per channel.

On CUDA the weight is stored once, in the tiled layout of the decode kernel (`int4_pack.tile`:
tiles of 8P inputs, P = 16 or 32 words, chosen per shape class), converted at load. Paths,
chosen per call by the number of rows and recorded in `extra_repr` (so in the plan):

* `gemv` (CUDA, rows <= `gemv_max_batch`, at most 16): `int4_gemv_tiled` of `kernels/int4_triton.py`,
  its kernel and launch config by exact shape or shape class and rows bucket (`int4_triton.tiled_config`,
  tuned with `scripts/int4_sweep.py`): the Triton kernels, or where they measured faster the CUDA C ones
  of `kernels/int4_cuda.py` (NVRTC at first use; `KTINJECT_INT4_CUDA=0` turns them off);
* `tinygemm` (CUDA, bf16 activations, rows <= `gemv_max_batch`, K % 128 == 0, group 32..256):
  torch's `aten._weight_int4pack_mm` on a second int4 copy repacked to its layout at load; with
  `backend: tinygemm` always, with `auto` only for the shape classes and rows buckets where it
  measured faster than ours (`int4_triton.TINYGEMM_FASTER`, by shape or shape class);
* `dequant+matmul` (CUDA, more rows): a Triton dequantize into a temporary, then one matmul;
* `torch` (CPU, or `backend: torch`): the same math in plain torch, for CI and for checking.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional

import torch
from torch import nn

from ..errors import LoadError, PlacementError, WeightError
from ..weights import GGMLTensor, as_dense
from .base import BuildContext, Operator
from .kernels import int4_pack, triton_available
from .kernels.int4_pack import Int4Tiled, Int4Weight
from .registry import register

log = logging.getLogger(__name__)

# GGML types repacked without requantization (group size 32), by gguf.GGMLQuantizationType value.
_DIRECT_REPACK = {2: int4_pack.from_q4_0, 12: int4_pack.from_q4_k}
BACKENDS = ("auto", "tinygemm", "triton", "torch")
TINYGEMM_GROUPS = (32, 64, 128, 256)
ROWS_BUCKETS = (1, 4, 16)           # the rows classes launch configs are tuned for (int4_triton.rows_bucket)


@dataclass(frozen=True)
class Int4Options:
    # Group size along in_features: 32, 64, 128, 256 ...; -1 = one group per output channel.
    # None: 32 for GGUF Q4_0 / Q4_K weights (exact repack), 128 for everything else.
    group_size: Optional[int] = None
    gemv_max_batch: int = 16        # rows up to which the GEMV kernel runs (<= 16)
    # auto: our GEMV on CUDA (tinygemm where it measured faster), torch on CPU; triton: our kernels
    # only; tinygemm: torch's int4 kernel for bf16 decode (K % 128 == 0, group 32..256); torch
    backend: str = "auto"

    def __post_init__(self):
        g = self.group_size
        if g is not None and g != -1 and (g < 8 or g & (g - 1)):
            raise ValueError(f"group_size must be a power of two >= 8 or -1 (per channel), got {g}")
        if not 0 <= self.gemv_max_batch <= 16:
            raise ValueError(f"gemv_max_batch must be in 0..16, got {self.gemv_max_batch}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")



def _tinygemm_fits(n: int, k: int, group: int) -> bool:
    return (k % 128 == 0 and n % 8 == 0 and group in TINYGEMM_GROUPS
            and hasattr(torch.ops.aten, "_weight_int4pack_mm"))


def _wants_tinygemm(options: Int4Options, n: int, k: int, group: int, rows: Optional[int] = None,
                    device: Any = None) -> bool:
    """Does an [N, K] weight on `device` keep a tinygemm copy (rows None), or run tinygemm for `rows` rows?"""
    if options.backend not in ("auto", "tinygemm") or not _tinygemm_fits(n, k, group):
        return False
    if options.backend == "tinygemm":
        return True
    from .kernels import int4_cuda, int4_triton as T
    cuda_ok = device is not None and torch.device(device).type == "cuda" and int4_cuda.available(device)
    faster = T.tinygemm_buckets(n, k, group, cuda_ok)
    if rows is None:
        return any(T.rows_bucket(r) in faster for r in ROWS_BUCKETS if r <= max(options.gemv_max_batch, 1))
    return T.rows_bucket(rows) in faster


@register("linear_int4")
class Int4Linear(Operator):
    Options = Int4Options
    replaces = ("Linear",)
    device_types = ("cuda", "cpu")
    summary = "4-bit weight-only linear (Triton / CUDA GEMV at decode, dequantize+matmul at prefill)"
    # tests only: take the CUDA paths (tiled layout, Triton kernels) on CPU tensors, to run them under
    # TRITON_INTERPRET=1 on a machine without a GPU
    _kernels_on_cpu = False

    def __init__(self, in_features: int, out_features: int, bias: bool, options: Int4Options,
                 device: torch.device, dtype: Optional[torch.dtype] = None):
        super().__init__()
        if in_features % 8:
            raise ValueError(f"linear_int4 needs in_features divisible by 8, got {in_features}")
        self.in_features, self.out_features, self.options = in_features, out_features, options
        self.group_size = self._group_for(None)
        self.compute_dtype = dtype
        ng = -(-in_features // self.group_size)
        # plain layout: qweight int32 [N, K/8], scales/mins fp16 [N, NG]; tiled (CUDA, `pack` > 0):
        # qweight int32 [N, Kp/8], scales/mins fp16 [NG, N] (see int4_pack.Int4Tiled)   bias: [N]
        self.register_buffer("qweight", torch.empty(out_features, in_features // 8, dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.empty(out_features, ng, dtype=torch.float16, device=device))
        self.register_buffer("mins", torch.empty(out_features, ng, dtype=torch.float16, device=device))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype or torch.float32, device=device)
                             if bias else None)
        self.pack = 0                                  # 0: plain layout; P: tiled layout, P words a tile
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
        ng = -(-k // g)
        total = n * k // 2 + 4 * n * ng
        if ctx.device.type == "cuda" and ctx.options.backend != "torch":
            from .kernels import int4_triton as T
            span = 8 * T.tiled_pack(n, k, g)
            total = n * (-(-k // span) * span) // 2 + 4 * n * ng          # tiled: K padded to whole tiles
            if _wants_tinygemm(ctx.options, n, k, g, device=ctx.device):
                total += n * k // 2 + 4 * n * ng                            # the tinygemm copy
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
        n, k = self.out_features, self.in_features
        if shape != (n, k):
            raise WeightError(f"shape {list(shape)} does not match linear [{n}, {k}]", tensor=name)
        dev = getattr(self, "target_device", torch.device("cpu"))
        ggml_type = w.ggml_type if isinstance(w, GGMLTensor) else None
        self.group_size = g = self._group_for(ggml_type)
        if ggml_type in _DIRECT_REPACK and g == 32:
            packed = _DIRECT_REPACK[ggml_type](w.data, n, k, name or w.name)
        else:
            work = dev if dev.type == "cuda" else torch.device("cpu")
            packed = int4_pack.quantize(as_dense(w, torch.float32, work), g)
        packed = packed.to(dev)
        self.tg_weight = self.tg_scale_zero = None
        if dev.type == "cuda" and _wants_tinygemm(self.options, n, k, g, device=dev):
            self.tg_weight, self.tg_scale_zero = tinygemm_pack(packed)
        elif self.options.backend == "tinygemm":
            raise PlacementError(f"{name}: backend 'tinygemm' needs CUDA, K % 128 == 0 and group size in "
                                 f"{TINYGEMM_GROUPS} (have K={k}, group={g}, {dev})")
        self.pack = 0
        if self._kernel_device(dev) and self.options.backend != "torch" and triton_available():
            from .kernels import int4_triton as T
            tiled = int4_pack.tile(packed, T.tiled_pack(n, k, g))
            self.qweight, self.scales, self.mins, self.pack = tiled.qweight, tiled.scales, tiled.mins, tiled.pack
            self._reserve_workspace()
        else:
            self.qweight, self.scales, self.mins = packed.qweight, packed.scales, packed.mins

    def _reserve_workspace(self) -> None:
        """Size the shared split-K workspace for every rows bucket now: a CUDA-graph capture must not allocate."""
        from .kernels import int4_triton as T
        need = [0, 0, 0]                                  # fp32 partials, counters, fp32 accumulator
        for rows in {min(r, self.options.gemv_max_batch) for r in ROWS_BUCKETS}:
            cfg = self._gemv_config(rows, torch.bfloat16) if rows else None
            if cfg is not None:
                got = T.tiled_workspace_need(rows, self.out_features, self.weight_tiled.n_tiles, cfg)
                need = [max(a, b) for a, b in zip(need, got)]
                if cfg.mode in T.CUDA_MODES and self.qweight.is_cuda:
                    T.warm_up(self.weight_tiled, rows, cfg, self.bias is not None)   # compile now, not in a capture
        T.reserve_workspace(self.qweight.device, *need)

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
        """The weight in the plain layout (converted back from the tiled one when that is what is held)."""
        if self.pack:
            return int4_pack.untile(self.weight_tiled)
        return Int4Weight(self.qweight, self.scales, self.mins, self.group_size)

    @property
    def weight_tiled(self) -> Int4Tiled:
        if not self.pack:
            raise RuntimeError("this linear_int4 holds the plain layout (CPU, or backend torch)")
        return Int4Tiled(self.qweight, self.scales, self.mins, self.group_size, self.in_features, self.pack)

    def _gemv_config(self, rows: int, dtype: torch.dtype):
        """The tiled-GEMV launch config for `rows` rows of `dtype`, or None where that GEMV cannot run."""
        from .kernels import int4_triton as T
        cfg = T.tiled_config(rows, self.out_features, self.in_features, self.group_size)
        half = dtype in (torch.bfloat16, torch.float16)
        if cfg.mode in T.CUDA_MODES and not half:   # the CUDA kernels take half activations
            cfg = T.class_config(rows, self.out_features, self.in_features)
        if cfg.mode in ("dot", "dot_x") and (self.pack < 16 or not half):
            if rows > 4:
                return None                   # tensor cores and the CUDA kernels need half activations
            cfg = replace(cfg, mode="fma")
        return cfg

    def _kernel_device(self, dev: torch.device) -> bool:
        return dev.type == "cuda" or (self._kernels_on_cpu and dev.type == "cpu")

    def path(self, rows: int, dtype: torch.dtype = torch.bfloat16) -> str:
        """Which implementation runs for `rows` input rows of `dtype` on this module's device."""
        if not self._kernel_device(self.qweight.device) or self.options.backend == "torch":
            return "torch"
        if rows <= self.options.gemv_max_batch:
            if getattr(self, "tg_weight", None) is not None and dtype == torch.bfloat16 and \
                    _wants_tinygemm(self.options, self.out_features, self.in_features, self.group_size, rows,
                                    self.qweight.device):
                return "tinygemm"
            if not triton_available():
                return "torch"
            if not self.pack or self._gemv_config(rows, dtype) is not None:
                return "gemv"
        elif not triton_available():
            return "torch"
        return "dequant+matmul"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)                              # [M, K]
        rows = x2.shape[0]
        path = self.path(rows, x2.dtype)
        bias = self.bias.to(x2.dtype) if self.bias is not None else None
        if path == "tinygemm":
            y = torch.ops.aten._weight_int4pack_mm(x2.contiguous(), self.tg_weight, self.group_size,
                                                   self.tg_scale_zero)
            if bias is not None:
                y = y + bias
        elif path == "gemv":
            from .kernels import int4_triton as T
            if self.pack:
                y = T.int4_gemv_tiled(x2, self.weight_tiled, bias, self._gemv_config(rows, x2.dtype))
            else:                             # a plain-layout module moved to CUDA after load: the older GEMV
                y = T.int4_gemv(x2, self.qweight, self.scales, self.mins, self.group_size, bias)
        else:
            if path == "dequant+matmul":
                from .kernels import int4_triton as T
                if self.pack:
                    w = T.int4_dequantize_tiled(self.weight_tiled, x2.dtype)
                else:
                    w = T.int4_dequantize(self.qweight, self.scales, self.mins, self.group_size, x2.dtype)
            else:
                w = int4_pack.dequantize(self.weight_int4, x2.dtype)      # [N, K]
            y = nn.functional.linear(x2, w, bias)
        return y.reshape(*lead, self.out_features)

    def _path_label(self, rows: int) -> str:
        """`path(rows)`, with the GEMV's kernel mode (after any fallback) for `ktinject explain`."""
        path = self.path(rows)
        if path != "gemv" or not self.pack:
            return path
        from .kernels import int4_triton as T
        cfg = self._gemv_config(rows, torch.bfloat16)
        run = T.runnable_config(cfg, self.weight_tiled, rows, self.out_features, self.in_features,
                                self.qweight.device, torch.bfloat16)
        return f"gemv({run.mode})"

    def extra_repr(self) -> str:
        dev = self.qweight.device.type
        if self.path(1) == "torch":
            paths = "torch dequantize+matmul"
        else:
            by_rows = {r: self._path_label(r) for r in ROWS_BUCKETS if r <= max(self.options.gemv_max_batch, 1)}
            kinds = list(dict.fromkeys(by_rows.values()))
            paths = ", ".join(f"{k} at {'/'.join(str(r) for r, v in by_rows.items() if v == k)} rows" for k in kinds)
            paths += f" (bf16), dequant+matmul above {self.options.gemv_max_batch}"
        g = "per-channel" if self.group_size == self.in_features else str(self.group_size)
        layout = f", layout=tiled{self.pack}" if self.pack else ""
        return (f"op=linear_int4, in={self.in_features}, out={self.out_features}, group={g}, "
                f"bias={self.bias is not None}, device={dev}{layout}, path={paths}")


def tinygemm_pack(w: Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """Our int4 weight in the layout of `aten._weight_int4pack_mm` (same values, no requantization).

    tinygemm computes `(q - 8) * scale + zero` per group, so zero = min + 8 * scale.
    """
    q = int4_pack.unpack_nibbles(w.qweight)                                      # [N, K] uint8
    packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).contiguous(), 8)
    s = w.scales.to(torch.bfloat16)
    z = (w.mins.float() + 8 * w.scales.float()).to(torch.bfloat16)
    return packed, torch.stack([s, z], -1).transpose(0, 1).contiguous()          # [NG, N, 2]
