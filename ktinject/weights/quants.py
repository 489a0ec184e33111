"""GGML block formats, dequantized in torch.

One small class per GGML type, registered by `__init_subclass__` into `QUANTS` (keyed by
`gguf.GGMLQuantizationType`). Each class knows its block facts (`block_size` values per
block, `type_size` bytes per block) and has a pure, vectorized
`dequantize_blocks(blocks: uint8 [n_blocks, type_size]) -> float32 [n_blocks, block_size]`
made of torch ops only, so it runs on CPU and CUDA alike. The arithmetic follows the order
of `gguf.quants` (numpy) so that results are bit-exact with it; the tests check every type.

`dequantize(t, dtype, device)` turns a `GGMLTensor` into a dense tensor, chunk by chunk so
temporaries stay bounded.
"""
from __future__ import annotations

from typing import ClassVar, Optional, Union

import torch
from gguf import GGMLQuantizationType as QT

from ..errors import UnsupportedQuantError, WeightError

QK_K = 256
QUANTS: dict[QT, type["QuantType"]] = {}

# Largest number of blocks dequantized at once (bounds temporaries to ~100 MB per chunk).
_CHUNK_BLOCKS = 1 << 16


class QuantType:
    """A GGML type: block facts plus `dequantize_blocks`."""
    qtype: ClassVar[QT]
    block_size: ClassVar[int]
    type_size: ClassVar[int]

    def __init_subclass__(cls, qtype: QT, block_size: int, type_size: int, **kw):
        super().__init_subclass__(**kw)
        cls.qtype, cls.block_size, cls.type_size = qtype, block_size, type_size
        QUANTS[qtype] = cls

    @classmethod
    def dequantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


# ---------------------------------------------------------------- helpers (torch only)

def _f16(b: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 2k] -> float32 [n, k], reading little-endian fp16."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [n, m] -> uint8 [n, 2, m]: low nibbles then high nibbles."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=1)


def _bits(b: torch.Tensor, nbits: int = 8) -> torch.Tensor:
    """uint8 [..., m] -> uint8 [..., nbits, m]: bit j of every byte, j = 0..nbits-1."""
    shifts = torch.arange(nbits, dtype=torch.uint8, device=b.device).view(*([1] * (b.dim() - 1)), nbits, 1)
    return (b.unsqueeze(-2) >> shifts) & 1


def _crumbs(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., m] -> uint8 [..., 4, m]: 2-bit fields at shifts 0, 2, 4, 6."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(*([1] * (b.dim() - 1)), 4, 1)
    return (b.unsqueeze(-2) >> shifts) & 3


def _lut(values, idx: torch.Tensor) -> torch.Tensor:
    """Look up `values` (a tuple of ints) at uint8 indices, as float32."""
    table = torch.tensor(values, dtype=torch.float32, device=idx.device)
    return table[idx.long()]


# ---------------------------------------------------------------- float types

class F32(QuantType, qtype=QT.F32, block_size=1, type_size=4):
    @classmethod
    def dequantize_blocks(cls, blocks):
        return blocks.contiguous().view(torch.float32).clone()


class F16(QuantType, qtype=QT.F16, block_size=1, type_size=2):
    @classmethod
    def dequantize_blocks(cls, blocks):
        return blocks.contiguous().view(torch.float16).float()


class BF16(QuantType, qtype=QT.BF16, block_size=1, type_size=2):
    @classmethod
    def dequantize_blocks(cls, blocks):
        return blocks.contiguous().view(torch.bfloat16).float()


# ---------------------------------------------------------------- 32-value blocks

class Q4_0(QuantType, qtype=QT.Q4_0, block_size=32, type_size=18):
    # d: fp16 | qs: 16 bytes, value j in low nibble of byte j, value j+16 in the high nibble
    @classmethod
    def dequantize_blocks(cls, blocks):
        n = blocks.shape[0]
        d = _f16(blocks[:, :2])
        q = _nibbles(blocks[:, 2:]).reshape(n, 32).to(torch.int8) - 8
        return d * q.float()


class Q4_1(QuantType, qtype=QT.Q4_1, block_size=32, type_size=20):
    # d: fp16 | m: fp16 | qs: 16 bytes
    @classmethod
    def dequantize_blocks(cls, blocks):
        n = blocks.shape[0]
        d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        q = _nibbles(blocks[:, 4:]).reshape(n, 32).float()
        return d * q + m


def _q5_high(qh: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 4] (a little-endian uint32) -> uint8 [n, 32]: bit i for value i."""
    return _bits(qh).transpose(1, 2).reshape(qh.shape[0], 32)


class Q5_0(QuantType, qtype=QT.Q5_0, block_size=32, type_size=22):
    # d: fp16 | qh: 4 bytes (bit 4 of each value) | qs: 16 bytes
    @classmethod
    def dequantize_blocks(cls, blocks):
        n = blocks.shape[0]
        d = _f16(blocks[:, :2])
        q = _nibbles(blocks[:, 6:]).reshape(n, 32) | (_q5_high(blocks[:, 2:6]) << 4)
        return d * (q.to(torch.int8) - 16).float()


class Q5_1(QuantType, qtype=QT.Q5_1, block_size=32, type_size=24):
    # d: fp16 | m: fp16 | qh: 4 bytes | qs: 16 bytes
    @classmethod
    def dequantize_blocks(cls, blocks):
        n = blocks.shape[0]
        d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        q = _nibbles(blocks[:, 8:]).reshape(n, 32) | (_q5_high(blocks[:, 4:8]) << 4)
        return d * q.float() + m


class Q8_0(QuantType, qtype=QT.Q8_0, block_size=32, type_size=34):
    # d: fp16 | qs: 32 x int8
    @classmethod
    def dequantize_blocks(cls, blocks):
        d = _f16(blocks[:, :2])
        return blocks[:, 2:].contiguous().view(torch.int8).float() * d


IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


class IQ4_NL(QuantType, qtype=QT.IQ4_NL, block_size=32, type_size=18):
    # d: fp16 | qs: 16 bytes of 4-bit indices into a non-linear table
    @classmethod
    def dequantize_blocks(cls, blocks):
        n = blocks.shape[0]
        d = _f16(blocks[:, :2])
        return d * _lut(IQ4_NL_VALUES, _nibbles(blocks[:, 2:]).reshape(n, 32))


MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)   # e2m1, doubled


def e8m0_to_fp32_half(e: torch.Tensor) -> torch.Tensor:
    """uint8 shared exponent -> float32 2^(e-128) (half the e8m0 value, as ggml does)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.bitwise_left_shift(torch.full_like(e, 0x00200000), e), (e - 1) << 23)
    return bits.view(torch.float32)


class MXFP4(QuantType, qtype=QT.MXFP4, block_size=32, type_size=17):
    # e: e8m0 exponent | qs: 16 bytes of e2m1 codes
    @classmethod
    def dequantize_blocks(cls, blocks):
        n = blocks.shape[0]
        d = e8m0_to_fp32_half(blocks[:, :1])
        return d * _lut(MXFP4_VALUES, _nibbles(blocks[:, 1:]).reshape(n, 32))


# ---------------------------------------------------------------- K-quants (256-value super-blocks)

def k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K 12 packed bytes [..., 12] -> 8 six-bit scales and 8 six-bit mins, uint8 [..., 8] each."""
    s = scales.unflatten(-1, (3, 4))
    d, m, md = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


class Q2_K(QuantType, qtype=QT.Q2_K, block_size=QK_K, type_size=84):
    # scales: 16 bytes (4-bit scale | 4-bit min) | qs: 64 bytes of 2-bit | d: fp16 | dmin: fp16
    @classmethod
    def dequantize_blocks(cls, blocks):
        n = blocks.shape[0]
        scales, qs = blocks[:, :16], blocks[:, 16:80]
        d, dmin = _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
        dl = (d * (scales & 0x0F).float()).reshape(n, 16, 1)
        ml = (dmin * (scales >> 4).float()).reshape(n, 16, 1)
        q = _crumbs(qs.reshape(n, 2, 32)).reshape(n, 16, 16).float()   # [n, half, shift, 32]
        return (dl * q - ml).reshape(n, QK_K)


class Q3_K(QuantType, qtype=QT.Q3_K, block_size=QK_K, type_size=110):
    # hmask: 32 bytes | qs: 64 bytes of 2-bit | scales: 12 bytes (16 six-bit) | d: fp16
    @classmethod
    def dequantize_blocks(cls, blocks):
        n = blocks.shape[0]
        hmask, qs, scales = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108]
        d = _f16(blocks[:, 108:110])
        lo = torch.stack((scales[:, :8] & 0x0F, scales[:, :8] >> 4), dim=1).reshape(n, 16)
        hi = _crumbs(scales[:, 8:12]).reshape(n, 16)
        sc = ((lo | (hi << 4)).to(torch.int8) - 32).float()
        dl = (d * sc).reshape(n, 16, 1)
        ql = _crumbs(qs.reshape(n, 2, 32)).reshape(n, 16, 16)
        qh = _bits(hmask).reshape(n, 16, 16) ^ 1     # a set bit means "no -4 offset"
        q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()
        return (dl * q).reshape(n, QK_K)


class Q4_K(QuantType, qtype=QT.Q4_K, block_size=QK_K, type_size=144):
    # d: fp16 | dmin: fp16 | scales: 12 bytes (8 scales + 8 mins, 6-bit) | qs: 128 bytes
    @classmethod
    def dequantize_blocks(cls, blocks):
        n = blocks.shape[0]
        d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        sc, mn = k_scale_min(blocks[:, 4:16])
        dl = (d * sc.float()).reshape(n, 8, 1)
        ml = (dmin * mn.float()).reshape(n, 8, 1)
        qs = blocks[:, 16:].reshape(n, 4, 1, 32)                          # 4 chunks of 32 bytes
        q = torch.cat((qs & 0x0F, qs >> 4), dim=2).reshape(n, 8, 32).float()
        return (dl * q - ml).reshape(n, QK_K)


class Q5_K(QuantType, qtype=QT.Q5_K, block_size=QK_K, type_size=176):
    # d | dmin | scales: 12 bytes | qh: 32 bytes (bit 4; bit j for sub-block j) | qs: 128 bytes
    @classmethod
    def dequantize_blocks(cls, blocks):
        n = blocks.shape[0]
        d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        sc, mn = k_scale_min(blocks[:, 4:16])
        dl = (d * sc.float()).reshape(n, 8, 1)
        ml = (dmin * mn.float()).reshape(n, 8, 1)
        ql = blocks[:, 48:].reshape(n, 4, 1, 32)
        ql = torch.cat((ql & 0x0F, ql >> 4), dim=2).reshape(n, 8, 32)
        qh = _bits(blocks[:, 16:48]).reshape(n, 8, 32)
        q = (ql | (qh << 4)).float()
        return (dl * q - ml).reshape(n, QK_K)


class Q6_K(QuantType, qtype=QT.Q6_K, block_size=QK_K, type_size=210):
    # ql: 128 bytes (low 4 bits) | qh: 64 bytes (high 2 bits) | scales: 16 x int8 | d: fp16
    @classmethod
    def dequantize_blocks(cls, blocks):
        n = blocks.shape[0]
        ql, qh, scales = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208]
        d = _f16(blocks[:, 208:210])
        dl = (d * scales.contiguous().view(torch.int8).float()).reshape(n, 16, 1)
        lo = ql.reshape(n, 2, 1, 64)
        lo = torch.cat((lo & 0x0F, lo >> 4), dim=2).reshape(n, 8, 32)
        hi = _crumbs(qh.reshape(n, 2, 32)).reshape(n, 8, 32)
        q = ((lo | (hi << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
        return (dl * q).reshape(n, QK_K)


class IQ4_XS(QuantType, qtype=QT.IQ4_XS, block_size=QK_K, type_size=136):
    # d: fp16 | scales_h: uint16 (2 bits per sub-block) | scales_l: 4 bytes (4 bits) | qs: 128 bytes
    @classmethod
    def dequantize_blocks(cls, blocks):
        n = blocks.shape[0]
        d = _f16(blocks[:, :2])
        sh = blocks[:, 2:4].to(torch.int32)
        sh = sh[:, 0] | (sh[:, 1] << 8)                                   # [n] uint16 value
        sh = (sh.unsqueeze(1) >> torch.arange(0, 16, 2, device=blocks.device, dtype=torch.int32)) & 3
        sl = blocks[:, 4:8]
        sl = torch.stack((sl & 0x0F, sl >> 4), dim=-1).reshape(n, 8).to(torch.int32)
        sc = ((sl | (sh << 4)) - 32).float()
        dl = (d * sc).reshape(n, 8, 1)
        qs = blocks[:, 8:].reshape(n, 8, 1, 16)
        qs = torch.cat((qs & 0x0F, qs >> 4), dim=2).reshape(n, 8, 32)
        return (dl * _lut(IQ4_NL_VALUES, qs)).reshape(n, QK_K)


# ---------------------------------------------------------------- public helpers

def quant_class(qtype: int, tensor: str = "", file: str = "") -> type[QuantType]:
    """The class of a GGML type; `UnsupportedQuantError` (naming tensor and type) if none."""
    try:
        return QUANTS[QT(int(qtype))]
    except (KeyError, ValueError):
        try:
            name = QT(int(qtype)).name
        except ValueError:
            name = f"#{int(qtype)}"
        raise UnsupportedQuantError(f"GGML type {name} is not supported (supported: "
                                    f"{', '.join(sorted(q.name for q in QUANTS))})",
                                    file=file or None, tensor=tensor or None) from None


def block_size(qtype: int) -> int:
    return quant_class(qtype).block_size


def type_size(qtype: int) -> int:
    return quant_class(qtype).type_size


def row_bytes(qtype: int, n: int, tensor: str = "", file: str = "") -> int:
    """Bytes of one row of `n` values; `WeightError` when `n` is not a whole number of blocks."""
    cls = quant_class(qtype, tensor, file)
    if n % cls.block_size:
        raise WeightError(f"row length {n} is not a multiple of the {cls.qtype.name} block size "
                          f"{cls.block_size}", file=file or None, tensor=tensor or None)
    return n // cls.block_size * cls.type_size


def supported_types() -> list[str]:
    return sorted(q.name for q in QUANTS)


def dequantize_bytes(data: torch.Tensor, qtype: int, shape: tuple[int, ...],
                     dtype: torch.dtype = torch.float32, device=None, name: str = "",
                     file: str = "") -> torch.Tensor:
    """Raw GGML bytes (uint8, any shape, rows of blocks) -> dense `shape` tensor."""
    cls = quant_class(qtype, name, file)
    numel = 1
    for s in shape:
        numel *= int(s)
    if shape and int(shape[-1]) % cls.block_size:
        raise WeightError(f"row length {shape[-1]} is not a multiple of the {cls.qtype.name} block size "
                          f"{cls.block_size}", file=file or None, tensor=name or None)
    n_blocks = numel // cls.block_size
    if data.numel() != n_blocks * cls.type_size:
        raise WeightError(f"{data.numel()} bytes do not hold {list(shape)} values of {cls.qtype.name} "
                          f"({n_blocks * cls.type_size} expected)", file=file or None, tensor=name or None)
    device = torch.device(device) if device is not None else data.device
    blocks = data.reshape(n_blocks, cls.type_size)
    out = torch.empty((n_blocks, cls.block_size), dtype=dtype, device=device)
    for start in range(0, n_blocks, _CHUNK_BLOCKS):
        chunk = blocks[start:start + _CHUNK_BLOCKS].to(device, non_blocking=True)
        out[start:start + chunk.shape[0]] = cls.dequantize_blocks(chunk).to(dtype)
    return out.reshape(shape)


def dequantize(t, dtype: torch.dtype = torch.float32,
               device: Optional[Union[str, torch.device]] = None) -> torch.Tensor:
    """A `GGMLTensor` as a dense tensor of `t.shape`, `dtype`, on `device` (default: where the bytes are)."""
    return dequantize_bytes(t.data, t.ggml_type, tuple(t.shape), dtype, device, t.name, t.file)


__all__ = ["QK_K", "QUANTS", "QuantType", "block_size", "dequantize", "dequantize_bytes", "quant_class",
           "row_bytes", "supported_types", "type_size"]
