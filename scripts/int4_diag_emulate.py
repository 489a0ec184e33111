"""Lane-level numpy emulation of int4_cuda.ktk_int4_diag: checks the fragment and super-step design (not the CUDA
code itself) against the dequantized reference. Development aid: python scripts/int4_diag_emulate.py"""
import sys
import numpy as np
import torch
sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.abspath(__file__))))
from ktinject.operators.kernels import int4_pack as P_, int4_triton as T

def emulate(x, tw, MAGIC_V=128.0):
    M, K = x.shape
    qw = tw.qweight.numpy().view(np.uint32)
    N, KW = qw.shape
    P = tw.pack
    nsub, g_shift = T.tiled_groups(tw)
    assert nsub == 1
    sc = tw.scales.float().numpy(); mn = tw.mins.float().numpy(); NG = sc.shape[0]
    NSTEP = KW // 16
    MR = 1 << max(M - 1, 0).bit_length(); GS = 16 // MR
    xf = x.float().numpy()
    # staging: pairs per (m, wc, a) and xsum per (m, st)
    def xval(m, k): return xf[m, k] if k < K else 0.0
    pairs = np.zeros((M, KW, 4, 2))
    for m in range(M):
        for wc in range(KW):
            k0 = (wc // P) * 8 * P + (wc % P)
            for a in range(4):
                pairs[m, wc, a] = (xval(m, k0 + a * P), xval(m, k0 + a * P + 4 * P))
    xsum = np.zeros((M, NSTEP))
    for m in range(M):
        for st in range(NSTEP):
            tot = 0.0
            for wc in range(st * 16, st * 16 + 16):
                t, j = wc // P, wc % P
                for i in range(8):
                    tot += xval(m, t * 8 * P + i * P + j)
            xsum[m, st] = tot
    out = np.zeros((M, N))
    for nt in range((N + 7) // 8):
        acc = np.zeros((32, 4)); D = np.zeros((16, 8))
        for st in range(NSTEP):
            j = st % GS
            for u in range(4):
                for h in range(2):
                    A = np.zeros((16, 16)); B = np.zeros((16, 8))
                    for L in range(32):
                        g, c = L >> 2, L & 3
                        mA, jA, mB, jB = g // GS, g % GS, (g + 8) // GS, (g + 8) % GS
                        wc = st * 16 + 4 * c + u
                        if j == jA and mA < M:
                            A[g, 2 * c:2 * c + 2] = pairs[mA, wc, 2 * h]
                            A[g, 2 * c + 8:2 * c + 10] = pairs[mA, wc, 2 * h + 1]
                        if j == jB and mB < M:
                            A[g + 8, 2 * c:2 * c + 2] = pairs[mB, wc, 2 * h]
                            A[g + 8, 2 * c + 8:2 * c + 10] = pairs[mB, wc, 2 * h + 1]
                        row = min(nt * 8 + g, N - 1)
                        w = int(qw[row, wc])
                        def qp(a): return (MAGIC_V + ((w >> (4 * a)) & 15), MAGIC_V + ((w >> (4 * a + 16)) & 15))
                        B[2 * c:2 * c + 2, g] = qp(2 * h)
                        B[2 * c + 8:2 * c + 10, g] = qp(2 * h + 1)
                    D += A @ B
            if j == GS - 1 or st == NSTEP - 1:
                s0 = st - j
                for L in range(32):
                    g, c = L >> 2, L & 3
                    n0 = nt * 8 + 2 * c
                    for hh in range(2):
                        mm, jj = ((g + 8) // GS, (g + 8) % GS) if hh else (g // GS, g % GS)
                        sst = s0 + jj; r = g + 8 * hh
                        if mm < M and sst < NSTEP:
                            X = xsum[mm, sst]
                            go = min(((sst * 16 // P) * 8 * P) >> g_shift, NG - 1)
                            for t2 in range(2):
                                n = min(n0 + t2, N - 1)
                                acc[L, 2 * hh + t2] += sc[go, n] * (D[r, 2 * c + t2] - MAGIC_V * X) + mn[go, n] * X
                D[:] = 0
        if GS == 16:
            acc[:, 0] += acc[:, 2]; acc[:, 1] += acc[:, 3]
        # xor reductions over lane offsets 4, 8, ... < 4 * min(GS, 8)
        off = 4
        while off < 4 * min(GS, 8):
            acc = acc + acc[np.arange(32) ^ off]
            off <<= 1
        for L in range(32):
            g, c = L >> 2, L & 3
            n0 = nt * 8 + 2 * c
            for hh in range(2):
                mm, jj = ((g + 8) // GS, (g + 8) % GS) if hh else (g // GS, g % GS)
                if jj == 0 and mm < M and not (GS == 16 and hh == 1):
                    for t2 in range(2):
                        if n0 + t2 < N:
                            out[mm, n0 + t2] = acc[L, 2 * hh + t2]
    return out

torch.manual_seed(0)
for (n, k, grp, p, m) in [(20, 392, 128, 16, 1), (16, 512, 256, 32, 3), (9, 256, -1, 16, 2), (8, 384, 128, 16, 5), (13, 256, 128, 16, 16), (8, 256, 128, 16, 8)]:
    iw = P_.quantize(torch.randn(n, k), k if grp == -1 else grp)
    tw = P_.tile(iw, p)
    x = torch.randn(m, k).to(torch.bfloat16)
    ref = (x.float() @ P_.dequantize(iw).T).numpy()
    y = emulate(x, tw)
    print(n, k, grp, p, m, "max rel err", np.abs(y - ref).max() / np.abs(ref).max())
