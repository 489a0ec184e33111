"""The model skeleton: the transformers model class built with parameters on the meta device.

Buffers stay real (they are small and some, like rotary `inv_freq`, are computed at
construction and never stored in checkpoints).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from torch import nn

from ..errors import ModelError


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Parameters registered inside the block go to meta; buffers stay real (accelerate's
    `init_empty_weights(include_buffers=False)` when accelerate is installed)."""
    try:
        from accelerate import init_empty_weights
    except ImportError:
        init_empty_weights = None
    if init_empty_weights is not None:
        with init_empty_weights(include_buffers=False):
            yield
        return
    original = nn.Module.register_parameter

    def register(module, name, param):
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            p = module._parameters[name]
            module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def build_skeleton(config: Any, dtype: Optional[torch.dtype] = None) -> torch.nn.Module:
    """A `PreTrainedModel` for `config` with every parameter on meta (allocates no weights)."""
    from transformers import AutoModelForCausalLM

    try:
        with params_on_meta():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype or config_dtype(config))
    except (ValueError, KeyError) as exc:
        raise ModelError(f"cannot build model type {getattr(config, 'model_type', '?')!r}: {exc}") from None
    return model.eval()


def config_dtype(config: Any) -> torch.dtype:
    """The dtype a config declares (`dtype` / `torch_dtype`), float32 when it declares none."""
    d = getattr(config, "dtype", None) or vars(config).get("torch_dtype")
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if isinstance(d, torch.dtype) else torch.float32
