"""Shared helpers of the native tests (imported by test_native_*.py) plus their own checks."""
from __future__ import annotations

import gguf
import torch
from gguf import GGMLQuantizationType as QT

from ktinject import native
from ktinject.native.synth import SUPPORTED as QUANTS, random_rows

native.ensure_built()       # a fresh checkout: build the extension in place rather than skip


def rand_rows(qt: QT, rows: int, n: int, seed: int = 0) -> torch.Tensor:
    """Model-like blocks: Gaussian weights through the real quantizers."""
    return random_rows(qt, rows, n, seed=seed, realistic=True)


def dequant(qt: QT, rows: torch.Tensor, n: int) -> torch.Tensor:
    """The reference: gguf-py's numpy dequantization (BF16: torch's own conversion)."""
    if qt == QT.BF16:
        return rows.view(torch.bfloat16).float().reshape(-1, n)
    return torch.from_numpy(gguf.quants.dequantize(rows.numpy(), qt)).float().reshape(-1, n)


def moe_case(qt: QT, dqt: QT, E: int = 8, H: int = 256, I: int = 512, seed: int = 0):
    """A routed-experts layer of random model-like blocks: the three `ExpertMatrix`es (gate, up:
    type qt; down: dqt) and their dequantized [E, I, H], [E, I, H], [E, H, I] references."""
    g, u, d = rand_rows(qt, E * I, H, seed + 1), rand_rows(qt, E * I, H, seed + 2), rand_rows(dqt, E * H, I, seed + 3)
    mats = (native.ExpertMatrix(int(qt), g, E, I, H, "gate"), native.ExpertMatrix(int(qt), u, E, I, H, "up"),
            native.ExpertMatrix(int(dqt), d, E, H, I, "down"))
    dense = (dequant(qt, g, H).reshape(E, I, H), dequant(qt, u, H).reshape(E, I, H), dequant(dqt, d, I).reshape(E, H, I))
    return mats, dense


def ref_moe(x, ids, w, gate, up, down):
    """x: [T, H]; gate/up: [E, I, H]; down: [E, H, I] (float). Returns [T, H], summed in float64,
    with `.scale` [T] attached: errors are judged against the terms' size, since two experts'
    outputs can cancel and make a plain relative error meaningless."""
    T, k = ids.shape
    out = torch.zeros(x.shape, dtype=torch.float64)
    scale = torch.zeros(T, dtype=torch.float64)
    xd = x.double()
    for e in torch.unique(ids).tolist():
        t, j = torch.nonzero(ids == e, as_tuple=True)                   # tokens routed to e, their slot
        xe = xd[t]                                                      # [n, H]
        h = torch.nn.functional.silu(xe @ gate[e].double().T) * (xe @ up[e].double().T)   # [n, I]
        y = (h @ down[e].double().T) * w[t, j].double()[:, None]        # [n, H]
        out.index_add_(0, t, y)
        scale.index_add_(0, t, y.norm(dim=1))
    res = out.float()
    res.scale = scale
    return res


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (the inverse of an SQNR); for a `ref_moe` result, per token against
    the size of the summed terms, worst token."""
    scale = getattr(b, "scale", None)
    if scale is not None and b.dim() == 2 and b.shape[0]:
        err = (a.double() - b.double()).norm(dim=1) / scale.clamp_min(1e-30)
        return float(err.max())
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def test_random_rows_are_valid_blocks():
    for qt in QUANTS:
        rows = random_rows(qt, 4, 256, seed=3)
        ref = dequant(qt, rows, 256)
        assert torch.isfinite(ref).all(), qt.name
        assert ref.abs().max() > 0, qt.name


def test_native_library_builds_where_a_compiler_exists():
    """The native tests skip without the extension; with a compiler present it must have built,
    so a broken build cannot pass as skipped tests."""
    import shutil
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        import pytest
        pytest.skip("no C compiler on this machine")
    assert native.available(), native.missing_reason()
