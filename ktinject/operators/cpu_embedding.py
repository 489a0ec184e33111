"""`cpu_embedding`: a token-embedding table on the CPU whose rows stay in GGML blocks.

transformers' `nn.Embedding` holds the table dense: DeepSeek-V2-Lite's 102400 x 2048 is 839 MB in
float32 (V3's 129280 x 7168: 3.7 GB) where the GGUF file stores 118 MB of Q4_K (Q4_K_M), and the
load dequantizes all of it (2.9 s on two cores of the development machine). This operator keeps
the file's rows as they are (memory-mapped, no copy) and dequantizes only the rows of the tokens
it is given, with the native kernels: `y[i] = dequant(row ids[i])`, as nn.Embedding would return
from the dequantized table (to the native dequantization's rounding, within 1e-6 of gguf's). Float
weights (safetensors, or F16 / BF16 / F32 GGUF tensors) are kept dense as stored where that type is no
wider than the model's (a bf16 table stays bf16, zero copy from the mapping, its looked-up rows cast to
the model's dtype), GGUF types the native kernels cannot read dense in the model's dtype; torch looks
them up. Token ids outside the table raise an error naming the id and the table size, where
nn.Embedding would raise an index error from deep inside torch.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from .base import BuildContext, Operator, source_weight, stored_bytes, whole_block_rows
from .cpu_experts import KEPT_TYPES, NATIVE_TYPES
from .registry import register

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuEmbeddingOptions:
    threads: int = 0      # the native pool that dequantizes looked-up rows (0: all CPUs, the CPU experts' pool)

    def __post_init__(self):
        if self.threads < 0:
            raise ValueError("threads must be >= 0")


@register("cpu_embedding")
class CpuEmbedding(Operator):
    Options = CpuEmbeddingOptions
    replaces = ("Embedding",)
    device_types = ("cpu",)
    summary = "token embeddings on the CPU with GGML-block rows (as the GGUF stores them), dequantized per looked-up token"

    def __init__(self, num_embeddings: int, embedding_dim: int, options: CpuEmbeddingOptions, name: str,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.options, self.name = num_embeddings, embedding_dim, options, name
        self.dtype = dtype
        self.ggml_type = -1
        self._pool = None
        # (one of the two holds the table after load; the other stays empty, not on meta)
        self.register_buffer("qweight", torch.empty(0, dtype=torch.uint8), persistent=False)
        self.register_buffer("dense", torch.empty(0), persistent=False)

    @classmethod
    def build(cls, original: nn.Module, ctx: BuildContext) -> nn.Module:
        if getattr(original, "max_norm", None) is not None:   # (no family here uses it: refused, not ignored)
            from ..errors import ModelError
            raise ModelError(f"{ctx.name}: cpu_embedding does not renormalize rows (max_norm="
                             f"{original.max_norm}); keep this embedding as it is")
        dtype = ctx.dtype or original.weight.dtype
        return cls(original.num_embeddings, original.embedding_dim, ctx.options or CpuEmbeddingOptions(), ctx.name,
                   dtype if dtype.is_floating_point else torch.float32)

    @classmethod
    def planned_bytes(cls, original: nn.Module, ctx: BuildContext) -> dict[str, int]:
        """The file's bytes where the plan sees a GGUF table in blocks the kernels read (kept as stored),
        else the dense size, an upper bound (a GGUF table kept in Q4_K blocks is 7x smaller than float32)."""
        from .. import native
        dtype = ctx.dtype or original.weight.dtype
        width = dtype.itemsize if dtype.is_floating_point else 4   # float tables kept as stored up to this width
        floats = [NATIVE_TYPES[n] for n, size in (("f32", 4), ("f16", 2), ("bf16", 2)) if size <= width]
        kept = stored_bytes(ctx, ctx.name + ".weight", {*KEPT_TYPES, *floats} if native.available() else floats)
        if kept is not None:
            return {"cpu": kept}
        return {"cpu": original.weight.numel() * dtype.itemsize}

    def load_weights(self, prefix: str, source: Mapping[str, Any]) -> set[str]:
        from .. import native
        from ..weights.tensor import GGMLTensor, as_dense
        key = prefix + "weight"
        want = (self.num_embeddings, self.embedding_dim)
        t = source_weight(source, key, want)
        if isinstance(t, GGMLTensor) and int(t.ggml_type) in NATIVE_TYPES.values() and native.available():
            self.qweight = whole_block_rows(t.data.reshape(self.num_embeddings, -1), int(t.ggml_type),
                                            self.embedding_dim, key)
            self.ggml_type = int(t.ggml_type)
            self._pool = native.default_pool(self.options.threads)
        else:                             # float rows, or blocks the kernels cannot read: a dense table
            if isinstance(t, GGMLTensor):
                log.info("%s: %s table kept dense in %s (%s)", key, t.type_name, self.dtype,
                         "no native library" if not native.available() else "a type the native kernels do not read")
            dense = as_dense(t)
            if isinstance(t, GGMLTensor) or not dense.is_floating_point() or dense.element_size() > self.dtype.itemsize:
                dense = dense.to(self.dtype)
            self.dense = dense.to(torch.device("cpu")).reshape(want).contiguous()
        return {key}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from .. import native
        if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise TypeError(f"{self.name or 'cpu_embedding'}: token ids of dtype {ids.dtype}, expected an integer type")
        flat = ids.reshape(-1).to("cpu", torch.int64)
        if flat.numel():
            lo, hi = int(flat.min()), int(flat.max())
            if lo < 0 or hi >= self.num_embeddings:
                bad = lo if lo < 0 else hi
                raise IndexError(f"{self.name or 'cpu_embedding'}: token id {bad} is outside the table of "
                                 f"{self.num_embeddings} rows")
        if self.ggml_type < 0:
            out = self.dense.index_select(0, flat).to(self.dtype)
        else:
            rows = self.qweight.index_select(0, flat)
            out = native.dequant_rows(self._pool, self.ggml_type, rows, self.embedding_dim).to(self.dtype)
        return out.reshape(*ids.shape, self.embedding_dim).to(ids.device)

    def extra_repr(self) -> str:
        from gguf import GGMLQuantizationType as QT
        kind = QT(self.ggml_type).name if self.ggml_type >= 0 else str(self.dtype).replace("torch.", "")
        return f"op=cpu_embedding, rows={self.num_embeddings}, dim={self.embedding_dim}, weight={kind}"
