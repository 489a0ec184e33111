"""The current inference phase, and the module that dispatches on it.

`generate.py` wraps the prompt pass in `with phase.use("prefill"):`; everything else runs in
the `"generate"` phase (the default). A rule with `prefill_op`/`generate_op` or
`prefill_device`/`generate_device` that differ becomes a `PhaseDispatch` holding one branch
per phase; each branch is loaded on its own device, and the call goes to the branch of the
current phase (inputs moved to its device, the result moved back).
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Mapping

import torch
from torch import nn

PHASES = ("prefill", "generate")
_CURRENT: contextvars.ContextVar[str] = contextvars.ContextVar("ktinject_phase", default="generate")


def current() -> str:
    """`"prefill"` or `"generate"`."""
    return _CURRENT.get()


@contextlib.contextmanager
def use(phase: str) -> Iterator[str]:
    """Run the block in `phase` (restored afterwards, also on error)."""
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}; phases: {', '.join(PHASES)}")
    token = _CURRENT.set(phase)
    try:
        yield phase
    finally:
        _CURRENT.reset(token)


def _move(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_move(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _move(v, device) for k, v in obj.items()}
    return obj


def _first_device(args, kwargs) -> torch.device | None:
    for obj in (*args, *kwargs.values()):
        if isinstance(obj, torch.Tensor):
            return obj.device
    return None


class PhaseDispatch(nn.Module):
    """Calls `prefill` or `generate` (two modules) according to `current()`."""

    def __init__(self, prefill: nn.Module, generate: nn.Module, prefill_device: torch.device,
                 generate_device: torch.device):
        super().__init__()
        self.prefill, self.generate = prefill, generate
        self.devices = {"prefill": prefill_device, "generate": generate_device}

    def forward(self, *args, **kwargs):
        phase = current()
        branch = self.prefill if phase == "prefill" else self.generate
        back = _first_device(args, kwargs)
        dev = self.devices[phase]
        out = branch(*_move(args, dev), **_move(kwargs, dev))
        return _move(out, back) if back is not None and back != dev else out

    def load_weights(self, prefix: str, source: Mapping[str, Any], load_branch) -> set[str]:
        """Load both branches from the same tensors; `load_branch(module, prefix, source, device)` loads one."""
        return (load_branch(self.prefill, prefix, source, self.devices["prefill"])
                | load_branch(self.generate, prefix, source, self.devices["generate"]))

    def extra_repr(self) -> str:
        return f"prefill on {self.devices['prefill']}, generate on {self.devices['generate']}"
