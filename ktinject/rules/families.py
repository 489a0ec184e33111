"""Which shipped pack fits a model: a table from transformers `model_type` to pack name."""
from __future__ import annotations

from typing import Any

from ..errors import ModelError

FAMILY_PACKS = {
    "deepseek_v2": "deepseek-v2",
    "deepseek_v3": "deepseek-v3",
    "qwen2_moe": "qwen2-moe",
    "qwen3_moe": "qwen3-moe",
    "mixtral": "mixtral",
}
CPU_OVERLAY = "-cpu"


def default_pack(config: Any, cuda: bool) -> str:
    """The family's hybrid pack when `cuda`, else its CPU overlay."""
    model_type = getattr(config, "model_type", None)
    try:
        base = FAMILY_PACKS[model_type]
    except KeyError:
        raise ModelError(f"no shipped rule pack for model type {model_type!r}; pass --rules "
                         f"(families with packs: {', '.join(sorted(FAMILY_PACKS))})") from None
    return base if cuda else base + CPU_OVERLAY
