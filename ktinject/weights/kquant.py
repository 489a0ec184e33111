"""K-quant quantizers (Q4_K, Q5_K, Q6_K) in vectorized torch.

The `gguf` package cannot produce K-quants, so this module does. Each function takes float32
values `[n_blocks, 256]` and returns the GGML blocks as uint8 `[n_blocks, type_size]`, the exact
byte layout `quants.py` (and llama.cpp) reads back.

The native library has the same quantizers in C (native/kquant.c, ~4x torch per core and free of
the GIL, so threads scale): `QUANTIZERS` uses them where the library is built, the torch
versions (`TORCH_QUANTIZERS`) otherwise or with KTINJECT_KQUANT=torch. The two sum in different
orders, so blocks differ where candidates tie within rounding: 1-3% of Gaussian blocks, more on
sparse or one-signed data; the SQNR agrees within 0.02 dB on the tested distributions.
Non-finite values, and values whose scales overflow fp16, are a ValueError (both versions).

The scale search follows the idea of llama.cpp's reference quantizers (not their code): per
32-value sub-block (16 for Q6_K), try a small grid of scales around the naive min/max one, fit
scale and min by weighted least squares for each candidate's rounding, and keep the best
weighted error; then quantize the sub-block scales (and mins) to 6 bits (8 for Q6_K) under
one fp16 super-block scale and re-round the values with the final scales. All candidates are
evaluated at once as tensors, so torch spreads the work over its threads.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

QK_K = 256
_CHUNK = 512                       # super-blocks per step (keeps the candidate tensors in cache)


def _weights(x: torch.Tensor) -> torch.Tensor:
    """Importance of each value: larger magnitudes matter more (as llama.cpp weighs them)."""
    rms = x.pow(2).mean(dim=-1, keepdim=True).sqrt()
    return rms + x.abs()


def _fit_affine(x: torch.Tensor, nmax: int, steps: int = 8, spread: float = 1.0):
    """Best (scale, min >= 0) per row of x `[..., L]` with x ~ scale*q - min, q in 0..nmax.

    The error of each candidate's fit comes from its weighted sums in closed form, so no
    second pass over `[..., S, L]` is needed.
    """
    w = _weights(x)
    wx = w * x
    sw, sx, sxx = w.sum(-1, keepdim=True), wx.sum(-1, keepdim=True), (wx * x).sum(-1, keepdim=True)  # [..., 1]
    lo = x.amin(dim=-1, keepdim=True).clamp(max=0.0)
    hi = x.amax(dim=-1, keepdim=True)
    rng = (hi - lo).clamp(min=1e-30)
    grid = torch.linspace(-spread, spread, steps, dtype=x.dtype, device=x.device)
    iscale = (nmax + grid).view(*([1] * (x.dim() - 1)), steps, 1) / rng.unsqueeze(-2)      # [..., S, 1]
    q = ((x - lo).unsqueeze(-2) * iscale).round_().clamp_(0, nmax)                         # [..., S, L]
    wq = q * w.unsqueeze(-2)
    sq, sqx, sqq = wq.sum(-1), (wq * x.unsqueeze(-2)).sum(-1), (wq * q).sum(-1)             # [..., S]
    det = sw * sqq - sq * sq
    # det / (sw * sqq) is the (normalized) weighted variance of q: ~0 when every value rounds alike
    # (a constant sub-block); then fit the scale alone or the min alone, whichever errs less
    ok = det.abs() > 1e-6 * sw * sqq
    safe = det.where(ok, torch.ones_like(det))
    scale_a = sqx / sqq.clamp(min=1e-30)                                    # min = 0
    err_a = sxx - 2 * scale_a * sqx + scale_a * scale_a * sqq
    mn_b = (sx / sw.clamp(min=1e-30)).clamp(max=0.0)                        # scale = 0
    err_b = sxx - 2 * mn_b * sx + mn_b * mn_b * sw
    use_a = err_a <= err_b
    scale = torch.where(ok, (sw * sqx - sq * sx) / safe, torch.where(use_a, scale_a, torch.zeros_like(det)))
    mn = torch.where(ok, (sqq * sx - sq * sqx) / safe, torch.where(use_a, torch.zeros_like(det), mn_b))
    # x ~ scale*q + mn needs mn <= 0 (the format stores -mn >= 0): refit the scale alone otherwise
    pos = mn > 0
    scale = torch.where(pos, sqx / sqq.clamp(min=1e-30), scale)
    mn = torch.where(pos, torch.zeros_like(mn), mn)
    err = scale * scale * sqq + 2 * scale * mn * sq + mn * mn * sw - 2 * scale * sqx - 2 * mn * sx + sxx
    best = err.argmin(dim=-1, keepdim=True)
    scale = scale.gather(-1, best).squeeze(-1).clamp(min=0.0)
    mn = (-mn.gather(-1, best).squeeze(-1)).clamp(min=0.0)
    return scale, mn


def _fit_symmetric(x: torch.Tensor, nmax: int, steps: int = 8, spread: float = 1.0):
    """Best scale per row of x `[..., L]` with x ~ scale*q, q in -nmax-1..nmax (Q6_K style).

    For a fixed rounding the best scale is sqx/sqq and its error sxx - sqx^2/sqq, so the best
    candidate maximises sqx^2/sqq.
    """
    w = _weights(x)
    amax_idx = x.abs().argmax(dim=-1, keepdim=True)
    vmax = x.gather(-1, amax_idx)                                      # signed value of largest magnitude
    vmax = torch.where(vmax.abs() < 1e-30, torch.full_like(vmax, 1e-30), vmax)
    grid = torch.linspace(-spread, spread, steps, dtype=x.dtype, device=x.device) * 0.1
    iscale = (-(nmax + 1) * (1 + grid)).view(*([1] * (x.dim() - 1)), steps, 1) / vmax.unsqueeze(-2)
    q = (x.unsqueeze(-2) * iscale).round_().clamp_(-(nmax + 1), nmax)                  # [..., S, L]
    wq = q * w.unsqueeze(-2)
    sqx, sqq = (wq * x.unsqueeze(-2)).sum(-1), (wq * q).sum(-1).clamp(min=1e-30)
    best = (sqx * sqx / sqq).argmax(dim=-1, keepdim=True)
    return (sqx / sqq).gather(-1, best).squeeze(-1)


def _fp16(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(value rounded through fp16 as float32, its 2 little-endian bytes uint8 [n, 2])."""
    h = v.reshape(-1).to(torch.float16).contiguous()
    return h.float(), h.view(torch.uint8).reshape(-1, 2)


def _pack_scales_k(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """8 six-bit scales and mins (uint8 [n, 8] each) -> the 12-byte Q4_K/Q5_K field."""
    s_lo, s_hi, m_lo, m_hi = sc[:, :4], sc[:, 4:], mn[:, :4], mn[:, 4:]
    b0 = (s_lo & 63) | ((s_hi >> 4) << 6)
    b1 = (m_lo & 63) | ((m_hi >> 4) << 6)
    b2 = (s_hi & 15) | ((m_hi & 15) << 4)
    return torch.cat((b0, b1, b2), dim=1)


def _check_input(x: torch.Tensor) -> None:
    if x.numel() and not torch.isfinite(x).all():
        raise ValueError("values to quantize are not all finite (NaN or Inf)")


def _check_scale(d: torch.Tensor, what: str) -> None:
    if d.numel() and not torch.isfinite(d).all():
        raise ValueError(f"values too large for the format: the {what} overflows fp16 (|x| must stay below ~6e7)")


def _affine_superblock(x: torch.Tensor, nmax: int):
    """Shared Q4_K/Q5_K part: x [n, 256] -> (q uint8 [n, 8, 32], d/dmin bytes, packed scales)."""
    _check_input(x)
    n = x.shape[0]
    xb = x.reshape(n, 8, 32)
    scale, mn = _fit_affine(xb, nmax)                                   # [n, 8] each, >= 0
    d, d_bytes = _fp16(scale.amax(dim=1) / 63)
    dmin, dmin_bytes = _fp16(mn.amax(dim=1) / 63)
    _check_scale(d, "super-block scale")
    _check_scale(dmin, "super-block min")
    ls = (scale / d.clamp(min=1e-30).unsqueeze(1)).round().clamp(0, 63)
    lm = (mn / dmin.clamp(min=1e-30).unsqueeze(1)).round().clamp(0, 63)
    ls = torch.where(d.unsqueeze(1) > 0, ls, torch.zeros_like(ls))
    lm = torch.where(dmin.unsqueeze(1) > 0, lm, torch.zeros_like(lm))
    eff_d = (d.unsqueeze(1) * ls).unsqueeze(-1)                           # [n, 8, 1]
    eff_m = (dmin.unsqueeze(1) * lm).unsqueeze(-1)
    q = ((xb + eff_m) / eff_d.clamp(min=1e-30)).round().clamp(0, nmax)
    q = torch.where(eff_d > 0, q, torch.zeros_like(q)).to(torch.uint8)
    head = torch.cat((d_bytes, dmin_bytes, _pack_scales_k(ls.to(torch.uint8), lm.to(torch.uint8))), dim=1)
    return q, head


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [n, 8, 32] (low 4 bits used) -> 128 bytes: sub-blocks 2c (low) and 2c+1 (high)."""
    n = q.shape[0]
    q = q.reshape(n, 4, 2, 32) & 15
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)


class _one_thread:
    """Run torch ops single-threaded inside; parallelism comes from our own chunk workers.

    Many small ops, each split over an OpenMP team, stall badly when the machine is busy
    (measured 30-100x slower on a loaded 2-core box); whole chunks per worker thread do not.
    """

    def __enter__(self):
        self.saved = torch.get_num_threads()
        torch.set_num_threads(1)
        return self.saved

    def __exit__(self, *exc):
        torch.set_num_threads(self.saved)
        return False


def _each(fn, starts, workers: int) -> None:
    """fn(i) for every i of `starts`, on a pool of `workers` threads when there is more than one."""
    if workers <= 1 or len(starts) <= 1:
        for i in starts:
            fn(i)
        return
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(fn, starts))


def _chunked(type_size: int):
    """Run a quantizer over `[n, 256]` in chunks of `_CHUNK` super-blocks, one chunk per worker
    thread at a time (torch ops release the GIL), into one output tensor."""
    def wrap(fn):
        def run(x: torch.Tensor) -> torch.Tensor:
            x = x.reshape(-1, QK_K).float()
            out = torch.empty((x.shape[0], type_size), dtype=torch.uint8)
            starts = range(0, x.shape[0], _CHUNK)

            def one(i: int) -> None:
                out[i:i + _CHUNK] = fn(x[i:i + _CHUNK])
            with _one_thread() as workers:
                _each(one, starts, workers)
            return out
        run.__doc__, run.__name__ = fn.__doc__, fn.__name__
        return run
    return wrap


@_chunked(144)
def quantize_q4_k(x: torch.Tensor) -> torch.Tensor:
    """float32 [n, 256] -> Q4_K blocks uint8 [n, 144]."""
    q, head = _affine_superblock(x, 15)
    return torch.cat((head, _pack_nibbles(q)), dim=1)


@_chunked(176)
def quantize_q5_k(x: torch.Tensor) -> torch.Tensor:
    """float32 [n, 256] -> Q5_K blocks uint8 [n, 176]."""
    n = x.shape[0]
    q, head = _affine_superblock(x, 31)
    bits = (q >> 4) & 1                                                   # [n, 8 (bit j), 32]
    qh = (bits << torch.arange(8, dtype=torch.uint8).view(1, 8, 1)).sum(dim=1, dtype=torch.int32).to(torch.uint8)
    return torch.cat((head, qh.reshape(n, 32), _pack_nibbles(q)), dim=1)


@_chunked(210)
def quantize_q6_k(x: torch.Tensor) -> torch.Tensor:
    """float32 [n, 256] -> Q6_K blocks uint8 [n, 210]."""
    _check_input(x)
    n = x.shape[0]
    xb = x.reshape(n, 16, 16)
    scale = _fit_symmetric(xb, 31)                                        # [n, 16], signed
    amax = scale.abs().amax(dim=1)
    d, d_bytes = _fp16(amax / 127)
    _check_scale(d, "super-block scale")
    ls = (scale / d.clamp(min=1e-30).unsqueeze(1)).round().clamp(-128, 127)
    ls = torch.where(d.unsqueeze(1) > 0, ls, torch.zeros_like(ls))
    eff = (d.unsqueeze(1) * ls).unsqueeze(-1)
    safe = torch.where(eff == 0, torch.ones_like(eff), eff)
    q = torch.where(eff != 0, (xb / safe).round().clamp(-32, 31), torch.zeros_like(xb))
    q = (q + 32).to(torch.uint8).reshape(n, 2, 4, 32)                     # [n, half, shift, 32]
    low, high = q & 15, q >> 4
    ql = low[:, :, 0:2].reshape(n, 2, 64) | (low[:, :, 2:4].reshape(n, 2, 64) << 4)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6))
    scales = ls.to(torch.int8).view(torch.uint8)
    return torch.cat((ql.reshape(n, 128), qh.reshape(n, 64), scales, d_bytes), dim=1)


def quantize_iq4_xs(x: torch.Tensor) -> torch.Tensor:
    """f32 [nb, 256] -> uint8 [nb, 136] IQ4_XS blocks (gguf-py has no IQ4_XS quantizer). A plain
    round-to-nearest version of llama.cpp's (no scale search, no importance weights): each
    32-value sub-block gets scale max / -127 (its value of largest magnitude onto the grid's end),
    the 6-bit sub-block scales are those over the super-block's d = -max_scale / 32, and every
    value takes the nearest grid point. Valid blocks with model-like values, for tests."""
    x = x.detach().to(torch.float32).reshape(-1, 8, 32)
    nb = x.shape[0]
    from .quants import IQ4_NL_VALUES
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


def _pack_2bit(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [n, 256] (values 0..3 used) -> the 64 qs bytes of Q2_K / Q3_K: value 128h + 32g + l in
    bits 2g, 2g+1 of byte 32h + l."""
    q = (q & 3).reshape(-1, 2, 4, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64)


@_chunked(84)
def quantize_q2_k(x: torch.Tensor) -> torch.Tensor:
    """float32 [n, 256] -> Q2_K blocks uint8 [n, 84]: per 16-value sub-block the affine fit of Q4_K
    (x ~ scale * q - min, q in 0..3), scales and mins to 4 bits under the fp16 d and dmin."""
    _check_input(x)
    n = x.shape[0]
    xb = x.reshape(n, 16, 16)
    scale, mn = _fit_affine(xb, 3)                                       # [n, 16] each, >= 0
    d, d_bytes = _fp16(scale.amax(dim=1) / 15)
    dmin, dmin_bytes = _fp16(mn.amax(dim=1) / 15)
    _check_scale(d, "super-block scale")
    _check_scale(dmin, "super-block min")
    ls = torch.where(d.unsqueeze(1) > 0, (scale / d.clamp(min=1e-30).unsqueeze(1)).round().clamp(0, 15), torch.zeros_like(scale))
    lm = torch.where(dmin.unsqueeze(1) > 0, (mn / dmin.clamp(min=1e-30).unsqueeze(1)).round().clamp(0, 15), torch.zeros_like(mn))
    eff_d = (d.unsqueeze(1) * ls).unsqueeze(-1)
    eff_m = (dmin.unsqueeze(1) * lm).unsqueeze(-1)
    q = ((xb + eff_m) / eff_d.clamp(min=1e-30)).round().clamp(0, 3)
    q = torch.where(eff_d > 0, q, torch.zeros_like(q)).to(torch.uint8).reshape(n, 256)
    scales = (ls.to(torch.uint8) | (lm.to(torch.uint8) << 4))
    return torch.cat((scales, _pack_2bit(q), d_bytes, dmin_bytes), dim=1)


@_chunked(110)
def quantize_q3_k(x: torch.Tensor) -> torch.Tensor:
    """float32 [n, 256] -> Q3_K blocks uint8 [n, 110]: per 16-value sub-block the symmetric fit of
    Q6_K (x ~ scale * q, q in -4..3), the signed scales to 6 bits (-32..31) under the fp16 d."""
    _check_input(x)
    n = x.shape[0]
    xb = x.reshape(n, 16, 16)
    scale = _fit_symmetric(xb, 3)                                        # [n, 16], signed
    big = scale.gather(1, scale.abs().argmax(dim=1, keepdim=True)).squeeze(1)
    d, d_bytes = _fp16(-big / 32)                                        # the largest scale onto -32
    _check_scale(d, "super-block scale")
    ls = torch.where(d.unsqueeze(1) != 0, (scale / torch.where(d == 0, torch.ones_like(d), d).unsqueeze(1)).round()
                     .clamp(-32, 31), torch.zeros_like(scale))
    eff = (d.unsqueeze(1) * ls).unsqueeze(-1)
    safe = torch.where(eff == 0, torch.ones_like(eff), eff)
    q = torch.where(eff != 0, (xb / safe).round().clamp(-4, 3), torch.zeros_like(xb))
    q = (q + 4).to(torch.uint8).reshape(n, 256)
    hbit = (q >> 2).reshape(n, 8, 32)                                    # bit 4h + g of hmask[l]
    hmask = (hbit << torch.arange(8, dtype=torch.uint8).view(1, 8, 1)).sum(dim=1, dtype=torch.int32).to(torch.uint8)
    L = (ls + 32).to(torch.uint8)                                        # [n, 16], 0..63
    low = (L[:, :8] & 15) | ((L[:, 8:] & 15) << 4)
    top = L >> 4                                                         # scale j's top bits: byte 8 + j % 4, bits 2 (j / 4)
    high = top[:, 0:4] | (top[:, 4:8] << 2) | (top[:, 8:12] << 4) | (top[:, 12:16] << 6)
    return torch.cat((hmask, _pack_2bit(q), low, high, d_bytes), dim=1)


LOW_BIT_QUANTIZERS = {"Q2_K": quantize_q2_k, "Q3_K": quantize_q3_k}   # torch only (tests, synth)
TORCH_QUANTIZERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}
LEGACY_NATIVE = ("Q4_0", "Q5_0", "Q8_0")          # legacy types native/kquant.c writes


def native_available() -> bool:
    try:
        from .. import native
        return native.available()
    except ImportError:
        return False


def _use_native() -> bool:
    import os
    return os.environ.get("KTINJECT_KQUANT", "").strip().lower() != "torch" and native_available()


def native_blocks(name: str, x: torch.Tensor) -> torch.Tensor:
    """x float32 (n blocks of the type's block size) -> the blocks, uint8 [n, type size], by the
    native quantizers (native/kquant.c; the GIL released) over chunks on a thread pool. K-quants and
    the legacy types Q4_0 / Q5_0 / Q8_0 (byte for byte what the gguf package writes)."""
    from gguf import GGMLQuantizationType as QT

    from .. import native
    from .quants import QUANTS
    lib, ffi = native.load()
    qt = QT[name]
    type_size, block = QUANTS[qt].type_size, QUANTS[qt].block_size
    fn = lib.ktk_quantize_k if name in TORCH_QUANTIZERS else lib.ktk_quantize_legacy
    qtype = int(qt)
    x = x.reshape(-1, block).to(torch.float32).contiguous()
    n = x.shape[0]
    out = torch.empty((n, type_size), dtype=torch.uint8)
    workers = max(1, torch.get_num_threads())
    step = max(256 * QK_K // block, -(-n // (4 * workers)))

    def one(i: int) -> None:
        j = min(n, i + step)
        rc = fn(qtype, ffi.cast("float *", x[i:j].data_ptr()), j - i, ffi.cast("uint8_t *", out[i:j].data_ptr()))
        if rc == lib.KTK_ERANGE:
            raise ValueError("values to quantize are not all finite, or too large for the format "
                             "(a scale overflows fp16)")
        if rc:
            raise ValueError(f"native {name} quantizer failed (code {rc})")
    _each(one, range(0, n, step), workers)
    return out


def _native(name: str):
    """The native quantizer where the library is built, the torch version otherwise or with
    KTINJECT_KQUANT=torch (same algorithm)."""
    fallback = TORCH_QUANTIZERS[name]

    def run(x: torch.Tensor) -> torch.Tensor:
        return native_blocks(name, x) if _use_native() else fallback(x)
    run.__name__, run.__doc__ = fallback.__name__, fallback.__doc__
    return run


def legacy_quantizer(name: str):
    """The native Q4_0 / Q5_0 / Q8_0 quantizer (float32 [..., n] -> uint8 [..., n/32 * type size]),
    or None where it is not built or KTINJECT_KQUANT=torch (then the gguf package's numpy code)."""
    if name not in LEGACY_NATIVE or not _use_native():
        return None

    def run(x: torch.Tensor) -> torch.Tensor:
        blocks = native_blocks(name, x)
        return blocks.reshape(*x.shape[:-1], -1)
    return run


# what `convert` and `synth` use: native where built, else torch (same algorithm, same error)
QUANTIZERS = {name: _native(name) for name in TORCH_QUANTIZERS}


_FP16_MAX = 65504.0
_LEGACY_QMAX = {"Q4_0": 8, "Q4_1": 7.5, "Q5_0": 16, "Q5_1": 15.5, "Q8_0": 127}   # |x| / d at most (x_1: d = range / 2^b-1)


def _rows_in_parallel(values: np.ndarray, fn, workers: Optional[int] = None) -> np.ndarray:
    """fn over groups of rows of `values` (last dim kept) on a thread pool, concatenated: the same
    bytes as fn(values) for a row-wise encoder such as gguf's numpy quantizers, which release the
    GIL inside numpy and ran on one core otherwise (Q8_0 / Q5_0 / Q4_0 tensors)."""
    from concurrent.futures import ThreadPoolExecutor
    rows = values.reshape(-1, values.shape[-1])
    workers = workers or max(1, torch.get_num_threads())
    step = max(64, -(-rows.shape[0] // (8 * workers)))
    if workers <= 1 or rows.shape[0] <= step:
        return fn(values)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        parts = list(pool.map(lambda i: fn(rows[i:i + step]), range(0, rows.shape[0], step)))
    out = np.concatenate(parts)
    return out.reshape(*values.shape[:-1], out.shape[-1])


def quantize_rows(w: torch.Tensor, qt) -> torch.Tensor:
    """Dense [rows, n] -> uint8 [rows, row_bytes] GGML rows of type `qt` (a gguf
    GGMLQuantizationType): F32 / F16 / BF16 as the values themselves; the K-quants through
    `QUANTIZERS`; Q4_0 / Q5_0 / Q8_0 native where built (the bytes gguf-py writes); IQ4_XS, Q2_K and
    Q3_K through `quantize_iq4_xs` / `LOW_BIT_QUANTIZERS`; other types through gguf-py (over threads, refusing NaN / Inf and values past
    the block's fp16 scale). A ValueError when rows are not whole blocks."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT
    floats = {QT.F32: torch.float32, QT.F16: torch.float16, QT.BF16: torch.bfloat16}
    w = w.detach().to(torch.float32).contiguous()
    if qt in floats:
        return w.to(floats[qt]).contiguous().view(torch.uint8)
    block = GGML_QUANT_SIZES[qt][0]
    if w.shape[-1] % block:
        raise ValueError(f"{w.shape[-1]} values per row is not a multiple of the {qt.name} block ({block})")
    if qt == QT.IQ4_XS:
        data = quantize_iq4_xs(w.reshape(-1, 256))
    elif qt.name in LOW_BIT_QUANTIZERS:
        data = LOW_BIT_QUANTIZERS[qt.name](w.reshape(-1, 256))
    elif qt.name in QUANTIZERS:
        data = QUANTIZERS[qt.name](w.reshape(-1, 256))
    elif legacy_quantizer(qt.name) is not None:
        data = legacy_quantizer(qt.name)(w)
    else:
        import gguf.quants as gq
        if w.numel() and not torch.isfinite(w).all():
            raise ValueError("values to quantize are not all finite (NaN or Inf)")
        limit = _FP16_MAX * _LEGACY_QMAX.get(qt.name, 1)
        if w.numel() and float(w.abs().max()) > limit:
            raise ValueError(f"values up to {float(w.abs().max()):.3g} are too large for {qt.name} "
                             f"(its fp16 block scale holds |x| <= {limit:.3g})")
        data = torch.from_numpy(_rows_in_parallel(w.numpy(), lambda rows: gq.quantize(rows, qt)))
    return data.reshape(w.shape[0], -1).contiguous()


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of y against x, in dB."""
    x, y = x.double().flatten(), y.double().flatten()
    noise = (x - y).pow(2).sum()
    return float(10 * torch.log10(x.pow(2).sum() / noise.clamp(min=1e-300)))


def benchmark(n_blocks: int = 16384, seed: int = 0) -> list[dict]:
    """SQNR and throughput (MB/s of float32 input) of our K-quants next to the gguf package's types."""
    import time

    import gguf.quants as gq
    from gguf import GGMLQuantizationType as QT

    from .quants import QUANTS
    g = torch.Generator().manual_seed(seed)
    data = {"gaussian": torch.randn(n_blocks, QK_K, generator=g)}
    u = torch.rand(n_blocks, QK_K, generator=g) - 0.5
    data["laplace"] = -torch.sign(u) * torch.log1p(-2 * u.abs())
    rows = []
    for name in ("Q4_0", "Q4_K", "Q5_0", "Q5_K", "Q6_K", "Q8_0"):
        row = {"type": name, "bits/weight": QUANTS[QT[name]].type_size * 8 / QUANTS[QT[name]].block_size}
        for kind, x in data.items():
            start = time.perf_counter()
            if name in QUANTIZERS:
                blocks = QUANTIZERS[name](x).numpy()
            else:
                blocks = gq.quantize(x.numpy(), QT[name])
            elapsed = time.perf_counter() - start
            y = torch.from_numpy(gq.dequantize(blocks, QT[name]).reshape(x.shape))
            row[f"SQNR {kind} (dB)"] = sqnr_db(x, y)
            row.setdefault("MB/s", x.numel() * 4 / elapsed / 1e6)
        rows.append(row)
    return rows


if __name__ == "__main__":
    from rich.console import Console
    from rich.table import Table

    results = benchmark()
    table = Table(title=f"K-quants vs gguf package types ({torch.get_num_threads()} torch threads)")
    for col in results[0]:
        table.add_column(col)
    for r in results:
        table.add_row(*(f"{v:.2f}" if isinstance(v, float) else str(v) for v in r.values()))
    Console().print(table)
