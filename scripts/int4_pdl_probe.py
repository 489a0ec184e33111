#!/usr/bin/env python
"""What programmatic dependent launch (PDL) buys the CUDA int4 decode GEMVs at one row, on an H200-class GPU.

    python3 scripts/int4_pdl_probe.py [--quick]

Two settings, both CUDA-graph replays over >= 256 MB of weight copies (L2 holds none), median:

* `chain`: the GEMVs back to back (as scripts/int4_sweep.py times them). With PDL a GEMV may start while the
  one before it finishes: it prefetches its first weight tiles into L2 and then waits (griddepcontrol.wait)
  for the one before to be done before it reads x. Its x does not depend on the one before here, but the
  wait is the same as if it did.
* `after op`: each GEMV follows a small elementwise kernel of torch (an RMSNorm's multiply, as in a decoder
  layer), which knows nothing of PDL; the time is per pair, next to the op alone and to bf16 after the op.

Variants: bf16 `F.linear`; torch's tinygemm where it takes the shape; the config `linear_int4` runs today
(`int4_gemv_tiled`, TUNED or class); the tensor-core `diag` and the one-row `cuda` kernel with PDL off, PDL 1
(the grid lets its own dependents start right after its wait) or 2 (at its end), with 0 or more weight
tiles (`pf`) prefetched into L2 before the wait. Each variant's output is checked against the dequantized
weight first. A last check chains square GEMVs y <- W y with and without PDL and compares them bit for bit
(a GEMV reading x before the previous one wrote it would differ).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ktinject.bench_gpu import L2_BYTES, graph_time, hardware_line, read_bandwidth, torch_int4  # noqa: E402
from ktinject.operators.kernels import int4_cuda as C, int4_pack as P  # noqa: E402
from ktinject.operators.kernels.int4_triton import (TUNED, int4_gemv_tiled, tiled_config,  # noqa: E402
                                                     tiled_pack)

SHAPES = [  # (label, N, K, group)
    ("lm_head 102400x2048", 102400, 2048, 128),
    ("gate+up 21888x2048", 21888, 2048, 128),
    ("10944x2048", 10944, 2048, 128),
    ("7168x2048", 7168, 2048, 128),
    ("4096x4096", 4096, 4096, 128),
    ("4096x2048", 4096, 2048, 128),
    ("3072x2048", 3072, 2048, 128),
    ("2048x2048", 2048, 2048, 128),
]


def diag_bases(n: int, k: int, group: int) -> list[tuple[int, int, int]]:
    """(warps, batch, ctas) of the diag kernel to try: the tuned one where TUNED holds diag, and small grids."""
    cfg = tiled_config(1, n, k, group)
    out = [(cfg.num_warps, cfg.chunk, cfg.ctas)] if cfg.mode == "diag" else []
    for c in ((10, 4, 2), (4, 4, 0), (2, 4, 0), (8, 8, 2)):
        if c not in out:
            out.append(c)
    return out[:3]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer variants (about half the time)")
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args(argv)
    print(hardware_line(), flush=True)
    roof = read_bandwidth()
    print(f"HBM read roofline {roof / 1e9:.0f} GB/s", flush=True)
    dev = torch.device("cuda")
    h = torch.randn(1, 2048, device=dev, dtype=torch.bfloat16)
    op = lambda: h.mul_(1.0)                                                 # noqa: E731 - a norm's multiply
    t_op = graph_time([op] * 64, a.reps)
    print(f"op alone (torch elementwise on 2048 values, in a chain of 64): {t_op * 1e6:.2f} us", flush=True)
    pdl_variants = [(1, 0), (1, 2), (1, 8), (2, 2)] if not a.quick else [(1, 2), (2, 2)]
    for label, n, k, group in SHAPES:
        torch.manual_seed(0)
        iw = P.quantize(torch.randn(n, k, device=dev) * 0.02, group)
        pack = tiled_pack(n, k, group)
        w0 = P.tile(iw, pack)
        wbytes = w0.qweight.numel() * 4 + 2 * w0.scales.numel() * 2
        copies = [w0] + [P.tile(iw, pack) for _ in range(max(1, -(-L2_BYTES // wbytes)) - 1)]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        ref = x.float() @ P.dequantize(iw).T
        wb = P.dequantize(iw, torch.bfloat16)
        bcopies = [wb] + [wb.clone() for _ in range(max(1, -(-L2_BYTES // (wb.numel() * 2))) - 1)]
        rows = []

        def timed(name, fns_of_w, ws, check=None):
            try:
                if check is not None:
                    y = check()
                    torch.cuda.synchronize()
                    err = ((y.float() - ref).norm() / ref.norm()).item()
                    if not err < 1e-2:
                        rows.append(f"  {name:<34} wrong (rel err {err:.2g})")
                        return
                tc = graph_time([lambda w=w: fns_of_w(w) for w in ws], a.reps)
                tm = graph_time([f for w in ws for f in (op, lambda w=w: fns_of_w(w))], a.reps) * 2
                rows.append(f"  {name:<34} chain {tc * 1e6:7.2f} us {wbytes / tc / roof:5.2f} HBM   "
                            f"after op {tm * 1e6:7.2f} us")
            except Exception as exc:                                  # noqa: BLE001 - a probe: report, go on
                rows.append(f"  {name:<34} {type(exc).__name__}: {str(exc).splitlines()[0][:90]}")

        timed("bf16 F.linear", lambda w: F.linear(x, w), bcopies)
        tg, why = torch_int4(iw, group)
        if tg is not None:
            tcop = [torch_int4(iw, group)[0] for _ in range(len(copies))]
            timed("tinygemm", lambda f: f(x), tcop, check=lambda: tg(x))
        cfg = TUNED.get((n, k, group, 1)) or tiled_config(1, n, k, group)
        timed(f"today: {cfg.mode} w{cfg.num_warps}", lambda w: int4_gemv_tiled(x, w), copies,
              check=lambda: int4_gemv_tiled(x, w0))
        for warps, batch, ctas in diag_bases(n, k, group):
            for pdl, pf in [(0, 0)] + pdl_variants:
                kw = dict(warps=warps, batch=batch, ctas_per_sm=ctas, pdl=pdl, pf=pf)
                timed(f"diag w{warps} V{batch} ct{ctas} pdl{pdl} pf{pf}", lambda w, kw=kw: C.gemv_diag(x, w, **kw),
                      copies, check=lambda kw=kw: C.gemv_diag(x, w0, **kw))
        for rpw, warps in ((4, 8), (2, 4)):
            for pdl, pf in [(0, 0)] + pdl_variants[:2]:
                kw = dict(rows_per_warp=rpw, warps=warps, step_batch=2, pdl=pdl, pf=min(pf, 1))
                timed(f"cuda r{rpw} w{warps} pdl{pdl} pf{min(pf, 1)}", lambda w, kw=kw: C.gemv(x, w, **kw),
                      copies, check=lambda kw=kw: C.gemv(x, w0, **kw))
        print(f"{label}: {wbytes / 1e6:.1f} MB int4, {len(copies)} copies", flush=True)
        print("\n".join(rows), flush=True)
        del copies, bcopies, wb
        torch.cuda.empty_cache()

    # dependence: y <- W_i y through 24 square GEMVs, with PDL and without, bit for bit
    torch.manual_seed(1)
    ws = [P.tile(P.quantize(torch.randn(2048, 2048, device=dev) * (1 / 2048 ** 0.5), 128), 16) for _ in range(24)]
    for kern, kw in (("diag", dict(warps=2, batch=4)), ("cuda", dict(rows_per_warp=2, warps=4))):
        outs = []
        for pdl in (0, 1, 2):
            def run(pdl=pdl):
                y = torch.ones(1, 2048, device=dev, dtype=torch.bfloat16)
                for w in ws:
                    y = (C.gemv_diag if kern == "diag" else C.gemv)(y, w, pdl=pdl, pf=2, **kw)
                return y
            run()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                y = run()
            g.replay()
            torch.cuda.synchronize()
            outs.append(y.clone())
        same = all(torch.equal(outs[0], o) for o in outs[1:])
        print(f"dependence check ({kern}, 24 chained GEMVs in a graph, PDL 0/1/2): "
              f"{'identical' if same else 'DIFFERENT'} (|y| {outs[0].float().norm():.3g})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
