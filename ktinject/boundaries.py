"""Device boundaries along the model's trunk, and moving tensors across them once.

The trunk is the path the hidden state takes: the modules before the decoder-layer list
(embedding), each decoder layer in order, the modules after it (final norm), then the root's
remaining children (`lm_head`). Modules without parameters (rotary embeddings) are not
stages. A *boundary* is a stage whose device differs from the previous stage's: that is
where hidden states, positions and masks must cross. Layers may be spread over any number
of devices (`cpu`, `cuda:0`, `cuda:1`, ...); the plan lists the boundaries and `ktinject
explain` prints them.

At run time each hooked module moves its tensor inputs to its own device through a
`TransferMemo`, which the root model clears at the start and end of every forward pass: the
rotary position embeddings and the attention mask computed once at the bottom of the model
cross to each device once per forward, not once per layer.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn


@dataclass(frozen=True)
class Boundary:
    module: str          # first stage on the new device, e.g. "model.layers.14"
    src: str             # device of the previous stage
    dst: str             # device of this stage

    def __str__(self) -> str:
        return f"{self.module}: {self.src} -> {self.dst}"


def _is_layer_list(name: str, names: Sequence[str]) -> bool:
    """True when `name` has numbered children (`name.0`, `name.1`, ...), i.e. a ModuleList."""
    return f"{name}.0" in names and f"{name}.1" in names


def trunk(entries: Sequence[Any], has_params: Optional[set] = None) -> list[Any]:
    """The plan entries along the hidden state's path (see module docstring), in order.

    `entries` are `PlanEntry`s in module order; a stage is a direct child of the decoder
    stack's parent, a child of the stack itself, or a direct child of the root. `has_params`
    (names of modules that own parameters somewhere below) filters out parameter-less modules.
    """
    names = [e.name for e in entries]
    by_depth = [e for e in entries if e.name.count(".") <= 2]
    lists = [n for n in names if _is_layer_list(n, names)]
    if not lists:
        return []
    stack = max(lists, key=lambda n: sum(1 for m in names if m.startswith(n + ".") and m.count(".") == n.count(".") + 1))
    parent = stack.rsplit(".", 1)[0] if "." in stack else ""
    out = []
    for e in by_depth:
        n = e.name
        if n == stack or n == parent or n == "":
            continue
        in_parent = (n.rsplit(".", 1)[0] if "." in n else "") == parent
        in_stack = n.startswith(stack + ".") and n.count(".") == stack.count(".") + 1
        at_root = "." not in n and n != parent.split(".")[0]
        if (in_parent or in_stack or at_root) and (has_params is None or n in has_params):
            out.append(e)
    return out


def canonical(device: str) -> str:
    """`cuda` means `cuda:0` (the device index a bare `cuda` tensor gets in a fresh process)."""
    return "cuda:0" if device == "cuda" else device


def boundaries(entries: Sequence[Any], has_params: Optional[set] = None) -> tuple[Boundary, ...]:
    stages = trunk(entries, has_params)
    out = []
    for prev, cur in zip(stages, stages[1:]):
        if canonical(cur.device) != canonical(prev.device):
            out.append(Boundary(cur.name, prev.device, cur.device))
    return tuple(out)


class TransferMemo:
    """Per-forward memo of device copies: a tensor crosses to a given device once.

    Keys hold the source tensor itself (so its id cannot be reused while the memo lives) and
    its version counter (an in-place change makes a fresh copy; inference-mode tensors have none,
    and within one forward pass the model's inputs are not changed in place). `transfers` counts
    copies.
    """

    def __init__(self) -> None:
        self._moved: dict[tuple[int, torch.device], tuple[torch.Tensor, int, torch.Tensor]] = {}
        self.transfers = 0

    def clear(self) -> None:
        self._moved.clear()

    def move(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        if t.device == device:
            return t
        key = (id(t), device)
        version = None if t.is_inference() else t._version    # inference tensors keep no version counter
        hit = self._moved.get(key)
        if hit is not None and hit[0] is t and hit[1] == version:
            return hit[2]
        # host -> device copies may be asynchronous; device -> host copies must complete before use
        moved = t.to(device, non_blocking=device.type != "cpu")
        self._moved[key] = (t, version, moved)
        self.transfers += 1
        return moved

    def move_all(self, obj: Any, device: torch.device) -> Any:
        if isinstance(obj, torch.Tensor):
            return self.move(obj, device)
        if isinstance(obj, tuple):
            return tuple(self.move_all(o, device) for o in obj)
        if isinstance(obj, list):
            return [self.move_all(o, device) for o in obj]
        if isinstance(obj, dict):
            return {k: self.move_all(v, device) for k, v in obj.items()}
        return obj


def attach_memo(model: nn.Module) -> TransferMemo:
    """The model's memo, created once and cleared around every forward of the root module."""
    memo = getattr(model, "ktinject_transfers", None)
    if memo is None:
        memo = TransferMemo()
        model.ktinject_transfers = memo
        model.register_forward_pre_hook(lambda mod, args: memo.clear())
        model.register_forward_hook(lambda mod, args, out: memo.clear())
    return memo


def cuda_index(device: Any) -> int:
    """The index of a CUDA device; a bare `cuda` is the current GPU."""
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def make_current(device: torch.device) -> None:
    """Make a CUDA device current (a bare `cuda`, the current one, changes nothing)."""
    if device.index is not None and torch.cuda.current_device() != device.index:
        torch.cuda.set_device(device.index)


def attach_device_restore(model: nn.Module) -> None:
    """Around every forward of the root: note the current CUDA device, and restore it at the end
    (also when the forward raises), since the stages' hooks switch it as the hidden state moves
    from GPU to GPU."""
    if getattr(model, "ktinject_device_restore", False):
        return
    model.ktinject_device_restore = True
    local = threading.local()              # each calling thread restores its own device

    def enter(mod, args):
        local.__dict__.setdefault("saved", []).append(torch.cuda.current_device() if torch.cuda.is_available() else -1)

    def leave(mod, args, out):
        saved = local.__dict__.get("saved")
        if saved:
            index = saved.pop()
            if index >= 0:
                make_current(torch.device("cuda", index))

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)
