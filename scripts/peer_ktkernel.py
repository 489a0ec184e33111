#!/usr/bin/env python3
"""The peer, measured in the same run: kt-kernel's CPU MoE on one V2-Lite routed-experts layer.

../shared/PERF.md records kt-kernel 0.7.2 (KTransformers' CPU expert engine) on one lease of the lent
machine. Leases differ by 2x in memory bandwidth and AMX tile speed (docs/benchmarks.md, twenty-third
and twenty-fourth sessions), so a ratio against those recorded rows says as much about the host as about
the kernels. This script runs the peer on the host at hand, beside `ktinject bench experts`
(scripts/device_peer.sh alternates them), with PERF.md's setup: one layer of hidden 2048, moe_intermediate
1408, 64 experts, top-6, layers cycled over >= --gib of weights, random routing, one pool of `--threads`
workers. It prints one JSON object per (method, batch).

It needs only the peer's compiled extension and the libraries beside it, not its Python package (which
imports torch and CUDA helpers): `--ext DIR/kt_kernel/_kt_kernel_ext_amx.cpython-312-x86_64-linux-gnu.so`
with DIR/kt_kernel.libs next to it, as in the kt-kernel 0.7.2 wheel (Apache-2.0; `pip download kt-kernel==0.7.2`
on a machine with the index). Buffers are numpy arrays; weights are bf16 from a normal distribution, the
peer quantizing them at load as its online path does.

Usage: python3 scripts/peer_ktkernel.py --ext PATH --threads 16 [--methods int4,bf16] [--batch 1,512]
       [--gib 2] [--seconds 1.5]
"""
from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import os
import sys
import time

import numpy as np

METHODS = {"int4": ("AMXInt4_MOE", 0.5), "int8": ("AMXInt8_MOE", 1.0), "bf16": ("AMXBF16_MOE", 2.0),
           "avx2-bf16": ("AVX2BF16_MOE", 2.0)}


def load_ext(path: str):
    if not os.path.isfile(path):
        sys.exit(f"peer_ktkernel: no extension at {path}")
    loader = importlib.machinery.ExtensionFileLoader("kt_kernel_ext", path)
    spec = importlib.util.spec_from_file_location("kt_kernel_ext", path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def bf16_normal(rng: np.random.Generator, shape, scale: float) -> np.ndarray:
    """bf16 bit patterns (uint16) of N(0, scale^2) values, rounded to nearest even"""
    f = (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).view(np.uint32)
    return ((f + 0x7FFF + ((f >> 16) & 1)) >> 16).astype(np.uint16)


def f32(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def reference_error(o, x, ids, wts, gate, up, down, nt: int) -> float:
    """relative error of the peer's first nt tokens' outputs against float64 on the same bf16 values"""
    num = den = 0.0
    for t in range(nt):
        xt, acc = f32(x[t]), 0.0
        for e, w in zip(ids[t], wts[t]):
            g, u = f32(gate[e]) @ xt, f32(up[e]) @ xt
            acc = acc + w * (f32(down[e]) @ (g / (1 + np.exp(-g)) * u))
        num += float(np.sum((o[t] - acc) ** 2))
        den += float(np.sum(acc ** 2))
    return (num / den) ** 0.5 if den > 0 else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ext", required=True, help="the peer's compiled extension (.so), kt_kernel.libs beside its folder")
    ap.add_argument("--threads", type=int, required=True, help="the peer's pool size (one subpool, NUMA node 0)")
    ap.add_argument("--methods", default="int4,bf16", help=f"comma-separated, of {', '.join(METHODS)}")
    ap.add_argument("--batch", default="1,512", help="tokens per call, comma-separated")
    ap.add_argument("--gib", type=float, default=2.0, help="weights cycled, GiB (layers: 2 to --max-layers)")
    ap.add_argument("--seconds", type=float, default=1.5, help="per timed round (two rounds, the better kept)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=1408)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=6)
    ap.add_argument("--max-layers", type=int, default=16)
    a = ap.parse_args()
    ext = load_ext(a.ext)
    H, I, E, k = a.hidden, a.inter, a.experts, a.topk
    batches = [int(b) for b in a.batch.split(",")]

    cfg = ext.WorkerPoolConfig()
    cfg.subpool_count = 1
    cfg.subpool_numa_map = [0]
    cfg.subpool_thread_count = [a.threads]
    cpu = ext.CPUInfer(cfg)

    rng = np.random.default_rng(0)
    # one set of source weights, quantized by every layer into its own buffers (the peer copies them at load)
    gate, up = bf16_normal(rng, (E, I, H), H ** -0.5), bf16_normal(rng, (E, I, H), H ** -0.5)
    down = bf16_normal(rng, (E, H, I), I ** -0.5)
    mask = np.zeros(E, dtype=np.bool_)
    p2l = np.arange(E, dtype=np.int64)
    maxb = max(batches)

    for meth in a.methods.split(","):
        cls_name, bpw = METHODS[meth]
        layer_bytes = 3 * E * I * H * bpw
        n_layers = max(2, min(a.max_layers, int(np.ceil(a.gib * 2 ** 30 / layer_bytes))))
        t0 = time.perf_counter()
        layers = []
        for li in range(n_layers):
            c = ext.moe.MOEConfig(E, k, H, I, mask.ctypes.data)
            c.layer_idx = li
            c.pool = cpu.backend_
            c.max_len = maxb
            c.gate_proj, c.up_proj, c.down_proj = gate.ctypes.data, up.ctypes.data, down.ctypes.data
            moe = getattr(ext.moe, cls_name)(c)
            cpu.submit(moe.load_weights_task(p2l.ctypes.data))
            cpu.sync()
            layers.append((c, moe))
        load_s = time.perf_counter() - t0

        for T in batches:
            NR = 32   # routings cycled
            ids = np.stack([np.stack([rng.permutation(E)[:k] for _ in range(T)]) for _ in range(NR)]).astype(np.int64)
            wts = rng.random((NR, T, k), dtype=np.float32)
            x = bf16_normal(rng, (n_layers, T, H), 1.0)
            out = np.zeros((n_layers, T, H), dtype=np.uint16)
            bsz = np.array([T], dtype=np.int64)

            def step(i: int) -> None:
                li, r = i % n_layers, i % NR
                cpu.submit(layers[li][1].forward_task(bsz.ctypes.data, k, ids[r].ctypes.data, wts[r].ctypes.data,
                                                      x[li].ctypes.data, out[li].ctypes.data, False))
                cpu.sync()

            for i in range(2 * n_layers):
                step(i)
            best = None
            for _ in range(2):   # two rounds, the better one kept (as ktinject bench --rounds 2)
                n, t0 = 0, time.perf_counter()
                while True:
                    step(n)
                    n += 1
                    el = time.perf_counter() - t0
                    if el >= a.seconds and n >= 2 * n_layers:
                        break
                ms = el / n * 1e3
                best = ms if best is None else min(best, ms)
            o = (out.astype(np.uint32) << 16).view(np.float32)
            # the last call's output (layer li, routing r) against float64 on the bf16 weights, first 4 tokens
            li, r = (n - 1) % n_layers, (n - 1) % NR
            err = reference_error(o[li], x[li], ids[r], wts[r], gate, up, down, min(T, 4))
            # bytes of the experts the batch touches (each once; weights only, without the peer's scales)
            touched = float(np.mean([len(np.unique(ids[r])) for r in range(NR)]))
            gb = touched * 3 * I * H * bpw / 1e9
            rec = {"peer": "kt-kernel", "method": meth, "class": cls_name, "batch": T, "threads": a.threads,
                   "layers": n_layers, "load_s": round(load_s, 1), "ms_per_layer": round(best, 4),
                   "gbps": round(gb / (best / 1e3), 1), "tflops": round(2 * 3 * T * k * I * H / (best / 1e3) / 1e12, 3),
                   "rel_err": round(err, 5)}
            print(json.dumps(rec), flush=True)
        del layers


if __name__ == "__main__":
    main()
