"""The operator contract: what every injected module provides.

An operator is an `nn.Module` subclass registered under a YAML name.  Injection happens in
two steps that never touch real memory before loading:

1. `build(original, ctx)` runs while the skeleton is on the meta device and returns the
   replacement module (it may keep some of the original's children).
2. `load_weights(prefix, source)` pulls this module's tensors from a weight source (a
   `Mapping[str, WeightLike]` keyed by transformers state-dict names), places them on the
   planned device (possibly repacked or kept quantized) and returns the keys it consumed.

`Options` is a frozen dataclass: a rule's `kwargs` are checked against its fields (unknown
keys are errors) and it validates values in `__post_init__` by raising `ValueError`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Container, Mapping, Optional

import torch
from torch import nn

from ..weights.tensor import Stored


@dataclass(frozen=True)
class NoOptions:
    """For operators that take no kwargs."""


@dataclass(frozen=True)
class BuildContext:
    name: str                          # dotted module name in the model, e.g. model.layers.3.mlp
    device: torch.device               # where the operator lives (the generate-phase device)
    prefill_device: torch.device       # equal to `device` unless the rule splits by phase
    generate_device: torch.device
    dtype: Optional[torch.dtype]       # compute/storage dtype for dense weights (None: keep)
    config: Any                        # the model's transformers PretrainedConfig
    options: Any                       # an instance of the operator's Options dataclass
    stored: Optional[Callable[[str], Optional[Stored]]] = None   # the weight file's header (None: config only)


def stored_bytes(ctx: BuildContext, key: str, kept: Container[int], layouts: tuple[str, ...] = ("plain",)) -> Optional[int]:
    """The file's bytes for `key` when an operator keeps them as stored (zero copy from the mapping): every
    tensor behind it of a GGML type in `kept`, mapped by one of `layouts`. None when the plan has no file
    (a config only, a safetensors directory) or the operator would convert them: its upper bound then."""
    info = ctx.stored(key) if ctx.stored is not None else None
    if info is None or info.layout not in layouts or not all(t in kept for t, _ in info.parts):
        return None
    return info.nbytes


def module_matches(module: nn.Module, class_names: tuple[str, ...]) -> bool:
    """True when a class name (plain or qualified) appears along the module's MRO."""
    if not class_names:
        return True
    for klass in type(module).__mro__:
        if klass.__name__ in class_names or f"{klass.__module__}.{klass.__qualname__}" in class_names:
            return True
    return False


class Operator(nn.Module):
    """Base class of registered operators (see module docstring for the contract)."""

    op_name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    # Class names (compared along the original module's MRO) this operator can replace; () = any.
    replaces: ClassVar[tuple[str, ...]] = ()
    # Device types the operator can run on.
    device_types: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    # A one-line description shown by `ktinject explain` and the operator reference.
    summary: ClassVar[str] = ""

    @classmethod
    def build(cls, original: nn.Module, ctx: BuildContext) -> nn.Module:
        raise NotImplementedError(f"operator {cls.op_name!r} does not implement build()")

    @classmethod
    def planned_bytes(cls, original: nn.Module, ctx: BuildContext) -> dict[str, int]:
        """Bytes this operator will hold per device. Default: the original's parameters."""
        total = 0
        for p in original.parameters():
            itemsize = (ctx.dtype or p.dtype).itemsize if p.is_floating_point() else p.element_size()
            total += p.numel() * itemsize
        return {str(ctx.device): total}

    def load_weights(self, prefix: str, source: Mapping[str, Any]) -> set[str]:
        raise NotImplementedError(f"operator {self.op_name!r} does not implement load_weights()")

    def extra_repr(self) -> str:
        return f"op={self.op_name}"


def source_weight(source: Mapping[str, Any], key: str, shape: tuple[int, ...]) -> Any:
    """`source[key]`, checked to exist and to have the model's `shape` (LoadError naming the key)."""
    from ..errors import LoadError
    from ..weights.tensor import logical_shape
    if key not in source:
        raise LoadError("tensor not found in the weights", missing=[key])
    t = source[key]
    if tuple(logical_shape(t)) != tuple(shape):
        raise LoadError("tensor shape differs from the model",
                        mismatched=[f"{key} (file {list(logical_shape(t))}, model {list(shape)})"])
    return t


def whole_block_rows(data: torch.Tensor, ggml_type: int, n: int, key: str) -> torch.Tensor:
    """GGML rows (uint8 [rows, bytes]) checked to hold whole blocks of n values, made contiguous."""
    from .. import native
    from ..errors import LoadError
    if data.shape[1] != native.row_bytes_or_none(ggml_type, n):
        raise LoadError("tensor rows do not hold whole blocks of their type",
                        mismatched=[f"{key} ({n} values per row, {data.shape[1]} bytes)"])
    return data if data.is_contiguous() else data.contiguous()


def options_fields(options_cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(options_cls)}
