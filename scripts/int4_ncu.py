"""Time and profile linear_int4's CUDA GEMVs on one shape (development diagnostic).

    python scripts/int4_ncu.py            # times (CUDA graphs over weight copies) of a few configs
    NCU=1 ncu ... python scripts/int4_ncu.py   # runs each kernel 3 times, for the profiler
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from ktinject.bench_gpu import graph_time  # noqa: E402
from ktinject.operators.kernels import int4_cuda, int4_pack as P  # noqa: E402

n, k = (int(v) for v in os.environ.get("SHAPE", "102400x2048").split("x"))
m = int(os.environ.get("ROWS", "1"))
tw = P.tile(P.quantize(torch.randn(n, k, device="cuda") * 0.02, 128), 16)
x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
runs = {"fma r4 w8 b2": lambda t: int4_cuda.gemv(x, t, None, rows_per_warp=4, warps=8, step_batch=2),
        "mma w8 b2": lambda t: int4_cuda.gemv_mma(x, t, None, warps=8, batch=2),
        "mma w4 b4": lambda t: int4_cuda.gemv_mma(x, t, None, warps=4, batch=4),
        "mma w4 b2 ctas8": lambda t: int4_cuda.gemv_mma(x, t, None, warps=4, batch=2, ctas_per_sm=8),
        "mma w8 b8": lambda t: int4_cuda.gemv_mma(x, t, None, warps=8, batch=8),
        "mma w2 b2": lambda t: int4_cuda.gemv_mma(x, t, None, warps=2, batch=2),
        "diag w8 b2 ctas4": lambda t: int4_cuda.gemv_diag(x, t, None, warps=8, batch=2, ctas_per_sm=4),
        "diag w4 b2 ctas4": lambda t: int4_cuda.gemv_diag(x, t, None, warps=4, batch=2, ctas_per_sm=4),
        "diag w4 b4": lambda t: int4_cuda.gemv_diag(x, t, None, warps=4, batch=4)}
if m > 1:
    del runs["fma r4 w8 b2"]
if os.environ.get("NCU"):
    for f in runs.values():
        for _ in range(3):
            f(tw)
    torch.cuda.synchronize()
    sys.exit(0)
copies = [tw] + [P.Int4Tiled(tw.qweight.clone(), tw.scales.clone(), tw.mins.clone(), tw.group_size, tw.in_features,
                             tw.pack) for _ in range(max(0, 300_000_000 // (n * k // 2) - 1))]
nbytes = tw.qweight.numel() * 4 + tw.scales.numel() * 4
bf = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(max(1, 300_000_000 // (n * k * 2)))]
t_bf = graph_time([lambda w=w: torch.nn.functional.linear(x, w) for w in bf], 20)
print(f"{n}x{k} rows {m}: bf16 {t_bf * 1e6:.1f} us")
for name, f in runs.items():
    t = graph_time([lambda c=c: f(c) for c in copies], 20)
    print(f"  {name:<18}{t * 1e6:7.1f} us {nbytes / t / 1e9:6.0f} GB/s  x bf16 {t_bf / t:.2f}")
