#!/usr/bin/env python
"""The K-split tensor-core GEMV (`int4_cuda.gemv_ksplit`, mode "ksplit") on the small and mid-size matrices,
next to bf16, the plain read of the same bytes, `linear_int4`'s path today and torch's tinygemm.

    python3 scripts/int4_ksplit_probe.py [--shapes 2048x2048,4096x4096] [--top 4] [--rows 4] [--group 32] [--dequant]
        [--occupancy 16,32,48,64]
    python3 scripts/int4_ksplit_probe.py --rows 16 --kblocks 1,2,4,8,16 [--shapes ...]

First a correctness pass (1, 2, 3, 4, 8, 9, 13 and 16 rows of x, bias, fp16, pack 32, ragged N, per-channel groups) against
the dequantized weight; then per shape CUDA-graph replays over >= 256 MB of copies (L2 holds none), median,
over a grid of (ksplit, warps a block, occupancy), each config as it is and with its unpacking and mma
removed (`nomath`), with the registers a thread takes. Each config runs as `gemv_ksplit` defaults (the weights
scaled before the mma where a step holds several groups); `--dequant`: each config both ways (`dequant=False`,
`True`; `nomath` only for the unscaled one, whose math it removes). `--kblocks`: instead of that grid, K split over
blocks too (each of the listed counts) with 1-32 tiles a block and 8, 16 or 32 warps (where a warp takes at most
four steps and the grid holds 96-8192 blocks; 8 warps at 16 and 32 warps an SM); no `nomath` there.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ktinject.bench_gpu import graph_time, hardware_line, read_bandwidth  # noqa: E402
from ktinject.operators.kernels import int4_cuda as C, int4_pack as P, int4_triton as T  # noqa: E402
from int4_grid_probe import reference_paths, regs, shape_setup  # noqa: E402  (this folder)


PERSIST_CASES = [  # more tiles than a persistent grid holds at once (132 SMs x 4 blocks): several rounds a block
    (21888, 2048, 128, 16, 1, torch.bfloat16, True, 8, 8),
    (21000, 2048, 128, 16, 3, torch.float16, False, 8, 16),       # (1312.5 tiles: the last half empty)
    (12000, 1536, 64, 16, 1, torch.bfloat16, True, 4, 8),         # (groups of 64: scaled before the mma)
    (40000, 1024, 32, 16, 2, torch.bfloat16, False, 8, 8),
    (9000, 4096, 256, 32, 1, torch.bfloat16, False, 16, 16),
]


def check_all(persist: bool = False) -> int:
    """Each case against the dequantized weight; `persist`: the cases of one block over K and PERSIST_CASES
    with the persistent grid, each also bit for bit against the same config without it."""
    bad = 0
    g = torch.Generator(device="cpu").manual_seed(3)
    cases = [  # (n, k, group, pack, rows, dtype, bias, ksplit, warps[, kblocks])
        (2048, 2048, 128, 16, 1, torch.bfloat16, False, 16, 16),
        (2056, 2048, 128, 16, 1, torch.bfloat16, True, 8, 16),
        (1000, 4096, 256, 32, 2, torch.bfloat16, False, 16, 16),
        (4096, 2048, 256, 16, 4, torch.float16, True, 4, 8),
        (640, 1536, 128, 16, 8, torch.bfloat16, False, 3, 6),
        (3072, 2048, -1, 16, 1, torch.bfloat16, False, 16, 32),
        (96, 392, 128, 16, 3, torch.bfloat16, True, 2, 4),
        (40, 2176, 128, 16, 1, torch.float16, False, 1, 2),
        (2048, 2048, 128, 16, 16, torch.bfloat16, True, 8, 8),
        (1000, 1088, 128, 16, 9, torch.float16, False, 4, 8),
        (3000, 4096, 256, 32, 13, torch.bfloat16, False, 16, 16),
        (2048, 2048, 32, 16, 1, torch.bfloat16, False, 8, 8),       # groups of 32 and 64: several a step
        (2056, 1160, 32, 16, 5, torch.float16, True, 3, 6),
        (2048, 10944, 64, 16, 4, torch.bfloat16, True, 32, 32),
        (1000, 2048, 64, 16, 16, torch.bfloat16, False, 8, 16),
        (4096, 4096, 128, 16, 16, torch.bfloat16, True, 2, 32, 8),    # K over blocks too
        (2056, 10944, 64, 16, 16, torch.bfloat16, True, 2, 32, 16),   # (86 steps: 15 blocks, the last of 2)
        (1000, 4096, 256, 32, 13, torch.float16, False, 4, 16, 3),
        (2048, 2048, 32, 16, 8, torch.bfloat16, False, 1, 16, 16),
        (640, 1160, 128, 16, 5, torch.bfloat16, True, 2, 8, 4),
    ]
    if persist:
        cases = [c for c in cases if len(c) < 10] + PERSIST_CASES
    for case, dq in [(c, False) for c in cases] + [(c, True) for c in cases if c[3] == 16]:
        n, k, group, pack, rows, dt, with_bias, ks, warps = case[:9]
        kb = case[9] if len(case) > 9 else 1
        iw = P.quantize(torch.randn(n, k, generator=g) * 0.05, group)
        tw = P.tile(iw, pack).to("cuda")
        x = torch.randn(rows, k, generator=g).to("cuda", dt)
        b = torch.randn(n, generator=g).to("cuda", dt) if with_bias else None
        ref = x.float() @ P.dequantize(iw, torch.float32).to("cuda").T
        if b is not None:
            ref = ref + b.float()
        try:
            y = C.gemv_ksplit(x, tw, b, ksplit=ks, warps=warps, dequant=dq, kblocks=kb, persist=persist)
            torch.cuda.synchronize()
            err = ((y.float() - ref).norm() / ref.norm()).item()
            worst = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            ok = err < 1e-2 and worst < 3e-2
            again = C.gemv_ksplit(x, tw, b, ksplit=ks, warps=warps, dequant=dq, kblocks=kb)   # (persist: without)
            same = torch.equal(again, y)
        except Exception as exc:                                      # noqa: BLE001 - a probe: report, go on
            ok, same, err, worst = False, False, float("nan"), float("nan")
            print(f"  {type(exc).__name__}: {str(exc)[:300]}")
        bad += not (ok and same)
        print(f"check {n}x{k} G{group} P{pack} rows {rows} {str(dt)[6:]} bias {with_bias} ks{ks} w{warps} kb{kb}"
              f"{' persist' if persist else ''}: "
              f"rel err {err:.2g}, worst {worst:.2g}, deterministic {same}: {'ok' if ok and same else 'WRONG'}"
              f"{' (scaled before the mma)' if dq else ''}",
              flush=True)
    return bad


def kblocks_grid(x, w0, ref, copies, a, steps, idx) -> list:
    """(seconds, nan, name, registers) of K split over blocks too: kblocks x tiles a block x warps."""
    rows, n_tiles = [], -(-w0.qweight.shape[0] // 16)
    for kb, spb in sorted({C.ksplit_kblocks(steps, int(v)) for v in a.kblocks.split(",")}):
        for tpb, warps, occ in itertools.product((1, 2, 4, 8, 16, 32), (8, 16, 32), (16, 32)):
            ks = warps // tpb
            if ks < 1 or ks > spb or -(-spb // ks) > 4 or not 96 <= -(-n_tiles // tpb) * kb <= 8192 or \
                    (warps, occ) in ((16, 32), (32, 16)):
                continue
            name = f"kb{kb:<2} tiles{tpb:<2} ks{ks:<2} w{warps:<2} occ{occ}"
            try:
                y = C.gemv_ksplit(x, w0, ksplit=ks, warps=warps, occupancy=occ, kblocks=kb)
                torch.cuda.synchronize()
                err = ((y.float() - ref).norm() / ref.norm()).item()
                if not err < 1e-2:
                    raise RuntimeError(f"wrong (rel err {err:.2g})")
                t = graph_time([lambda w=w: C.gemv_ksplit(x, w, ksplit=ks, warps=warps, occupancy=occ,
                                                          kblocks=kb) for w in copies], a.reps)
                shape = C.ksplit_shape(w0, a.rows, True, False, ksplit=ks, warps=warps, occupancy=occ, kblocks=kb)[0]
                rows.append((t, float("nan"), name, regs(shape, idx)))
            except Exception as exc:                                  # noqa: BLE001 - a probe: report, go on
                print(f"  {name}: {type(exc).__name__}: {str(exc)[:120]}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="2048x2048,3072x2048,4096x2048,7168x2048,4096x4096,10944x2048,21888x2048")
    ap.add_argument("--top", type=int, default=4)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--group", type=int, default=128, help="scale group size of the weights (32, 64, 128 ...)")
    ap.add_argument("--dequant", action="store_true", help="each config both ways: weights scaled before the mma or not")
    ap.add_argument("--occupancy", default="16,32", help="comma list: warps an SM the launch bound asks for")
    ap.add_argument("--persist", action="store_true", help="each config also as a persistent grid (checked too)")
    ap.add_argument("--kblocks", default="", help="comma list: K split over that many blocks too (its own grid)")
    a = ap.parse_args(argv)
    print(hardware_line(), flush=True)
    bad = 0 if a.no_check else check_all() + (check_all(persist=True) if a.persist else 0)
    roof = read_bandwidth()
    print(f"HBM read roofline {roof / 1e9:.0f} GB/s", flush=True)
    idx = C.device_index("cuda")
    for spec in a.shapes.split(","):
        n, k = map(int, spec.split("x"))
        iw, w0, wbytes, copies, x, ref, t_bf16, (t_read, how) = shape_setup(n, k, a.rows, a.reps, a.group)
        print(f"{spec} x {a.rows}, groups of {a.group}: {wbytes / 1e6:.1f} MB int4; bf16 {t_bf16 * 1e6:.2f} us (x2: {t_bf16 * 5e5:.2f}, "
              f"x3: {t_bf16 * 1e6 / 3:.2f}); plain read {t_read * 1e6:.2f} us ({how})", flush=True)
        found = reference_paths(x, iw, copies, a.reps)
        tri = T.class_config(a.rows, n, k)                            # the Triton kernels' config for the shape
        found.append((graph_time([lambda w=w: T.int4_gemv_tiled(x, w, None, tri) for w in copies], a.reps),
                      f"Triton class ({tri.mode})"))
        steps = k // 128
        occs = [int(v) for v in a.occupancy.split(",")]
        rows = []
        if a.kblocks:
            rows = kblocks_grid(x, w0, ref, copies, a, steps, idx)
        for ks in [] if a.kblocks else sorted({s for s in (4, 8, 16, 32) if s <= steps}):
            for warps in sorted({ks, 2 * ks} & set(range(1, 33))):
                for occ, dq, pe in [(o, d, p) for o in occs for d in ((False, True) if a.dequant else (None,))
                                    for p in ((False, True) if a.persist else (False,))]:
                    scaled = dq if dq is not None else C.ksplit_groups(w0) > 1     # (gemv_ksplit's default)
                    try:
                        res = []
                        for nomath in ((False,) if scaled else (False, True)):
                            y = C.gemv_ksplit(x, w0, ksplit=ks, warps=warps, occupancy=occ, nomath=nomath, dequant=dq,
                                              persist=pe)
                            torch.cuda.synchronize()
                            if not nomath:
                                err = ((y.float() - ref).norm() / ref.norm()).item()
                                if not err < 1e-2:
                                    raise RuntimeError(f"wrong (rel err {err:.2g})")
                            res.append(graph_time([lambda w=w, nm=nomath: C.gemv_ksplit(
                                x, w, ksplit=ks, warps=warps, occupancy=occ, nomath=nm, dequant=dq, persist=pe)
                                for w in copies], a.reps))
                        res += [float("nan")] * (2 - len(res))
                        shape = C.ksplit_shape(w0, a.rows, True, False, ksplit=ks, warps=warps, occupancy=occ,
                                               dequant=dq, persist=pe)[0]
                        rows.append((res[0], res[1], f"ks{ks:<2} w{warps:<2} occ{occ}{' scaled' if scaled else ''}"
                                     f"{' persist' if pe else ''}",
                                     regs(shape, idx)))
                    except Exception as exc:                          # noqa: BLE001 - a probe: report, go on
                        print(f"  ks{ks} w{warps} occ{occ} dq {dq}: {type(exc).__name__}: {str(exc)[:120]}")
        for t, name in found:
            print(f"  {name:<34} {t * 1e6:6.2f} us ({t_bf16 / t:.2f}x bf16, {t / t_read:.2f}x the plain read)",
                  flush=True)
        rows.sort(key=lambda r: r[0])
        for t, tn, cfg, nreg in rows[:a.top]:
            print(f"  ksplit {cfg} ({nreg} regs): {t * 1e6:6.2f} us ({t_bf16 / t:.2f}x bf16, "
                  f"{wbytes / t / roof:.2f} HBM, {t / t_read:.2f}x read), nomath {tn * 1e6:6.2f} us", flush=True)
        del copies
        torch.cuda.empty_cache()
    print(f"correctness: {'all ok' if not bad else f'{bad} WRONG'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
