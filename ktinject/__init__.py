"""ktinject: YAML-driven operator injection for hybrid CPU/GPU inference of MoE models.

    import ktinject
    model, tokenizer = ktinject.optimize_and_load("DeepSeek-V2-Lite-Q4_K_M.gguf", rules="deepseek-v2")
    print(ktinject.generate(model, tokenizer, "Write a haiku", max_new_tokens=64).text)
"""
from __future__ import annotations

__version__ = "0.1.0"

from .errors import (KtInjectError, LoadError, ModelError, NativeError, PlacementError, RuleError,
                     UnknownOperatorError, UnsupportedQuantError, WeightError)

# Imported eagerly: importing the submodule `ktinject.generate` would otherwise rebind the
# package attribute `generate` to the module and hide the function.
from .generate import GenerationResult, generate, release_generation, stream_generate  # noqa: E402

_LAZY = {
    "optimize_and_load": ("ktinject.load", "optimize_and_load"),
    "plan": ("ktinject.rules.plan", "plan"),
    "load_rules": ("ktinject.rules.parse", "load_rules"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'ktinject' has no attribute {name!r}")


__all__ = ["GenerationResult", "generate", "release_generation", "stream_generate", "KtInjectError", "LoadError",
           "ModelError", "NativeError", "PlacementError", "RuleError", "UnknownOperatorError",
           "UnsupportedQuantError", "WeightError", *_LAZY]
