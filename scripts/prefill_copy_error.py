"""The error each prefill path adds to one routed-experts layer: bf16 tiles (or the AVX-512 path), I8 copies and
I4 copies at several gate/up group sizes, each against float64 on the same dequantized weights. The layer has
V2-Lite's hidden 2048 and moe_intermediate 1408 (8 experts, top-6, so that it runs in seconds) of random valid
GGUF blocks (tests/test_native_util.py's moe_case: Q4_K gate/up, Q5_0 down, as V2-Lite's GGUF files hold).

    python scripts/prefill_copy_error.py [--isa amx] [--tokens 256] [--groups 256 512 1024] [--outliers 30]

Prints, per path, the worst token's error against the size of its summed terms (the tests' measure) and the
whole output's relative error. Speed is `ktinject bench experts --int8 [--int8-bits 4] --int8-group G D`'s.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
os.environ.setdefault("KTINJECT_TILE_MIN", "4")   # every expert on the grouped (tile) path

from gguf import GGMLQuantizationType as QT  # noqa: E402
from test_native_util import moe_case, ref_moe, rel_err  # noqa: E402

from ktinject import native  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--isa", default="amx", help="native path (amx; avx512 for the 8-bit grouped path without tiles)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--groups", type=int, nargs="+", default=[256, 512, 1024], help="I4 gate/up group sizes")
    ap.add_argument("--outliers", type=float, default=1.0,
                    help="scale 8 of the tokens' channels by this (real models' hidden states have a few channels "
                         "far larger than the rest, which per-group token scales absorb less well as groups grow)")
    a = ap.parse_args()
    if a.isa not in native.usable_isas():
        sys.exit(f"prefill_copy_error: the {a.isa} path is not usable here ({', '.join(native.usable_isas())} are)")
    (gate, up, down), (G, U, D) = moe_case(QT.Q4_K, QT.Q5_0, E=8, H=2048, I=1408, seed=3)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(a.tokens, 2048, generator=gen)
    x[:, ::256] *= a.outliers
    ids = torch.rand(a.tokens, 8, generator=gen).topk(6, dim=1).indices.contiguous()
    w = torch.rand(a.tokens, 6, generator=gen)
    ref = ref_moe(x, ids, w, G, U, D)
    paths = [("floats (bf16 tiles on amx)", {}), ("I8 copies, default groups", {"int8_prefill": True})]
    paths += [(f"I4 copies, groups {g}/704", {"int8_prefill": True, "int8_bits": 4, "int8_group": (g, 704)})
              for g in a.groups]
    for name, kw in paths:
        out = native.MoEKernel(gate, up, down, threads=2, isa=a.isa, **kw)(x, ids, w)
        whole = float((out.double() - ref).norm() / ref.norm())
        print(f"{name:32s} worst token {rel_err(out, ref):.4f}   whole {whole:.4f}")


if __name__ == "__main__":
    main()
