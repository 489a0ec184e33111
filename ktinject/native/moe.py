"""`MoEKernel`: one routed-experts layer computed natively on GGUF blocks.

Weights stay where they are (usually a memory-mapped GGUF file): the kernel keeps references
to the uint8 row tensors and hands their addresses to C. `submit` posts the work to the pool
and returns; `sync` waits and returns the result; `forward` does both.

R16: on CPUs with the AVX-512 VNNI path, Q4_K, Q5_K, Q4_0, Q5_0, Q8_0, Q6_K, IQ4_XS, Q2_K and Q3_K experts can be
repacked at load into groups of 16 interleaved rows (`repack_r16`, layout in native/r16.c), which
the decode kernels read with about a third of the instructions (docs/operators.md, "cpu_experts").
`MoEKernel(repack=...)` decides; `KTINJECT_REPACK=0` turns it off everywhere.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from ..errors import NativeError
from . import ISAS, Pool, _need, _ptr, check, default_pool, isa_index, load, row_bytes  # noqa: F401
from .knobs import check_env

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExpertMatrix:
    """Stacked expert weights as GGML rows, logical [E, rows, cols].

    `data` is uint8 [N, row_bytes]; expert e's rows are `data[e*stride + offset : ... + rows]`
    (stride defaults to `rows`: plain stacking; a fused gate_up [E, 2I, H] tensor gives the
    gate with offset 0 and the up projection with offset I, stride 2I, zero copy).
    """
    ggml_type: int
    data: torch.Tensor
    n_experts: int
    rows: int
    cols: int
    name: str = ""
    stride: int = 0          # rows from one expert to the next (0: `rows`)
    offset: int = 0          # first row of expert 0
    layout: str = "gguf"     # "r16": rows repacked by `repack_r16` (groups of 16, r16_row_bytes each)

    @property
    def expert_stride(self) -> int:
        return self.stride or self.rows

    def validate(self) -> None:
        what = self.name or "expert matrix"
        if not isinstance(self.data, torch.Tensor) or self.data.dtype != torch.uint8 or self.data.dim() != 2:
            raise NativeError(f"{what}: data must be a uint8 [E*rows, row_bytes] tensor")
        if self.data.device.type != "cpu" or not self.data.is_contiguous():
            raise NativeError(f"{what}: data must be a contiguous CPU tensor")
        need = (self.n_experts - 1) * self.expert_stride + self.offset + self.rows
        if self.offset < 0 or self.expert_stride < self.rows or self.data.shape[0] < need:
            raise NativeError(f"{what}: {self.data.shape[0]} rows, expected at least {need} for {self.n_experts} "
                              f"experts of {self.rows} rows (stride {self.expert_stride}, offset {self.offset})")
        if self.layout not in ("gguf", "r16"):
            raise NativeError(f"{what}: layout must be 'gguf' or 'r16', got {self.layout!r}")
        rb = r16_row_bytes(self.ggml_type, self.cols) if self.layout == "r16" else row_bytes(self.ggml_type, self.cols)
        if self.layout == "r16" and (self.rows % 16 or self.offset % 16 or self.expert_stride % 16):
            raise NativeError(f"{what}: an R16 matrix needs rows, offset and stride in multiples of 16 "
                              f"(rows {self.rows}, offset {self.offset}, stride {self.expert_stride})")
        if self.data.shape[1] != rb:
            raise NativeError(f"{what}: rows of {self.data.shape[1]} bytes, expected {rb} for {self.cols} values "
                              f"of GGML type {self.ggml_type}")


def r16_row_bytes(ggml_type: int, n: int) -> int:
    """Bytes per row of n values in the R16 layout (a group of 16 rows takes 16 times that)."""
    lib, _ = load()
    rb = int(lib.ktk_r16_row_bytes(int(ggml_type), int(n)))
    if rb < 0:
        raise NativeError(f"GGML type {ggml_type} has no R16 layout ({', '.join(R16_TYPES.values())} do) or {n} values "
                          f"are not whole blocks")
    return rb


def r16_supported(m: ExpertMatrix) -> Optional[str]:
    """None when `m` can be repacked, else why not."""
    lib, _ = load()
    if m.layout == "r16":
        return "already repacked"
    if not lib.ktk_r16_supported(int(m.ggml_type)):
        return f"GGML type {m.ggml_type} has no R16 layout ({', '.join(R16_TYPES.values())} do)"
    if m.rows % 16:
        return f"{m.rows} rows per expert is not a multiple of 16"
    if lib.ktk_r16_row_bytes(int(m.ggml_type), int(m.cols)) < 0:
        return f"{m.cols} values per row are not whole blocks"
    return None


def repack_r16(m: ExpertMatrix, pool: Optional[Pool] = None) -> ExpertMatrix:
    """The experts of `m` in the R16 layout: a new uint8 [E*rows, r16_row_bytes] tensor, experts back
    to back (a stride or offset of `m` is resolved here), repacked over the pool's threads."""
    m.validate()
    why = r16_supported(m)
    if why:
        raise NativeError(f"{m.name or 'expert matrix'}: cannot repack: {why}")
    lib, ffi = load()
    rb = r16_row_bytes(m.ggml_type, m.cols)
    out = torch.empty(m.n_experts * m.rows, rb, dtype=torch.uint8)
    _huge_pages(out)
    src_rb = m.data.shape[1]
    src = ffi.cast("uint8_t *", m.data.data_ptr() + m.offset * src_rb)
    check(lib.ktk_r16_repack(pool.ptr if pool is not None else ffi.NULL, int(m.ggml_type), src, src_rb,
                             m.expert_stride * src_rb, m.n_experts, m.rows, m.cols, _ptr(ffi, out, "uint8_t *")),
          f"repack {m.name or 'expert matrix'}")
    return ExpertMatrix(m.ggml_type, out, m.n_experts, m.rows, m.cols, m.name, layout="r16")


_MADV_HUGEPAGE = 14
_HUGE = 2 << 20


def _huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux for transparent huge pages (2 MiB) under a large tensor not yet written to (THP in
    `madvise` mode, the usual default, gives them only when asked): one TLB entry per 2 MiB
    instead of per 4 KiB for the decode kernels' streams. $KTINJECT_R16_HUGE=0 turns it off."""
    nbytes = t.numel() * t.element_size()
    if os.environ.get("KTINJECT_R16_HUGE", "1").strip() == "0" or nbytes < 2 * _HUGE or not hasattr(os, "uname") \
            or os.uname().sysname != "Linux":
        return False
    import ctypes
    start = (t.data_ptr() + _HUGE - 1) // _HUGE * _HUGE
    end = (t.data_ptr() + nbytes) // _HUGE * _HUGE
    if end <= start:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE) == 0


def r16_dequant(ggml_type: int, w: torch.Tensor, n: int) -> torch.Tensor:
    """R16 rows (uint8 [rows, r16_row_bytes], rows % 16 == 0) to f32 [rows, n]: GGML's values."""
    lib, ffi = load()
    _need(w, "w", torch.uint8, 2)
    rb = r16_row_bytes(ggml_type, n)
    if w.shape[1] != rb or w.shape[0] % 16:
        raise NativeError(f"w: expected [16*g, {rb}] R16 rows for {n} values, got {list(w.shape)}")
    out = torch.empty(w.shape[0], n, dtype=torch.float32)
    check(lib.ktk_r16_dequant(int(ggml_type), _ptr(ffi, w, "uint8_t *"), w.shape[0], n, _ptr(ffi, out, "float *")),
          "r16_dequant")
    return out


def r16_gemv(ggml_type: int, w: torch.Tensor, n: int, x: torch.Tensor, isa_name: Optional[str] = None) -> torch.Tensor:
    """y [T, rows] = x [T, n] W^T with W as R16 rows, T <= 4 (the decode kernel; one thread)."""
    lib, ffi = load()
    _need(w, "w", torch.uint8, 2)
    _need(x, "x", torch.float32, 2)
    rb = r16_row_bytes(ggml_type, n)
    if w.shape[1] != rb or w.shape[0] % 16:
        raise NativeError(f"w: expected [16*g, {rb}] R16 rows for {n} values, got {list(w.shape)}")
    if x.shape[1] != n or not 1 <= x.shape[0] <= 4:
        raise NativeError(f"x: expected [T <= 4, {n}], got {list(x.shape)}")
    y = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    check(lib.ktk_r16_gemv(isa_index(isa_name), int(ggml_type), _ptr(ffi, w, "uint8_t *"), w.shape[0], n, x.shape[0],
                           _ptr(ffi, x, "float *"), _ptr(ffi, y, "float *")), "r16_gemv")
    return y


ENV_REPACK = "KTINJECT_REPACK"
# repack=None (auto) repacks these types only, except on AMD: measured faster at decode from memory on
# the lent Xeon (Q5_0 down projections ~30% faster per byte); Q4_K's R16 kernel is ~2x faster in cache
# but was not faster from memory there (docs/benchmarks.md), so auto leaves Q4_K in GGUF rows on Intel.
# GGML types with an R16 layout (native/r16.c)
R16_TYPES = {12: "Q4_K", 13: "Q5_K", 2: "Q4_0", 6: "Q5_0", 8: "Q8_0", 14: "Q6_K", 23: "IQ4_XS", 10: "Q2_K", 11: "Q3_K"}
# Q4_0 since the twenty-sixth session: the Q4_0 down projections of a Q2_K V2-Lite layer at 16 threads on
# the lent Xeon, 95.5 us from GGUF rows, 69.3 from R16 copies (one A/B; Q4_0's layout is Q5_0's, less the masks)
AUTO_TYPES = (6, 8, 2)    # Q5_0, Q8_0, Q4_0
# On AMD the R16 kernels prefetch into L2 ahead of the compute-heavy types, and every type read faster
# from R16 copies than from GGUF rows on a Zen 4 (gate/up at one thread: Q4_K 1.3x, Q5_K 1.4x, Q6_K 1.5x,
# Q4_0 1.5-1.6x, IQ4_XS 1.7-1.8x, Q2_K 1.6x, Q3_K 1.6x; docs/native.md)
AUTO_TYPES_AMD = (12, 13, 2, 6, 8, 14, 23, 10, 11)   # Q4_K, Q5_K, Q4_0, Q5_0, Q8_0, Q6_K, IQ4_XS, Q2_K, Q3_K


def auto_types() -> tuple[int, ...]:
    """The GGML types `repack: auto` gives R16 copies on this CPU: `AUTO_TYPES`, or `AUTO_TYPES_AMD` on AMD."""
    lib, _ = load()
    return AUTO_TYPES_AMD if lib.ktk_cpu_vendor() == lib.KTK_VENDOR_AMD else AUTO_TYPES


_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        log.warning(msg)


def _ram_allows(nbytes: int) -> bool:
    """Whether `nbytes` fit in what Linux reports available, less an eighth of RAM (at least 2 GiB)
    for everything else."""
    from ..sysmem import memory_total_available
    total, avail = memory_total_available()
    return total > 0 and nbytes <= avail - max(total // 8, 2 << 30)


def repack_mode(isa: int, repack: Optional[bool]) -> str:
    """"off", "auto" (the `auto_types()`, when RAM allows) or "on" (every type with the layout), in
    this order: $KTINJECT_REPACK=0 is off everywhere; `repack` False / True is off / on;
    $KTINJECT_REPACK=1 is on; else auto on the AVX-512 and AMX paths (whose VNNI kernels read R16),
    off on the others."""
    env = os.environ.get(ENV_REPACK, "").strip()
    if env == "0" or repack is False:
        return "off"
    if env == "1" or repack is True:
        return "on"
    return "auto" if isa >= ISAS.index("avx512") else "off"


ENV_INT8 = "KTINJECT_AMX_INT8"
I8_GMAX = 1024   # native/ktk.h KTK_I8_GMAX: the longest group of an I8 copy


def i8_group(cols: int, bits: int = 8) -> int:
    """The default group size of a copy of rows of `cols` values (native/i8.c), -1 if cols % 64. I8 copies
    (ktk_i8_group): the smallest multiple of 64 that divides cols and is at least 256, where that is at most
    1024, else the largest below 256 (V2-Lite: 256 for gate/up's 2048, 704 for down's 1408). I4 copies
    (ktk_i4_group): the largest multiple of 64 up to 1024 that divides cols (1024 and 704): their sub-scales
    keep the steps local, so a longer group only saves the tiles a scaling of their sums."""
    lib, _ = load()
    return int(lib.ktk_ix_group(int(cols), _check_bits(bits)))


def i8_groups_for(cols: int) -> list[int]:
    """Every group size an I8 copy of rows of `cols` values can take (native/i8.c decides)."""
    return [g for g in range(64, I8_GMAX + 1, 64) if i8_expert_bytes(32, cols, g) >= 0]


def check_i8_group(group: int, cols: int, what: str, bits: int = 8) -> None:
    """Raise a NativeError naming `what` unless `group` (0: the default) fits rows of `cols` values."""
    if isinstance(group, bool) or not isinstance(group, int):
        raise NativeError(f"{what}: int8 group size must be an integer, got {group!r}")
    if group and group not in i8_groups_for(cols):
        raise NativeError(f"{what}: int8 group size {group} does not fit rows of {cols} values: it must be a "
                          f"multiple of 64 that divides {cols}, at most {I8_GMAX} (here: "
                          f"{', '.join(map(str, i8_groups_for(cols))) or 'none'}; 0: the default, "
                          f"{i8_group(cols, bits)})")


INT8_BITS = (8, 4)   # the copies' widths: I8 (int8, symmetric) and I4 (4 bits, symmetric, integer sub-scales)


def _check_bits(bits: int) -> int:
    if isinstance(bits, bool) or bits not in INT8_BITS:
        raise NativeError(f"int8_bits must be 8 (I8 copies) or 4 (I4 copies), got {bits!r}")
    return int(bits)


def i8_expert_bytes(rows: int, cols: int, group: int = 0, bits: int = 8) -> int:
    """Bytes of one expert's I8 copy (bits 8) or I4 copy (bits 4; native/i8.c) with groups of `group`
    values (0: `i8_group(cols, bits)`), or -1 where the layout does not take the shape (rows % 32, cols % 64, a
    group that does not fit)."""
    lib, _ = load()
    fn = lib.ktk_i4_expert_bytes if _check_bits(bits) == 4 else lib.ktk_i8_expert_bytes
    return int(fn(int(rows), int(cols), int(group)))


def repack_i8(m: ExpertMatrix, pool: Optional[Pool] = None, group: int = 0, bits: int = 8) -> torch.Tensor:
    """The experts of `m` requantized for the AMX-INT8 prefill path: a uint8 tensor of
    E * i8_expert_bytes(rows, cols, group, bits) bytes (layout in native/i8.c). bits 8: int8 per row
    and group of `group` values (0: `i8_group(cols)`) with an f32 scale each, at most half a step from
    GGML's values; bits 4: 4 bits, symmetric, an integer sub-scale k (1-16) per 64 values under an f32
    scale S per row and group (0: `i8_group(cols, 4)`), each value within half its step S * k of GGML's
    but for the ends of a range a sub-scale chose to clip (native/i8.c)."""
    m.validate()
    bits = _check_bits(bits)
    if m.layout != "gguf":
        raise NativeError(f"{m.name or 'expert matrix'}: I8 copies are made from GGUF rows, not {m.layout!r} ones")
    check_i8_group(group, m.cols, m.name or "expert matrix", bits)
    lib, ffi = load()
    es = i8_expert_bytes(m.rows, m.cols, group, bits)
    if es < 0:
        raise NativeError(f"{m.name or 'expert matrix'}: no I{bits} copy for {m.rows} rows of {m.cols} values "
                          f"(needs rows % 32 == 0 and cols % 64 == 0)")
    out = torch.empty(m.n_experts * es, dtype=torch.uint8)
    rb = m.data.shape[1]
    src = ffi.cast("uint8_t *", m.data.data_ptr() + m.offset * rb)
    fn = lib.ktk_i4_repack if bits == 4 else lib.ktk_i8_repack
    check(fn(pool.ptr if pool is not None else ffi.NULL, int(m.ggml_type), src, rb, m.expert_stride * rb,
             m.n_experts, m.rows, m.cols, group, _ptr(ffi, out, "uint8_t *")),
          f"i{bits}_repack {m.name or ''}".strip())
    return out


def i8_dequant(w: torch.Tensor, rows: int, cols: int, group: int = 0, bits: int = 8) -> torch.Tensor:
    """One expert's I8 (or I4) copy (uint8, i8_expert_bytes(rows, cols, group, bits) bytes) to f32
    [rows, cols]: the values the AMX-INT8 tiles multiply."""
    lib, ffi = load()
    check_i8_group(group, cols, "i8_dequant", bits)
    es = i8_expert_bytes(rows, cols, group, bits)
    if w.dtype != torch.uint8 or w.dim() != 1 or not w.is_contiguous() or w.numel() != es:
        raise NativeError(f"i8_dequant: expected a contiguous uint8 tensor of {es} bytes")
    out = torch.empty(rows, cols, dtype=torch.float32)
    fn = lib.ktk_i4_dequant if bits == 4 else lib.ktk_i8_dequant
    check(fn(_ptr(ffi, w, "uint8_t *"), rows, cols, group, _ptr(ffi, out, "float *")), f"i{bits}_dequant")
    return out


def _int8_groups(int8_group: Union[int, Sequence[int], None]) -> tuple[int, int]:
    """`int8_group` as (gate/up, down): None or 0 -> (0, 0); one int -> both; a pair as given."""
    if int8_group is None:
        return 0, 0
    if isinstance(int8_group, (list, tuple)):
        if len(int8_group) != 2:
            raise NativeError(f"int8_group: expected one group size or a pair (gate/up, down), got {list(int8_group)}")
        return int8_group[0], int8_group[1]
    return int8_group, int8_group


ENV_BF16_TILES = "KTINJECT_AMX_BF16_TILES"
GGML_BF16 = 30   # gguf.GGMLQuantizationType.BF16


def bt_expert_bytes(rows: int, cols: int) -> int:
    """Bytes of one expert's BF16 tile copy (native/ktk.h, ktk_bt_expert_bytes): rows * cols * 2, or -1
    unless rows and cols are multiples of 32."""
    lib, _ = load()
    return int(lib.ktk_bt_expert_bytes(int(rows), int(cols)))


def repack_bt(m: ExpertMatrix, pool: Optional[Pool] = None) -> torch.Tensor:
    """The experts of a BF16 matrix `m` copied into the AMX-BF16 tiles' layout: a uint8 tensor of
    E * bt_expert_bytes(rows, cols) bytes, in each block of 32 rows k-step ks's 32 values of row r at
    (ks * 32 + r) * 32 (native/ktk.h). The same values as the GGUF rows, no rounding."""
    m.validate()
    what = m.name or "expert matrix"
    if m.layout != "gguf":
        raise NativeError(f"{what}: BF16 tile copies are made from GGUF rows, not {m.layout!r} ones")
    if m.ggml_type != GGML_BF16:
        raise NativeError(f"{what}: BF16 tile copies are made from BF16 rows, not GGML type {m.ggml_type}")
    es = bt_expert_bytes(m.rows, m.cols)
    if es < 0:
        raise NativeError(f"{what}: no BF16 tile copy for {m.rows} rows of {m.cols} values (both must be multiples of 32)")
    lib, ffi = load()
    out = torch.empty(m.n_experts * es, dtype=torch.uint8)
    rb = m.data.shape[1]
    src = ffi.cast("uint8_t *", m.data.data_ptr() + m.offset * rb)
    check(lib.ktk_bt_repack(pool.ptr if pool is not None else ffi.NULL, int(m.ggml_type), src, rb,
                            m.expert_stride * rb, m.n_experts, m.rows, m.cols, _ptr(ffi, out, "uint8_t *")),
          f"bt_repack {m.name or ''}".strip())
    return out


BF16_TILE_ROLES = {"all": ("gate", "up", "down"), "down": ("down",)}


def bf16_tiles_mode(bf16_tiles: Union[None, bool, str]) -> tuple[str, ...]:
    """Which BF16 matrices get tile copies: $KTINJECT_AMX_BF16_TILES=0 is none anywhere; `bf16_tiles` True (or
    "all") / "down" / False is gate, up and down / the down only / none; else $KTINJECT_AMX_BF16_TILES=1 / down
    says the same; none by default (an A/B: the copies take as much RAM again as the matrices copied, beside the
    GGUF pages decode reads; on the lent Xeon they slowed the gate/up GEMM and sped up the down's: docs/native.md,
    "BF16 tile copies")."""
    env = os.environ.get(ENV_BF16_TILES, "").strip()
    if env == "0" or bf16_tiles is False:
        return ()
    if bf16_tiles is None:
        bf16_tiles = {"1": "all", "down": "down"}.get(env)
    if bf16_tiles is None:
        return ()
    key = "all" if bf16_tiles is True else bf16_tiles
    if key not in BF16_TILE_ROLES:
        raise NativeError(f"bf16_tiles: {bf16_tiles!r} is not one of True, False, None, 'all', 'down'")
    return BF16_TILE_ROLES[key]


def int8_mode(int8_prefill: Optional[bool]) -> bool:
    """Whether to make I8 copies: $KTINJECT_AMX_INT8=0 is off everywhere; `int8_prefill` True / False
    is on / off; else $KTINJECT_AMX_INT8=1 is on; off by default (the copies are lossy and take
    1 byte a weight beside the GGUF pages). Only the AMX path with AMX-INT8 uses them."""
    env = os.environ.get(ENV_INT8, "").strip()
    if env == "0" or int8_prefill is False:
        return False
    return bool(int8_prefill) or env == "1"


class MoEKernel:
    """out[t] = sum_j w[t,j] * down_e(SiLU(gate_e x_t) * up_e x_t), e = ids[t,j].

    gate, up: [E, I, H]; down: [E, H, I] (ExpertMatrix each). `threads` 0 = one per CPU.
    `repack`: True / False / None (`repack_mode`: auto on AVX-512 and AMX: the `auto_types()`, when RAM
    allows): gate and up (both or neither) and down get an R16 copy where `r16_supported` allows
    (`repacked` names them), which the decode (row-dot) path reads; the grouped (prefill) path and
    streamed_experts keep reading the GGUF rows given (`gate`, `up`, `down`).
    `int8_prefill`: True / False / None (`int8_mode`; off unless asked): on the AMX path of a CPU
    with AMX-INT8, gate, up and down get I8 copies (`repack_i8`: 1 byte a weight, requantized per
    row and group) which the grouped (prefill) path multiplies with 8-bit tiles, its tokens quantized
    per token and group as well, instead of converting the GGUF rows to bf16 tiles on every call
    (`int8_copies` names them). Decode keeps reading the GGUF rows (or R16 copies).
    `int8_group`: the copies' group sizes: 0 or None (`i8_group` of each), one int for gate/up and
    down alike, or a pair (gate/up, down); each must fit its rows (`check_i8_group`).
    `int8_bits`: 8 (I8 copies) or 4 (I4 copies: half the bytes to read at prefill, 4 bits a weight,
    an integer sub-scale per 64 values and a scale per row and group, coarser: see docs/native.md), the
    same tiles.
    `bf16_tiles`: True / "down" / False / None (`bf16_tiles_mode`; off unless asked): on the AMX path, BF16 gate/up
    (both or neither) and down, or the down only, get tile copies (`repack_bt`: the same values, laid out as the AMX-BF16 tiles
    load them) which the grouped (prefill) path multiplies instead of reading 16 GGUF rows a tile; the same
    bits (`bf16_tile_copies` names them). I8 copies, where made, take precedence. Decode reads the GGUF rows.
    """

    def __init__(self, gate: ExpertMatrix, up: ExpertMatrix, down: ExpertMatrix, threads: int = 0,
                 pool: Optional[Pool] = None, isa: Optional[str] = None, repack: Optional[bool] = None,
                 int8_prefill: Optional[bool] = None, int8_group: Union[int, Sequence[int], None] = None,
                 int8_bits: int = 8, bf16_tiles: Union[None, bool, str] = None):
        lib, ffi = load()
        check_env()   # the layer's $KTINJECT_* settings, which ktk_moe_new and the tile GEMMs read leniently
        bits = _check_bits(int8_bits)
        for m in (gate, up, down):
            m.validate()
        E, I, H = gate.n_experts, gate.rows, gate.cols
        if (up.n_experts, up.rows, up.cols) != (E, I, H) or (down.n_experts, down.rows, down.cols) != (E, H, I):
            raise NativeError(f"expert shapes disagree: gate {[E, I, H]}, up {[up.n_experts, up.rows, up.cols]}, "
                              f"down {[down.n_experts, down.rows, down.cols]} (expected [E, H, I])")
        if H % 32 or I % 32:
            raise NativeError(f"hidden ({H}) and intermediate ({I}) sizes must be multiples of 32")
        self.n_experts, self.hidden, self.inter = E, H, I
        g_gu, g_dn = _int8_groups(int8_group)
        check_i8_group(g_gu, H, f"int8_group for gate/up ({gate.name or 'gate'})", bits)
        check_i8_group(g_dn, I, f"int8_group for down ({down.name or 'down'})", bits)
        self.isa = isa_index(isa)
        self.pool = pool or default_pool(threads)
        for m in (gate, up, down):
            if m.layout != "gguf":
                raise NativeError(f"{m.name or 'expert matrix'}: MoEKernel takes GGUF rows (it makes its own "
                                  f"R16 copies: repack=True)")
        self.gate, self.up, self.down = gate, up, down
        self.r16: dict[str, ExpertMatrix] = {}
        mode = repack_mode(self.isa, repack)
        if mode != "off":
            auto = auto_types()

            def ok(m: ExpertMatrix) -> bool:
                return not r16_supported(m) and (mode == "on" or m.ggml_type in auto)
            todo = ([("gate", gate), ("up", up)] if gate.ggml_type == up.ggml_type and ok(gate) and ok(up) else []) \
                + ([("down", down)] if ok(down) else [])
            if mode == "on":                     # asked for: say what stays in GGUF rows, and why
                done = {role for role, _ in todo}
                for role, m in (("gate", gate), ("up", up), ("down", down)):
                    if role in done:
                        continue
                    why = r16_supported(m) or ("gate and up differ in type" if gate.ggml_type != up.ggml_type
                                               else "gate and up are repacked together, and the other cannot be")
                    _warn_once(f"repack: on: {role} ({m.name or 'expert matrix'}) stays in GGUF rows: {why}")
            def size(ms) -> int:
                return sum(m.n_experts * m.rows * r16_row_bytes(m.ggml_type, m.cols) for _, m in ms)
            if todo and mode == "auto" and not _ram_allows(2 * size(todo)):
                # short of room for every copy: the types repacked everywhere first (Q5_0, Q8_0, Q4_0: the
                # largest gains per byte), so that AMD's extra Q4_K / Q6_K never cost a model those
                base = [(role, m) for role, m in todo if m.ggml_type in AUTO_TYPES]
                nbytes, todo = size(todo), (base if base and _ram_allows(2 * size(base)) else [])
                left = "only " + "+".join(role for role, _ in todo) + " repacked" if todo else "not repacked"
                _warn_once(f"routed experts {left} (slower decode): the R16 copies need {nbytes / 2**20:.0f} MiB "
                           f"beside the GGUF pages the prefill path reads, more than this machine has to spare")
            if todo and self.isa < ISAS.index("avx512"):
                _warn_once(f"repack: on with the {ISAS[self.isa]} path: its R16 dots are a portable scalar loop, "
                           f"slower than the GGUF kernels (the R16 kernels need AVX-512 VNNI)")
            self.r16 = {name: repack_r16(m, self.pool) for name, m in todo}
        self.repacked: tuple[str, ...] = tuple(self.r16)
        self.i8: dict[str, torch.Tensor] = {}
        if int8_mode(int8_prefill):
            why = None
            if self.isa != ISAS.index("amx") or not lib.ktk_amx_int8_usable():
                why = f"the {ISAS[self.isa]} path is in use" if self.isa != ISAS.index("amx") else "this CPU has no AMX-INT8"
            elif i8_expert_bytes(I, H, g_gu, bits) < 0 or i8_expert_bytes(H, I, g_dn, bits) < 0:
                why = f"hidden ({H}) and intermediate ({I}) sizes must be multiples of 64"
            else:
                nbytes = E * (2 * i8_expert_bytes(I, H, g_gu, bits) + i8_expert_bytes(H, I, g_dn, bits))
                if not _ram_allows(nbytes):
                    why = f"the copies need {nbytes / 2**20:.0f} MiB, more than this machine has to spare"
            if why:
                _warn_once(f"int8 prefill: off: {why}; prefill converts the GGUF rows to bf16 tiles instead")
            else:
                self.i8 = {name: repack_i8(m, self.pool, g, bits) for name, m, g in
                           (("gate", gate, g_gu), ("up", up, g_gu), ("down", down, g_dn))}
        self.int8_copies: tuple[str, ...] = tuple(self.i8)
        self.int8_groups = (g_gu or i8_group(H, bits), g_dn or i8_group(I, bits)) if self.i8 else None
        self.int8_bits = bits if self.i8 else None
        self.bt: dict[str, torch.Tensor] = {}
        roles = bf16_tiles_mode(bf16_tiles)
        if roles:
            bf = ([("gate", gate), ("up", up)] if gate.ggml_type == up.ggml_type == GGML_BF16 and "gate" in roles
                  else []) + ([("down", down)] if down.ggml_type == GGML_BF16 else [])
            why = None
            if self.isa != ISAS.index("amx"):
                why = f"the {ISAS[self.isa]} path is in use"
            elif self.i8:
                why = "int8_prefill's I8 copies are in use"
            elif not bf:
                why = ("the down is not BF16" if roles == ("down",) else
                       "no BF16 expert matrix here (gate and up are copied both or neither)")
            else:
                nbytes = sum(m.n_experts * bt_expert_bytes(m.rows, m.cols) for _, m in bf)
                if not _ram_allows(nbytes):
                    why = f"the copies need {nbytes / 2**20:.0f} MiB, more than this machine has to spare"
            if why:
                _warn_once(f"bf16 tiles: off: {why}; prefill reads the GGUF rows")
            else:
                self.bt = {role: repack_bt(m, self.pool) for role, m in bf}
        self.bf16_tile_copies: tuple[str, ...] = tuple(self.bt)
        desc = ffi.new("ktk_moe_desc *")
        desc.gate_type, desc.up_type, desc.down_type = gate.ggml_type, up.ggml_type, down.ggml_type
        desc.n_experts, desc.hidden, desc.inter = E, H, I
        desc.gate = ffi.cast("uint8_t *", gate.data.data_ptr() + gate.offset * gate.data.shape[1])
        desc.up = ffi.cast("uint8_t *", up.data.data_ptr() + up.offset * up.data.shape[1])
        desc.down = ffi.cast("uint8_t *", down.data.data_ptr() + down.offset * down.data.shape[1])
        desc.gate_rb, desc.up_rb, desc.down_rb = gate.data.shape[1], up.data.shape[1], down.data.shape[1]
        desc.gate_es = gate.expert_stride * gate.data.shape[1]
        desc.up_es = up.expert_stride * up.data.shape[1]
        desc.down_es = down.expert_stride * down.data.shape[1]
        for name in self.r16:
            setattr(desc, name + "_r16", ffi.cast("uint8_t *", self.r16[name].data.data_ptr()))
        for name, t in self.i8.items():
            setattr(desc, name + "_i8", ffi.cast("uint8_t *", t.data_ptr()))
        if self.i8:
            desc.gate_i8_group, desc.down_i8_group = g_gu, g_dn
            desc.i8_bits = bits
        for name, t in self.bt.items():
            setattr(desc, name + "_bt", ffi.cast("uint8_t *", t.data_ptr()))
        err = ffi.new("int *")
        ptr = lib.ktk_moe_new(desc, err)
        if ptr == ffi.NULL:
            check(err[0] or -3, "MoE layer")
        self._ptr = ffi.gc(ptr, lib.ktk_moe_free)
        self._inflight = None

    @property
    def weight_bytes_per_expert(self) -> int:
        return (self.gate.data.shape[1] * self.inter + self.up.data.shape[1] * self.inter
                + self.down.data.shape[1] * self.hidden)

    def _check(self, x, ids, w):
        _need(x, "hidden_states", torch.float32, 2)
        _need(ids, "top_k_index", torch.int64, 2)
        _need(w, "top_k_weights", torch.float32, 2)
        T = x.shape[0]
        if x.shape[1] != self.hidden:
            raise NativeError(f"hidden_states: expected [T, {self.hidden}], got {list(x.shape)}")
        if ids.shape[0] != T or w.shape != ids.shape:
            raise NativeError(f"top_k_index {list(ids.shape)} and top_k_weights {list(w.shape)} must both be "
                              f"[T={T}, k]")

    def submit(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> None:
        """Start the layer on the pool and return at once. x: [T, H] f32, ids: [T, k] i64, w: [T, k] f32."""
        if self._inflight is not None:
            raise NativeError("submit() called twice without sync()")
        self._check(x, ids, w)
        lib, ffi = load()
        out = torch.empty_like(x)
        T, k = ids.shape
        rc = lib.ktk_moe_submit(self._ptr, self.pool.ptr, self.isa, T, max(k, 1), _ptr(ffi, x, "float *"),
                                _ptr(ffi, ids, "int64_t *"), _ptr(ffi, w, "float *"), _ptr(ffi, out, "float *"))
        if rc == lib.KTK_ERANGE:   # the C side checks every id; the message names the first bad one
            bad = ids[(ids < 0) | (ids >= self.n_experts)][0]
            raise NativeError(f"top_k_index: expert id {int(bad)} out of range [0, {self.n_experts})")
        check(rc, "MoE submit")
        self._inflight = (x, ids, w, out)      # inputs stay alive until sync()

    def sync(self) -> torch.Tensor:
        if self._inflight is None:
            raise NativeError("sync() without a submit()")
        lib, _ = load()
        rc = lib.ktk_moe_sync(self._ptr, self.pool.ptr)
        out = self._inflight[3]
        self._inflight = None
        check(rc, "MoE sync")
        return out

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        self.submit(x, ids, w)
        return self.sync()

    __call__ = forward


def run_chain(kernels: list[MoEKernel], x: torch.Tensor, routes: list[tuple[torch.Tensor, torch.Tensor]],
              calls: int) -> tuple[float, torch.Tensor]:
    """Run `calls` layers back to back from native code, the way the hybrid decode's doorbell
    dispatcher hands layers to the pool (no Python between one layer's end and the next's post):
    call i runs `kernels[i % len(kernels)]` on `routes[i % len(routes)]` (ids, weights). The
    kernels must share one pool and one ISA path. Returns the seconds all calls took and the
    output of the last call. `ktinject bench experts --caller native` times layers this way."""
    if not kernels or not routes:
        raise NativeError("run_chain: needs at least one kernel and one routing")
    if isinstance(calls, bool) or not isinstance(calls, int) or calls < 1:
        raise NativeError(f"run_chain: calls must be a positive integer, got {calls!r}")
    k0 = kernels[0]
    for i, kern in enumerate(kernels):
        if not isinstance(kern, MoEKernel):
            raise NativeError(f"run_chain: kernels[{i}] is a {type(kern).__name__}, not a MoEKernel")
        if kern.pool is not k0.pool or kern.isa != k0.isa or kern.hidden != k0.hidden:
            raise NativeError(f"run_chain: kernels[{i}] differs from kernels[0] in pool, ISA path or hidden size")
        if kern._inflight is not None:
            raise NativeError(f"run_chain: kernels[{i}] has a submit() without sync()")
    for ids, w in routes:
        k0._check(x, ids, w)
        if ids.shape != routes[0][0].shape:
            raise NativeError(f"run_chain: routings of different shapes {list(routes[0][0].shape)} and {list(ids.shape)}")
    T, k = routes[0][0].shape
    if T < 1 or k < 1:
        raise NativeError(f"run_chain: routings of shape {[T, k]}: needs at least one token and one expert")
    lib, ffi = load()
    out = torch.empty_like(x)
    ptrs = ffi.new("ktk_moe *[]", [kern._ptr for kern in kernels])
    idp = ffi.new("const int64_t *[]", [_ptr(ffi, ids, "int64_t *") for ids, _ in routes])
    wp = ffi.new("const float *[]", [_ptr(ffi, w, "float *") for _, w in routes])
    sec = ffi.new("double *")
    rc = lib.ktk_moe_chain(ptrs, len(kernels), k0.pool.ptr, k0.isa, T, k, _ptr(ffi, x, "float *"), idp, wp,
                           len(routes), _ptr(ffi, out, "float *"), int(calls), sec)
    if rc == lib.KTK_ERANGE:
        n_exp = min(kern.n_experts for kern in kernels)
        bad = next(int(ids[(ids < 0) | (ids >= n_exp)][0]) for ids, _ in routes if ((ids < 0) | (ids >= n_exp)).any())
        raise NativeError(f"top_k_index: expert id {bad} out of range [0, {n_exp})")
    check(rc, "MoE chain")
    return float(sec[0]), out
