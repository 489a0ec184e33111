"""`ktinject synth --arch NAME [--layers N] [--recipe q4_k_m] OUT.gguf`: a random-weight GGUF
with the exact shapes and metadata of a public model."""
from __future__ import annotations

import time
from pathlib import Path

from ._common import add_writer_arguments, apply_threads

NAME = "synth"
HELP = "write a random-weight GGUF with the shapes and metadata of a public model (no download)"


def add_arguments(p) -> None:
    from ..weights.gguf_write import PRESETS
    from ..weights.synth import SHAPES
    p.add_argument("out", type=Path, help="output .gguf path")
    p.add_argument("--arch", required=True, choices=sorted(SHAPES), help="which public model's shapes")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N layers")
    p.add_argument("--recipe", default="q4_k_m", choices=sorted(PRESETS), help="tensor type recipe (default q4_k_m)")
    p.add_argument("--seed", type=int, default=0)
    add_writer_arguments(p)


def run(args) -> int:
    from . import console
    from ..weights.synth import synthesize
    apply_threads(args)
    start = time.perf_counter()
    files = synthesize(args.arch, args.out, layers=args.layers, recipe_name=args.recipe, seed=args.seed,
                       split_max_size=args.split_max_size, progress=not args.no_progress)
    elapsed = time.perf_counter() - start
    size = sum(f.stat().st_size for f in files)
    console.print(f"wrote {', '.join(str(f) for f in files)}: {size / 2**20:.1f} MiB in {elapsed:.1f} s "
                  f"({size / 2**20 / max(elapsed, 1e-9):.0f} MiB/s)")
    return 0
