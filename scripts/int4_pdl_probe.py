#!/usr/bin/env python
"""The K-split int4 GEMV launched as a programmatic dependent (PDL, sm_90+) against the plain launch.

    python3 scripts/int4_pdl_probe.py [--shapes 2048x2048,3072x2048] [--rows 1,4,16] [--reps 15]

First a correctness pass: chains of K-split GEMVs, each reading the output of the one before (and a torch
kernel between some of them), captured in a CUDA graph with `pdl` "sum", "auto" and "all" and replayed, and run eagerly,
bit for bit against the same chain with "off" (a kernel that read its input before the kernel before it finished
would differ). Then per shape and rows (`linear_int4`'s K-split config for it): CUDA-graph replays over >= 256 MB of
weight copies, us a call, with each `pdl` mode ("off": plain launches, the binary without griddepcontrol; "sum":
the parts' sum kernel as a dependent of the K split, and a K split over blocks as a dependent of the kernel before;
"auto", the default: that, and a K split as a dependent of a kernel that releases it early; "all": every K split so):
* back to back, and bf16 `F.linear` the same way;
* in a layer's order: each call preceded by a torch kernel that writes its x (`torch.mul(h, s, out=x)`, as a
  norm would), the pair's time less that kernel's alone; bf16 the same way;
* after ktinject's own `rms_norm` kernel, which lets the kernel after it start early on sm_90+ (this probe sets
  `KTINJECT_INT4_PDL=auto` for its process, so the norms release whatever the caller's environment says; each K
  split takes its mode explicitly, and "auto" launches it as the norm's dependent: kernels/pdl.py), the pair's time
  less the norm's alone; bf16 the same way. Back to back "auto" is "all" (each K split follows one of ours).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ktinject.bench_gpu import L2_BYTES, graph_time, hardware_line  # noqa: E402
from ktinject.operators.kernels import int4_cuda as C, int4_pack as P, int4_triton as T  # noqa: E402
from ktinject.operators.norm import rms_norm_triton  # noqa: E402


def ksplit_kwargs(cfg) -> dict:
    return dict(ksplit=cfg.chunk, warps=cfg.num_warps, dequant=cfg.dequant, kblocks=cfg.kblocks,
                occupancy=cfg.occupancy)


def check_chains() -> int:
    """Graph-captured chains with PDL against eager ones without; the count of mismatches."""
    bad = 0
    g = torch.Generator(device="cpu").manual_seed(5)
    for n, rows, group, links, kb in ((2048, 1, 128, 12, 1), (2048, 4, 128, 8, 1), (2048, 16, 128, 8, 4),
                                      (2048, 1, 32, 8, 1), (1024, 3, 64, 10, 2)):
        ws = [P.tile(P.quantize(torch.randn(n, n, generator=g) * 0.03, group), 16).to("cuda") for _ in range(links)]
        h = torch.randn(rows, n, generator=g).to("cuda", torch.bfloat16)
        cfgs = [dict(ksplit=8, warps=8, kblocks=kb), dict(ksplit=4, warps=16, kblocks=kb)]

        def chain(mode: str) -> list:
            outs, x = [], h
            for i, w in enumerate(ws):
                if i % 3 == 2:
                    x = torch.mul(x, 0.5)                                 # a torch kernel between two GEMVs
                x = C.gemv_ksplit(x, w, ksplit=cfgs[i % 2]["ksplit"], warps=cfgs[i % 2]["warps"],
                                  kblocks=kb, pdl=mode)
                outs.append(x)
            return outs

        ref = [t.clone() for t in chain("off")]
        for mode in ("sum", "auto", "all"):
            chain(mode)                                                   # (compile, warm)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                got = chain(mode)
            ok = True
            for _ in range(5):
                for t in got:
                    t.fill_(0)
                graph.replay()
                torch.cuda.synchronize()
                ok &= all(torch.equal(a, b) for a, b in zip(got, ref))
            eager = chain(mode)
            torch.cuda.synchronize()
            ok &= all(torch.equal(a, b) for a, b in zip(eager, ref))
            bad += not ok
            print(f"chain {links} x [{n}, {n}] G{group}, {rows} rows, kblocks {kb}, pdl {mode}: "
                  f"{'bit-identical' if ok else 'DIFFERENT'} (graph replays and eager, against pdl off)", flush=True)
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="2048x2048,3072x2048,4096x4096,10944x2048,21888x2048,2048x10944")
    ap.add_argument("--rows", default="1")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--no-check", action="store_true")
    a = ap.parse_args(argv)
    os.environ["KTINJECT_INT4_PDL"] = "auto"       # (rms_norm releases its dependents; the GEMVs take pdl= each)
    print(hardware_line(), flush=True)
    if not C.pdl_supported(C.device_index("cuda")):
        print("this GPU or driver takes no programmatic dependent launch")
        return 1
    bad = 0 if a.no_check else check_chains()
    for spec in a.shapes.split(","):
        n, k = map(int, spec.split("x"))
        torch.manual_seed(0)
        group = 64 if k == 10944 else 128
        iw = P.quantize(torch.randn(n, k, device="cuda") * 0.02, group)
        w0 = P.tile(iw, 16)
        wbytes = w0.qweight.numel() * 4 + 2 * w0.scales.numel() * 2
        copies = [w0] + [P.tile(iw, 16) for _ in range(max(1, -(-L2_BYTES // wbytes)) - 1)]
        wb = P.dequantize(iw, torch.bfloat16)
        bcopies = [wb] + [wb.clone() for _ in range(max(1, -(-L2_BYTES // (wb.numel() * 2))) - 1)]
        for rows in map(int, a.rows.split(",")):
            cfg = T.tiled_config(rows, n, k, group)
            if cfg.mode != "ksplit":
                print(f"{spec} x {rows}: linear_int4 runs {cfg.mode} there, not the K split; skipped")
                continue
            kw = ksplit_kwargs(cfg)
            h = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            xs = [torch.empty_like(h) for _ in copies]
            xb = [torch.empty_like(h) for _ in bcopies]

            def pre(x):
                return torch.mul(h, 1.0, out=x)

            t_pre = graph_time([lambda x=x: pre(x) for x in xs], a.reps)
            line = {"bf16": graph_time([lambda w=w: F.linear(h, w) for w in bcopies], a.reps)}
            for mode in C.PDL_MODES:
                line[mode] = graph_time([lambda w=w, m_=mode: C.gemv_ksplit(h, w, pdl=m_, **kw) for w in copies],
                                        a.reps)
            ctx = {"bf16": graph_time([lambda w=w, x=x: (pre(x), F.linear(x, w)) for w, x in zip(bcopies, xb)],
                                      a.reps) - t_pre}
            for mode in C.PDL_MODES:
                ctx[mode] = graph_time([lambda w=w, x=x, m_=mode: (pre(x), C.gemv_ksplit(x, w, pdl=m_, **kw))
                                        for w, x in zip(copies, xs)], a.reps) - t_pre
            nw = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5

            def norm():
                return rms_norm_triton(h, nw, 1e-6)

            t_norm = graph_time([norm for _ in copies], a.reps)
            after = {"bf16": graph_time([lambda w=w: F.linear(norm(), w) for w in bcopies], a.reps) - t_norm}
            for mode in C.PDL_MODES:
                after[mode] = graph_time([lambda w=w, m_=mode: C.gemv_ksplit(norm(), w, pdl=m_, **kw)
                                          for w in copies], a.reps) - t_norm
            fmt = "  ".join(f"{name} {t * 1e6:.2f}" for name, t in line.items())
            fmc = "  ".join(f"{name} {t * 1e6:.2f}" for name, t in ctx.items())
            fmn = "  ".join(f"{name} {t * 1e6:.2f}" for name, t in after.items())
            xb16 = lambda d: ", ".join(f"{m_} {d['bf16'] / d[m_]:.2f}" for m_ in C.PDL_MODES)   # noqa: E731
            print(f"{spec} x {rows} ({kw}), us a call\n  back to back: {fmt}  (x bf16: {xb16(line)})\n"
                  f"  after a torch kernel (its {t_pre * 1e6:.2f} us taken off): {fmc}  (x bf16: {xb16(ctx)})\n"
                  f"  after rms_norm (its {t_norm * 1e6:.2f} us taken off): {fmn}  (x bf16: {xb16(after)})",
                  flush=True)
        del copies, bcopies, wb
        torch.cuda.empty_cache()
    print(f"correctness: {'all ok' if not bad else f'{bad} WRONG'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
