"""The 4-bit weight-only format of `linear_int4`, in plain torch (CPU or GPU).

A weight `W: [N, K]` (out, in) is stored as

* `qweight`: int32 `[N, K/8]`; nibble `i` (bits 4i..4i+3) of word `j` holds `q[n, 8j+i]` in 0..15;
* `scales`, `mins`: fp16 `[N, ceil(K/G)]`; group `g` covers columns `g*G .. g*G+G-1`;

and `W[n, k] = q[n, k] * scales[n, k // G] + mins[n, k // G]`.  One affine form covers the
min-max requantization of dense weights (any G; G = K is per-channel) and the exact repack of
GGUF Q4_0 (`d * (q - 8)`: scale d, min -8d) and Q4_K (`d*sc*q - dmin*m` per 32 values) blocks,
whose sub-blocks are 32 wide, so those convert with G = 32 and only fp16 rounding of the scales.

The GPU decode kernel reads the same values in a *tiled* layout (`Int4Tiled`, made at load by
`tile()`, undone by `untile()`): K is padded with zeros to a multiple of 8P (P = `pack`, 16 or
32 words) and cut into tiles of 8P inputs; word `j` (0..P-1) of tile `t` holds, in nibble `i`,
input `k = 8P t + P i + j`. So one `[rows, P]` block of words read with 16-byte loads unpacks,
nibble by nibble, into 8 blocks of P *consecutive* inputs, each matched by one contiguous slice
of x and (as P divides G) by one scale group. Scales and mins are stored transposed,
`[NG, N]`, so the kernel loads a group's values for a block of rows as one coalesced vector.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import WeightError

# GGML block facts (see gguf.constants.GGML_QUANT_SIZES): values per block, bytes per block.
Q4_0_BLOCK = (32, 18)
Q4_K_BLOCK = (256, 144)


@dataclass
class Int4Weight:
    qweight: torch.Tensor    # int32 [N, K/8]
    scales: torch.Tensor     # fp16  [N, NG]
    mins: torch.Tensor       # fp16  [N, NG]
    group_size: int          # G (== K for per-channel)

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.qweight.shape[0]), int(self.qweight.shape[1]) * 8

    def to(self, device) -> "Int4Weight":
        return Int4Weight(self.qweight.to(device), self.scales.to(device), self.mins.to(device), self.group_size)


@dataclass
class Int4Tiled:
    """`Int4Weight` in the GPU decode layout (see the module doc)."""
    qweight: torch.Tensor    # int32 [N, Kp/8], Kp = K rounded up to a multiple of 8 * pack
    scales: torch.Tensor     # fp16  [NG, N]
    mins: torch.Tensor       # fp16  [NG, N]
    group_size: int          # G (== K for per-channel)
    in_features: int         # K
    pack: int                # P: words per tile

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.qweight.shape[0]), self.in_features

    @property
    def n_tiles(self) -> int:
        return int(self.qweight.shape[1]) // self.pack

    def to(self, device) -> "Int4Tiled":
        return Int4Tiled(self.qweight.to(device), self.scales.to(device), self.mins.to(device), self.group_size,
                         self.in_features, self.pack)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q: uint8/int [N, K] with values 0..15, K % 8 == 0 -> int32 [N, K/8]."""
    n, k = q.shape
    q = q.to(torch.int32).view(n, k // 8, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=q.device)
    return _pack_sum(q, shifts)


def _pack_sum(q: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    # OR of disjoint nibbles == their sum; do it in int64 and wrap to int32 two's complement.
    words = (q.to(torch.int64) << shifts.to(torch.int64)).sum(-1)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)
    return words.to(torch.int32)


def unpack_nibbles(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [N, K/8] -> uint8 [N, K] (values 0..15)."""
    n, k8 = qweight.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    return ((qweight.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8).view(n, k8 * 8)


def dequantize(w: Int4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense [N, K] of `dtype` on the weight's device (the reference math of the kernels)."""
    n, k = w.shape
    q = unpack_nibbles(w.qweight).to(torch.float32)                       # [N, K]
    idx = torch.arange(k, device=q.device) // w.group_size                # [K] group of each column
    s = w.scales.to(torch.float32).index_select(1, idx)                   # [N, K]
    m = w.mins.to(torch.float32).index_select(1, idx)
    return (q * s + m).to(dtype)


def quantize(weight: torch.Tensor, group_size: int) -> Int4Weight:
    """Min-max asymmetric 4-bit quantization of a dense [N, K] weight; group_size <= 0: per channel."""
    if weight.dim() != 2:
        raise ValueError(f"quantize() needs a 2-D weight, got shape {list(weight.shape)}")
    n, k = weight.shape
    if k % 8:
        raise ValueError(f"in_features {k} must be a multiple of 8 for int4 packing")
    g = k if group_size <= 0 else group_size
    ng = -(-k // g)
    w = weight.to(torch.float32)
    pad = ng * g - k
    wp = torch.nn.functional.pad(w, (0, pad)).view(n, ng, g)              # [N, NG, G]
    if pad:   # padded columns must not widen the last group's range
        valid = (torch.arange(ng * g, device=w.device) < k).view(1, ng, g)
        lo = torch.where(valid, wp, torch.full_like(wp, float("inf"))).amin(-1)
        hi = torch.where(valid, wp, torch.full_like(wp, float("-inf"))).amax(-1)
    else:
        lo, hi = wp.amin(-1), wp.amax(-1)                                 # [N, NG]
    scale = ((hi - lo) / 15.0).to(torch.float16).to(torch.float32)
    mins = lo.to(torch.float16).to(torch.float32)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((wp - mins.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, 15)
    q = q.view(n, ng * g)[:, :k].to(torch.uint8)
    return Int4Weight(pack_nibbles(q), scale.to(torch.float16), mins.to(torch.float16), g)


def _blocks(raw: torch.Tensor, n: int, k: int, block: tuple[int, int], name: str) -> torch.Tensor:
    vals, size = block
    if k % vals or raw.shape != (n, k // vals * size):
        raise WeightError(f"raw blocks of shape {list(raw.shape)} do not fit a [{n}, {k}] weight "
                          f"({vals} values / {size} bytes per block)", tensor=name)
    return raw.reshape(n, k // vals, size)


def from_q4_0(raw: torch.Tensor, n: int, k: int, name: str = "") -> Int4Weight:
    """Exact repack of GGML Q4_0 rows (uint8 [N, K/32*18]): w = d * (q - 8), G = 32."""
    b = _blocks(raw, n, k, Q4_0_BLOCK, name)                              # [N, K/32, 18]
    d = b[..., :2].contiguous().view(torch.float16).squeeze(-1)           # [N, K/32]
    qs = b[..., 2:]                                                       # [N, K/32, 16]
    q = torch.cat([qs & 0xF, qs >> 4], dim=-1).reshape(n, k)              # values 0..15 then 16..31
    return Int4Weight(pack_nibbles(q), d.clone(), (-8.0 * d.to(torch.float32)).to(torch.float16), 32)


def _q4k_scale_min(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sc: uint8 [..., 12] -> 6-bit scales and mins, int32 [..., 8] each."""
    sc = sc.to(torch.int32)
    lo_s, lo_m = sc[..., 0:4] & 63, sc[..., 4:8] & 63
    hi_s = (sc[..., 8:12] & 0xF) | ((sc[..., 0:4] >> 6) << 4)
    hi_m = (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)
    return torch.cat([lo_s, hi_s], -1), torch.cat([lo_m, hi_m], -1)


def from_q4_k(raw: torch.Tensor, n: int, k: int, name: str = "") -> Int4Weight:
    """Repack of GGML Q4_K rows (uint8 [N, K/256*144]): w = d*sc*q - dmin*m per 32 values, G = 32."""
    b = _blocks(raw, n, k, Q4_K_BLOCK, name)                              # [N, K/256, 144]
    d = b[..., 0:2].contiguous().view(torch.float16).to(torch.float32)    # [N, K/256, 1]
    dmin = b[..., 2:4].contiguous().view(torch.float16).to(torch.float32)
    sc, mn = _q4k_scale_min(b[..., 4:16])                                 # [N, K/256, 8]
    qs = b[..., 16:].reshape(n, k // 256, 4, 32)                          # 4 chunks of 64 values
    q = torch.stack([qs & 0xF, qs >> 4], dim=3).reshape(n, k)             # sub-block 2j: low, 2j+1: high
    scales = (d * sc).reshape(n, k // 32).to(torch.float16)
    mins = (-dmin * mn).reshape(n, k // 32).to(torch.float16)
    return Int4Weight(pack_nibbles(q), scales, mins, 32)


# ---- tiled layout ---------------------------------------------------------------------------------
_ROW_CHUNK = 2048      # rows converted at once (bounds the int64 temporaries of pack_nibbles)


def tile(w: Int4Weight, pack: int = 16) -> Int4Tiled:
    """Repack to the tiled decode layout (same values; exact). `pack` must divide the group size."""
    n, k = w.shape
    if pack < 8 or pack & (pack - 1):
        raise ValueError(f"pack must be a power of two >= 8, got {pack}")
    if w.group_size < k and w.group_size % pack:
        raise ValueError(f"pack {pack} must divide the group size {w.group_size}")
    span = 8 * pack
    kp = -(-k // span) * span
    out = torch.empty((n, kp // 8), dtype=torch.int32, device=w.qweight.device)
    for r in range(0, n, _ROW_CHUNK):
        q = unpack_nibbles(w.qweight[r:r + _ROW_CHUNK])                        # [n', K] uint8
        q = torch.nn.functional.pad(q, (0, kp - k))                             # [n', Kp]
        q = q.view(-1, kp // span, 8, pack).transpose(2, 3).reshape(-1, kp)     # word-major: [t, j, i]
        out[r:r + _ROW_CHUNK] = pack_nibbles(q)
    return Int4Tiled(out, w.scales.t().contiguous(), w.mins.t().contiguous(), w.group_size, k, pack)


def untile(t: Int4Tiled) -> Int4Weight:
    """The standard layout back (exact)."""
    n, k, p = int(t.qweight.shape[0]), t.in_features, t.pack
    kp = int(t.qweight.shape[1]) * 8
    out = torch.empty((n, k // 8), dtype=torch.int32, device=t.qweight.device)
    for r in range(0, n, _ROW_CHUNK):
        q = unpack_nibbles(t.qweight[r:r + _ROW_CHUNK])                        # [n', Kp] as [t, j, i]
        q = q.view(-1, kp // (8 * p), p, 8).transpose(2, 3).reshape(-1, kp)[:, :k]
        out[r:r + _ROW_CHUNK] = pack_nibbles(q.contiguous())
    return Int4Weight(out, t.scales.t().contiguous(), t.mins.t().contiguous(), t.group_size)
