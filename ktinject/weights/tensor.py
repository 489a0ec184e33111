"""Tensor kinds a weight source can hand out, besides plain `torch.Tensor`.

* `GGMLTensor`: a quantized (or raw F16/BF16/F32) GGML tensor kept exactly as stored: the
  GGML type, the logical shape in torch order, and the raw bytes (zero copy: usually a view
  of a memory-mapped file). CPU operators compute on the blocks directly.
* `FusedTensor`: several tensors concatenated along one dimension, lazily. GGUF stores the
  routed experts' gate and up projections apart; transformers 5 fuses them as
  `gate_up_proj: [E, 2*I, H]` (gate first). The fused view keeps the parts zero copy.

`as_dense(t, dtype, device)` turns any of these into a plain tensor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch


@dataclass(frozen=True, eq=False)
class GGMLTensor:
    ggml_type: int                 # a gguf.GGMLQuantizationType value
    shape: tuple[int, ...]         # logical torch order: [out, in] or [E, out, in]; the last dim is the row
    data: torch.Tensor             # uint8 [prod(shape[:-1]), row_bytes], CPU, contiguous rows of blocks
    name: str = ""                 # tensor name in its file, for error messages
    file: str = ""                 # file it came from, for error messages

    @property
    def type_name(self) -> str:
        import gguf
        return gguf.GGMLQuantizationType(self.ggml_type).name

    @property
    def row_bytes(self) -> int:
        return int(self.data.shape[-1])

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32,
                   device: Optional[Union[str, torch.device]] = None) -> torch.Tensor:
        """Dense tensor of `self.shape` (vectorized torch; runs on `device` when given)."""
        from .quants import dequantize  # implemented per GGML type in quants.py
        return dequantize(self, dtype=dtype, device=device)

    def select(self, index: int) -> "GGMLTensor":
        """Slice along dim 0 of a 3-D tensor (one expert), zero copy."""
        if len(self.shape) != 3:
            raise ValueError(f"select() needs a 3-D tensor, {self.name} is {self.shape}")
        rows = self.shape[1]
        return GGMLTensor(self.ggml_type, self.shape[1:], self.data[index * rows:(index + 1) * rows],
                          f"{self.name}[{index}]", self.file)

    def __repr__(self) -> str:
        return f"GGMLTensor({self.name!r}, {self.type_name}, shape={list(self.shape)})"


@dataclass(frozen=True, eq=False)
class FusedTensor:
    parts: tuple                   # tensors (torch.Tensor or GGMLTensor) with equal shapes but on `dim`
    dim: int                       # the dimension they are concatenated along (non-negative)
    name: str = ""

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.parts[0].shape)
        shape[self.dim] = sum(int(p.shape[self.dim]) for p in self.parts)
        return tuple(shape)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dequantize(self, dtype: torch.dtype = torch.float32,
                   device: Optional[Union[str, torch.device]] = None) -> torch.Tensor:
        return torch.cat([as_dense(p, dtype, device) for p in self.parts], dim=self.dim)

    def __repr__(self) -> str:
        return f"FusedTensor({self.name!r}, dim={self.dim}, parts={list(self.parts)})"


WeightLike = Union[torch.Tensor, GGMLTensor, FusedTensor]


@dataclass(frozen=True)
class Stored:
    """What a weight file holds for one checkpoint key, read from its header alone (no tensor data):
    the layout that maps it (weights/gguf_names.py: plain, gate_up, stacked, ...) and the GGML type and
    byte count of each file tensor behind it."""
    layout: str
    parts: tuple[tuple[int, int], ...]

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.parts)


def as_dense(t: WeightLike, dtype: Optional[torch.dtype] = None,
             device: Optional[Union[str, torch.device]] = None) -> torch.Tensor:
    """Any weight as a plain tensor of `dtype` on `device` (None: keep the stored dtype / device)."""
    if isinstance(t, torch.Tensor):
        return t.to(device=device if device is not None else t.device, dtype=dtype or t.dtype)
    out = t.dequantize(dtype=torch.float32, device=device)
    return out.to(dtype or torch.float32)


def logical_shape(t: WeightLike) -> tuple[int, ...]:
    return tuple(int(s) for s in t.shape)
