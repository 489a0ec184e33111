"""Correctness of every usable ISA path against gguf's dequantization, without pytest (for the
lent machine, where pytest may be missing). Exit status 1 on any failure. Uses the test
helpers of tests/test_native_util.py and the tolerances of tests/test_native_kernels.py."""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from test_native_util import QUANTS, dequant, rand_rows, ref_moe, rel_err  # noqa: E402

from ktinject import native  # noqa: E402


def main() -> int:
    torch.manual_seed(0)
    fails, rows = 0, []
    E, H, I, k = 8, 256, 512, 2
    for qt in QUANTS:
        w = rand_rows(qt, 24, 1024, seed=5)
        x = torch.randn(1024)
        ref = (dequant(qt, w, 1024).double() @ x.double()).float()
        g, u, d = rand_rows(qt, E * I, H, 1), rand_rows(qt, E * I, H, 2), rand_rows(qt, E * H, I, 3)
        G, U, D = dequant(qt, g, H).reshape(E, I, H), dequant(qt, u, H).reshape(E, I, H), dequant(qt, d, I).reshape(E, H, I)
        mats = (native.ExpertMatrix(int(qt), g, E, I, H), native.ExpertMatrix(int(qt), u, E, I, H),
                native.ExpertMatrix(int(qt), d, E, H, I))
        for isa in native.usable_isas():
            deq = float((native.dequant_row(int(qt), w[3].contiguous(), 1024, isa) - dequant(qt, w, 1024)[3]).abs().max())
            full = native.gemv(int(qt), w, 1024, x, isa)
            eg = rel_err(full, ref)
            # multi-row dots: any start / row count (short passes) must give the full call's values
            parts = all(torch.equal(native.gemv(int(qt), w[a:a + c].contiguous(), 1024, x, isa), full[a:a + c])
                        for a, c in ((0, 1), (1, 2), (2, 3), (3, 5), (4, 9), (21, 3)))
            kern = native.MoEKernel(*mats, isa=isa)
            res = {"quant": qt.name, "isa": isa, "dequant_maxdiff": deq, "gemv": round(eg, 5), "gemv_parts": parts}
            ok = deq <= 1e-6 and parts and eg < (1e-4 if isa == "scalar" or qt.name == "BF16" else 3e-2)
            for T in ((1, 80) if isa == "scalar" else (1, 80, 512)):
                xx = torch.randn(T, H)
                ids = torch.rand(T, E).topk(k, dim=1).indices.contiguous()
                ww = torch.rand(T, k)
                e = rel_err(kern(xx, ids, ww), ref_moe(xx, ids, ww, G, U, D))
                tol = 1e-4 if isa == "scalar" else (2e-2 if isa == "amx" and T > 1 else
                                                     (1e-4 if T > 1 or qt.name == "BF16" else 4e-2))
                res[f"moe_T{T}"] = round(e, 5)
                ok = ok and e < tol
            res["ok"] = ok
            fails += not ok
            rows.append(res)
            print(json.dumps(res), flush=True)  # noqa: T201
    print(f"{'OK' if not fails else 'FAIL'} ({fails} failures)", flush=True)  # noqa: T201
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
