"""`plan(config_or_skeleton, rules) -> Plan`: where every module goes and what it becomes.

Pure data, no weights touched. Walk the module tree from the root; for each module the
first matching rule wins. A matched module gets the rule's op and device(s) (a device the
rule leaves out is inherited); an unmatched module inherits its parent's device and dtype,
the root those of `defaults`. `recursive: false` stops the descent: the whole subtree then
belongs to that module's entry.  Bytes are counted per device for the module's own tensors
(for an operator: its `planned_bytes` minus what its planned descendants count themselves).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn

from ..errors import PlacementError, RuleError
from ..operators import registry
from ..operators.base import BuildContext, module_matches
from .match import class_names, matches
from .model import Rule, RuleSet
from .parse import load_rules
from .skeleton import build_skeleton, config_dtype

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class PlanEntry:
    name: str                      # dotted module name ("" is the root)
    cls: str                       # the original module's class name
    rule: Optional[str]            # "file:line" of the matched rule; None when inherited
    op: str                        # op in the generate phase ("keep" when unmatched)
    device: str                    # device in the generate phase
    prefill_op: str
    prefill_device: str
    dtype: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    bytes: Mapping[str, int] = field(default_factory=dict)
    recursive: bool = True
    fallback: Optional[str] = None  # why and where a rule's fallback_device was used
    holds_params: bool = True      # the module or its subtree has parameters (rotary embeddings do not)

    @property
    def split(self) -> bool:
        return (self.prefill_op, self.prefill_device) != (self.op, self.device)

    @property
    def matched(self) -> bool:
        return self.rule is not None


@dataclass(frozen=True)
class Plan:
    entries: tuple[PlanEntry, ...]
    unmatched_rules: tuple[str, ...]        # descriptions of rules no module matched
    totals: Mapping[str, int]               # bytes per device
    default_device: str
    default_dtype: str
    files: tuple[str, ...] = ()
    rules: Optional[RuleSet] = field(default=None, compare=False, repr=False)
    # rules that matched modules, but each of those modules was taken by an earlier rule (an
    # including file's own rules come first): not mistakes, reported apart from unmatched_rules
    overridden_rules: tuple[str, ...] = ()

    def entry(self, name: str) -> PlanEntry:
        for e in self.entries:
            if e.name == name:
                return e
        raise KeyError(name)

    def by_name(self) -> dict[str, PlanEntry]:
        return {e.name: e for e in self.entries}

    @property
    def matched(self) -> tuple[PlanEntry, ...]:
        return tuple(e for e in self.entries if e.rule is not None)

    @property
    def fallbacks(self) -> tuple[PlanEntry, ...]:
        return tuple(e for e in self.entries if e.fallback)

    @property
    def boundaries(self) -> tuple:
        """Where the hidden state changes device along the trunk (see ktinject/boundaries.py)."""
        from ..boundaries import boundaries
        return boundaries(self.entries, {e.name for e in self.entries if e.holds_params})

    def to_dict(self) -> dict:
        return {"default_device": self.default_device, "default_dtype": self.default_dtype,
                "files": list(self.files), "totals": dict(self.totals),
                "boundaries": [vars(b) for b in self.boundaries],
                "unmatched_rules": list(self.unmatched_rules), "overridden_rules": list(self.overridden_rules),
                "modules": [{**asdict(e), "kwargs": dict(e.kwargs), "bytes": dict(e.bytes)} for e in self.entries]}

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)


def cuda_available(device: str) -> bool:
    if not device.startswith("cuda"):
        return True
    if not torch.cuda.is_available():
        return False
    index = int(device.split(":")[1]) if ":" in device else 0
    return index < torch.cuda.device_count()


def dtype_name(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def plan(config_or_skeleton: Any, rules: Any, *, dtype: Optional[torch.dtype] = None,
         check_devices: bool = False, stored: Optional[Callable[[str], Any]] = None) -> Plan:
    """Plan `rules` (a RuleSet, paths or pack names) over a model config or a skeleton module.

    `dtype` overrides the rule files' `defaults.dtype` (rules with their own `dtype` still win).
    `check_devices=True` (the loader's setting) also requires each planned CUDA device to exist:
    otherwise the rule's `fallback_device` is used and recorded, or a PlacementError is raised.
    `stored` (a GGUF source's `stored`: key -> `Stored` from the file's header) lets the operators that
    keep the file's blocks (`cpu_experts`, `cpu_linear`, `cpu_embedding`, `moe`) count the bytes the file
    holds; without it they count their upper bound (the float or conversion size).
    """
    ruleset = load_rules(rules)
    skeleton = config_or_skeleton if isinstance(config_or_skeleton, nn.Module) else None
    config = getattr(skeleton, "config", None) if skeleton is not None else config_or_skeleton
    root_dtype = dtype or DTYPES.get(ruleset.default_dtype or "") or config_dtype(config)
    if skeleton is None:
        skeleton = build_skeleton(config, root_dtype)
    walker = _Walker(ruleset, config, check_devices, stored)
    root_device = ruleset.default_device or "cpu"
    walker.check_inherited(root_device, "defaults.device")
    walker.walk(skeleton, "", root_device, root_device, dtype_name(root_dtype))
    if walker.unavailable:
        shown = ", ".join(walker.unavailable[:8]) + (" ..." if len(walker.unavailable) > 8 else "")
        raise PlacementError(f"{len(walker.unavailable)} placement(s) on a device this machine does not have: "
                             f"{shown}. Use a CPU layout (e.g. the pack's '-cpu' overlay) or add "
                             f"'fallback_device: cpu' to the rule.")
    totals: dict[str, int] = {}
    for e in walker.entries:
        for dev, n in e.bytes.items():
            totals[dev] = totals.get(dev, 0) + n
    unmatched = tuple(r.describe() for r in ruleset.rules if id(r) not in walker.used | walker.shadowed)
    overridden = tuple(r.describe() for r in ruleset.rules if id(r) in walker.shadowed and id(r) not in walker.used)
    return Plan(tuple(walker.entries), unmatched, totals, root_device, dtype_name(root_dtype), ruleset.files,
                ruleset, overridden)


def _tensor_bytes(t: torch.Tensor, dtype: torch.dtype) -> int:
    return t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size())


def own_bytes(module: nn.Module, dtype: torch.dtype, recurse: bool) -> int:
    total = sum(_tensor_bytes(p, dtype) for p in module.parameters(recurse=recurse))
    for mod in (module.modules() if recurse else (module,)):
        for name, b in mod.named_buffers(recurse=False):
            total += _tensor_bytes(b, dtype)
    return total


class _Walker:
    def __init__(self, ruleset: RuleSet, config: Any, check_devices: bool, stored: Optional[Callable[[str], Any]] = None):
        self.rules, self.config, self.check, self.stored = ruleset.rules, config, check_devices, stored
        self.entries: list[PlanEntry] = []
        self.used: set[int] = set()
        self.shadowed: set[int] = set()        # rules that matched a module an earlier rule had taken
        self.unavailable: list[str] = []

    def check_inherited(self, device: str, what: str) -> None:
        if self.check and not cuda_available(device) and what not in self.unavailable:
            self.unavailable.append(f"{what}={device}")

    def first_rule(self, name: str, module: nn.Module) -> Optional[Rule]:
        if not name:
            return None
        classes = class_names(module)
        first = None
        for rule in self.rules:
            if matches(rule, name, classes):
                if first is None:
                    first = rule
                    self.used.add(id(rule))
                else:
                    self.shadowed.add(id(rule))
        return first

    def walk(self, module: nn.Module, name: str, pre_dev: str, gen_dev: str, dtype: str) -> dict[str, int]:
        """Plan `module` and its subtree; returns the bytes its subtree counts per device (for parent ops)."""
        rule = self.first_rule(name, module)
        index = len(self.entries)
        self.entries.append(None)  # placeholder: children come after their parent
        tdtype = DTYPES[dtype]
        if rule is None:
            entry = PlanEntry(name, type(module).__name__, None, registry.KEEP, gen_dev, registry.KEEP, pre_dev,
                              dtype, {}, {gen_dev: own_bytes(module, tdtype, False)} if pre_dev == gen_dev else
                              {gen_dev: own_bytes(module, tdtype, False), pre_dev: own_bytes(module, tdtype, False)})
            recurse = True
        else:
            entry = self.matched_entry(rule, module, name, pre_dev, gen_dev, dtype)
            recurse = entry.recursive
        # an op counted its whole subtree (in its dtype, or as it converts it); its planned descendants
        # count their own share, which is subtracted from the op's, device by device
        subtracts = rule is not None and entry.recursive and (entry.op != registry.KEEP or entry.prefill_op != registry.KEEP)
        child_bytes: dict[str, int] = {}
        counted: dict[str, int] = {}   # what the op itself may have counted for its children's subtrees
        if recurse:
            for child_name, child in module.named_children():
                full = f"{name}.{child_name}" if name else child_name
                got = self.walk(child, full, entry.prefill_device, entry.device, entry.dtype)
                for dev, n in got.items():
                    child_bytes[dev] = child_bytes.get(dev, 0) + n
                if not subtracts:
                    continue
                if len(got) == 1:   # a child that keeps a file's blocks counts less than the op's float view of it
                    (dev, n), = got.items()
                    got = {dev: max(n, own_bytes(child, DTYPES[entry.dtype], True))}
                for dev, n in got.items():
                    counted[dev] = counted.get(dev, 0) + n
        if subtracts:
            b = dict(entry.bytes)
            for dev, n in counted.items():
                if dev in b:
                    b[dev] = max(0, b[dev] - n)
            entry = PlanEntry(**{**entry.__dict__, "bytes": b})
        holds = next(module.parameters(), None) is not None
        if holds != entry.holds_params:
            entry = PlanEntry(**{**entry.__dict__, "holds_params": holds})
        self.entries[index] = entry
        total = dict(child_bytes)
        for dev, n in entry.bytes.items():
            total[dev] = total.get(dev, 0) + n
        return total

    def matched_entry(self, rule: Rule, module: nn.Module, name: str, pre_dev: str, gen_dev: str,
                      dtype: str) -> PlanEntry:
        dtype = rule.dtype or dtype
        tdtype = DTYPES[dtype]
        fallback = None
        resolved = {}
        for phase, inherited in (("prefill", pre_dev), ("generate", gen_dev)):
            choice = getattr(rule, phase)
            op_cls = registry.get(choice.op, file=rule.file, line=rule.line, key="replace.op")
            if op_cls is not None and op_cls.replaces and not module_matches(module, op_cls.replaces):
                raise RuleError(f"operator '{choice.op}' cannot replace {type(module).__name__} ({name})",
                                file=rule.file, line=rule.line, key="replace.op", allowed=op_cls.replaces)
            device = choice.device or inherited
            problem = None
            types = op_cls.device_types if op_cls is not None else ("cpu", "cuda")
            if device.split(":")[0] not in types:
                problem = f"operator '{choice.op}' cannot run on {device}"
            elif self.check and not cuda_available(device):
                problem = f"{device} is not available on this machine"
            if problem:
                fb = rule.fallback_device
                if fb is None or fb.split(":")[0] not in types or (self.check and not cuda_available(fb)):
                    if self.check and not cuda_available(device):
                        self.unavailable.append(f"{name} ({rule.where})")
                    else:
                        raise PlacementError(f"{rule.where}: {name}: {problem} and the rule gives no usable "
                                             f"fallback_device")
                else:
                    fallback = f"{device} -> {fb}: {problem}"
                    device = fb
            resolved[phase] = (choice, op_cls, device)
        split = (resolved["prefill"][0].op, resolved["prefill"][2]) != (resolved["generate"][0].op,
                                                                       resolved["generate"][2])
        recursive = rule.recursive and not split      # a phase-split module owns its subtree
        nbytes: dict[str, int] = {}
        seen = set()
        for phase in ("prefill", "generate"):
            choice, op_cls, device = resolved[phase]
            key = (choice.op, device, choice.options)
            if key in seen:
                continue
            seen.add(key)
            if op_cls is None:
                b = {device: own_bytes(module, tdtype, not recursive)}
            else:
                ctx = BuildContext(name, torch.device(device), torch.device(resolved["prefill"][2]),
                                   torch.device(resolved["generate"][2]), tdtype, self.config, choice.options,
                                   self.stored)
                b = op_cls.planned_bytes(module, ctx)
            for dev, n in b.items():
                nbytes[dev] = nbytes.get(dev, 0) + int(n)
        (pc, _, pdev), (gc, _, gdev) = resolved["prefill"], resolved["generate"]
        return PlanEntry(name, type(module).__name__, rule.where, gc.op, gdev, pc.op, pdev, dtype, dict(gc.kwargs),
                         nbytes, recursive, fallback)
