"""Frozen, typed rule objects. A `RuleSet` is what `load_rules` returns and `plan` consumes."""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Mapping, Optional



@dataclass(frozen=True)
class PhaseChoice:
    """What a rule asks for in one phase: the op, its validated options, and a device (None: inherit)."""
    op: str
    options: Any
    device: Optional[str]
    kwargs: Mapping[str, Any]


@dataclass(frozen=True)
class Rule:
    file: str
    line: int
    name: Optional[str]                    # regex source (fullmatch), or None
    classes: tuple[str, ...]               # plain or qualified class names; () = any
    prefill: PhaseChoice
    generate: PhaseChoice
    dtype: Optional[str] = None
    fallback_device: Optional[str] = None
    recursive: bool = True
    pattern: Optional[re.Pattern] = field(default=None, compare=False, repr=False)

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def split(self) -> bool:
        """True when the two phases differ (op, options or device)."""
        return self.prefill != self.generate

    @property
    def op(self) -> str:
        return self.generate.op

    def remapped(self, remap: Mapping[str, str]) -> "Rule":
        return replace(self, prefill=_remap_choice(self.prefill, remap), generate=_remap_choice(self.generate, remap),
                       fallback_device=remap_device(self.fallback_device, remap))

    def describe(self) -> str:
        what = []
        if self.name is not None:
            what.append(f"name={self.name!r}")
        if self.classes:
            what.append(f"class={'|'.join(self.classes)}")
        return f"{self.where} ({', '.join(what)})"


@dataclass(frozen=True)
class RuleSet:
    rules: tuple[Rule, ...] = ()
    default_device: Optional[str] = None
    default_dtype: Optional[str] = None
    files: tuple[str, ...] = ()            # every file read, in include order

    def __iter__(self):
        return iter(self.rules)

    def __len__(self) -> int:
        return len(self.rules)


def remap_device(device: Optional[str], remap: Mapping[str, str]) -> Optional[str]:
    """Apply a `remap:` table. `cuda` in the table also covers `cuda:N`."""
    if device is None or not remap:
        return device
    if device in remap:
        return remap[device]
    base = device.split(":")[0]
    return remap.get(base, device)


def _remap_choice(c: PhaseChoice, remap: Mapping[str, str]) -> PhaseChoice:
    return replace(c, device=remap_device(c.device, remap))


def freeze(d: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(d))
