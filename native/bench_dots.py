"""In-cache micro-benchmark of the decode row dots: GB/s of weight bytes per quant type and ISA,
one thread, through `ktinject.native.gemv` (the kernel table's multi-row dots), on rows small
enough to stay resident in L2.

    python native/bench_dots.py [--rows 128] [--n 2048] [--seconds 0.5] [--isa avx2] [--quant q4_k,q8_0]

The column `r16` is the R16 decode kernel (native/r16.c) on the same rows repacked, for the
types that have that layout (GB/s of the GGUF bytes, so the columns compare time per weight).

Two numbers per cell:
* kernel: the marginal rate, (bytes(rows) - bytes(rows/8)) / (t(rows) - t(rows/8)), which cancels
  the fixed cost of a call (about 10 us of Python, cffi and activation quantization here);
* call: bytes(rows) / t(rows), a whole `gemv` call as Python sees it (what a plain timing loop
  around `native.gemv` reports; dominated by the fixed cost for small matrices).
"""
from __future__ import annotations

import argparse
import time

import torch
from gguf import GGMLQuantizationType as QT

from ktinject import native
from ktinject.native.synth import SUPPORTED, random_rows


def _per_call(qt: QT, w: torch.Tensor, n: int, x: torch.Tensor, isa: str, seconds: float) -> float:
    """Best seconds per gemv call over 5 rounds (R16 rows when `isa` ends in '+r16')."""
    if isa.endswith("+r16"):
        w = native.repack_r16(native.ExpertMatrix(int(qt), w, 1, w.shape[0], n)).data
        x2 = x.view(1, -1)
        call = lambda: native.r16_gemv(int(qt), w, n, x2, isa[:-4])  # noqa: E731
    else:
        call = lambda: native.gemv(int(qt), w, n, x, isa)  # noqa: E731
    call()                                                # warm the caches
    best = float("inf")
    for _ in range(5):
        reps, t0 = 0, time.perf_counter()
        while True:
            for _ in range(20):
                call()
            reps += 20
            dt = time.perf_counter() - t0
            if dt >= seconds / 5:
                break
        best = min(best, dt / reps)
    return best


def bench(qt: QT, isa: str, rows: int, n: int, seconds: float) -> tuple[float, float]:
    w = random_rows(qt, rows, n, seed=1)
    x = torch.randn(n)
    small = max(16, rows // 8 // 16 * 16)
    t_big = _per_call(qt, w, n, x, isa, seconds)
    t_small = _per_call(qt, w[:small].contiguous(), n, x, isa, seconds / 2)
    bytes_big, bytes_small = w.numel(), small * w.shape[1]
    kernel = (bytes_big - bytes_small) / max(t_big - t_small, 1e-12) / 1e9
    return kernel, bytes_big / t_big / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--seconds", type=float, default=0.5)
    ap.add_argument("--isa", default="", help="comma list (default: every usable one except scalar)")
    ap.add_argument("--quant", default="", help="comma list (default: all supported)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    isas = a.isa.split(",") if a.isa else [i for i in native.usable_isas() if i != "scalar"]
    quants = [QT[q.upper()] for q in a.quant.split(",")] if a.quant else list(SUPPORTED)
    r16 = "avx512" if "avx512" in native.usable_isas() else ""
    print(f"rows {a.rows} x n {a.n}, one thread, GB/s of weight bytes: kernel (marginal) / call")  # noqa: T201
    print("quant   " + "".join(f"{i:>18}" for i in isas) + (f"{'r16':>18}" if r16 else ""))  # noqa: T201
    for qt in quants:
        cells = [bench(qt, i, a.rows, a.n, a.seconds) for i in isas]
        if r16 and native.load()[0].ktk_r16_supported(int(qt)) and a.rows % 16 == 0:
            cells.append(bench(qt, r16 + "+r16", a.rows, a.n, a.seconds))
        print(f"{qt.name:<8}" + "".join(f"{k:10.1f} /{c:6.1f}" for k, c in cells), flush=True)  # noqa: T201


if __name__ == "__main__":
    main()
