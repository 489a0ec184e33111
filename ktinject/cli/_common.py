"""Helpers shared by the model commands (not a subcommand: the name starts with '_')."""
from __future__ import annotations

from typing import Optional


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def model_path(arg: Optional[str]):
    """MODEL argument, or the built-in default model when omitted."""
    if arg:
        return arg
    from ..default_model import default_model_path
    return default_model_path()


def pick_rules(rules: Optional[list], path, console, config_dir=None):
    """The rules given, or the model family's pack (hybrid with CUDA, else the CPU overlay)."""
    if rules:
        return rules
    import torch

    from ..rules.families import default_pack
    from ..weights import load_config
    cuda = torch.cuda.is_available()
    pack = default_pack(load_config(path, config_dir), cuda)
    console.print(f"[dim]rules:[/] shipped pack [bold]{pack}[/] ({'CUDA found' if cuda else 'no CUDA: CPU layout'})")
    return [pack]
