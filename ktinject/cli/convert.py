"""`ktinject convert HF_DIR OUT.gguf [--preset q4_k_m]`: write a transformers model as GGUF."""
from __future__ import annotations

import time
from pathlib import Path

from ._common import add_writer_arguments, apply_threads

NAME = "convert"
HELP = "write a Hugging Face model directory as a GGUF file (llama.cpp names, per-tensor type presets)"


def add_arguments(p) -> None:
    from ..weights.gguf_write import PRESETS
    p.add_argument("hf_dir", type=Path, help="model directory (config.json + *.safetensors)")
    p.add_argument("out", type=Path, help="output .gguf path (split parts get -0000N-of-0000M)")
    p.add_argument("--preset", default="q4_k_m", choices=sorted(PRESETS),
                   help="tensor type recipe (default q4_k_m)")
    p.add_argument("--split-max-tensors", type=int, default=0, metavar="N", help="split after N tensors per file")
    add_writer_arguments(p)


def run(args) -> int:
    from . import console
    from ..weights.gguf_write import convert_model
    apply_threads(args)
    start = time.perf_counter()
    files = convert_model(args.hf_dir, args.out, args.preset, split_max_tensors=args.split_max_tensors,
                          split_max_size=args.split_max_size, progress=not args.no_progress)
    size = sum(f.stat().st_size for f in files)
    console.print(f"wrote {', '.join(str(f) for f in files)} ({size / 2**20:.1f} MiB, preset {args.preset}) "
                  f"in {time.perf_counter() - start:.1f} s")
    return 0
