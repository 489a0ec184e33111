#!/usr/bin/env python
"""In-kernel time against launch overhead for the one-row int4 GEMV of the small matrices.

    python3 scripts/int4_ncu_small.py                      # graph-replay times (as int4_grid_probe)
    ROWS_SWEEP=1 python3 scripts/int4_ncu_small.py         # and mode rows over a few launch configs
    NCU=1 ncu --profile-from-start off --csv --section SpeedOfLight --section WarpStateStats --section LaunchStats \
        --section Occupancy python3 scripts/int4_ncu_small.py   # each kernel twice, for the profiler
    KSPLIT=8,8 SHAPES=21888x2048 ...                        # and the K-split GEMV (ksplit, warps), with and without math

Per shape (SHAPES, default 2048x2048,4096x4096): a plain read of the int4 bytes (Triton, 16 KB a
program, 4 warps: the fastest config of int4_grid_probe's floor on these shapes), linear_int4's
GEMV as it runs today, torch's tinygemm, and bf16 F.linear. Nsight Compute's gpu__time_duration is
the kernel alone; the graph replay adds what launching it costs. Their difference per kernel says
whether the gap to the plain read is inside the kernel or around it (seventeenth session).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ktinject.bench_gpu import L2_BYTES, graph_time, torch_int4  # noqa: E402
from ktinject.operators.kernels import int4_pack as P  # noqa: E402
from ktinject.operators.kernels.int4_triton import int4_gemv_tiled  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _plain_read(w_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(w_ptr + offs, mask=offs < n, other=0, eviction_policy="evict_first")
    tl.store(out_ptr + tl.program_id(0), tl.sum(v, axis=0))


def kernels(n: int, k: int):
    """(name -> one call per weight copy, the tiled copies), all on the same quantized weight."""
    torch.manual_seed(0)
    iw = P.quantize(torch.randn(n, k, device="cuda") * 0.02, 128)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    nbytes = iw.qweight.numel() * 4 + iw.scales.numel() * 4
    copies = 1 if os.environ.get("NCU") else max(1, -(-L2_BYTES // nbytes))
    tiled = [P.tile(iw, 16) for _ in range(copies)]
    words = [torch.ones(nbytes // 4, dtype=torch.int32, device="cuda") for _ in range(copies)]
    block = 4096
    grid = -(-(nbytes // 4) // block)
    rd_out = torch.empty(grid, dtype=torch.int32, device="cuda")
    tg = [torch_int4(iw, 128)[0] for _ in range(copies)]
    wb = P.dequantize(iw, torch.bfloat16)
    bfs = [wb.clone() for _ in range(1 if os.environ.get("NCU") else max(1, -(-L2_BYTES // (n * k * 2))))]
    out = {"read": ([lambda b=b: _plain_read[(grid,)](b, rd_out, nbytes // 4, BLOCK=block, num_warps=4) for b in words]),
           "ours": [lambda w=w: int4_gemv_tiled(x, w) for w in tiled],
           "bf16": [lambda w=w: F.linear(x, w) for w in bfs]}
    if tg[0] is not None:
        out["tinygemm"] = [lambda f=f: f(x) for f in tg]
    if os.environ.get("KSPLIT"):                     # KSPLIT=ksplit,warps: the K-split kernel with and without math
        from ktinject.operators.kernels.int4_cuda import gemv_ksplit
        ks, warps = (int(v) for v in os.environ["KSPLIT"].split(","))
        for name, nm in (("ksplit", False), ("ksplit_nomath", True)):
            out[name] = [lambda w=w, nm=nm: gemv_ksplit(x, w, ksplit=ks, warps=warps, nomath=nm, dequant=False)
                         for w in tiled]
    return out, tiled


def main() -> int:
    shapes = [tuple(int(v) for v in s.split("x")) for s in os.environ.get("SHAPES", "2048x2048,4096x4096").split(",")]
    for n, k in shapes:
        ks, copies = kernels(n, k)
        if os.environ.get("NCU"):                    # profile only these calls: ncu --profile-from-start off
            for calls in ks.values():
                calls[0]()                           # compiled and warm before the profiler starts
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            for calls in ks.values():
                for _ in range(2):
                    calls[0]()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            continue
        line = [f"{n}x{k}:"]
        for name, calls in ks.items():
            line.append(f"{name} {graph_time(calls, 20) * 1e6:.2f} us")
        print("  ".join(line), flush=True)
        if os.environ.get("ROWS_SWEEP"):                # mode rows over (rows a program, warps, tiles a chunk)
            from ktinject.operators.kernels.int4_triton import TiledConfig
            tw = copies[0]
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            found = []
            for bn, warps, ct in ((8, 4, 16), (8, 4, 8), (8, 4, 32), (16, 4, 16), (16, 8, 16), (8, 2, 16), (4, 4, 16),
                                  (16, 4, 8), (4, 2, 16), (8, 8, 16)):
                cfg = TiledConfig("rows", bn, num_warps=warps, chunk=ct)
                try:
                    int4_gemv_tiled(x, tw, None, cfg)
                    t = graph_time([lambda w=w: int4_gemv_tiled(x, w, None, cfg) for w in copies], 20)
                    found.append((t, f"bn {bn} w {warps} ct {ct}"))
                except Exception as exc:                 # noqa: BLE001  (a config that does not build here)
                    found.append((float("inf"), f"bn {bn} w {warps} ct {ct}: {type(exc).__name__}"))
            print("    rows: " + "; ".join(f"{name} {t * 1e6:.2f}" for t, name in sorted(found)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
