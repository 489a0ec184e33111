"""Operators from other packages arrive through the entry-point group `ktinject.operators`; the
skeleton works without accelerate."""
from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import pytest

from ktinject.errors import RuleError
from ktinject.operators import registry
from ktinject.operators.base import Operator


class _EP:
    name, value = "plug", "fake_ktinject_plugin"

    def load(self):
        mod = types.ModuleType(self.value)

        @dataclass(frozen=True)
        class PlugOptions:
            scale: float = 1.0

            def __post_init__(self):
                if self.scale <= 0:
                    raise ValueError("scale must be > 0")

        @registry.register("plugin_linear")
        class PlugLinear(Operator):
            Options = PlugOptions
            replaces = ("Linear",)

        mod.PlugLinear = PlugLinear
        sys.modules[self.value] = mod
        return mod


def test_entry_point_operator_is_usable_and_validated(tmp_path, monkeypatch):
    from ktinject.rules import load_rules
    monkeypatch.setattr(registry, "_LOADED", False)
    monkeypatch.setattr(registry, "entry_points", lambda group: [_EP()] if group == "ktinject.operators" else [])
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    assert "plugin_linear" in registry.names()
    ok = tmp_path / "ok.yaml"
    ok.write_text("version: 1\nrules:\n  - match: {name: lm_head}\n    replace: {op: plugin_linear, kwargs: {scale: 2}}\n")
    assert load_rules(ok).rules[0].generate.options.scale == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nrules:\n  - match: {name: lm_head}\n    replace:\n      op: plugin_linear\n"
                   "      kwargs: {scale: -1}\n")
    with pytest.raises(RuleError) as info:
        load_rules(bad)
    assert info.value.line == 6 and "scale must be > 0" in str(info.value)
    typed = tmp_path / "typed.yaml"
    typed.write_text("version: 1\nrules:\n  - match: {name: lm_head}\n    replace: {op: plugin_linear, "
                     "kwargs: {scale: fast}}\n")
    with pytest.raises(RuleError) as info:
        load_rules(typed)
    assert info.value.key == "rules[0].replace.kwargs.scale"


def test_skeleton_without_accelerate(monkeypatch):
    monkeypatch.setitem(sys.modules, "accelerate", None)
    from ktinject.rules.skeleton import build_skeleton
    from ktinject.testing import tiny_config
    m = build_skeleton(tiny_config("deepseek_v3"))
    assert all(p.is_meta for p in m.parameters())
    assert not any(b.is_meta for b in m.buffers())
    import torch
    assert torch.nn.Module.register_parameter.__name__ == "register_parameter"
