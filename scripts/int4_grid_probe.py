#!/usr/bin/env python
"""Where the one-row int4 GEMV of the mid-size matrices (2-24 MB of int4) loses its time, on an H200-class GPU.

    python3 scripts/int4_grid_probe.py [--shapes 21888x2048,10944x2048] [--top 6]

Per shape, CUDA-graph replays over >= 256 MB of copies (L2 holds none), median:
* `bf16`: F.linear on the dequantized weight (the denominator of the issue's targets);
* `read`: the fastest plain read of the same number of bytes (a Triton sum over int32 words, one load
  wave per program, block and warps swept): the floor any kernel reading these bytes has here, launch and
  first-load latency included;
* `linear_int4`'s path today (`int4_gemv_tiled`) and torch's tinygemm;
* the one-row CUDA C kernel (`cuda`) over a few (rows a warp, warps, step batch);
* the tensor-core `diag` kernel over a grid of (warps, batch V, ring stages, persistent CTAs), each
  config as it is and with its unpacking and mma removed (`nomath`: the loads and the loop only), with
  the registers a thread takes (occupancy). The `top` fastest are printed, and the config TUNED holds.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ktinject.bench_gpu import L2_BYTES, graph_time, hardware_line, read_bandwidth, torch_int4  # noqa: E402
from ktinject.operators.kernels import int4_cuda as C, int4_pack as P  # noqa: E402
from ktinject.operators.kernels.int4_triton import int4_gemv_tiled, tiled_config  # noqa: E402
from int4_diag_probe import run_diag  # noqa: E402  (this folder: sys.path[0] when run as a script)


def regs(shape, idx):
    from torch.cuda._utils import _get_gpu_runtime_library
    import ctypes
    v = ctypes.c_int()
    _get_gpu_runtime_library().cuFuncGetAttribute(ctypes.byref(v), 4, C._binary(shape, idx).func)  # NUM_REGS
    return v.value


def read_floor(nbytes: int, reps: int) -> tuple[float, str]:
    import triton
    import triton.language as tl

    @triton.jit
    def _sum(w_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(w_ptr + offs, mask=offs < n, other=0, eviction_policy="evict_first")
        tl.store(out_ptr + tl.program_id(0), tl.sum(v, axis=0))

    n = nbytes // 4
    bufs = [torch.ones(n, dtype=torch.int32, device="cuda") for _ in range(max(1, -(-L2_BYTES // nbytes)))]
    best = (float("inf"), "")
    for block, warps in itertools.product((512, 1024, 2048, 4096, 8192), (2, 4, 8)):
        if block < warps * 32 * 4:
            continue
        grid = -(-n // block)
        out = torch.empty(grid, dtype=torch.int32, device="cuda")
        t = graph_time([lambda b=b: _sum[(grid,)](b, out, n, BLOCK=block, num_warps=warps) for b in bufs], reps)
        best = min(best, (t, f"block {block * 4 // 1024} KB, {warps} warps, {grid} programs"))
    return best


def shape_setup(n: int, k: int, rows: int, reps: int, group: int = 128):
    """A random [N, K] weight of groups of `group` in the tiled layout (pack 16) with enough copies to pass the L2,
    `rows` bf16 rows of x, the fp32 reference, and the times of bf16 F.linear and of the plain read of the
    int4 bytes: (iw, w0, wbytes, copies, x, ref, t_bf16, (t_read, how))."""
    torch.manual_seed(0)
    iw = P.quantize(torch.randn(n, k, device="cuda") * 0.02, group)
    w0 = P.tile(iw, 16)
    wbytes = w0.qweight.numel() * 4 + 2 * w0.scales.numel() * 2
    copies = [w0] + [P.tile(iw, 16) for _ in range(max(1, -(-L2_BYTES // wbytes)) - 1)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ P.dequantize(iw).T
    wb = P.dequantize(iw, torch.bfloat16)
    bcopies = [wb] + [wb.clone() for _ in range(max(1, -(-L2_BYTES // (wb.numel() * 2))) - 1)]
    t_bf16 = graph_time([lambda w=w: F.linear(x, w) for w in bcopies], reps)
    del bcopies, wb
    return iw, w0, wbytes, copies, x, ref, t_bf16, read_floor(wbytes, reps)


def reference_paths(x, iw, copies, reps):
    """(seconds, name) of linear_int4's path today and of torch's tinygemm on the same weight."""
    out = [(graph_time([lambda w=w: int4_gemv_tiled(x, w) for w in copies], reps), "today (int4_gemv_tiled)")]
    tg, _ = torch_int4(iw, iw.group_size)
    if tg is not None:
        tgs = [tg] + [torch_int4(iw, iw.group_size)[0] for _ in copies[1:]]
        out.append((graph_time([lambda f=f: f(x) for f in tgs], reps), "tinygemm"))
    return sorted(out)


def cuda_grid(x, w0, ref, copies, reps):
    """(seconds, name) of the one-row `cuda` kernel over (rows a warp, warps, step batch), fastest first."""
    found = []
    for rpw, warps, sb in ((4, 8, 2), (2, 4, 2), (2, 8, 2), (1, 4, 2), (4, 4, 2), (1, 8, 2), (2, 4, 4), (4, 8, 4)):
        kw = dict(rows_per_warp=rpw, warps=warps, step_batch=sb)
        try:
            y = C.gemv(x, w0, **kw)
            torch.cuda.synchronize()
            err = ((y.float() - ref).norm() / ref.norm()).item()
            if not err < 1e-2:
                raise RuntimeError(f"wrong (rel err {err:.2g})")
            found.append((graph_time([lambda w=w, kw=kw: C.gemv(x, w, **kw) for w in copies], reps),
                          f"cuda r{rpw} w{warps} batch {sb}"))
        except Exception as exc:                                      # noqa: BLE001 - a probe: report, go on
            print(f"  cuda r{rpw} w{warps} batch {sb}: {type(exc).__name__}: {str(exc)[:100]}")
    return sorted(found)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="2048x2048,3072x2048,4096x2048,7168x2048,4096x4096,10944x2048,21888x2048")
    ap.add_argument("--top", type=int, default=6)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--modes", default="cuda,diag", help="kernels to sweep: cuda (one-row CUDA C), diag")
    a = ap.parse_args(argv)
    print(hardware_line(), flush=True)
    roof = read_bandwidth()
    print(f"HBM read roofline {roof / 1e9:.0f} GB/s", flush=True)
    dev = torch.device("cuda")
    idx = C.device_index(dev)
    for spec in a.shapes.split(","):
        n, k = map(int, spec.split("x"))
        iw, w0, wbytes, copies, x, ref, t_bf16, (t_read, how) = shape_setup(n, k, 1, a.reps)
        out = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
        print(f"{spec}: {wbytes / 1e6:.1f} MB int4; bf16 {t_bf16 * 1e6:.2f} us (x2: {t_bf16 * 5e5:.2f}, "
              f"x3: {t_bf16 * 1e6 / 3:.2f}); plain read {t_read * 1e6:.2f} us ({how}, "
              f"{wbytes / t_read / roof:.2f} of the roofline)", flush=True)
        tuned = tiled_config(1, n, k, 128)
        found = reference_paths(x, iw, copies, a.reps)
        if "cuda" in a.modes:
            found += cuda_grid(x, w0, ref, copies, a.reps)[:a.top]
        for t, name in found:
            print(f"  {name:<40} {t * 1e6:6.2f} us ({t_bf16 / t:.2f}x bf16, {wbytes / t / roof:.2f} HBM, "
                  f"{t / t_read:.2f}x the plain read)", flush=True)
        if "diag" not in a.modes:
            del copies
            torch.cuda.empty_cache()
            continue
        steps = k // 128
        grid = [(w, v, st, ct) for w, v, st, ct in itertools.product((2, 4, 8, 10, 11), (2, 4, 8), (0, 2, 4), (0, 2))
                if not (ct and w < 8) and not (st and C.diag_stages(st, steps, v) != st)]
        rows = []
        for warps, batch, stages, ctas in grid:
            res = []
            try:
                for nomath in (False, True):
                    shape = run_diag(x, w0, out, warps, batch, ctas, nomath, stages)
                    torch.cuda.synchronize()
                    if not nomath:
                        err = ((out.float() - ref).norm() / ref.norm()).item()
                        worst = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                        if not (err < 1e-2 and worst < 3e-2):
                            raise RuntimeError(f"wrong (rel err {err:.2g}, worst {worst:.2g})")
                    res.append(graph_time([lambda w=w, nm=nomath: run_diag(x, w, out, warps, batch, ctas, nm, stages)
                                           for w in copies], a.reps))
                rows.append((res[0], res[1], warps, shape.batch, stages, ctas, regs(shape, idx)))
            except Exception as exc:                                  # noqa: BLE001 - a probe: report, go on
                print(f"  w{warps} V{batch} ring{stages} ct{ctas}: {type(exc).__name__}: {str(exc)[:100]}")
        rows.sort()
        is_tuned = lambda r: (tuned.mode == "diag" and (r[2], r[3], r[5]) == (tuned.num_warps, tuned.chunk, tuned.ctas)  # noqa: E731
                              and r[4] == (tuned.num_stages if tuned.num_stages > 1 else 0))
        for r in rows[:a.top] + [r for r in rows[a.top:] if is_tuned(r)]:
            t, tn, warps, batch, stages, ctas, nreg = r
            print(f"  diag w{warps:<2} V{batch} ring{stages} ct{ctas} ({nreg} regs): "
                  f"{t * 1e6:6.2f} us ({t_bf16 / t:.2f}x bf16, {wbytes / t / roof:.2f} HBM, {t / t_read:.2f}x read), "
                  f"nomath {tn * 1e6:6.2f} us{'  <- TUNED' if is_tuned(r) else ''}", flush=True)
        del copies
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
