"""Where the tensor-core int4 GEMV (ktk_int4_diag) spends its time on the lm_head (102400 x 2048): each launch
config as it is and with the unpacking and mma removed (NOMATH: the weight loads and the loop only), next to
the HBM read roofline; `ring` > 0: the weights through the cp.async ring of that depth. Development aid, on a
CUDA machine: python3 scripts/int4_diag_probe.py"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ktinject.bench_gpu import graph_time, read_bandwidth  # noqa: E402
from ktinject.operators.kernels import int4_cuda as C, int4_pack as P  # noqa: E402
from ktinject.operators.kernels.int4_triton import tiled_groups  # noqa: E402


def run_diag(x, w, out, warps, batch, ctas, nomath, stages=0):
    """One launch of ktk_int4_diag for one bf16 row (scripts/int4_grid_probe.py uses it too); its DiagShape."""
    n, kw = w.qweight.shape
    idx = C.device_index(x.device)
    batch = min(batch, kw // 16)
    stages = C.diag_stages(stages, kw // 16, batch)
    shape = C.DiagShape(w.pack, kw // 16, batch, warps, True, False, 1, nomath, stages)
    blocks = -(-(-(-n // 8)) // warps)
    if ctas:
        blocks = min(blocks, ctas * torch.cuda.get_device_properties(idx).multi_processor_count)
    C._launch(shape, idx, blocks, warps, C.diag_shared_bytes(1, kw, warps, stages, batch),
              [x, w.qweight, w.scales, w.mins, w.scales, out, n, x.shape[1], kw, tiled_groups(w)[1],
               int(w.scales.shape[0]), 1, x.stride(0), out.stride(0)])
    return shape


def main() -> int:
    n, k = 102400, 2048
    roof = read_bandwidth()
    print(f"HBM read roofline {roof / 1e9:.0f} GB/s", flush=True)
    iw = P.quantize(torch.randn(n, k, device="cuda") * 0.02, 128)
    copies = [P.tile(iw, 16) for _ in range(3)]
    wbytes = copies[0].qweight.numel() * 4 + 2 * copies[0].scales.numel() * 2
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ P.dequantize(iw).T
    configs = [(10, 4, 2, 0), (10, 4, 2, 2), (10, 4, 2, 4), (8, 8, 2, 2), (8, 4, 2, 4), (4, 4, 4, 4), (16, 4, 1, 4)]
    for warps, batch, ctas, stages in configs:
        line = f"w{warps:<3} V{batch:<3} ctas{ctas} ring{stages}"
        for nomath in (False, True):
            try:
                run_diag(x, copies[0], out, warps, batch, ctas, nomath, stages)
                torch.cuda.synchronize()
                if not nomath:
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    if not err < 1e-2:
                        line += f"  wrong (rel err {err:.2g})"
                        break
                t = graph_time([lambda w=w: run_diag(x, w, out, warps, batch, ctas, nomath, stages) for w in copies], 15)
                line += f"  {'nomath' if nomath else 'diag  '} {t * 1e6:6.1f} us {wbytes / t / 1e9:5.0f} GB/s " \
                        f"{wbytes / t / roof:.2f}"
            except Exception as exc:                           # noqa: BLE001 - a probe: report and go on
                line += f"  {type(exc).__name__}: {str(exc)[:80]}"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
