"""A/B of the CUDA int4 GEMVs in one process: this tree's `int4_cuda` against another version of the module, loaded
from a file (`git show REV:ktinject/operators/kernels/int4_cuda.py > old_int4_cuda.py` in the repo root, untracked,
so that it travels to the device; f33239d is the one before the nibble pairs became one LOP3, 9636b09 the one before
the K split's loads took whole base pointers).

    python3 scripts/int4_cuda_ab.py [old_int4_cuda.py]

Each kernel (`mma`, `diag` with and without its ring, the K split one row / 3 rows fp16 / groups of 32 and 64 scaled
first / over blocks) must give the same bits both ways (with AB_TOL=1, for a change of the summation order: an error
against float32 no worse than before); then, at one row, graph-replay times over >= 256 MB of
copies, alternating the two modules three times.
"""
import importlib.util
import os
import sys
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ktinject.bench_gpu import graph_time, L2_BYTES, hardware_line
from ktinject.operators.kernels import int4_cuda as NEW, int4_pack as P
spec = importlib.util.spec_from_file_location("ktinject.operators.kernels.int4_cuda_old",
                                              sys.argv[1] if len(sys.argv) > 1 else "old_int4_cuda.py")
OLD = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = OLD                     # (its dataclasses look their module up there)
spec.loader.exec_module(OLD)
print(hardware_line(), flush=True)
g = torch.Generator(device="cpu").manual_seed(0)
def case(n, k, group, rows, dt, bias):
    iw = P.quantize(torch.randn(n, k, generator=g) * 0.02, group)
    w = P.tile(iw, 16).to("cuda")
    x = torch.randn(rows, k, generator=g).to("cuda", dt)
    b = torch.randn(n, generator=g).to("cuda", dt) if bias else None
    return w, x, b, iw
checks = [  # (name, n, k, group, rows, dtype, bias, fn(mod, x, w, b))
    ("ksplit 8,8", 21888, 2048, 128, 1, torch.bfloat16, True, lambda M, x, w, b: M.gemv_ksplit(x, w, b, ksplit=8, warps=8)),
    ("ksplit 16,16 fp16 r3", 4096, 4096, 128, 3, torch.float16, False, lambda M, x, w, b: M.gemv_ksplit(x, w, b, ksplit=16, warps=16)),
    ("ksplit dq G32", 2048, 2048, 32, 1, torch.bfloat16, False, lambda M, x, w, b: M.gemv_ksplit(x, w, b, ksplit=8, warps=8)),
    ("ksplit dq G64 kb r16", 2048, 10944, 64, 16, torch.bfloat16, True, lambda M, x, w, b: M.gemv_ksplit(x, w, b, ksplit=2, warps=32, kblocks=16)),
    ("diag 10,4,2", 102400, 2048, 128, 1, torch.bfloat16, False, lambda M, x, w, b: M.gemv_diag(x, w, b, warps=10, batch=4, ctas_per_sm=2)),
    ("diag ring r4", 102400, 2048, 128, 4, torch.bfloat16, True, lambda M, x, w, b: M.gemv_diag(x, w, b, warps=10, batch=4, ctas_per_sm=2, stages=2)),
    ("ksplit 8,8 o_proj", 2048, 2048, 128, 1, torch.bfloat16, False, lambda M, x, w, b: M.gemv_ksplit(x, w, b, ksplit=8, warps=8)),
    ("ksplit 8,8 q_proj", 3072, 2048, 128, 1, torch.bfloat16, False, lambda M, x, w, b: M.gemv_ksplit(x, w, b, ksplit=8, warps=8)),
    ("ksplit 8,8 ragged", 2056, 2048, 128, 1, torch.bfloat16, True, lambda M, x, w, b: M.gemv_ksplit(x, w, b, ksplit=8, warps=8)),
    ("ksplit 8,8 gate", 10944, 2048, 128, 1, torch.bfloat16, False, lambda M, x, w, b: M.gemv_ksplit(x, w, b, ksplit=8, warps=8)),
    ("ksplit 16,16", 4096, 4096, 128, 1, torch.bfloat16, False, lambda M, x, w, b: M.gemv_ksplit(x, w, b, ksplit=16, warps=16)),
    ("ksplit 4,4 G32 lm_head", 102400, 2048, 32, 1, torch.bfloat16, False, lambda M, x, w, b: M.gemv_ksplit(x, w, b, ksplit=4, warps=4, occupancy=16)),
    ("ksplit down G64 kb8", 2048, 10944, 64, 1, torch.bfloat16, False, lambda M, x, w, b: M.gemv_ksplit(x, w, b, ksplit=8, warps=8, kblocks=8)),
    ("mma r16", 4096, 2048, 128, 16, torch.bfloat16, True, lambda M, x, w, b: M.gemv_mma(x, w, b, warps=4, batch=2)),
    ("mma fp16 r5", 3000, 4096, 128, 5, torch.float16, False, lambda M, x, w, b: M.gemv_mma(x, w, b, warps=4, batch=2)),
]
bad = 0
TOL = os.environ.get("AB_TOL") == "1"
for name, n, k, group, rows, dt, bias, fn in checks:
    w, x, b, iw = case(n, k, group, rows, dt, bias)
    try:
        yn, yo = fn(NEW, x, w, b), fn(OLD, x, w, b)
        torch.cuda.synchronize()
        ref = x.float() @ P.dequantize(iw, torch.float32).to("cuda").T + (b.float() if b is not None else 0)
        err = ((yn.float() - ref).norm() / ref.norm()).item()
        err_old = ((yo.float() - ref).norm() / ref.norm()).item()
        same = torch.equal(yn, yo)
    except Exception as exc:
        same, err, err_old = False, float("nan"), float("nan"); print(name, type(exc).__name__, str(exc)[:200])
    # AB_TOL=1: a change of the summation order (other bits) passes where its error against float32 is no worse
    ok = same or (TOL and err <= err_old * 1.1 + 1e-4)
    bad += not ok
    print(f"check {name}: bit-identical {same}, rel err {err:.2g} (before {err_old:.2g})", flush=True)
    if rows == 1 and ok:
        copies = [w] + [P.tile(iw, 16).to("cuda") for _ in range(max(1, -(-L2_BYTES // (w.qweight.numel() * 4))) - 1)]
        t = {"new": [], "old": []}
        for _ in range(3):
            for v, M in (("new", NEW), ("old", OLD)):
                t[v].append(graph_time([lambda w_=w_, M=M: fn(M, x, w_, b) for w_ in copies], 15) * 1e6)
        print(f"  {name} {n}x{k}: new {' '.join(f'{v:.2f}' for v in t['new'])}  old {' '.join(f'{v:.2f}' for v in t['old'])} us", flush=True)
        del copies
print(("ALL WITHIN TOLERANCE" if TOL else "ALL BIT-IDENTICAL") if not bad else f"{bad} DIFFER")
sys.exit(1 if bad else 0)
