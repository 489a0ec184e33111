"""Launch sweep of linear_fp8's decode GEMV (kernels/fp8_triton.py) over DeepSeek-V3's fp8 shapes at 1, 4, 8
and 16 rows, next to a bf16 linear on the same weight: per shape and row count one JSON line with the
default launch's time, the best launch found and its time. Run on a CUDA machine (H200 figures: docs/gpu.md):
    python3 scripts/fp8_sweep.py [--shapes kv_a_proj,o_proj] [--rows 1,4] [--top 3]"""
import argparse
import itertools
import json
import math
import time

import torch
import torch.nn.functional as F

from ktinject.bench_gpu import L2_BYTES, graph_time
from ktinject.operators.kernels.fp8_triton import DOT, Launch, fp8_gemv, launch_config
from ktinject.operators.linear_fp8 import quantize_rowwise

SHAPES = {"kv_a_proj": (576, 7168), "q_a_proj": (1536, 7168), "kv_b_proj": (32768, 512), "4096x4096": (4096, 4096),
          "shared_down": (7168, 2048), "shared_gate_up": (4096, 7168), "q_b_proj": (24576, 1536),
          "o_proj": (7168, 16384), "dense_gate": (18432, 7168)}


def candidates(m: int, n: int, k: int) -> list[Launch]:
    base = launch_config(m, n, k, 1)
    out = [base._replace(split=sp) for sp in (1, 2, 4, 8)]
    if m == 1:
        out += [base._replace(stages=st, split=sp) for st in (1, 4) for sp in (1, 4)]
        out += [base._replace(block_k=bk, warps=8, split=sp) for bk in (1024, 2048) for sp in (1, 4)
                if base.block_n * bk <= 8192]
        return out
    for bn, bk, w, st, sp in itertools.product((16, 32), (256, 512), (4, 8), (2, 3, 4), (1, 4)):
        out.append(Launch(DOT, 16, bn, bk, w, st, sp))
    return list(dict.fromkeys(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--top", type=int, default=3)
    args = ap.parse_args()
    t0 = time.time()
    for label in args.shapes.split(","):
        n, k = SHAPES[label]
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q, s = quantize_rowwise(w)
        qs = [(q.clone(), s.clone()) for _ in range(max(1, min(32, math.ceil(L2_BYTES / (n * k)))))]
        wds = [w] + [w.clone() for _ in range(max(1, math.ceil(L2_BYTES / (2 * n * k))) - 1)]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x.float(), q.float() * s[:, None])
            times = {}
            for lc in candidates(m, n, k):
                try:
                    err = ((fp8_gemv(x, q, s, launch=lc).float() - ref).norm() / ref.norm()).item()
                    if err > 1e-2:
                        raise AssertionError(f"rel err {err}")
                    times[lc] = graph_time([lambda a=a, b=b, lc=lc: fp8_gemv(x, a, b, launch=lc) for a, b in qs]) * 1e6
                except Exception as exc:          # a launch that does not compile or run: say so, go on
                    print(json.dumps({"shape": label, "rows": m, "launch": list(lc), "error": str(exc)[:200]}))
            default = launch_config(m, n, k)
            best = sorted(times, key=times.get)[:args.top]
            print(json.dumps({"shape": f"{label} {n}x{k}", "rows": m,
                              "bf16_us": round(graph_time([lambda w_=w_: F.linear(x, w_) for w_ in wds]) * 1e6, 2),
                              "default": [list(default), round(times.get(default, float("nan")), 2)],
                              "best": [[list(b), round(times[b], 2)] for b in best], "tried": len(times),
                              "t": round(time.time() - t0)}), flush=True)
        del qs, wds, w, q, s
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
