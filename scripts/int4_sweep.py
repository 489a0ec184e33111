#!/usr/bin/env python
"""Sweep the launch configs of linear_int4's tiled GEMV on one GPU; compare with bf16 and tinygemm.

    python scripts/int4_sweep.py --quick          # ~100 s: batch 1 on every shape, 4 and 16 on two
    python scripts/int4_sweep.py                  # wider grid, more reps (budget 500 s)

For each weight shape it times, inside CUDA graphs that cycle through enough weight copies that the
L2 cache (~60 MB) holds none of them (>= 256 MB of weights per replay; median of the replays):
the bf16 `F.linear`, torch's tinygemm (`aten._weight_int4pack_mm`, where it accepts the shape), and
our `int4_gemv_tiled` over a small grid of (mode, pack, block_n, warps, stages, prefetch) x K split.
Every config is first checked against the dequantized weight in fp32 (and run twice: the split-K
reduction must be deterministic); one that fails to compile or to match is skipped with one line.

The roofline: the HBM read bandwidth measured first in the same process (`bench_gpu.read_bandwidth`: a
Triton streaming sum over 2 GiB); column HBM is the best config's int4 bytes per second over it.
Prints one `JSON {...}` line per (shape, batch) as it finishes, a table at the end, and the
`TUNED` / `TINYGEMM_FASTER` entries to paste into ktinject/operators/kernels/int4_triton.py.
The kernels are compiled up front in parallel worker processes (--jobs) into the Triton cache.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:                      # run from a checkout without PYTHONPATH: import this tree's ktinject
    sys.path.insert(0, _ROOT)

from ktinject.bench_gpu import INT4_SHAPES, L2_BYTES  # noqa: E402  (after the path set-up above)

SHAPES = INT4_SHAPES + [  # (label, N, K, group)  group -1: per channel; the GPU bench's shapes and more
    ("7168x2048", 7168, 2048, 128),
    ("4096x2048", 4096, 2048, 128),
    ("2048x2048 g32 (Q4_K)", 2048, 2048, 32),
    ("3072x2048 per-channel", 3072, 2048, -1),
]
MULTI_BATCH = {"lm_head 102400x2048", "o_proj 2048x2048"}     # also batch 4 and 16 (all shapes with --full)
TARGETS = (264, 528, 1056, 2112)          # target programs (K split) tried for every config


def grid_for(m: int, quick: bool):
    """[(mode, pack, block_n, warps, stages, prefetch, reduce, chunk)] candidates for `m` rows, most promising
    first."""
    def c(mode, pack, bn, warps, stages=1, prefetch=False, reduce="serial", chunk=16, ctas=0):
        return (mode, pack, bn, warps, stages, prefetch, reduce, chunk, ctas)
    mma = [c("mma", 16, 32, 4, chunk=2), c("mma", 16, 32, 4, chunk=4), c("mma", 16, 64, 8, chunk=2),
           c("mma", 16, 16, 2, chunk=2), c("mma", 16, 32, 4, chunk=1), c("mma", 16, 32, 4, chunk=2, ctas=8),
           c("mma", 16, 64, 8, chunk=4, ctas=4), c("mma", 32, 32, 4, chunk=2), c("mma", 16, 32, 4, chunk=8)]
    rows = [c("rows", 16, 16, 4), c("rows", 16, 8, 4), c("rows", 16, 32, 8), c("rows", 16, 4, 4),
            c("rows", 16, 16, 4, chunk=8), c("rows", 32, 16, 4, chunk=8), c("rows", 16, 32, 4, chunk=8),
            c("rows", 16, 8, 2, chunk=16)]
    cuda = [c("cuda", 16, 16, 4, chunk=2), c("cuda", 16, 8, 4, chunk=2), c("cuda", 16, 16, 4, chunk=1),
            c("cuda", 16, 32, 8, chunk=2), c("cuda", 16, 4, 4, chunk=2), c("cuda", 16, 8, 8, chunk=1),
            c("cuda", 16, 32, 4, chunk=2), c("cuda", 16, 16, 4, chunk=4), c("cuda", 32, 8, 4, chunk=2),
            c("cuda", 32, 4, 4, chunk=4)]
    diag = [c("diag", 16, 32, 4, chunk=2, ctas=4), c("diag", 16, 64, 8, chunk=2, ctas=4), c("diag", 16, 32, 4, chunk=4),
            c("diag", 16, 64, 8, chunk=2), c("diag", 16, 32, 4, chunk=2, ctas=8), c("diag", 16, 128, 8, chunk=4, ctas=2),
            c("diag", 16, 16, 2, chunk=2), c("diag", 16, 8, 1, chunk=4)]      # (small N: more blocks)
    # warps a block x blocks an SM chosen so that a persistent grid's warps split the lm_head's 12800 tiles
    # into nearly whole rounds (14 warps an SM: 6.9 tiles each; 20: 4.85), not 6.06 (16 an SM)
    diag_balanced = [c("diag", 16, 56, 7, chunk=4, ctas=2), c("diag", 16, 80, 10, chunk=4, ctas=2),
                     c("diag", 16, 40, 5, chunk=4, ctas=4), c("diag", 16, 56, 7, chunk=8, ctas=2),
                     c("diag", 16, 48, 6, chunk=4, ctas=3), c("diag", 16, 56, 7, chunk=2, ctas=2),
                     c("diag", 16, 64, 8, chunk=8, ctas=2), c("diag", 16, 112, 14, chunk=4, ctas=1),
                     c("diag", 16, 56, 7, chunk=4, ctas=3), c("diag", 16, 88, 11, chunk=4, ctas=2),
                     c("diag", 16, 56, 7, chunk=4), c("diag", 16, 56, 7, chunk=2), c("diag", 16, 88, 11, chunk=4),
                     c("diag", 16, 48, 6, chunk=4), c("diag", 16, 40, 5, chunk=2)]   # (one round on smaller N)
    diag = diag[:4] + diag_balanced + diag[4:] if os.environ.get("SWEEP_DIAG_WIDE") else diag
    # the cp.async ring (stages >= 2): 512 contiguous bytes a copy instead of 64-byte pieces of 8 rows
    ring = [c("diag", 16, 80, 10, 4, chunk=4, ctas=2), c("diag", 16, 80, 10, 2, chunk=4, ctas=2),
            c("diag", 16, 64, 8, 2, chunk=8, ctas=2), c("diag", 16, 64, 8, 4, chunk=4, ctas=2),
            c("diag", 16, 32, 4, 4, chunk=4, ctas=4), c("diag", 16, 64, 8, 4, chunk=2), c("diag", 16, 56, 7, 4, chunk=4, ctas=2),
            c("diag", 16, 128, 16, 2, chunk=4, ctas=1)]
    diag = ring + diag if os.environ.get("SWEEP_DIAG_RING") else diag
    # the K split (chunk: warps a 16-row tile; block_n: 16 x tiles a block)
    ksplit = [c("ksplit", 16, 16, 8, chunk=8), c("ksplit", 16, 16, 16, chunk=16), c("ksplit", 16, 32, 8, chunk=4),
              c("ksplit", 16, 32, 32, chunk=16), c("ksplit", 16, 32, 16, chunk=8), c("ksplit", 16, 16, 4, chunk=4)]
    skip = set(filter(None, os.environ.get("SWEEP_SKIP_MODES", "").split(",")))   # e.g. diag, after a failed test
    ksplit, diag, mma, cuda, rows = ([x for x in lst if x[0] not in skip] for lst in (ksplit, diag, mma, cuda, rows))
    rows = ksplit + diag + mma + cuda + rows if m == 1 else ksplit + diag[:4] + mma[:4] + rows[:3] if m <= 4 \
        else diag[:4] + mma[:4]
    if m == 1:
        g = rows + [c("fma", 16, 256, 4), c("fma", 16, 128, 4), c("fma", 16, 64, 4), c("fma", 32, 128, 4),
             c("fma", 16, 512, 8), c("fma", 32, 256, 8), c("fma", 16, 256, 4, prefetch=True),
             c("fma", 16, 64, 4, reduce="atomic"), c("fma", 16, 128, 4, 3, prefetch=True)]
        if not quick:
            g += [c("fma", 16, 256, 8), c("fma", 16, 128, 2), c("fma", 16, 256, 4, 3), c("fma", 32, 256, 4),
                  c("dot_x", 16, 128, 4), c("fma", 16, 32, 4), c("fma", 16, 128, 4, reduce="atomic")]
        return g
    g = [c("dot_x", 16, 128, 4), c("dot", 16, 128, 4), c("dot_x", 16, 256, 8), c("dot_x", 16, 64, 4),
         c("dot", 16, 64, 4), c("dot_x", 32, 128, 4), c("dot_x", 16, 64, 4, reduce="atomic")]
    if m <= 4:
        g.insert(2, c("fma", 16, 128, 4))
    g = rows + g
    if not quick:
        g += [c("dot", 16, 256, 8), c("dot_x", 16, 128, 8), c("dot_x", 16, 128, 4, 3), c("dot", 32, 128, 4),
              c("dot_x", 16, 64, 4, prefetch=True)]
    return g


def as_cand(cfg):
    return (cfg.mode, cfg.pack, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.prefetch, cfg.reduce, cfg.chunk,
            cfg.ctas)


def make_cfg(T, c, target=1056, split=0):
    mode, pack, bn, warps, stages, prefetch, reduce, chunk, ctas = c
    return T.TiledConfig(mode=mode, block_n=bn, num_warps=warps, num_stages=stages, target_programs=target,
                         split=split, pack=pack, prefetch=prefetch, reduce=reduce, chunk=chunk, ctas=ctas)


def cfg_short(cfg) -> str:
    s = f"{cfg.mode}/P{cfg.pack}/bn{cfg.block_n}/w{cfg.num_warps}/s{cfg.num_stages}"
    if cfg.prefetch:
        s += "/pf"
    if cfg.reduce != "serial":
        s += f"/{cfg.reduce}"
    if cfg.mode in ("rows", "cuda", "mma", "diag", "ksplit"):
        s += f"/ct{cfg.chunk}"
    if cfg.ctas:
        s += f"/ctas{cfg.ctas}"
    return s


def cfg_dict(cfg) -> dict:
    return {k: getattr(cfg, k) for k in ("mode", "block_n", "num_warps", "num_stages", "target_programs", "split",
                                         "pack", "prefetch", "reduce", "chunk", "ctas")}


def group_of(k: int, group: int) -> int:
    return k if group == -1 else group


def pack_ok(k: int, group: int, pack: int) -> bool:
    g = group_of(k, group)
    return g >= k or g % pack == 0


# ---- parallel compile ------------------------------------------------------------------------------
def kernel_key(T, k, group, pack, m, c):
    """What the compiled binary depends on (constexprs and launch options) for one task."""
    g = group_of(k, group)
    nsub = 1 if g >= k else max(1, 8 * pack // g)
    mode = T.TILED_MODES[c[0]]
    if mode == 0 and nsub > 4:
        mode = 1
    block_m = T._next_pow2(m) if c[0].startswith("fma") or c[0] == "rows" else 16
    return (pack, nsub, k % (8 * pack) == 0, c[2], block_m, mode, c[3], c[4], c[5], c[6] == "atomic",
            c[7] if c[0] == "rows" else 0)


def _compile_task(task):
    """Worker: compile (and run once on a small problem with the same specialization) one variant."""
    k, group, pack, m, c = task
    t0 = time.time()
    try:
        import torch
        from ktinject.operators.kernels import int4_pack as P, int4_triton as T
        dev = os.environ.get("INT4_SWEEP_DEVICE", "cuda")           # cpu: --cpu-selftest
        cfg = make_cfg(T, tuple(c), split=2)
        n = 2 * cfg.block_n
        iw = P.quantize(torch.randn(n, k, device=dev), group_of(k, group))
        tw = P.tile(iw, pack)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16 if dev == "cuda" else torch.float16)
        T.int4_gemv_tiled(x, tw, None, cfg)
        if dev == "cuda":
            torch.cuda.synchronize()
        return task, None, time.time() - t0
    except Exception as exc:                                          # noqa: BLE001 - reported, never fatal
        return task, f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:160] if str(exc).strip() else ''}", \
            time.time() - t0


def precompile(tasks, jobs: int, timeout: float) -> dict:
    """Compile the variants in `jobs` processes (they fill the shared Triton cache); {task: error or None}."""
    import multiprocessing as mp
    import concurrent.futures as cf
    results = {}
    if jobs <= 1 or not tasks:
        return results
    t0 = time.time()
    pool = None
    try:
        pool = cf.ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn"))
        futs = [pool.submit(_compile_task, t) for t in tasks]
        for f in cf.as_completed(futs, timeout=timeout):
            task, err, _ = f.result()
            results[task] = err
    except cf.TimeoutError:
        print(f"note: precompile stopped after {timeout:.0f} s ({len(results)}/{len(tasks)} done); the rest "
              f"compiles on first use", flush=True)
    except Exception as exc:                                          # noqa: BLE001
        print(f"note: parallel precompile failed ({type(exc).__name__}: {exc}); compiling on first use", flush=True)
    finally:
        if pool is not None:                                          # do not wait for stragglers
            pool.shutdown(wait=False, cancel_futures=True)
    bad = sum(1 for e in results.values() if e)
    print(f"precompiled {len(results) - bad}/{len(tasks)} kernel variants in {time.time() - t0:.1f} s "
          f"with {jobs} processes ({bad} failed)", flush=True)
    return results


# ---- timing -----------------------------------------------------------------------------------------
def graph_time(torch, fns, reps: int) -> float:
    """Median seconds per call of `fns` run back to back inside one CUDA graph."""
    if not torch.cuda.is_available():                                 # --cpu-selftest: wall clock
        times = []
        for _ in range(max(1, reps)):
            t = time.perf_counter()
            for f in fns:
                f()
            times.append((time.perf_counter() - t) / len(fns))
        return statistics.median(times)
    from ktinject.bench_gpu import graph_time as timed_in_graph      # the GPU benches' own timer
    return timed_in_graph(fns, reps)


_SKIPS = [0]


def skip(msg: str) -> None:
    """One line per skipped config; after 40 of them only a count (the summary must stay in view)."""
    _SKIPS[0] += 1
    if _SKIPS[0] <= 40:
        print("skip: " + msg, flush=True)


def rel_err(y, ref) -> float:
    return ((y.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def summarize(results, T, dev_name: str) -> None:
    """The table and the entries to paste into int4_triton.py."""
    print(f"\n{'shape':<24}{'M':>3}{'bf16 us':>9}{'tg us':>8}{'ours us':>9}{'GB/s':>7}{'HBM':>6}{'x bf16':>8}"
          f"{'x tg':>6}{'dflt us':>9}  best config (split)")
    for r in results:
        b = r.get("best")
        tg = f"{r['tinygemm_us']:8.1f}" if r.get("tinygemm_us") else f"{'rej':>8}"
        if not b:
            print(f"{r['shape'][:23]:<24}{r['batch']:>3}{r['bf16_us']:9.1f}{tg}   (no config ran)")
            continue
        d = r.get("default", {}).get("us")
        print(f"{r['shape'][:23]:<24}{r['batch']:>3}{r['bf16_us']:9.1f}{tg}{b['us']:9.1f}{b['GBps']:7.0f}"
              f"{b.get('hbm_fraction', float('nan')):6.2f}{r['x_bf16']:8.2f}{r.get('x_tinygemm', float('nan')):6.2f}{(d or float('nan')):9.1f}  "
              f"{cfg_short(T.TiledConfig(**b['cfg']))} ({b['split']})")

    # paste-ready entries: per shape one pack (the best single-row config's), per batch the best with it
    print("\n# ---- paste into ktinject/operators/kernels/int4_triton.py (measured on "
          f"{dev_name}) ----\nTUNED.update({{")
    faster = {}
    by_shape = {}
    for r in results:
        by_shape.setdefault((r["N"], r["K"], r["group"]), []).append(r)
    for (n, k, group), rows in by_shape.items():
        one = next((r for r in rows if r["batch"] == 1 and r.get("best")), None)
        if one is None:
            continue
        pk = str(one["best"]["cfg"]["pack"])
        for r in rows:
            choice = (r.get("best_by_pack") or {}).get(pk)
            if not choice:
                continue
            c = dict(choice["cfg"])
            args_s = ", ".join(f"{kk}={v!r}" for kk, v in c.items())
            print(f"    ({n}, {k}, {group_of(k, group)}, {r['batch']}): TiledConfig({args_s}),   "
                  f"# {choice['us']:.1f} us, bf16 {r['bf16_us']:.1f}, tinygemm {r.get('tinygemm_us', '-')}")
            if r.get("tinygemm_us") and r["tinygemm_us"] < choice["us"]:
                faster.setdefault((n, k), set()).add(T.rows_bucket(r["batch"]))
    print("})")
    print("# shapes (N, K) and rows buckets where tinygemm measured faster than ours (a shape class as key,"
          " e.g. 24.0, covers every shape of the class):")
    print("TINYGEMM_FASTER.update({" + ", ".join(f"{nk}: {{{', '.join(str(r) for r in sorted(b))}}}"
                                                 for nk, b in sorted(faster.items())) + "})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller grid and fewer reps, for a ~120 s device call")
    ap.add_argument("--full", action="store_true", help="batch 4 and 16 on every shape, not only two")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole sweep (default 100 with --quick, else 500); configs past it are "
                         "skipped with a note")
    ap.add_argument("--jobs", type=int, default=None, help="compile processes (default: min(12, CPUs - 2))")
    ap.add_argument("--reps", type=int, default=None, help="graph replays per timing (default 15 quick, 30)")
    ap.add_argument("--shapes", default="", help="comma-separated substrings of shape labels to keep")
    ap.add_argument("--out", default=None, help="also write all results as JSON here (default $OUT/int4_sweep.json "
                                                "when OUT is set)")
    # development only: the whole script on tiny shapes on the CPU (run with TRITON_INTERPRET=1)
    ap.add_argument("--cpu-selftest", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    t_start = time.time()
    budget = args.budget or (100.0 if args.quick else 500.0)
    reps = args.reps or (15 if args.quick else 30)

    try:
        import torch
    except ImportError:
        print("int4_sweep: torch is not installed", file=sys.stderr)
        return 2
    selftest = args.cpu_selftest
    if not torch.cuda.is_available() and not selftest:
        print("int4_sweep: needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured", file=sys.stderr)
        return 2
    dev = "cpu" if selftest else "cuda"
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join("/tmp", "ktinject_int4_sweep_triton"))
    try:
        import triton
        import torch.nn.functional as F
        from ktinject.operators.kernels import int4_pack as P, int4_triton as T
        from ktinject.operators.linear_int4 import tinygemm_pack
    except ImportError as exc:
        print(f"int4_sweep: {exc}", file=sys.stderr)
        return 2

    if selftest:
        dev_name = "cpu (selftest, Triton interpreter)"
        shapes = [("tiny 96x512", 96, 512, 128), ("tiny 40x1088 g64", 40, 1088, 64), ("tiny 48x512 g32", 48, 512, 32),
                  ("tiny 32x256 per-channel", 32, 256, -1)]
        MULTI_BATCH.add("tiny 96x512")
        os.environ["INT4_SWEEP_DEVICE"] = "cpu"
        if args.jobs is None:
            args.jobs = 0
    else:
        prop = torch.cuda.get_device_properties(0)
        dev_name = prop.name
        print(f"device: {prop.name}, {prop.multi_processor_count} SMs, {prop.total_memory / 2**30:.0f} GiB; torch "
              f"{torch.__version__}, triton {triton.__version__}; budget {budget:.0f} s, reps {reps}", flush=True)
        shapes = SHAPES
    shapes = [s for s in shapes if not args.shapes or any(t.strip() and t.strip() in s[0]
                                                          for t in args.shapes.split(","))]
    plan = []   # (label, n, k, group, [batches])
    for label, n, k, group in shapes:
        batches = [1, 4, 16] if (args.full or label in MULTI_BATCH) else [1]
        plan.append((label, n, k, group, batches))

    # ---- compile everything once, in parallel --------------------------------------------------------
    tasks = []
    for label, n, k, group, batches in plan:
        for m in batches:
            cands = grid_for(m, args.quick)[:2 if selftest else None]
            cands = [as_cand(T.tiled_config(m, n, k, group_of(k, group)))] + cands
            for c in cands:
                if pack_ok(k, group, c[1]) and c[0] not in T.CUDA_MODES:   # (NVRTC: per process)
                    mm = m if c[0].startswith("fma") or c[0] == "rows" else 16
                    tasks.append((k, group, c[1], mm, c))
    by_kernel = {}                                 # one task per compiled variant (same constexprs -> same binary)
    for t in tasks:
        by_kernel.setdefault(kernel_key(T, *t), t)
    tasks = list(by_kernel.values())
    jobs = args.jobs if args.jobs is not None else max(1, min(12, (os.cpu_count() or 4) - 2))
    compiled = precompile(tasks, jobs, timeout=0.4 * budget)
    for task, err in compiled.items():
        if err:
            skip(f"{cfg_short(make_cfg(T, task[4]))} K={task[0]} g={task[1]} M={task[3]}: compile/run failed: {err}")

    hbm = None
    if not selftest:
        from ktinject.bench_gpu import read_bandwidth
        hbm = read_bandwidth()
        print(f"HBM read bandwidth (Triton streaming sum over 2 GiB): {hbm / 1e9:.0f} GB/s", flush=True)
    cuda_ok = not selftest and T.int4_cuda.available()
    if not selftest:
        print(f"CUDA (NVRTC) GEMV: {'available' if cuda_ok else T.int4_cuda.unavailable_reason()}", flush=True)
    torch.manual_seed(0)
    results = []
    n_shapes_left = sum(len(b) for *_, b in plan)
    for label, n, k, group, batches in plan:
        g = group_of(k, group)
        w = torch.randn(n, k, device=dev) * 0.02
        iw = P.quantize(w, g)
        del w
        wd = P.dequantize(iw, torch.float32)                            # [N, K] the reference weight
        wbf = wd.to(torch.bfloat16)
        ng = iw.scales.shape[1]
        tiled = {p: P.tile(iw, p) for p in (16, 32) if pack_ok(k, group, p)}
        int4_bytes = {p: t.qweight.numel() * 4 + 4 * n * ng for p, t in tiled.items()}
        copies = {p: 1 if selftest else max(1, min(128, math.ceil(L2_BYTES / b))) for p, b in int4_bytes.items()}
        tcopies = {p: [t] + [P.Int4Tiled(t.qweight.clone(), t.scales.clone(), t.mins.clone(), t.group_size,
                                         t.in_features, t.pack) for _ in range(copies[p] - 1)]
                   for p, t in tiled.items()}
        nb = 1 if selftest else max(1, min(64, math.ceil(L2_BYTES / (n * k * 2))))
        wbfs = [wbf] + [wbf.clone() for _ in range(nb - 1)]
        try:
            if selftest:
                raise RuntimeError("not on the CPU")
            tg = tinygemm_pack(iw)
            tgs = [tg] + [(tg[0].clone(), tg[1].clone()) for _ in range(max(1, min(128, math.ceil(
                L2_BYTES / (n * k // 2)))) - 1)]
            tg_err = None
        except Exception as exc:                                      # noqa: BLE001
            tgs, tg_err = None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:80]}"
        for m in batches:
            shape_t0 = time.time()
            left = budget - (time.time() - t_start)
            share = left / max(1, n_shapes_left)
            n_shapes_left -= 1
            x = torch.randn(m, k, device=dev, dtype=torch.float16 if selftest else torch.bfloat16)
            ref = x.float() @ wd.T                                       # [M, N] fp32
            row = {"shape": label, "N": n, "K": k, "group": group, "batch": m, "bf16_MB": round(n * k * 2 / 1e6, 1)}
            row["bf16_us"] = graph_time(torch, [lambda w_=w_: F.linear(x, w_.to(x.dtype)) for w_ in wbfs], reps) * 1e6
            if tgs is not None:
                try:
                    y = torch.ops.aten._weight_int4pack_mm(x, tgs[0][0], g, tgs[0][1])
                    row["tinygemm_err"] = rel_err(y, ref)
                    row["tinygemm_us"] = graph_time(
                        torch, [lambda t=t: torch.ops.aten._weight_int4pack_mm(x, t[0], g, t[1]) for t in tgs],
                        reps) * 1e6
                except Exception as exc:                              # noqa: BLE001
                    row["tinygemm"] = f"rejects ({type(exc).__name__}: {str(exc).strip().splitlines()[0][:80]})"
            else:
                row["tinygemm"] = f"rejects ({tg_err})"
            default = T.tiled_config(m, n, k, g)
            cands = [as_cand(default)] + grid_for(m, args.quick)[:2 if selftest else None]
            cands = [c for c in dict.fromkeys(cands) if pack_ok(k, group, c[1]) and (c[0] not in T.CUDA_MODES or cuda_ok)]
            timings, skipped = [], 0
            for ci, c in enumerate(cands):
                if time.time() - shape_t0 > share and ci > 0:
                    skipped = len(cands) - ci
                    break
                p = c[1]
                tw = tiled[p]
                seen_grids = set()
                for target in ((default.target_programs,) if ci == 0 else ()) + TARGETS:
                    cfg = make_cfg(T, c, target)
                    try:
                        grid, _, _ = T.plan_tiled(m, n, tw.n_tiles, cfg)
                    except ValueError as exc:
                        skip(f"{label} M={m} {cfg_short(cfg)}: {exc}")
                        break
                    if grid in seen_grids:
                        continue
                    seen_grids.add(grid)
                    try:
                        y1 = T.int4_gemv_tiled(x, tw, None, cfg)
                        y2 = T.int4_gemv_tiled(x, tw, None, cfg)
                        if not selftest:
                            torch.cuda.synchronize()
                        err = rel_err(y1, ref)
                        same = torch.equal(y1, y2) or cfg.reduce == "atomic"     # fp32 atomics: any order
                        if not (err < 2e-2) or not same or not (rel_err(y2, ref) < 2e-2):
                            skip(f"{label} M={m} {cfg_short(cfg)} split={grid[1]}: wrong result "
                                 f"(rel err {err:.3g}, repeatable={torch.equal(y1, y2)})")
                            continue
                        t = graph_time(torch, [lambda tw_=tw_, cfg=cfg: T.int4_gemv_tiled(x, tw_, None, cfg)
                                               for tw_ in tcopies[p]], reps)
                        outs = T.int4_gemv_tiled(x, tcopies[p][-1], None, cfg)
                        if rel_err(outs, ref) >= 2e-2:
                            skip(f"{label} M={m} {cfg_short(cfg)}: wrong after graph replay")
                            continue
                    except Exception as exc:                          # noqa: BLE001 - one line, never fatal
                        msg = str(exc).strip().splitlines()[-1][:160] if str(exc).strip() else ""
                        skip(f"{label} M={m} {cfg_short(cfg)}: {type(exc).__name__}: {msg}")
                        break
                    timings.append({"cfg": cfg, "us": t * 1e6, "err": err, "split": grid[1],
                                    "programs": grid[0] * grid[1],
                                    "is_default": ci == 0 and target == default.target_programs})
            if skipped:
                print(f"note: {label} M={m}: budget reached, {skipped} of {len(cands)} configs not tried", flush=True)
            if timings:
                best = min(timings, key=lambda r: r["us"])
                p = best["cfg"].pack
                row["best"] = {"cfg": cfg_dict(best["cfg"]), "us": round(best["us"], 2), "split": best["split"],
                               "GBps": round(int4_bytes[p] / best["us"] / 1e3, 1), "rel_err": round(best["err"], 5)}
                if hbm:
                    row["best"]["hbm_fraction"] = round(int4_bytes[p] / (best["us"] * 1e-6) / hbm, 3)
                row["best_by_pack"] = {}
                for pk in sorted(tiled):
                    tp = [r for r in timings if r["cfg"].pack == pk]
                    if tp:
                        b = min(tp, key=lambda r: r["us"])
                        row["best_by_pack"][str(pk)] = {"cfg": cfg_dict(b["cfg"]), "us": round(b["us"], 2)}
                dft = [r for r in timings if r["is_default"]]
                if dft:
                    row["default"] = {"cfg": cfg_dict(dft[0]["cfg"]), "us": round(dft[0]["us"], 2)}
                row["x_bf16"] = round(row["bf16_us"] / best["us"], 2)
                if row.get("tinygemm_us"):
                    row["x_tinygemm"] = round(row["tinygemm_us"] / best["us"], 2)
                row["configs_timed"] = len(timings)
            else:
                row["best"] = None
            row["bf16_us"] = round(row["bf16_us"], 2)
            if row.get("tinygemm_us"):
                row["tinygemm_us"] = round(row["tinygemm_us"], 2)
            results.append(row)
            print("JSON " + json.dumps(row), flush=True)
        del wd, wbf, wbfs, tiled, tcopies, tgs, iw
        if not selftest:
            torch.cuda.empty_cache()

    summarize(results, T, dev_name)
    if _SKIPS[0] > 40:
        print(f"({_SKIPS[0] - 40} more skipped configs not shown)")
    print(f"total {time.time() - t_start:.0f} s", flush=True)

    out = args.out or (os.path.join(os.environ["OUT"], "int4_sweep.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump({"device": dev_name, "torch": torch.__version__, "triton": triton.__version__,
                       "hbm_read_GBps": round(hbm / 1e9, 1) if hbm else None,
                       "results": results}, f, indent=1)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
