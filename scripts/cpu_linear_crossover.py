#!/usr/bin/env python
"""Where should `cpu_linear` leave its native dots for dequantize-then-matmul? Both of its paths on
DeepSeek-V2-Lite's dense shapes, at growing token counts, on this machine (development diagnostic for
the `gemv_max_tokens` option; docs/operators.md says what it chose).

For each weight (random valid GGML blocks of its type in q4_k_m's mix), per token count T:
  dots   native.linear_checked_rows, what cpu_linear runs up to gemv_max_tokens
  f32    the rows dequantized 64 MB of float32 at a time into one buffer, each chunk x @ w.T
         (what it runs above: torch's float32 GEMM)
  bf16   the same chunks cast to bfloat16 and multiplied in bf16 (AMX / AVX512-BF16 GEMMs where torch
         has them), for comparison only
Each cell is the median of --reps calls (ms), after one warm-up. Prints a line per (weight, T) and,
per weight, the first T at which dequantize-then-matmul (f32) is faster than the dots.

    python scripts/cpu_linear_crossover.py [--threads N] [--tokens 1,8,...] [--reps 5] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402

from ktinject import native  # noqa: E402
from ktinject.native.synth import parse_quant, random_rows  # noqa: E402

# (name, out, in, type in q4_k_m): V2-Lite's attention, its shared experts (2 x 1408), layer 0's dense
# FFN (its down rows, 10944 wide, hold no whole 256-value K-quant block: a 32-value type) and the output head
SHAPES = [("q_proj", 3072, 2048, "q4_k"), ("kv_a_proj", 576, 2048, "q4_k"), ("kv_b_proj", 4096, 512, "q4_k"),
          ("o_proj", 2048, 2048, "q4_k"), ("shared_gate_up", 5632, 2048, "q4_k"), ("shared_down", 2048, 2816, "q6_k"),
          ("dense_up", 10944, 2048, "q4_k"), ("dense_down", 2048, 10944, "q8_0"), ("lm_head", 102400, 2048, "q6_k")]
CHUNK_MB = 64


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def dequant_matmul(pool, qt: int, w: torch.Tensor, n: int, x: torch.Tensor, scratch: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    rows = w.shape[0]
    y = torch.empty(x.shape[0], rows, dtype=torch.float32)
    step = max(1, (CHUNK_MB << 20) // (4 * n))
    xd = x.to(dtype)
    for r0 in range(0, rows, step):
        r1 = min(r0 + step, rows)
        wf = native.dequant_rows(pool, qt, w[r0:r1], n, out=scratch)
        y[:, r0:r1] = (xd @ (wf if dtype == torch.float32 else wf.to(dtype)).T).float()
    return y


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=0, help="native pool and torch threads (0: every CPU)")
    ap.add_argument("--tokens", default="1,8,16,32,64,128,256,512")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", default="", help="comma-separated shape names (default: all)")
    ap.add_argument("--json", action="store_true", help="one JSON object a line")
    a = ap.parse_args(argv)
    threads = native.resolve_threads(a.threads)
    torch.set_num_threads(threads)
    pool = native.Pool(threads)
    isa = native.isa_index()
    tokens = [int(t) for t in a.tokens.split(",")]
    only = set(filter(None, a.only.split(",")))
    print(f"# threads {threads}, isa {native.isa()}, torch {torch.__version__}", flush=True)
    for name, rows, n, quant in SHAPES:
        if only and name not in only:
            continue
        qt = parse_quant(quant)
        w = random_rows(qt, rows, n, seed=1)
        scratch = torch.empty(min(rows, max(1, (CHUNK_MB << 20) // (4 * n))) * n, dtype=torch.float32)
        first = None
        for T in tokens:
            x = torch.randn(T, n)
            cell = {"shape": name, "rows": rows, "in": n, "quant": quant, "tokens": T, "threads": threads,
                    "dots_ms": median_ms(lambda: native.linear_checked_rows(pool, isa, int(qt), w, n, x), a.reps),
                    "f32_ms": median_ms(lambda: dequant_matmul(pool, int(qt), w, n, x, scratch, torch.float32), a.reps),
                    "bf16_ms": median_ms(lambda: dequant_matmul(pool, int(qt), w, n, x, scratch, torch.bfloat16), a.reps)}
            if first is None and cell["f32_ms"] < cell["dots_ms"]:
                first = T
            if a.json:
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in cell.items()}), flush=True)
            else:
                print(f"{name:15s} {rows:6d} x {n:5d} {quant:5s} T={T:4d}: dots {cell['dots_ms']:8.3f} ms  "
                      f"f32 {cell['f32_ms']:8.3f}  bf16 {cell['bf16_ms']:8.3f}", flush=True)
        print(f"# {name}: dequantize-then-matmul (f32) first faster at T = {first}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
