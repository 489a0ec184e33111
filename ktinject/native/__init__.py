"""Python side of the native CPU kernels (C sources in `native/`, built by cffi).

* `available()` / `load()`: the compiled module, or a `NativeError` saying why it is missing.
* `describe()`: which ISA paths were compiled, which ones this CPU can run, which one runs.
* `isa()`: the path in use: the best one, or `KTINJECT_ISA=scalar|avx2|avx512|amx`.
* `Pool`: the persistent pinned thread pool; `default_pool(threads)` shares one per size.
* `MoEKernel`: one routed-experts layer over GGUF blocks with `forward`, `submit`, `sync`.
* `gemv`, `dequant_row`, `probe_read_gbps`: single kernels for tests and the bench.

Every call checks dtype, shape, contiguity and bounds first, so bad input raises a
`NativeError` naming the argument, never a crash in C.
"""
from __future__ import annotations

import logging
import os
import re
import threading
from typing import Optional

import torch

from ..errors import NativeError

log = logging.getLogger(__name__)

ISAS = ("scalar", "avx2", "avx512", "amx")
ENV_ISA = "KTINJECT_ISA"
_ERRORS = {-1: "invalid argument", -2: "expert id out of range (when quantizing: a NaN / Inf or an overflow)",
           -3: "out of memory", -4: "a job is already in flight on this pool", -5: "ISA path not available on this CPU"}

_lib = None
_ffi = None
_load_error: Optional[str] = None
_lock = threading.Lock()


def _import():
    global _lib, _ffi, _load_error
    if _lib is not None or _load_error is not None:
        return
    try:
        from . import _ktkernels  # type: ignore[attr-defined]
    except ImportError as exc:
        _load_error = (f"the native extension ktinject.native._ktkernels is not built ({exc}); "
                       "install with a C compiler (gcc) present, or run `python -m ktinject.native.build`")
        return
    _lib, _ffi = _ktkernels.lib, _ktkernels.ffi


def ensure_built() -> bool:
    """Development helper: build the extension in place when it is missing and gcc exists
    (tests call this so a fresh checkout tests the native path instead of skipping it)."""
    global _load_error
    if available():
        return True
    import shutil
    if shutil.which("gcc") is None:
        return False
    from .build import build_inplace
    try:
        build_inplace()
    except Exception as exc:  # compiler errors: report through missing_reason()
        _load_error = f"in-place build failed: {exc}"
        return False
    _load_error = None
    _import()
    return _lib is not None


def available() -> bool:
    _import()
    return _lib is not None


def missing_reason() -> Optional[str]:
    _import()
    return _load_error


def load():
    """(lib, ffi) of the extension; raises NativeError with the reason when it is missing."""
    _import()
    if _lib is None:
        raise NativeError(_load_error or "native extension unavailable")
    return _lib, _ffi


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise NativeError(f"{what}: {_ERRORS.get(rc, f'error {rc}')}")


def usable_isas() -> list[str]:
    lib, _ = load()
    f = lib.ktk_cpu_features()
    return [name for i, name in enumerate(ISAS) if f >> i & 1]


def isa_index(name: Optional[str] = None) -> int:
    """Index of the ISA path to run: `name`, else $KTINJECT_ISA, else the best usable one."""
    lib, _ = load()
    name = name or os.environ.get(ENV_ISA) or None
    if name is None:
        return int(lib.ktk_best_isa())
    if name not in ISAS:
        raise NativeError(f"{ENV_ISA}={name!r} is not an ISA path (allowed: {', '.join(ISAS)})")
    if name not in usable_isas():
        raise NativeError(f"ISA path {name!r} is not usable on this CPU (usable: {', '.join(usable_isas())})")
    return ISAS.index(name)


def isa() -> str:
    return ISAS[isa_index()]


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def describe() -> dict:
    """Facts for `ktinject doctor`: compiled / usable ISA paths, the one that runs, threads."""
    if not available():
        return {"available": False, "reason": missing_reason()}
    lib, _ = load()
    compiled = [n for i, n in enumerate(ISAS) if lib.ktk_compiled_isas() >> i & 1]
    try:
        running = isa()
        err = None
    except NativeError as exc:
        running, err = None, str(exc)
    out = {"available": True, "compiled": compiled, "usable": usable_isas(), "isa": running,
           "amx_permission": bool(lib.ktk_amx_permission()), "threads": cpu_count(),
           "forced_by": ENV_ISA if os.environ.get(ENV_ISA) else None}
    if running is not None:     # how the grouped (prefill) path multiplies here (docs/native.md)
        out["grouped"] = grouped_path(running)
    if running is not None:     # how cpu_linear's prompts multiply here (docs/operators.md)
        out["linear_prefill"] = linear_path(running)
    if running is not None:     # what repack: auto does on this path (docs/native.md, R16)
        from .moe import R16_TYPES, auto_types, repack_mode
        mode = repack_mode(ISAS.index(running), None)
        out["r16_repack"] = mode if mode == "off" else \
            f"{mode} ({', '.join(R16_TYPES[t] for t in (auto_types() if mode == 'auto' else R16_TYPES))})"
        if mode != "off":
            out["r16_stream"] = r16_stream()
    if err:
        out["error"] = err
    return out


def r16_stream() -> str:
    """How the R16 decode kernels read memory here: their software prefetch distance per type, into
    L1 or L2, and their segments per (group, token) pair; defaults by CPU vendor unless
    $KTINJECT_R16_PF / $KTINJECT_R16_PF_L2 / $KTINJECT_R16_SPLIT set them (docs/native.md, R16)."""
    from gguf import GGMLQuantizationType as QT
    lib, ffi = load()
    pf, l2, split = ffi.new("int *"), ffi.new("int *"), ffi.new("int *")
    by_pf: dict[int, list[str]] = {}
    for qt in (QT.Q4_K, QT.Q5_K, QT.Q4_0, QT.Q5_0, QT.Q6_K, QT.IQ4_XS, QT.Q2_K, QT.Q3_K, QT.Q8_0):
        check(lib.ktk_r16_stream(int(qt), pf, l2, split), "r16_stream")
        by_pf.setdefault(int(pf[0]), []).append(qt.name)
    ahead = "; ".join(f"{', '.join(names)} " + (f"{d} B ahead" if d else "none")
                      for d, names in sorted(by_pf.items(), reverse=True))
    into = "L2" if l2[0] else "L1"
    notes = []
    for k, lo, hi in (("KTINJECT_R16_PF", 0, 65536), ("KTINJECT_R16_PF_L2", 0, 1), ("KTINJECT_R16_SPLIT", 1, 4)):
        v = os.environ.get(k)
        if v is not None:   # as native/r16.c reads it (strtol, then spaces): a decimal number in range, else the default
            ok = re.fullmatch(r"[ \t\n\v\f\r]*[+-]?[0-9]+ *", v) is not None and lo <= int(v) <= hi
            notes.append(f"${k}" if ok else f"${k}={v!r} ignored: not {lo}-{hi}")
    vendor = {lib.KTK_VENDOR_INTEL: "Intel", lib.KTK_VENDOR_AMD: "AMD"}.get(lib.ktk_cpu_vendor(), "default")
    why = f"set by {' and '.join(notes)}" if notes else f"the {vendor} defaults"
    return f"prefetch into {into}: {ahead}; {split[0]} segment{'s' if split[0] > 1 else ''} a pair ({why})"


def grouped_path(isa_name: str) -> str:
    """How an ISA path's grouped (prefill) experts multiply: AMX-BF16 tiles (and whether AMX-INT8
    tiles are there for `int8_prefill`), 8-bit integers for the listed GGML types (f32 for the
    others), or f32 (docs/native.md, "8-bit grouped path" and "I8")."""
    from gguf import GGMLQuantizationType as QT
    lib, _ = load()
    if isa_name == "amx":
        return "AMX-BF16 tiles" + ("; AMX-INT8 tiles on I8 copies with int8_prefill" if lib.ktk_amx_int8_usable()
                                   else " (no AMX-INT8: int8_prefill has no effect)")
    mask = int(lib.ktk_grouped_int8_types(isa_index(isa_name)))
    names = [QT(t).name for t in range(32) if mask >> t & 1]
    out = f"8-bit integers ({', '.join(names)}), f32 for other types" if names else "f32"
    if isa_name == "avx512" and avx512_bf16_grouped():
        out += "; bf16 dot products (AVX512-BF16) where gate, up and down are all BF16"
    return out


def avx512_bf16_grouped() -> bool:
    """Whether the AVX-512 path's layers of BF16 experts multiply their grouped (prefill) experts with
    AVX512-BF16 dot products (native/amx.c ktk_dp_gemm: the tokens rounded to bf16, as on AMX) rather than in
    f32 panels: the CPU has AVX512-BF16 and $KTINJECT_AVX512_BF16_GROUPED is 1, or unset on an AMD CPU
    (docs/native.md: faster on Zen 4, slower on the lent Xeon)."""
    lib, _ = load()
    return bool(lib.ktk_avx512bf16_grouped())


def linear_path(isa_name: str) -> str:
    """How `linear` (cpu_linear) multiplies prompts on an ISA path: the grouped 8-bit GEMM from N
    tokens for the listed GGML types, the per-token dots otherwise."""
    from gguf import GGMLQuantizationType as QT
    lib, _ = load()
    mask, start = int(lib.ktk_linear_grouped_types(isa_index(isa_name))), int(lib.ktk_linear_grouped_min())
    names = [QT(t).name for t in range(32) if mask >> t & 1]
    return f"8-bit grouped GEMM from {start} tokens ({', '.join(names)}), dots otherwise" if names else "dots"


class Pool:
    """A persistent pool of pinned workers; `threads` as in `resolve_threads`."""

    def __init__(self, threads: int = 0, pin: bool = True):
        lib, ffi = load()
        threads = resolve_threads(threads)
        from .knobs import check_env
        check_env()   # $KTINJECT_POOL_CLAIM, _SPIN_US, ...: ktk_pool_new would take a bad value as its default
        ptr = lib.ktk_pool_new(int(threads), int(bool(pin)))
        if ptr == ffi.NULL:
            raise NativeError(f"could not start a pool of {threads} threads")
        self._ptr = ffi.gc(ptr, lib.ktk_pool_free)
        self.threads = int(lib.ktk_pool_threads(ptr))
        self.numa_nodes = int(lib.ktk_pool_numa_nodes(ptr))

    @property
    def ptr(self):
        return self._ptr


_pools: dict[int, Pool] = {}


ENV_THREADS = "KTINJECT_THREADS"


def resolve_threads(threads: int = 0) -> int:
    """Worker count: n > 0 as given; 0 = $KTINJECT_THREADS if set, else every CPU of the affinity
    mask; n < 0 = every CPU but |n| (leaves cores to the threads that drive a GPU)."""
    threads = int(threads or 0)
    if threads == 0 and os.environ.get(ENV_THREADS, "").strip():
        try:
            threads = int(os.environ[ENV_THREADS])
        except ValueError:
            raise NativeError(f"{ENV_THREADS}={os.environ[ENV_THREADS]!r} is not an integer") from None
    if threads > 0:
        return threads
    return max(1, cpu_count() + threads)


def default_pool(threads: int = 0) -> Pool:
    """One shared pool per thread count (layers of a model share workers); see resolve_threads."""
    threads = resolve_threads(threads)
    with _lock:
        if threads not in _pools:
            _pools[threads] = Pool(threads)
        return _pools[threads]


def _ptr(ffi, t: torch.Tensor, ctype: str):
    return ffi.cast(ctype, t.data_ptr())


def _need(t, name: str, dtype: torch.dtype, ndim: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise NativeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_cpu:
        raise NativeError(f"{name}: must be on the CPU, is on {t.device}")
    if t.dtype != dtype:
        raise NativeError(f"{name}: dtype must be {dtype}, got {t.dtype}")
    if t.dim() != ndim:
        raise NativeError(f"{name}: expected {ndim} dimensions, got shape {list(t.shape)}")
    if not t.is_contiguous():
        raise NativeError(f"{name}: must be contiguous")
    return t


def row_bytes(ggml_type: int, n: int) -> int:
    rb = row_bytes_or_none(ggml_type, n)
    if rb is None:
        raise NativeError(f"GGML type {ggml_type} is not supported natively or {n} is not a multiple of its block")
    return rb


def row_bytes_or_none(ggml_type: int, n: int) -> Optional[int]:
    """Bytes of a row of n values of the type, or None (not native, or n not whole blocks)."""
    lib, _ = load()
    rb = int(lib.ktk_row_bytes(int(ggml_type), int(n)))
    return rb if rb >= 0 else None


def dequant_row(ggml_type: int, row: torch.Tensor, n: int, isa_name: Optional[str] = None) -> torch.Tensor:
    """One GGML row to f32 [n] with the ISA path's dequantizer (the grouped/prefill path's)."""
    lib, ffi = load()
    _need(row, "row", torch.uint8, 1)
    if row.numel() != row_bytes(ggml_type, n):
        raise NativeError(f"row: expected {row_bytes(ggml_type, n)} bytes for {n} values, got {row.numel()}")
    out = torch.empty(n, dtype=torch.float32)
    check(lib.ktk_dequant_row_isa(isa_index(isa_name), int(ggml_type), _ptr(ffi, row, "uint8_t *"),
                                 _ptr(ffi, out, "float *"), n), "dequant_row")
    return out


def _rows(ggml_type: int, w: torch.Tensor, n: int) -> int:
    _need(w, "w", torch.uint8, 2)
    rb = row_bytes(ggml_type, n)
    if w.shape[1] != rb:
        raise NativeError(f"w: rows of {w.shape[1]} bytes, expected {rb} for {n} values of type {ggml_type}")
    return rb


def gemv(ggml_type: int, w: torch.Tensor, n: int, x: torch.Tensor, isa_name: Optional[str] = None) -> torch.Tensor:
    """y = W x with W as GGML rows (uint8 [rows, row_bytes]) and x f32 [n]; one thread."""
    lib, ffi = load()
    rb = _rows(ggml_type, w, n)
    _need(x, "x", torch.float32, 1)
    if x.numel() != n:
        raise NativeError(f"x: expected {n} values, got {x.numel()}")
    y = torch.empty(w.shape[0], dtype=torch.float32)
    check(lib.ktk_gemv(isa_index(isa_name), int(ggml_type), _ptr(ffi, w, "uint8_t *"), rb, w.shape[0], n,
                       _ptr(ffi, x, "float *"), _ptr(ffi, y, "float *")), "gemv")
    return y


def linear(pool: Optional["Pool"], ggml_type: int, w: torch.Tensor, n: int, x: torch.Tensor,
           isa_name: Optional[str] = None) -> torch.Tensor:
    """y [T, rows] = x [T, n] (f32) times W^T, W as GGML rows (uint8 [rows, row_bytes]), over the
    pool's workers (this thread alone when `pool` is None or busy)."""
    _rows(ggml_type, w, n)
    _need(x, "x", torch.float32, 2)
    if x.shape[1] != n:
        raise NativeError(f"x: expected [T, {n}], got {list(x.shape)}")
    return linear_checked_rows(pool, isa_index(isa_name), ggml_type, w, n, x)


def linear_checked_rows(pool: Optional["Pool"], isa: int, ggml_type: int, w: torch.Tensor, n: int,
                        x: torch.Tensor) -> torch.Tensor:
    """`linear` for a caller that checked w (uint8 [rows, row_bytes] of the type, contiguous) once
    and resolved the ISA index (`isa_index()`): per call only x is checked here (C checks every size
    again). The per-token path of `cpu_linear`."""
    lib, ffi = load()
    if x.dtype != torch.float32 or not x.is_cpu or x.dim() != 2 or x.shape[1] != n or not x.is_contiguous():
        raise NativeError(f"x: expected contiguous float32 CPU [T, {n}], got {x.dtype} {list(x.shape)}")
    y = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    check(lib.ktk_linear(pool.ptr if pool is not None else ffi.NULL, isa, int(ggml_type), _ptr(ffi, w, "uint8_t *"),
                         w.shape[1], w.shape[0], n, x.shape[0], _ptr(ffi, x, "float *"), _ptr(ffi, y, "float *")),
          "linear")
    return y


def linear_grouped_from(ggml_type: int, isa: Optional[int] = None) -> int:
    """The token count from which `linear` multiplies rows of this GGML type with the 8-bit grouped
    GEMM on the ISA path `isa` (an `isa_index()`; default the running one), 0 where it never does
    (float rows, types the grouped kernels do not take, the scalar path, or
    $KTINJECT_LINEAR_GROUPED_MIN=0)."""
    lib, _ = load()
    isa = isa_index() if isa is None else int(isa)
    return int(lib.ktk_linear_grouped_min()) if lib.ktk_linear_grouped_types(isa) >> int(ggml_type) & 1 else 0


def dequant_rows(pool: Optional["Pool"], ggml_type: int, w: torch.Tensor, n: int,
                 out: Optional[torch.Tensor] = None, isa_name: Optional[str] = None) -> torch.Tensor:
    """GGML rows (uint8 [rows, row_bytes]) to f32 [rows, n] over the pool's workers; into `out`
    (f32, contiguous, at least rows * n values) when given."""
    lib, ffi = load()
    rb = _rows(ggml_type, w, n)
    rows = w.shape[0]
    if out is None:
        out = torch.empty(rows, n, dtype=torch.float32)
    elif out.dtype != torch.float32 or out.device.type != "cpu" or not out.is_contiguous() or out.numel() < rows * n:
        raise NativeError(f"out: need a contiguous float32 CPU buffer of {rows * n} values")
    check(lib.ktk_dequant_rows(pool.ptr if pool is not None else ffi.NULL, isa_index(isa_name), int(ggml_type),
                               _ptr(ffi, w, "uint8_t *"), rb, rows, n, _ptr(ffi, out, "float *")), "dequant_rows")
    return out.view(-1)[:rows * n].view(rows, n)


def pool_trace(pool: Pool) -> Optional[dict]:
    """The pool's trace (KTINJECT_POOL_TRACE=1 when the pool was made) since the last read, then
    reset: per job, microseconds in each phase of a MoE layer (native/moe.c: quantize / pack tokens,
    gate+up, quantize / pack h, down), until the first and the last worker started, from post to
    done, and the caller's wait; the job count; the latest any job's last worker started
    (`last_worker_max`), how many jobs' last worker started 20 us or more after the post
    (`late_jobs`) and which workers those were ({worker: jobs}, `late_by`: one worker for most
    means something else runs on its core). None when tracing is off or no job ran."""
    lib, ffi = load()
    n = 10 + pool.threads
    out = ffi.new("double[]", n)
    if lib.ktk_pool_trace(pool.ptr, out, n) < n or out[0] == 0:
        return None
    c = out[0]
    ends = [out[5] / c, out[6] / c, out[7] / c, out[3] / c]
    spans = [ends[0]] + [ends[i] - ends[i - 1] for i in range(1, 4)]
    return {"jobs": int(c), "quantize_x": round(spans[0], 1), "gate_up": round(spans[1], 1),
            "quantize_h": round(spans[2], 1), "down": round(spans[3], 1),
            "first_worker_start": round(out[1] / c, 1), "last_worker_start": round(out[2] / c, 1),
            "last_worker_max": round(out[8], 1), "late_jobs": int(out[9]),
            "late_by": {i: int(out[10 + i]) for i in range(pool.threads) if out[10 + i]},
            "done": round(out[3] / c, 1), "wait": round(out[4] / c, 1)}


def probe_read_gbps(pool: Pool, nbytes: int, reps: int = 5, isa_name: Optional[str] = None) -> float:
    lib, _ = load()
    v = float(lib.ktk_probe_read_gbps(pool.ptr, isa_index(isa_name), int(nbytes), int(reps)))
    if v < 0:
        raise NativeError(f"bandwidth probe failed (buffer of {nbytes} bytes)")
    return v


class Probe:
    """A read-bandwidth probe that keeps its buffer (`nbytes`, rounded down to 4 MiB chunks, at
    least one; first touched by the pool's workers), so the bench can measure the memory's read
    bandwidth beside each of its own measurements rather than once before them all: on a shared
    host it moves by a third from one minute to the next (docs/benchmarks.md)."""

    def __init__(self, pool: Pool, nbytes: int):
        lib, ffi = load()
        if int(nbytes) <= 0:
            raise NativeError(f"bandwidth probe: a buffer of {nbytes} bytes")
        ptr = lib.ktk_probe_new(pool.ptr, int(nbytes))
        if ptr == ffi.NULL:
            raise NativeError(f"bandwidth probe: could not allocate {int(nbytes) / 2**30:.2f} GiB")
        self.pool = pool
        self._ptr = ffi.gc(ptr, lib.ktk_probe_free)
        self.nbytes = int(lib.ktk_probe_bytes(ptr))

    def gbps(self, reps: int = 3, isa_name: Optional[str] = None) -> float:
        """The best GB/s of `reps` full reads of the buffer by every worker of the pool."""
        if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
            raise NativeError(f"bandwidth probe failed: reps must be a positive integer, got {reps!r}")
        lib, _ = load()
        v = float(lib.ktk_probe_pass(self._ptr, self.pool.ptr, isa_index(isa_name), reps))
        if v < 0:
            raise NativeError("bandwidth probe failed: its pool is running another job")
        return v


def probe_amx_gemm(pool: Pool) -> list[float]:
    """Microseconds per hot 32 x 48 x 2048 bf16 tile GEMM (the AMX prefill path's block), one
    timing per pool worker: the tile unit's speed at the moment, which on a shared host can move by
    3x over time (docs/benchmarks.md, fourteenth session). NativeError without usable AMX."""
    lib, ffi = load()
    n = pool.threads
    buf = ffi.new("double[]", n)
    check(lib.ktk_probe_amx_gemm(pool.ptr, buf, n), "AMX tile probe")
    return [float(buf[i]) for i in range(n)]


from .moe import MoEKernel, ExpertMatrix, repack_r16, run_chain, r16_dequant, r16_gemv, r16_row_bytes, i8_dequant, i8_expert_bytes, repack_i8  # noqa: E402,F401  (needs the helpers above)

__all__ = ["ISAS", "ExpertMatrix", "MoEKernel", "Pool", "Probe", "available", "check", "default_pool", "describe",
           "avx512_bf16_grouped", "dequant_row", "dequant_rows", "gemv", "grouped_path", "isa", "isa_index", "linear", "linear_checked_rows", "load", "missing_reason",
           "linear_grouped_from", "linear_path", "pool_trace", "probe_amx_gemm", "probe_read_gbps", "row_bytes", "run_chain",
           "usable_isas"]
