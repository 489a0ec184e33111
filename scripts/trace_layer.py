"""Where one native MoE layer's time goes: the pool's trace (KTINJECT_POOL_TRACE) averaged over
repeated calls of one DeepSeek-V2-Lite-shaped layer (hidden 2048, 64 experts of 1408, top-6) of
random weights, per phase of the job (native/moe.c: pack/quantize tokens, gate+up, pack/quantize
h, down).

    python scripts/trace_layer.py QUANT BATCH [ISA] [--threads N] [--calls N]
    python scripts/trace_layer.py q4_k 512 amx

The same layer is called every time, so at small batches its weights stay in the L3 cache:
use `ktinject bench experts` for decode rates from memory.
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("KTINJECT_POOL_TRACE", "1")     # read when the pool is created

import torch  # noqa: E402

from ktinject import native  # noqa: E402
from ktinject.cli.bench import down_type  # noqa: E402
from ktinject.native import ExpertMatrix, MoEKernel, Pool  # noqa: E402
from ktinject.native.synth import parse_quant, random_rows  # noqa: E402
from ktinject.testing import random_routing  # noqa: E402

E, H, I, K_TOP = 64, 2048, 1408, 6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("quant")
    ap.add_argument("batch", type=int)
    ap.add_argument("isa", nargs="?", default=None)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--calls", type=int, default=0, help="default: 20 at batch > 1, else 500")
    a = ap.parse_args()
    qt = parse_quant(a.quant)
    dqt = down_type(qt, I)
    mats = (ExpertMatrix(int(qt), random_rows(qt, E * I, H, seed=1), E, I, H, "gate"),
            ExpertMatrix(int(qt), random_rows(qt, E * I, H, seed=2), E, I, H, "up"),
            ExpertMatrix(int(dqt), random_rows(dqt, E * H, I, seed=3), E, H, I, "down"))
    pool = Pool(a.threads)
    kern = MoEKernel(*mats, pool=pool, isa=a.isa)
    x = torch.randn(a.batch, H)
    ids, w = random_routing(a.batch, E, K_TOP, 0)
    for _ in range(3):
        kern(x, ids, w)
    if native.pool_trace(pool) is None:          # also resets the sums
        raise SystemExit("the pool was created without KTINJECT_POOL_TRACE")
    n = a.calls or (20 if a.batch > 1 else 500)
    t0 = time.perf_counter()
    for _ in range(n):
        kern(x, ids, w)
    ms = (time.perf_counter() - t0) / n * 1e3
    tr = native.pool_trace(pool)
    print(f"{qt.name} (down {dqt.name}) batch {a.batch}, {pool.threads} threads, isa {a.isa or 'best'}: "  # noqa: T201
          f"{ms:.3f} ms per call; per job (us): pack/quantize tokens {tr['quantize_x']:.0f}, gate+up {tr['gate_up']:.0f}, "
          f"pack/quantize h {tr['quantize_h']:.0f}, down {tr['down']:.0f}; last worker started "
          f"{tr['last_worker_start']:.0f} after the post")

if __name__ == "__main__":
    main()
