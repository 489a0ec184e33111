"""Synthetic GGML expert weights for tests and the bench: random bytes with sane fp16 scales
make valid blocks of every supported type (no NaN/Inf or denormal scales that would slow the
float units and skew timings)."""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

# re-exported: tests and benches take it from here
from ..weights.kquant import quantize_rows  # noqa: F401

# Byte offsets of the fp16 scale fields inside one block, per type.
_SCALE_FIELDS = {QT.Q4_0: (0,), QT.Q5_0: (0,), QT.Q8_0: (0,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (-2,), QT.IQ4_XS: (0,),
                 QT.Q2_K: (80, 82), QT.Q3_K: (108,)}
SUPPORTED = (QT.Q4_0, QT.Q5_0, QT.Q8_0, QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_XS, QT.BF16)


def parse_quant(name: str) -> QT:
    try:
        qt = QT[name.upper()]
    except KeyError:
        raise ValueError(f"unknown quant {name!r} (allowed: {', '.join(q.name.lower() for q in SUPPORTED)})") from None
    if qt not in SUPPORTED:
        raise ValueError(f"quant {name!r} is not supported natively (allowed: "
                         f"{', '.join(q.name.lower() for q in SUPPORTED)})")
    return qt


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
