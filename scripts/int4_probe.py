#!/usr/bin/env python
"""Where does the int4 GEMV's time go? Read-only and partial-compute variants of linear_int4's "rows" kernel
on the lm_head shape (102400 x 2048), timed like scripts/int4_sweep.py (CUDA graphs over weight copies that
the L2 cannot hold). Development diagnostic: prints one line per variant (us, GB/s of the int4 weights).

    python scripts/int4_probe.py
"""
from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from ktinject.bench_gpu import graph_time  # noqa: E402
from ktinject.operators.kernels import int4_pack as P, int4_triton as T  # noqa: E402


@triton.jit
def _stream(w_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    w = tl.load(w_ptr + offs, eviction_policy="evict_first")
    tl.store(out_ptr + tl.program_id(0), tl.sum(w, axis=0))


@triton.jit
def _rows_probe(x_ptr, qw_ptr, out_ptr, N, KW, n_tiles, MLO, MHI, EXP, NIB: tl.constexpr, P: tl.constexpr,
                BLOCK_N: tl.constexpr, CT: tl.constexpr):
    # NIB = 0: sum the words (read only); else NIB nibbles per word through _nibble and an FMA with x
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)
    offs_t = tl.arange(0, CT)
    offs_j = tl.arange(0, P)
    w_ptrs = qw_ptr + rows.to(tl.int64)[:, None, None] * KW + (offs_t[:, None] * P + offs_j[None, :])[None, :, :]
    r = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for c in range(0, n_tiles, CT):
        w = tl.load(w_ptrs + c * P, eviction_policy="evict_first")
        if NIB == 0:
            r += tl.sum(tl.sum(w, axis=2), axis=1).to(tl.float32)
        else:
            t = tl.zeros((BLOCK_N, CT, P), dtype=tl.float32)
            kb = (c + offs_t) * (8 * P)
            for i in tl.static_range(NIB):
                kx = kb[:, None] + i * P + offs_j[None, :]
                xv = tl.load(x_ptr + kx).to(tl.float32)
                t += T._nibble(w, i, MLO, MHI, EXP) * xv[None, :, :]
            r += tl.sum(tl.sum(t, axis=2), axis=1)
    tl.store(out_ptr + offs_n, r, mask=offs_n < N)


def main() -> int:
    n, k = 102400, 2048
    torch.manual_seed(0)
    iw = P.quantize(torch.randn(n, k, device="cuda") * 0.02, 128)
    tw = P.tile(iw, 16)
    wbytes = tw.qweight.numel() * 4
    copies = [tw] + [P.Int4Tiled(tw.qweight.clone(), tw.scales.clone(), tw.mins.clone(), tw.group_size,
                                 tw.in_features, tw.pack) for _ in range(2)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(n, device="cuda", dtype=torch.float32)
    kw = tw.qweight.shape[1]
    print(f"{torch.cuda.get_device_name()}, triton {triton.__version__}; weights {wbytes / 1e6:.1f} MB int4 "
          f"(+{(tw.scales.numel() * 4) / 1e6:.1f} MB scales/mins)", flush=True)

    def line(name, fns, nbytes=wbytes):
        t = graph_time(fns, 20)
        print(f"{name:<44}{t * 1e6:8.1f} us {nbytes / t / 1e9:7.0f} GB/s", flush=True)

    for blk in (4096, 8192, 16384):
        sums = torch.empty(wbytes // 4 // blk, device="cuda", dtype=torch.int32)
        for wrp in (4, 8):
            line(f"stream read BLOCK {blk} w{wrp}",
                 [lambda c=c: _stream[(sums.numel(),)](c.qweight, sums, BLOCK=blk, num_warps=wrp) for c in copies])
    for bn, ct, wrp in ((16, 8, 4), (16, 16, 4), (8, 16, 4), (32, 8, 4), (32, 16, 8), (64, 8, 8), (16, 16, 8)):
        for nib in (0, 1, 4, 8):
            kern = _rows_probe[(triton.cdiv(n, bn),)](x, tw.qweight, out, n, kw, tw.n_tiles, 0x78000, 0x780000,
                                                      0x3F800000, NIB=nib, P=16, BLOCK_N=bn, CT=ct, num_warps=wrp)
            print(f"  regs {getattr(kern, 'n_regs', '?')} spills {getattr(kern, 'n_spills', '?')}", end="")
            line(f"rows probe bn{bn} ct{ct} w{wrp} nibbles {nib}",
                 [lambda c=c: _rows_probe[(triton.cdiv(n, bn),)](x, c.qweight, out, n, kw, tw.n_tiles, 0x78000,
                                                                 0x780000, 0x3F800000, NIB=nib, P=16, BLOCK_N=bn,
                                                                 CT=ct, num_warps=wrp) for c in copies])
        cfg = T.TiledConfig("rows", block_n=bn, num_warps=wrp, chunk=ct, pack=16)
        line(f"rows kernel bn{bn} ct{ct} w{wrp}", [lambda c=c: T.int4_gemv_tiled(x, c, None, cfg) for c in copies],
             wbytes + tw.scales.numel() * 4)
    try:
        for dev_cache in T._k_gemv_rows.device_caches.values():
            for key, kern in dev_cache[0].items():
                print(f"rows kernel variant: regs {kern.n_regs} spills {kern.n_spills} "
                      f"warps {kern.metadata.num_warps} consts {str(key)[-160:]}")
    except Exception as exc:                                          # noqa: BLE001 - diagnostic only
        print(f"(no register counts: {type(exc).__name__}: {exc})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
