"""Write a random-weight Hugging Face model directory (config.json + bf16 safetensors shards)
with the exact shapes of a named public model, streaming shard by shard (bounded memory). It
feeds `ktinject convert` at real size with no download (the convert timing in docs/gguf.md):

    python scripts/make_hf_dir.py deepseek-v2-lite /tmp/v2lite-hf [--layers N]
    ktinject convert /tmp/v2lite-hf /tmp/v2lite-conv.gguf --preset q4_k_m
"""
import argparse
import json
import math
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from ktinject.weights.gguf_file import _expected_shapes
from ktinject.weights.synth import model_config

ap = argparse.ArgumentParser()
ap.add_argument("arch")
ap.add_argument("out", type=Path)
ap.add_argument("--layers", type=int)
ap.add_argument("--shard-gib", type=float, default=4.0)
args = ap.parse_args()
t0 = time.perf_counter()
config = model_config(args.arch, args.layers)
args.out.mkdir(parents=True, exist_ok=True)
config.save_pretrained(args.out)
shapes = _expected_shapes(config)
gen = torch.Generator().manual_seed(0)
shard, size, n, index, total = {}, 0, 0, {}, 0


def flush():
    global shard, size, n
    if shard:
        name = f"model-{n:05d}.safetensors"
        save_file(shard, str(args.out / name), metadata={"format": "pt"})
        index.update({k: name for k in shard})
        n += 1
    shard, size = {}, 0


for key, shape in shapes.items():
    if len(shape) == 1:
        t = torch.ones(shape, dtype=torch.bfloat16)
    else:
        t = torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, 1.0 / math.sqrt(shape[-1]), generator=gen)
    shard[key] = t
    size += t.numel() * 2
    total += t.numel() * 2
    if size >= args.shard_gib * 2**30:
        flush()
flush()
(args.out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": index}, indent=1))
print(f"wrote {args.out}: {total / 2**30:.1f} GiB bf16 in {n} shards, {time.perf_counter() - t0:.1f} s")
