"""Hub checkpoint names -> transformers module state-dict names, one small table per architecture.

transformers 5 modules hold the routed experts fused: `...experts.gate_up_proj: [E, 2I, H]`
(gate rows first) and `...experts.down_proj: [E, H, I]`, while checkpoints on the hub (and
`save_pretrained`) store one matrix per expert: `...experts.N.{gate,up,down}_proj.weight`
(Mixtral: `block_sparse_moe.experts.N.{w1,w3,w2}.weight`). `map_names` renames with the
architecture's table, then stacks complete expert sets into `Fuse` recipes; the weight source
turns a recipe into a lazy `FusedTensor` over zero-copy views. Checkpoints that already hold
the fused names pass through unchanged.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Union


@dataclass(frozen=True)
class Leaf:
    name: str                 # tensor name in the checkpoint
    unsqueeze: bool = False   # add a leading [1] dim (one expert of a stack)


@dataclass(frozen=True)
class Fuse:
    parts: tuple              # Leaf or Fuse
    dim: int                  # concatenated along this dim


Recipe = Union[Leaf, Fuse]


@dataclass(frozen=True)
class NameTable:
    renames: tuple[tuple[str, str], ...] = ()    # (regex, replacement) applied in order
    ignore: tuple[str, ...] = ()                 # checkpoint names (regex fullmatch) that no module needs
    drop_extra_layers: bool = False              # drop `model.layers.N.*` with N >= num_hidden_layers (MTP)


_COMMON_IGNORE = (r".*\.rotary_emb\.inv_freq",)

_MIXTRAL = NameTable(renames=(
    (r"\.block_sparse_moe\.", ".mlp."),
    (r"(\.experts\.\d+)\.w1\.", r"\1.gate_proj."),
    (r"(\.experts\.\d+)\.w3\.", r"\1.up_proj."),
    (r"(\.experts\.\d+)\.w2\.", r"\1.down_proj."),
))

TABLES: dict[str, NameTable] = {
    "deepseek_v2": NameTable(),
    "deepseek_v3": NameTable(drop_extra_layers=True),
    "qwen2_moe": NameTable(),
    "qwen3_moe": NameTable(),
    "mixtral": _MIXTRAL,
}

_EXPERT = re.compile(r"(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight")
_LAYER = re.compile(r"model\.layers\.(\d+)\..*")


def table_for(config: Any) -> NameTable:
    return TABLES.get(getattr(config, "model_type", ""), NameTable())


def map_names(names: Iterable[str], config: Any) -> dict[str, Recipe]:
    """Module state-dict name -> recipe over checkpoint names. Unmapped expert parts stay under their
    own (renamed) names, so an incomplete expert set shows up as missing + unexpected tensors."""
    table = table_for(config)
    ignore = [re.compile(p) for p in (*_COMMON_IGNORE, *table.ignore)]
    layers = getattr(config, "num_hidden_layers", None)
    out: dict[str, Recipe] = {}
    experts: dict[str, dict[str, dict[int, str]]] = {}    # prefix -> proj -> expert -> file name
    for raw in names:
        if any(p.fullmatch(raw) for p in ignore):
            continue
        m = _LAYER.fullmatch(raw)
        if table.drop_extra_layers and m and layers is not None and int(m.group(1)) >= layers:
            continue
        name = raw
        for pattern, repl in table.renames:
            name = re.sub(pattern, repl, name)
        m = _EXPERT.fullmatch(name)
        if m:
            experts.setdefault(m["prefix"], {}).setdefault(m["proj"], {})[int(m["e"])] = raw
        out[name] = Leaf(raw)
    for prefix, projs in experts.items():
        ids = sorted(projs.get("down_proj", {}))
        complete = (ids == list(range(len(ids))) and ids
                    and all(sorted(projs.get(p, {})) == ids for p in ("gate_proj", "up_proj")))
        if not complete:
            continue
        # gate_up_proj: [E, 2I, H] = stack_e(cat(gate_e [I, H], up_e [I, H]))   down_proj: [E, H, I]
        out[f"{prefix}.gate_up_proj"] = Fuse(tuple(
            Fuse((Leaf(projs["gate_proj"][e], True), Leaf(projs["up_proj"][e], True)), dim=1) for e in ids), dim=0)
        out[f"{prefix}.down_proj"] = Fuse(tuple(Leaf(projs["down_proj"][e], True) for e in ids), dim=0)
        for e in ids:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                del out[f"{prefix}.{e}.{proj}.weight"]
    return out


def leaves(recipe: Recipe) -> list[Leaf]:
    if isinstance(recipe, Leaf):
        return [recipe]
    return [leaf for part in recipe.parts for leaf in leaves(part)]
