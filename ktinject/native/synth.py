"""Synthetic GGML expert weights for tests and the bench: random bytes with sane fp16 scales
make valid blocks of every supported type (no NaN/Inf or denormal scales that would slow the
float units and skew timings)."""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

# Byte offsets of the fp16 scale fields inside one block, per type.
_SCALE_FIELDS = {QT.Q4_0: (0,), QT.Q5_0: (0,), QT.Q8_0: (0,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (-2,), QT.IQ4_XS: (0,)}
SUPPORTED = (QT.Q4_0, QT.Q5_0, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_XS, QT.BF16)


def parse_quant(name: str) -> QT:
    try:
        qt = QT[name.upper()]
    except KeyError:
        raise ValueError(f"unknown quant {name!r} (allowed: {', '.join(q.name.lower() for q in SUPPORTED)})") from None
    if qt not in SUPPORTED:
        raise ValueError(f"quant {name!r} is not supported natively (allowed: "
                         f"{', '.join(q.name.lower() for q in SUPPORTED)})")
    return qt


def quantize_rows(w: torch.Tensor, qt: QT) -> torch.Tensor:
    """Dense f32 [rows, n] -> uint8 [rows, row_bytes] of type `qt` (`ktinject.weights.kquant`'s
    quantizers: the K-quants and, native where built, Q4_0 / Q5_0 / Q8_0 as gguf-py writes them;
    gguf-py for the other legacy types; `quantize_iq4_xs` for IQ4_XS)."""
    w = w.detach().to(torch.float32).contiguous()
    if qt == QT.BF16:
        return w.to(torch.bfloat16).view(torch.uint8).contiguous()
    if qt == QT.IQ4_XS:
        return quantize_iq4_xs(w.reshape(-1, 256)).reshape(w.shape[0], -1).contiguous()
    from ..weights import kquant
    if qt.name in kquant.QUANTIZERS:
        data = kquant.QUANTIZERS[qt.name](w.reshape(-1, 256))
    elif kquant.legacy_quantizer(qt.name) is not None:
        data = kquant.legacy_quantizer(qt.name)(w)
    else:
        import gguf
        data = torch.from_numpy(gguf.quants.quantize(w.numpy(), qt))
    return data.reshape(w.shape[0], -1).contiguous()


def quantize_iq4_xs(x: torch.Tensor) -> torch.Tensor:
    """f32 [nb, 256] -> uint8 [nb, 136] IQ4_XS blocks (gguf-py has no IQ4_XS quantizer). A plain
    round-to-nearest version of llama.cpp's (no scale search, no importance weights): each
    32-value sub-block gets scale max / -127 (its value of largest magnitude onto the grid's end),
    the 6-bit sub-block scales are those over the super-block's d = -max_scale / 32, and every
    value takes the nearest grid point. Valid blocks with model-like values, for tests."""
    x = x.detach().to(torch.float32).reshape(-1, 8, 32)
    nb = x.shape[0]
    from ..weights.quants import IQ4_NL_VALUES
    grid = torch.tensor(IQ4_NL_VALUES, dtype=torch.float32)
    idx = x.abs().argmax(dim=2, keepdim=True)
    sub = torch.gather(x, 2, idx).squeeze(2) / -127.0                     # [nb, 8] sub-block scales
    big = torch.gather(sub, 1, sub.abs().argmax(dim=1, keepdim=True))    # [nb, 1]
    d = (-big / 32.0).squeeze(1).to(torch.float16)                       # fp16 super-block scale
    df = d.to(torch.float32)
    inv = torch.where(df != 0, 1.0 / df, torch.zeros_like(df))
    ls = torch.clamp(torch.round(sub * inv[:, None]), -32, 31).to(torch.int32) + 32   # [nb, 8] in 0..63
    dl = df[:, None] * (ls - 32).to(torch.float32)                       # [nb, 8]
    dinv = torch.where(dl != 0, 1.0 / dl, torch.zeros_like(dl))
    q = (x * dinv[:, :, None]).unsqueeze(-1) - grid                       # [nb, 8, 32, 16]
    qi = q.abs().argmin(dim=-1).to(torch.uint8)                           # [nb, 8, 32]
    qs = (qi[:, :, :16] | (qi[:, :, 16:] << 4)).reshape(nb, 128)
    scales_l = ((ls[:, 0::2] & 0xF) | ((ls[:, 1::2] & 0xF) << 4)).to(torch.uint8)          # [nb, 4]
    sh = ((ls >> 4) & 3) << (2 * torch.arange(8, dtype=torch.int32))
    scales_h = sh.sum(dim=1).to(torch.int32)                              # < 2**16
    out = torch.empty(nb, 136, dtype=torch.uint8)
    out[:, 0:2] = d.view(torch.uint8).reshape(nb, 2)
    out[:, 2] = (scales_h & 0xFF).to(torch.uint8)
    out[:, 3] = (scales_h >> 8).to(torch.uint8)
    out[:, 4:8] = scales_l
    out[:, 8:] = qs
    return out


def random_rows(qt: QT, rows: int, n: int, seed: int = 0, scale: float = 0.01, realistic: bool = False) -> torch.Tensor:
    """uint8 [rows, row_bytes] of random valid blocks of type `qt` holding `n` values per row.

    Default: random bytes with sane scales (fast, any size; values are not model-like).
    `realistic`: Gaussian weights quantized by the real quantizers (what a model file holds)."""
    g = torch.Generator().manual_seed(seed)
    if realistic:
        return quantize_rows(torch.randn(rows, n, generator=g) * 5 * scale, qt)
    if qt == QT.BF16:
        return (torch.randn(rows, n, generator=g) * 5 * scale).to(torch.bfloat16).view(torch.uint8).contiguous()
    bs, ts = GGML_QUANT_SIZES[qt]
    if n % bs:
        raise ValueError(f"{n} values per row is not a multiple of the {qt.name} block ({bs})")
    nb = n // bs
    raw = torch.randint(0, 256, (rows, nb, ts), dtype=torch.uint8, generator=g)
    for off in _SCALE_FIELDS[qt]:
        off = off % ts
        sc = (torch.rand(rows, nb, generator=g) * scale + 0.2 * scale).numpy().astype(np.float16)
        raw[:, :, off:off + 2] = torch.from_numpy(sc.view(np.uint8).reshape(rows, nb, 2))
    return raw.reshape(rows, nb * ts).contiguous()
