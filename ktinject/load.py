"""`optimize_and_load`: config -> skeleton on meta -> plan -> apply -> strict streaming load.

1. config and tokenizer come from the model path (any format of `ktinject.weights`);
2. the transformers model is built with its parameters on meta (`rules.skeleton`);
3. `plan()` decides op, device(s), dtype per module (and checks the devices exist);
4. apply: matched modules are replaced, deepest first, by `op.build(...)` (still on meta);
   a rule whose phases differ becomes a `phase.PhaseDispatch` with one branch per phase;
5. load: each operator pulls its tensors with `load_weights`; every other module gets its
   direct parameters and persistent buffers from the source, converted straight to the
   planned dtype on the planned device. Tensors are taken one module at a time and the
   source may drop the file pages behind each (`release`), so the CPU never holds the whole
   checkpoint on top of what the plan keeps there.

Loading is strict: missing tensors, tensors nothing consumed, shape mismatches and
parameters left on meta are gathered into one `LoadError` that names each one.
When the plan uses more than one device, modules whose parent spans several devices get a
pre-forward hook that moves their tensor inputs to their own device.
"""
from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch
from torch import nn

from . import weights
from .boundaries import TransferMemo, attach_device_restore, attach_memo, cuda_index, make_current, trunk
from .errors import LoadError, ModelError
from .operators import registry
from .operators.base import BuildContext, Operator
from .phase import PhaseDispatch, current
from .rules.parse import load_rules
from .rules.plan import DTYPES, Plan, PlanEntry, plan
from .rules.skeleton import build_skeleton, config_dtype
from .weights.tensor import FusedTensor, as_dense, logical_shape

log = logging.getLogger(__name__)

_OPTIONS = ("config_dir", "tokenizer")


def optimize_and_load(model_path: Union[str, Path], rules: Any, *, dtype: Union[None, str, torch.dtype] = None,
                      **options):
    """Load the model at `model_path` with `rules` (paths, shipped pack names, or a RuleSet).

    `dtype` overrides the rule files' `defaults.dtype` (rules with their own `dtype` still win).
    Options: `config_dir` (a Hugging Face directory whose config/tokenizer to use instead of the
    model's own), `tokenizer=False` (skip loading the tokenizer).
    Returns `(model, tokenizer)`; `model.ktinject_plan` is the `Plan` that was applied.
    """
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise ModelError(f"unknown option(s) {', '.join(unknown)} (allowed: {', '.join(_OPTIONS)})")
    config_dir = options.get("config_dir")
    tdtype = _dtype(dtype)
    ruleset = load_rules(rules)
    config = weights.load_config(model_path, config_dir)
    root_dtype = tdtype or DTYPES.get(ruleset.default_dtype or "") or config_dtype(config)
    skeleton = build_skeleton(config, root_dtype)
    ties = _ties(skeleton)
    source = weights.open_source(model_path, config)
    if ties:
        source = _TiedSource(source, ties)
    try:   # (the plan counts the bytes a GGUF file holds for the operators that keep its blocks)
        the_plan = plan(skeleton, ruleset, dtype=root_dtype, check_devices=True, stored=getattr(source, "stored", None))
        apply(skeleton, the_plan, config)
        load_into(skeleton, the_plan, source, ties)
    finally:
        close = getattr(source, "close", None)
        if close:
            close()
    install_device_hooks(skeleton, the_plan)
    skeleton.ktinject_plan = the_plan
    tokenizer = weights.load_tokenizer(model_path, config_dir) if options.get("tokenizer", True) else None
    return skeleton, tokenizer


def _dtype(dtype: Union[None, str, torch.dtype]) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).replace("torch.", "")
    if name not in DTYPES:
        raise ModelError(f"unknown dtype {dtype!r} (allowed: {', '.join(sorted(DTYPES))})")
    return DTYPES[name]


# ---------------------------------------------------------------- apply

def _device(s: str) -> torch.device:
    return torch.device(s)


def _build(entry: PlanEntry, phase: str, original: nn.Module, config: Any, rule_choice) -> nn.Module:
    op_name = entry.prefill_op if phase == "prefill" else entry.op
    op_cls = registry.get(op_name)
    if op_cls is None:
        return original
    device = entry.prefill_device if phase == "prefill" else entry.device
    ctx = BuildContext(entry.name, _device(device), _device(entry.prefill_device), _device(entry.device),
                       DTYPES[entry.dtype], config, rule_choice.options)
    return op_cls.build(original, ctx)


def apply(skeleton: nn.Module, the_plan: Plan, config: Any) -> None:
    """Replace matched modules (deepest first), still on meta."""
    rules = {r.where: r for r in (the_plan.rules.rules if the_plan.rules else ())}
    todo = [e for e in the_plan.entries if e.rule and (e.op != registry.KEEP or e.prefill_op != registry.KEEP
                                                       or e.split)]
    for entry in sorted(todo, key=lambda e: -e.name.count(".")):
        rule = rules[entry.rule]
        original = skeleton.get_submodule(entry.name)
        gen = _build(entry, "generate", original, config, rule.generate)
        if entry.split:
            # each phase gets its own copy: branches never share (and so never re-place) submodules
            pre = _build(entry, "prefill", copy.deepcopy(original), config, rule.prefill)
            new = PhaseDispatch(pre, gen, _device(entry.prefill_device), _device(entry.device))
        else:
            new = gen
        if new is not original:
            skeleton.set_submodule(entry.name, new)


# ---------------------------------------------------------------- load

class _TiedSource(Mapping):
    """A source where a tied parameter's name (e.g. `lm_head.weight`) falls back to the name it is
    tied to (`model.embed_tokens.weight`) when the checkpoint stores it only once."""

    def __init__(self, source: Mapping[str, Any], ties: dict[str, str]):
        self.source, self.ties = source, ties

    def _key(self, key: str) -> str:
        return self.ties[key] if key not in self.source and key in self.ties else key

    def __getitem__(self, key: str):
        return self.source[self._key(key)]

    def __contains__(self, key: object) -> bool:
        return key in self.source or (key in self.ties and self.ties[key] in self.source)

    @property
    def stored(self):
        inner = getattr(self.source, "stored", None)
        return (lambda key: inner(self._key(key))) if inner is not None else None

    def __iter__(self):
        return iter(self.source)

    def __len__(self) -> int:
        return len(self.source)

    def origin(self, key: str) -> str:
        origin = getattr(self.source, "origin", None)
        return origin(self._key(key)) if origin else ""

    def release(self, key: str) -> None:
        release = getattr(self.source, "release", None)
        if release:
            release(self._key(key))

    def release_tensor(self, t: torch.Tensor) -> None:
        release = getattr(self.source, "release_tensor", None)
        if release:
            release(t)

    def close(self) -> None:
        close = getattr(self.source, "close", None)
        if close:
            close()


def _dense(t: Any, dtype: Optional[torch.dtype], device: torch.device, drop=None) -> torch.Tensor:
    """Like `as_dense`, but a FusedTensor of plain tensors is copied part by part into one
    preallocated output on the target device (no float32 detour, no second full copy).
    `drop(tensor)` (the source's `release_tensor`) is called on each part once it was copied."""
    if isinstance(t, FusedTensor) and _plain(t):
        out = torch.empty(logical_shape(t), dtype=dtype or _leaf_dtype(t), device=device)
        _fill(out, t, drop)
        return out
    if isinstance(t, torch.Tensor) and dtype is not None and not t.is_floating_point():
        dtype = None
    out = as_dense(t, dtype, device)
    if drop is not None and isinstance(t, torch.Tensor) and out.data_ptr() != t.data_ptr():
        drop(t)
    return out


def _plain(t: Any) -> bool:
    return isinstance(t, torch.Tensor) or (isinstance(t, FusedTensor) and all(_plain(p) for p in t.parts))


def _leaf_dtype(t: Any) -> torch.dtype:
    return t.dtype if isinstance(t, torch.Tensor) else _leaf_dtype(t.parts[0])


def _fill(out: torch.Tensor, t: Any, drop=None) -> None:
    if isinstance(t, torch.Tensor):
        out.copy_(t)
        if drop is not None:
            drop(t)
        return
    start = 0
    for p in t.parts:
        n = int(p.shape[t.dim])
        _fill(out.narrow(t.dim, start, n), p, drop)
        start += n


def fetch_dense(source: Mapping[str, Any], key: str, shape: tuple, dtype: Optional[torch.dtype],
                device: Union[str, torch.device]) -> torch.Tensor:
    """The tensor `key` of `source` as a plain tensor of `dtype` on `device`, checked against `shape`.

    Raises `LoadError` naming the tensor when it is missing or has another shape. Operators use
    this in `load_weights`.
    """
    try:
        t = source[key]
    except KeyError:
        raise LoadError("tensor not found in the weights", missing=[key]) from None
    have = logical_shape(t)
    if have != tuple(int(s) for s in shape):
        raise LoadError("tensor shape differs from the model", mismatched=[f"{key} (file {list(have)}, "
                                                                           f"model {list(shape)})"])
    return _dense(t, dtype, torch.device(device), getattr(source, "release_tensor", None))


class _Errors:
    def __init__(self):
        self.missing: list[str] = []
        self.mismatched: list[str] = []

    def add(self, exc: LoadError) -> None:
        self.missing += exc.missing
        self.mismatched += exc.mismatched
        for name in exc.unexpected:
            self.mismatched.append(name)


def _ties(skeleton: nn.Module) -> dict[str, str]:
    """Parameters shared by two modules (tied embeddings): later name -> first name."""
    first: dict[int, str] = {}
    ties = {}
    for mod_name, mod in skeleton.named_modules(remove_duplicate=False):
        for pname, p in mod._parameters.items():
            if p is None:
                continue
            full = f"{mod_name}.{pname}" if mod_name else pname
            if id(p) in first and first[id(p)] != full:
                ties[full] = first[id(p)]
            else:
                first.setdefault(id(p), full)
    declared = getattr(skeleton, "_tied_weights_keys", None)
    config = getattr(skeleton, "config", None)
    if isinstance(declared, dict) and getattr(config, "tie_word_embeddings", False):
        for target, src in declared.items():
            if isinstance(target, str) and isinstance(src, str) and "*" not in target + src:
                ties.setdefault(target, src)
    return ties


def load_dense_tree(module: nn.Module, prefix: str, source: Mapping[str, Any], device: torch.device,
                    dtype: Optional[torch.dtype], *, recurse: bool, ties: Optional[dict] = None,
                    loaded: Optional[dict] = None, errors: Optional[_Errors] = None) -> set[str]:
    """Load the parameters and persistent buffers of `module` (and of its subtree when `recurse`)."""
    used: set[str] = set()
    ties, loaded = ties or {}, loaded if loaded is not None else {}
    mods = module.named_modules() if recurse else [("", module)]
    for sub_name, mod in mods:
        if isinstance(mod, Operator) and mod is not module:
            continue
        base = f"{prefix}{sub_name}." if sub_name else prefix
        for pname, p in list(mod._parameters.items()):
            if p is None:
                continue
            key = base + pname
            tied = ties.get(key.rstrip("."))
            if tied and tied in loaded and key not in source and loaded[tied].device == device:
                mod._parameters[pname] = loaded[tied]
                continue
            src_key = tied if tied and key not in source else key
            try:
                t = fetch_dense(source, src_key, tuple(p.shape), dtype if p.is_floating_point() else None, device)
            except LoadError as exc:
                if errors is None:
                    raise
                errors.add(exc)
                continue
            new = nn.Parameter(t, requires_grad=False)
            mod._parameters[pname] = new
            loaded[key] = new
            used.add(src_key)
        for bname, b in list(mod._buffers.items()):
            if b is None:
                continue
            key = base + bname
            if bname in mod._non_persistent_buffers_set:
                mod._buffers[bname] = b.to(device)
                continue
            try:
                mod._buffers[bname] = fetch_dense(source, key, tuple(b.shape), b.dtype, device)
            except LoadError as exc:
                if errors is None:
                    raise
                errors.add(exc)
                continue
            used.add(key)
    return used


@torch.no_grad()
def load_into(model: nn.Module, the_plan: Plan, source: Mapping[str, Any], ties: Optional[dict] = None) -> None:
    """Fill every planned module of an applied skeleton from `source`; strict (see module doc)."""
    errors, consumed, loaded = _Errors(), set(), {}
    source_keys = set(source)
    release = getattr(source, "release", None)
    for entry in the_plan.entries:
        try:
            mod = model.get_submodule(entry.name) if entry.name else model
        except AttributeError:       # a child of an operator that did not keep it: the op owns it
            continue
        prefix = f"{entry.name}." if entry.name else ""
        device, dtype = _device(entry.device), DTYPES[entry.dtype]
        if _loaded_by_ancestor(model, entry.name, mod):
            continue
        try:
            if isinstance(mod, PhaseDispatch):
                used = mod.load_weights(prefix, source, lambda m, p, s, d: _load_branch(m, p, s, d, dtype, ties))
            elif isinstance(mod, Operator):
                used = set(mod.load_weights(prefix, source))
            else:
                used = load_dense_tree(mod, prefix, source, device, dtype, recurse=not entry.recursive,
                                       ties=ties, loaded=loaded, errors=errors)
        except LoadError as exc:
            errors.add(exc)
            continue
        consumed |= {ties.get(k, k) if ties and k not in source_keys else k for k in used}
        if release:
            for key in used:
                release(key)
    unexpected = sorted(source_keys - consumed)
    for name, p in model.named_parameters():
        if p.is_meta and not any(name.startswith(m) or name == m for m in errors.missing):
            errors.missing.append(name)
    for name, b in model.named_buffers():
        if b.is_meta:
            errors.missing.append(name)
    if errors.missing or unexpected or errors.mismatched:
        origin = getattr(source, "origin", None)
        where = f" ({origin(unexpected[0])})" if origin and unexpected else ""
        raise LoadError(f"the weights do not fit the model{where}", missing=sorted(set(errors.missing)),
                        unexpected=unexpected, mismatched=errors.mismatched)


def _loaded_by_ancestor(model: nn.Module, name: str, mod: nn.Module) -> bool:
    """True when an enclosing operator already filled this module (operators may load their whole
    subtree, delegating to nested operators); then the module is not loaded a second time."""
    parts = name.split(".") if name else []
    if not any(isinstance(model.get_submodule(".".join(parts[:i])), (Operator, PhaseDispatch))
               for i in range(1, len(parts))):
        return False
    own = list(mod.parameters()) + list(mod.buffers()) if isinstance(mod, Operator) else \
        list(mod._parameters.values()) + list(mod._buffers.values())
    return all(t is None or not t.is_meta for t in own)


def _load_branch(module: nn.Module, prefix: str, source, device: torch.device, dtype, ties) -> set[str]:
    if isinstance(module, Operator):
        return set(module.load_weights(prefix, source))
    return load_dense_tree(module, prefix, source, device, dtype, recurse=True, ties=ties)


# ---------------------------------------------------------------- cross-device calls

def install_device_hooks(model: nn.Module, the_plan: Plan) -> int:
    """Hooks on each child of a module spanning several devices (see docs/architecture.md,
    "Devices and boundaries"):

    * a plain module gets its tensor inputs moved to its device and, on a GPU, makes that GPU
      the current CUDA device, so kernels that launch on the current device (Triton) launch on
      the right one;
    * an operator or phase dispatcher that is a stage of the trunk (a decoder layer, the final
      norm, `lm_head`: the path the hidden state takes) and sits on a GPU gets the same, so it
      computes where its input already is and keeps its result there: the hidden state crosses
      each boundary once (left alone, an operator moves its input in and its result back);
    * any other operator or dispatcher is left alone: it moves its inputs itself and returns its
      result to the caller's device (stream-ordered CPU experts read their GPU inputs in place).

    The root restores the caller's current device when the forward ends, error or not. Copies go
    through the model's per-forward `TransferMemo`, so a tensor crosses to a device once per
    forward pass (see ktinject/boundaries.py). A bare `cuda` is the device current now, where
    loading put it. Returns the number of hooked children."""
    devices: dict[str, set[str]] = {}
    own: dict[str, str] = {}
    for e in the_plan.entries:
        own[e.name] = e.device
        parts = e.name.split(".") if e.name else []
        for i in range(len(parts) + 1):
            devices.setdefault(".".join(parts[:i]), set()).update({e.device, e.prefill_device})
    if len(devices.get("", ())) <= 1:
        return 0
    memo = attach_memo(model)
    if any(d.startswith("cuda") for d in devices[""]):
        attach_device_restore(model)
    stages = {e.name for e in trunk(the_plan.entries)}
    count = 0
    for name, mod in model.named_modules():
        if len(devices.get(name, ())) <= 1 or isinstance(mod, (nn.ModuleList, nn.ModuleDict)):
            continue                      # a container's members are hooked as its parent's children
        for full, child in _called_children(mod, name):
            if full not in own:
                continue
            if isinstance(child, (Operator, PhaseDispatch)) and \
                    (full not in stages or not any(d.startswith("cuda") for d in devices.get(full, ()))):
                continue
            phases = {k: _hook_device(str(v)) for k, v in child.devices.items()} \
                if isinstance(child, PhaseDispatch) else None
            child.register_forward_pre_hook(_make_hook(memo, _hook_device(own[full]), phases), with_kwargs=True)
            count += 1
    log.debug("installed %d device hooks", count)
    return count


def _hook_device(device: str) -> torch.device:
    """The planned device with a bare `cuda` resolved to the GPU current at load time (where its
    tensors went)."""
    dev = _device(device)
    if dev.type == "cuda" and dev.index is None:
        # without CUDA (a plan checked on the meta skeleton, the CPU tests) the first GPU stands in
        dev = torch.device("cuda", cuda_index(dev) if torch.cuda.is_available() else 0)
    return dev


def _called_children(mod: nn.Module, name: str):
    """(full name, module) of the children the parent's forward calls: the members of a
    ModuleList / ModuleDict (containers with no forward, whose hooks would never fire) stand for
    the container itself."""
    for child_name, child in mod.named_children():
        full = f"{name}.{child_name}" if name else child_name
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            yield from _called_children(child, full)
        else:
            yield full, child


def _make_hook(memo: TransferMemo, device: torch.device, phases: Optional[dict] = None):
    """Move a stage's inputs to its device and make that GPU current. A dispatcher goes by its
    phase's device (`phases`: those devices, a bare `cuda` resolved at load like `device`); in a
    CPU phase it moves its inputs itself."""
    def hook(module, args, kwargs):
        if isinstance(module, PhaseDispatch):
            dev = (phases or module.devices)[current()]
            if dev.type != "cuda":
                return None
        else:
            dev = device
        if dev.type == "cuda":
            make_current(dev)
        return memo.move_all(args, dev), memo.move_all(kwargs, dev)
    return hook
