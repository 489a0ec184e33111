"""`streamed_experts`: `cpu_experts`, plus GPU prefill by streaming a layer's experts for long prompts.

Replaces the transformers 5 fused `*Experts` modules (the classes `cpu_experts` replaces) with the
same call, `forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`, and the
same `submit` / `sync` pair, so the `moe` operator still overlaps it with the shared experts.

It owns a `CpuExperts` (child `cpu_experts`) that builds and loads the weights: GGUF blocks stay
memory-mapped in RAM, zero copy; dense weights are converted once to `quant`. A call takes one
of two paths:

* **CPU** (T < `min_tokens`, or inputs not on CUDA): the native CPU kernel, exactly `cpu_experts`.
* **stream** (T >= `min_tokens` and the hidden states on a CUDA device): the raw GGML rows of the
  experts that received tokens cross to that GPU in chunks of about `chunk_mb` MB, on a copy
  stream, into one of two device buffers per GPU (shared by every layer, alternating); there they
  are dequantized to bf16 by torch ops (the same values as `ktinject.weights.quants`) and the
  chunk's experts run as grouped GEMMs (`torch._grouped_mm`, or one matmul pair per expert).
  While the GPU dequantizes and multiplies chunk i, the copy engine moves chunk i+1.

  Upload modes (`last_upload_mode`): **direct**: the copies go by DMA straight from page-locked
  host memory and the CPU only queues them. That memory is either a page-locked copy of the
  layer's weights made at load for the uploads alone (`host_memory`: `auto`, the default, makes
  one on a CUDA machine while RAM allows, keeping a quarter of it free; `pinned` insists; `mapped`
  never does; the CPU kernels keep reading the mapping), or the GGUF mapping's own pages
  registered with CUDA at the layer's first stream call (`register_host`, opt-in, read-only
  `cuMemHostRegister`). **gathered** (neither, or registration failed: one warning names the
  reason): `gather_threads` threads copy the rows into a pinned host buffer and each piece is
  queued as soon as it is there (the gather of chunk i+1 overlaps the copy of chunk i and the
  compute of chunk i-1). **mixed**: some matrices of the layer each way.

  Copies are whole runs of consecutive experts (all of a chunk's experts at once when they are
  contiguous). When the prompt routes about 4 tokens or more per expert, the first chunk (experts
  0..n) is uploaded before the routing counts are read back, so it overlaps the work queued before
  the layer (attention, router); an expert of it without tokens is then a group of zero rows.

The stream path's math is `stream_moe()`, which also runs with `device="cpu"` (plain buffers,
plain copies), so CI checks it without a GPU; `bench_layer()` measures it against the CPU kernel.

Memory: the plan counts the CPU bytes of `cpu_experts`. The stream path adds, per GPU, two device
buffers of about `chunk_mb` MB each (plus two pinned host buffers of that size in gathered mode),
the bf16 weights of one chunk, the dequantization temporaries and the routed activations;
`staging_bytes()` gives the numbers (the plan cannot place them: the operator lives on the CPU
and does not know its layer's GPU at plan time). Registered mode pins the weights' own pages
(no extra memory); `release_host_memory()` (or dropping the operator) unregisters them. A
page-locked copy (`host_memory`) takes the layer's weight bytes again, in RAM that cannot be
swapped (the CPU kernels read the file's pages, in the page cache).

Decode (fewer than `min_tokens` tokens) takes the CPU path, so a CUDA graph captures it as it
captures `cpu_experts`; the generation engine prefills in chunks of `PREFILL_CHUNK` tokens when a
model has this operator (each chunk streams every layer's experts once).
"""
from __future__ import annotations

import logging
import mmap
import os
import threading
import time
import weakref
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT
from torch import nn

from ..errors import ModelError, NativeError
from ..weights.quants import _f16, k_scale_min
from .base import BuildContext, Operator
from .cpu_experts import CpuExperts, CpuExpertsOptions
from .registry import register

log = logging.getLogger(__name__)

BACKENDS = ("auto", "grouped_mm", "loop")
HOST_MEMORY = ("auto", "pinned", "mapped")
PREFILL_CHUNK = 8192               # the engine's prefill chunk with this operator: each chunk streams every layer again
_ALIGN = 256                       # byte alignment of each matrix's region in a staging buffer
_DEQUANT_VALUES = 1 << 26          # values dequantized per group of torch calls (bounds the temporaries)
_PAGE = mmap.PAGESIZE
_PIECE = 4 << 20                   # bytes per gather job (gathered mode)
_FILL_BYTES = 512 << 10            # an idle expert between two busy ones is uploaded too (one copy, not
#                                    two) when its rows of one matrix are at most this many bytes
_PREFETCH_SLOTS = 4                # T*k >= this * E: the first chunk is uploaded before the routing counts


@dataclass(frozen=True)
class StreamedExpertsOptions:
    min_tokens: int = 256                # tokens per call from which a CUDA caller gets the stream path
    chunk_mb: int = 128                  # raw expert bytes per staged upload (MB; at least one expert)
    backend: str = "auto"                # GPU expert math: auto | grouped_mm | loop
    register_host: bool = False          # copy by DMA from the weights' own (CUDA-registered) pages: opt-in,
    #                                      see docs/prefill.md (fast alone; one end-to-end run hung, unresolved)
    gather_threads: int = 0              # threads gathering rows into pinned buffers otherwise (0: min(8, CPUs))
    host_memory: str = "auto"            # auto | pinned | mapped: where the layer's weights live in RAM (see
    #                                      docs/prefill.md): pinned copies upload by DMA at the link's speed
    # passed to the owned cpu_experts:
    threads: int = 0
    quant: str = "bf16"
    isa: Optional[str] = None
    convert_unsupported: bool = False
    repack: str = "auto"

    def __post_init__(self):
        if self.min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {self.min_tokens}")
        if self.chunk_mb < 1:
            raise ValueError(f"chunk_mb must be >= 1, got {self.chunk_mb}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r} is not one of {', '.join(BACKENDS)}")
        if not isinstance(self.register_host, bool):
            raise ValueError(f"register_host must be true or false, got {self.register_host!r}")
        if self.gather_threads < 0:
            raise ValueError(f"gather_threads must be >= 0, got {self.gather_threads}")
        if self.host_memory not in HOST_MEMORY:
            raise ValueError(f"host_memory {self.host_memory!r} is not one of {', '.join(HOST_MEMORY)}")
        self.cpu_options()                                                     # validates the rest

    def cpu_options(self) -> CpuExpertsOptions:
        return CpuExpertsOptions(self.threads, self.quant, self.isa, self.convert_unsupported, repack=self.repack)


# ---------------------------------------------------------------- host memory registration

def _in_file_mapping(lo: int, hi: int) -> bool:
    """True when [lo, hi) lies inside one file-backed mapping of this process (/proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                start, end = (int(v, 16) for v in parts[0].split("-"))
                if start <= lo and hi <= end:
                    return len(parts) == 6 and parts[5].startswith("/") and parts[4] != "0"
    except (OSError, ValueError, IndexError):
        return False
    return False


class HostRegistry:
    """Page-aligned, disjoint CUDA host registrations of CPU memory, shared by every layer and GPU.

    `cover(t, owner)` registers the pages of the contiguous CPU tensor `t` that no registration
    holds yet and returns the addresses inside `t` where one registration ends and the next
    begins (a copy must not cross them), or None when registration is off or failed (`disabled`
    says why; after the first failure nothing more is registered). Neighbouring tensors may share
    a page: each page is registered once, by whichever tensor came first. A registration keeps its
    first tensor alive (so the mapping stays) and is dropped when no covered tensor uses it any
    more: `release(owner)` forgets the tensors `owner` (a set) covered, after a device synchronize.

    `api` has `register(ptr, nbytes, device) -> error or None` and `unregister(ptr)`; default
    the CUDA driver (tests pass a fake)."""

    def __init__(self, api: Any = None, page: int = _PAGE, file_backed_only: bool = True):
        self._api, self.page = api, page
        # Registration locks whole pages. Pages of a file mapping (a GGUF file) belong to it alone;
        # pages of the heap are shared with unrelated allocations, whose later copies would cross
        # into a registered range (the CUDA copy then fails): those tensors are gathered instead.
        self.file_backed_only = file_backed_only
        self.regions: dict[int, list] = {}        # start -> [end, users (tensor keys), the first tensor]
        self.tensors: dict[tuple[int, int], list] = {}   # (ptr, nbytes) -> [cut points, owners count]
        self.disabled: Optional[str] = None
        self.seconds = 0.0                        # spent registering
        self.bytes = 0                            # registered now
        self._lock = threading.RLock()

    def api(self):
        if self._api is None:
            try:
                from ..native.cuda_driver import driver
                self._api = driver()
            except NativeError as exc:
                self.disabled = str(exc)
        return self._api

    def cover(self, t: torch.Tensor, owner: Optional[set] = None, device: Optional[int] = None,
              what: str = "") -> Optional[list[int]]:
        key = (t.data_ptr(), t.numel() * t.element_size())
        with self._lock:
            entry = self.tensors.get(key)
            if entry is None:
                if self.disabled or self.api() is None:
                    return None
                lo = key[0] // self.page * self.page
                hi = -(-(key[0] + key[1]) // self.page) * self.page
                if self.file_backed_only and not _in_file_mapping(lo, hi):
                    return None
                cuts = self._register(t, key, device, what)
                if cuts is None:
                    return None
                entry = self.tensors[key] = [cuts, 0]
            if owner is not None and key not in owner:
                owner.add(key)
                entry[1] += 1
            return entry[0]

    def _register(self, t, key, device, what) -> Optional[list[int]]:
        a, b = key[0], key[0] + key[1]
        lo, hi = a // self.page * self.page, -(-b // self.page) * self.page
        hits = sorted(s for s, r in self.regions.items() if s < hi and r[0] > lo)
        gaps, pos = [], lo
        for s in hits:
            if s > pos:
                gaps.append((pos, s))
            pos = max(pos, self.regions[s][0])
        if pos < hi:
            gaps.append((pos, hi))
        made, t0 = [], time.perf_counter()
        for g0, g1 in gaps:
            err = self._api.register(g0, g1 - g0, device)
            if err:
                for m in made:                                   # roll back this tensor's registrations
                    self._api.unregister(m)
                    self.bytes -= self.regions.pop(m)[0] - m
                self.disabled = f"registering {g1 - g0} bytes of {what or 'expert weights'} failed: {err}"
                return None
            self.regions[g0] = [g1, set(), t]
            self.bytes += g1 - g0
            made.append(g0)
        self.seconds += time.perf_counter() - t0
        used = sorted(hits + made)
        for s in used:
            self.regions[s][1].add(key)
        return sorted({x for s in used for x in (s, self.regions[s][0]) if a < x < b})

    def release(self, owner: set) -> int:
        """Forget the tensors `owner` covered; unregister what no tensor uses. Returns bytes unregistered."""
        with self._lock:
            keys, owner_keys = [], list(owner)
            owner.clear()
            for key in owner_keys:
                entry = self.tensors.get(key)
                if entry is not None:
                    entry[1] -= 1
                    if entry[1] <= 0:
                        del self.tensors[key]
                        keys.append(key)
            idle = []
            for s, r in self.regions.items():
                r[1].difference_update(keys)
                if not r[1]:
                    idle.append(s)
            if not idle:
                return 0
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                if torch.cuda.is_current_stream_capturing():
                    return 0                                     # keep them: a sync would break the capture
                for d in range(torch.cuda.device_count()):       # no queued copy may still read them
                    torch.cuda.synchronize(d)
            freed = 0
            for s in idle:
                end = self.regions.pop(s)[0]
                err = self._api.unregister(s) if self._api is not None else None
                if err:
                    log.warning("streamed_experts: unregistering %d bytes at %#x from CUDA failed (they stay "
                                "page-locked): %s", end - s, s, err)
                freed += end - s
            self.bytes -= freed
            return freed


_HOST = HostRegistry()
_NO_OWNER: set = set()                       # stream_moe calls without an owner (never released)
_WARNED: set = set()


_PINNED: dict[int, int] = {}      # storage address -> bytes of the page-locked copies made for host_memory


def is_page_locked_copy(t: torch.Tensor) -> bool:
    """True when `t` lies in a page-locked copy made by host_memory (memory merely registered with
    CUDA by someone else is not: its registration may cover only part of it)."""
    return t.untyped_storage().data_ptr() in _PINNED


def _page_locked_copy(t: torch.Tensor) -> torch.Tensor:
    c = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
    ptr, n = c.untyped_storage().data_ptr(), c.untyped_storage().nbytes()
    _PINNED[ptr] = n
    weakref.finalize(c.untyped_storage(), _PINNED.pop, ptr, None)
    return c


def pinnable_bytes() -> int:
    """Bytes that may still go into page-locked memory: what Linux reports available (within this
    process's cgroup limit, when it has one), less a reserve of a quarter of RAM (at least 4 GiB)
    for everything else. Page-locked memory cannot be swapped or reclaimed, so it is never taken
    to the last byte."""
    from ..sysmem import memory_total_available
    total, avail = memory_total_available()
    if total == 0:
        return 0
    return avail - max(total // 4, 4 << 30)


def pinned_footprint(nbytes: int) -> int:
    """What a page-locked allocation of `nbytes` takes: torch's caching host allocator rounds each
    block up to a power of two (a 104 MB expert matrix takes 128 MB)."""
    return 1 << max(nbytes - 1, 0).bit_length()


def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        log.warning("%s", msg)


# ---------------------------------------------------------------- staging buffers (per device)

def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class Staging:
    """Two device uint8 buffers (and, for gathered uploads, two pinned host buffers) for one
    device, shared by every layer on it.

    CUDA: `done[s]` is recorded on the copy stream after the last copy into dev[s] (and out of
    host[s]: host[s] may be rewritten once it completed), `free[s]` on the compute stream after
    the last kernel reading dev[s] (the copy stream waits for it before writing dev[s] again).
    CPU (tests): one plain buffer per slot serves as both, copies are plain copies.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.host: list[Optional[torch.Tensor]] = [None, None]
        self.dev: list[Optional[torch.Tensor]] = [None, None]
        self.slot = 1
        self._fresh = [False, False]            # dev[s] not yet written since acquire(): wait for free[s]
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device=device)
            self.done = [torch.cuda.Event(), torch.cuda.Event()]
            self.free = [torch.cuda.Event(), torch.cuda.Event()]

    def acquire(self, nbytes: int, host: bool = True) -> int:
        """The next slot, with buffers of at least `nbytes` (a host one only if `host`: then it may
        be written as soon as this returns)."""
        self.slot ^= 1
        s = self.slot
        if not self.cuda:
            if self.host[s] is None or self.host[s].numel() < nbytes:
                self.host[s] = self.dev[s] = torch.empty(nbytes, dtype=torch.uint8)
            return s
        if host:
            self.done[s].synchronize()                      # the previous copy out of host[s] finished
        grow_dev = self.dev[s] is None or self.dev[s].numel() < nbytes
        grow_host = host and (self.host[s] is None or self.host[s].numel() < nbytes)
        if grow_dev or grow_host:
            torch.cuda.synchronize(self.device)             # nothing may still use the buffers we drop
            if grow_dev:
                self.dev[s] = None
                self.dev[s] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            if grow_host:
                self.host[s] = None
                self.host[s] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self._fresh[s] = True
        return s

    def _copy(self, s: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        if not self.cuda:
            dst.copy_(src)
            return
        with torch.cuda.stream(self.copy_stream):
            if self._fresh[s]:
                self.copy_stream.wait_event(self.free[s])   # kernels still reading dev[s] come first
                self._fresh[s] = False
            dst.copy_(src, non_blocking=True)

    def upload(self, s: int, start: int, end: int) -> None:
        """Queue the copy of host[s][start:end] to dev[s][start:end] on the copy stream."""
        if self.cuda and end > start:
            self._copy(s, self.dev[s][start:end], self.host[s][start:end])

    def direct(self, s: int, start: int, src: torch.Tensor) -> None:
        """Queue the copy of `src` (flat uint8 in registered host memory) to dev[s][start:...]."""
        self._copy(s, self.dev[s][start:start + src.numel()], src)

    def record(self, s: int) -> None:
        """All copies of this slot are queued."""
        if self.cuda:
            self.done[s].record(self.copy_stream)

    def wait(self, s: int) -> None:
        """Kernels queued on the current stream from now on see the slot's copies."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.done[s])

    def uploaded(self, s: int) -> None:
        self.record(s)
        self.wait(s)

    def consumed(self, s: int) -> None:
        """Every kernel reading dev[s] is queued on the current stream."""
        if self.cuda:
            self.free[s].record(torch.cuda.current_stream(self.device))

    def nbytes(self) -> dict[str, int]:
        dev = sum(t.numel() for t in self.dev if t is not None)
        if not self.cuda:
            return {"host": dev, "device": 0}
        return {"host_pinned": sum(t.numel() for t in self.host if t is not None), "device": dev}


_STAGING: dict[str, Staging] = {}


def staging_for(device: torch.device) -> Staging:
    """The shared staging buffers of `device` (created on first use)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = str(device)
    if key not in _STAGING:
        _STAGING[key] = Staging(device)
    return _STAGING[key]


_POOLS: dict[int, ThreadPoolExecutor] = {}


def _pool(threads: int) -> Optional[ThreadPoolExecutor]:
    n = threads or min(8, os.cpu_count() or 1)
    if n <= 1:
        return None
    if n not in _POOLS:
        _POOLS[n] = ThreadPoolExecutor(n, thread_name_prefix="ktinject-gather")
    return _POOLS[n]


# ---------------------------------------------------------------- upload planning

def _segments(m, experts: list[int]) -> list[tuple[int, int]]:
    """(first row, rows) runs in `m.data` [N, row_bytes] holding `experts`' rows, merged where contiguous."""
    runs: list[list[int]] = []
    for e in experts:
        r0 = e * m.expert_stride + m.offset
        if runs and runs[-1][0] + runs[-1][1] == r0:
            runs[-1][1] += m.rows
        else:
            runs.append([r0, m.rows])
    return [(a, b) for a, b in runs]


def _chunks(experts: list[int], per_expert: int, budget: int) -> list[list[int]]:
    """Split sorted expert ids into groups of at most `budget` bytes (at least one expert each)."""
    out: list[list[int]] = []
    for e in experts:
        if out and (len(out[-1]) + 1) * per_expert <= budget:
            out[-1].append(e)
        else:
            out.append([e])
    return out


def _plan(counts: list[int], cap: int, fill: int = 0, first: int = 0) -> list[list[int]]:
    """Chunks of at most `cap` expert ids that hold every expert with tokens: experts [0, first)
    as one chunk (uploaded before the counts were known, busy or not), then the busy experts from
    `first` on, in order; an idle expert between two busy ones of a chunk joins it when the gap is
    at most `fill` experts (their rows then go in one copy)."""
    chunks = [list(range(first))] if first else []
    cur: list[int] = []
    for e in range(first, len(counts)):
        if not counts[e]:
            continue
        if cur:
            gap = e - cur[-1] - 1
            if 0 < gap <= fill and len(cur) + gap + 1 <= cap:
                cur.extend(range(cur[-1] + 1, e + 1))
                continue
            if len(cur) < cap:
                cur.append(e)
                continue
            chunks.append(cur)
        cur = [e]
    if cur:
        chunks.append(cur)
    return chunks


def _split(a: int, b: int, cuts: list[int]) -> list[tuple[int, int]]:
    """[a, b) cut at the points of `cuts` (sorted) strictly inside it."""
    out = []
    for c in cuts:
        if a < c < b:
            out.append((a, c))
            a = c
    out.append((a, b))
    return out


def _upload_chunk(staging: Staging, s: int, chunk: list[int], mats, cuts, pool, stats: dict) -> list[torch.Tensor]:
    """Queue the copies of `chunk`'s rows of each matrix into dev[s] (registered matrices
    straight from their pages, the others gathered into host[s] first); returns each matrix's
    region of dev[s], uint8 [n*rows, row_bytes]."""
    n = len(chunk)
    dev = staging.dev[s]
    regions, gather, pos = [], [], 0
    for m, cut in zip(mats, cuts):
        rb = m.data.shape[1]
        flat = m.data.view(-1)
        d = pos
        for r0, nr in _segments(m, chunk):
            a, b = r0 * rb, (r0 + nr) * rb
            if cut is None:
                gather.append((d, flat, a, b))
            else:
                base = m.data.data_ptr()
                for p0, p1 in _split(base + a, base + b, cut):
                    staging.direct(s, d + p0 - base - a, flat[p0 - base:p1 - base])
                    stats["copies"] += 1
                stats["direct_bytes"] += b - a
            d += b - a
        size = n * m.rows * rb
        regions.append(dev[pos:pos + size].view(n * m.rows, rb))
        pos += _aligned(size)
    if gather:
        _gather(staging, s, gather, pool, stats)
    staging.record(s)
    return regions


def _gather(staging: Staging, s: int, jobs, pool, stats: dict) -> None:
    """Copy (dst offset, flat source, a, b) jobs into host[s], in pieces over `pool`; queue the
    upload of each run of adjacent pieces as soon as it is complete."""
    host = staging.host[s]
    pieces = []
    for d, flat, a, b in jobs:
        for p in range(a, b, _PIECE):
            q = min(b, p + _PIECE)
            pieces.append((d + p - a, flat, p, q))
    hnp = host.numpy()

    def work(piece):
        d, flat, p, q = piece
        hnp[d:d + q - p] = flat[p:q].numpy()                   # numpy releases the GIL while copying
    futures = [pool.submit(work, pc) for pc in pieces] if pool is not None and len(pieces) > 1 else None
    run: Optional[list[int]] = None                             # adjacent gathered bytes not queued yet

    def flush():
        staging.upload(s, run[0], run[1])
        stats["copies"] += 1
    for i, pc in enumerate(pieces):
        if futures is None:
            work(pc)
        else:
            futures[i].result()
        d0, d1 = pc[0], pc[0] + pc[3] - pc[2]
        stats["gathered_bytes"] += d1 - d0
        if run is not None and run[1] == d0:
            run[1] = d1
        else:
            if run is not None:
                flush()
            run = [d0, d1]
        if run[1] - run[0] >= 4 * _PIECE:                       # queue long runs at once: the copy starts
            flush()
            run = None
    if run is not None:
        flush()


# ---------------------------------------------------------------- dequantization to bf16 (torch ops)
#
# The same values as `quants.QuantType.dequantize_blocks(...).to(bf16)` (same float32 operations
# in the same order, one rounding to bf16), with fewer and smaller temporaries: no float copies
# of the integer codes (torch multiplies uint8/int8 by float32 directly), codes assembled in
# preallocated uint8 buffers. Each takes blocks uint8 [..., type_size] and writes out [..., block_size].

_CONSTS: dict[tuple, torch.Tensor] = {}


def _const(values: tuple, device: torch.device) -> torch.Tensor:
    key = (values, str(device))
    if key not in _CONSTS:
        _CONSTS[key] = torch.tensor(values, dtype=torch.uint8, device=device)
    return _CONSTS[key]


def _nibbles_into(qs: torch.Tensor, q: torch.Tensor) -> None:
    """uint8 qs [..., m] -> q [..., 2, m]: low nibbles, then high nibbles."""
    torch.bitwise_and(qs, 0x0F, out=q[..., 0, :])
    torch.bitwise_right_shift(qs, 4, out=q[..., 1, :])


def _dq_q4_k(b: torch.Tensor, out: torch.Tensor) -> None:
    lead = b.shape[:-1]
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])                            # [..., 1]
    sc, mn = k_scale_min(b[..., 4:16])                                          # [..., 8] each
    dl = (d * sc.float()).unflatten(-1, (4, 2, 1))                            # sub-block 2c+h
    ml = (dmin * mn.float()).unflatten(-1, (4, 2, 1))
    qs = b[..., 16:].unflatten(-1, (4, 32))                                   # [..., 4, 32]
    tmp = torch.empty(lead + (4, 2, 32), dtype=torch.float32, device=b.device)
    torch.mul(dl[..., 0, :], qs & 0x0F, out=tmp[..., 0, :])
    torch.mul(dl[..., 1, :], qs >> 4, out=tmp[..., 1, :])
    tmp.sub_(ml)
    out.copy_(tmp.view(out.shape))


def _dq_q6_k(b: torch.Tensor, out: torch.Tensor) -> None:
    lead = b.shape[:-1]
    d = _f16(b[..., 208:210])
    dl = d * b[..., 192:208].view(torch.int8).float()                         # [..., 16]
    q = torch.empty(lead + (2, 2, 64), dtype=torch.uint8, device=b.device)    # [half, nibble, 64]
    _nibbles_into(b[..., 0:128].unflatten(-1, (2, 64)), q)
    hi = (b[..., 128:192].unflatten(-1, (2, 1, 32)) >> _const((0, 2, 4, 6), b.device).view(4, 1)) & 3
    q.view(lead + (2, 4, 32)).bitwise_or_(hi << 4)                            # [half, shift, 32]
    qi = q.view(torch.int8).sub_(32).view(lead + (16, 16))
    out.copy_(torch.mul(dl.unsqueeze(-1), qi).view(out.shape))


def _dq_q5_0(b: torch.Tensor, out: torch.Tensor) -> None:
    lead = b.shape[:-1]
    d = _f16(b[..., 0:2])
    q = torch.empty(lead + (2, 16), dtype=torch.uint8, device=b.device)
    _nibbles_into(b[..., 6:22], q)
    hb = (b[..., 2:6].unsqueeze(-1) >> _const(tuple(range(8)), b.device)) & 1  # [..., 4, 8]: bit i = 8*byte+bit
    q = q.view(lead + (32,)).bitwise_or_(hb.view(lead + (32,)) << 4)
    out.copy_(torch.mul(d, q.view(torch.int8).sub_(16)))


def _dq_q4_0(b: torch.Tensor, out: torch.Tensor) -> None:
    lead = b.shape[:-1]
    d = _f16(b[..., 0:2])
    q = torch.empty(lead + (2, 16), dtype=torch.uint8, device=b.device)
    _nibbles_into(b[..., 2:18], q)
    out.copy_(torch.mul(d, q.view(lead + (32,)).view(torch.int8).sub_(8)))


def _dq_q8_0(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(torch.mul(b[..., 2:34].view(torch.int8), _f16(b[..., 0:2])))


def _dq_float(dtype: torch.dtype) -> Callable:
    def dq(b: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(b.contiguous().view(dtype))
    return dq


_FAST_DEQUANT: dict[int, Callable] = {int(QT.Q4_K): _dq_q4_k, int(QT.Q6_K): _dq_q6_k, int(QT.Q5_0): _dq_q5_0,
                                      int(QT.Q4_0): _dq_q4_0, int(QT.Q8_0): _dq_q8_0,
                                      int(QT.BF16): _dq_float(torch.bfloat16), int(QT.F16): _dq_float(torch.float16),
                                      int(QT.F32): _dq_float(torch.float32)}


def dequantize_blocks_into(out: torch.Tensor, blocks: torch.Tensor, ggml_type: int, name: str = "") -> None:
    """blocks uint8 [..., type_size] -> out [..., block_size] (any float dtype, any strides)."""
    fast = _FAST_DEQUANT.get(int(ggml_type))
    if fast is not None:
        fast(blocks, out)
        return
    from ..weights.quants import quant_class
    cls = quant_class(ggml_type, tensor=name)
    out.copy_(cls.dequantize_blocks(blocks.reshape(-1, cls.type_size)).view(out.shape))


def _dequantize_into(dst: torch.Tensor, raw: torch.Tensor, m) -> None:
    """raw uint8 [n*rows, row_bytes] (on dst's device) -> dst [n, rows, cols] (any float dtype;
    each expert's [rows, cols] contiguous)."""
    from ..weights.quants import quant_class
    cls = quant_class(m.ggml_type, tensor=m.name)
    n, rows, cols = dst.shape
    nb = rows * cols // cls.block_size                                         # blocks per expert
    step = max(1, _DEQUANT_VALUES // (rows * cols))
    for j0 in range(0, n, step):
        j1 = min(n, j0 + step)
        blocks = raw[j0 * rows:j1 * rows].view(j1 - j0, nb, cls.type_size)
        dequantize_blocks_into(dst[j0:j1].view(j1 - j0, nb, cls.block_size), blocks, m.ggml_type, m.name)


# ---------------------------------------------------------------- the stream path's math

_GROUPED_MM_BROKEN = False


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, counts: list[int], backend: str,
                  offs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """a [S, K] rows sorted by group, w [G, N, K] (one matrix per group), counts[g] rows each -> [S, N].
    `offs`: the int32 cumulative counts on a's device, if the caller has them."""
    global _GROUPED_MM_BROKEN
    if backend == "grouped_mm" or (backend == "auto" and not _GROUPED_MM_BROKEN and hasattr(torch, "_grouped_mm")):
        if offs is None:
            offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(a.device, non_blocking=True)
        try:
            return torch._grouped_mm(a, w.transpose(1, 2), offs=offs)     # w^T: [G, K, N], column-major
        except (RuntimeError, NotImplementedError, AttributeError) as exc:
            if backend == "grouped_mm":
                raise ModelError(f"streamed_experts: torch._grouped_mm failed on {a.device} ({exc}); "
                                 f"use kwargs backend: loop") from None
            _GROUPED_MM_BROKEN = True
            log.warning("streamed_experts: torch._grouped_mm unavailable on %s (%s); using a per-expert loop",
                        a.device, exc)
    out = a.new_empty(a.shape[0], w.shape[1])
    start = 0
    for g, n in enumerate(counts):
        if n:
            torch.matmul(a[start:start + n], w[g].t(), out=out[start:start + n])
        start += n
    return out


def _mode(stats: dict) -> str:
    r, g = stats["direct_bytes"], stats["gathered_bytes"]
    return "mixed" if r and g else "direct" if r else "gathered"


def stream_moe(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, gate, up, down, *,
               device: Any = None, chunk_bytes: int = 128 << 20, backend: str = "auto",
               staging: Optional[Staging] = None, name: str = "streamed_experts",
               register_host: bool = False, gather_threads: int = 0, registry: Optional[HostRegistry] = None,
               owner: Optional[set] = None, stats: Optional[dict] = None,
               upload_only: bool = False) -> torch.Tensor:
    """The stream path: out[t] = sum_j wts[t,j] * down_e(SiLU(gate_e x_t) * up_e x_t), e = ids[t,j].

    x: [T, H], ids: [T, k] int, wts: [T, k]; gate, up: ExpertMatrix [E, I, H], down: [E, H, I]
    (GGML rows on the CPU). Only experts that received tokens are copied to `device` (default:
    x's) and dequantized to bf16 there; the result is float32 [T, H] on `device`.

    `register_host` (CUDA only) registers the matrices' host memory with `registry` (default the
    process-wide one; a given registry is used on any device), counting them as `owner`'s;
    matrices that are not registered are gathered by `gather_threads` threads. `stats`, if given,
    receives the upload's facts (mode, bytes, copies, chunks). `upload_only` (measurement): copy
    the weights, skip the math (the result is zeros).
    """
    device = torch.device(device) if device is not None else x.device
    E, I, H = gate.n_experts, gate.rows, gate.cols
    T, k = ids.shape
    st = {"direct_bytes": 0, "gathered_bytes": 0, "copies": 0, "chunks": 0}
    x = x.to(device, torch.bfloat16)                                          # [T, H]
    flat = ids.to(device).reshape(-1).long()                                  # [S = T*k] expert of each slot
    w = wts.to(device).reshape(-1).float()                                    # [S]
    out = torch.zeros(T, H, dtype=torch.float32, device=device)               # [T, H]
    if flat.numel() == 0:
        if stats is not None:
            stats.update(st, mode="none")
        return out
    # tokens per expert (+ one bin for ids out of range) and the id range: read back below
    counts_dev = torch.bincount(flat.clamp(0, E), minlength=E + 1)
    stats_dev = torch.cat((counts_dev, torch.stack(torch.aminmax(flat))))
    order = torch.argsort(flat, stable=True)                                  # [S] slots grouped by expert
    tok = order // k                                                          # [S] token of each sorted slot
    xs = x[tok]                                                               # [S, H] routed activations
    ws = w[order]                                                             # [S] routing weight per slot
    staging = staging or staging_for(device)
    mats = (gate, up, down)
    per_expert = sum(_aligned(m.rows * m.data.shape[1]) for m in mats)
    cap = max(1, min(E, chunk_bytes // per_expert))                           # experts per chunk
    reg = registry if registry is not None else (_HOST if register_host and device.type == "cuda" else None)
    # page-locked copies (host_memory) are copied by DMA as they are, in one piece per run
    cuts: list[Optional[list[int]]] = [[] if device.type == "cuda" and is_page_locked_copy(m.data) else None
                                       for m in mats]
    if reg is not None:
        for i, m in enumerate(mats):
            if cuts[i] is not None:
                continue
            cuts[i] = reg.cover(m.data, _NO_OWNER if owner is None else owner,
                                device.index if device.type == "cuda" else None, m.name or name)
        if any(c is None for c in cuts) and reg.disabled:
            _warn_once(f"streamed_experts: CUDA host registration of the expert weights is off ({reg.disabled}); "
                       f"gathering them into pinned buffers instead (slower uploads)")
    gathered = any(c is None for c in cuts)
    pool = _pool(gather_threads) if gathered else None
    # a long prompt routes tokens to nearly every expert: upload the first chunk now, so it
    # overlaps the GPU work queued before this call (the read-back below waits for it)
    first = cap if T * k >= _PREFETCH_SLOTS * E else 0
    slot0 = regions0 = None
    if first:
        slot0 = staging.acquire(cap * per_expert, host=gathered)
        regions0 = _upload_chunk(staging, slot0, list(range(first)), mats, cuts, pool, st)
    stats_host = stats_dev.cpu().tolist()                                     # the one host sync
    lo, hi = stats_host[E + 1], stats_host[E + 2]
    if lo < 0 or hi >= E:
        if slot0 is not None:
            staging.wait(slot0)
            staging.consumed(slot0)
        raise ModelError(f"{name}: top_k_index holds expert id {lo if lo < 0 else hi}, outside [0, {E})")
    counts = stats_host[:E]                                                   # [E] tokens per expert
    fill = 0 if any(m.expert_stride != m.rows for m in mats) else \
        _FILL_BYTES // max(m.rows * m.data.shape[1] for m in mats)
    chunks = _plan(counts, cap, fill, first)
    # every chunk's cumulative group sizes, in one host-to-device copy
    group_counts = [[counts[e] for e in chunk] for chunk in chunks]
    cum = []
    for c in group_counts:
        acc = 0
        for v in c:
            acc += v
            cum.append(acc)
    offs_all = torch.tensor(cum, dtype=torch.int32).to(device, non_blocking=True)
    start = o = 0                                                             # first sorted slot / offs of a chunk
    for i, chunk in enumerate(chunks):
        n, c = len(chunk), group_counts[i]
        if i == 0 and slot0 is not None:
            s, regions = slot0, regions0
        else:
            s = staging.acquire(cap * per_expert, host=gathered)
            regions = _upload_chunk(staging, s, chunk, mats, cuts, pool, st)
        st["chunks"] += 1
        end = start + sum(c)
        staging.wait(s)
        if upload_only or end == start:
            staging.consumed(s)
            start, o = end, o + n
            continue
        # dequantize on `device`: gate and up side by side, as the transformers weights are
        w_gu = torch.empty(n, 2 * I, H, dtype=torch.bfloat16, device=device)   # [n, 2I, H]
        w_dn = torch.empty(n, H, I, dtype=torch.bfloat16, device=device)       # [n, H, I]
        _dequantize_into(w_gu[:, :I], regions[0], gate)
        _dequantize_into(w_gu[:, I:], regions[1], up)
        _dequantize_into(w_dn, regions[2], down)
        staging.consumed(s)
        # grouped expert math over the chunk's sorted slots
        offs = offs_all[o:o + n]
        gu = _grouped_gemm(xs[start:end], w_gu, c, backend, offs)              # [Sc, 2I]
        h = F.silu(gu[:, :I]) * gu[:, I:]                                      # [Sc, I]
        y = _grouped_gemm(h, w_dn, c, backend, offs)                           # [Sc, H]
        out.index_add_(0, tok[start:end], y.float() * ws[start:end, None])     # weighted sum over top-k
        start, o = end, o + n
    if stats is not None:
        stats.update(st, mode=_mode(st), bytes=st["direct_bytes"] + st["gathered_bytes"])
    return out


# ---------------------------------------------------------------- measurement (for choosing min_tokens)

def _mapped_rows(rows: torch.Tensor, directory: str, name: str) -> torch.Tensor:
    """`rows` written to a file and memory-mapped back read-only, as a GGUF file's tensors are."""
    import warnings

    import numpy as np
    path = os.path.join(directory, name)
    rows.numpy().tofile(path)
    arr = np.memmap(path, dtype=np.uint8, mode="r")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                       # "the given NumPy array is not writable"
        return torch.from_numpy(arr).view(rows.shape)


def bench_layer(tokens=(64, 128, 256, 512, 1024, 2048, 4096), *, experts: int = 64, hidden: int = 2048,
                inter: int = 1408, top_k: int = 6, qtype: str = "Q4_K", layers: int = 4, threads: int = 0,
                chunk_mb: int = 128, backend: str = "auto", device: str = "cuda", reps: int = 3,
                register_host: bool = True, gather_threads: int = 0, mapped: bool = True,
                cpu: bool = True) -> list[dict]:
    """Milliseconds per routed-experts layer, stream path vs the native CPU kernel, per token count.

    Defaults: DeepSeek-V2-Lite's shapes; gate/up in `qtype`, down in `qtype` too when `inter` is a
    multiple of its block, else Q5_0 (what llama.cpp writes for V2-Lite). `layers` weight sets
    (memory-mapped from temporary files when `mapped`, as GGUF weights are) are cycled so neither
    the L3 cache nor a warm buffer flatters either path; uniform random routing (so at these sizes
    almost every expert is active, as in a real long prompt). `cpu=False` skips the CPU kernel.

    Returns rows {tokens, stream_ms, cpu_ms, speedup, upload_ms, upload_gb_s, stream_gb_s, mode,
    chunks, copies}: `upload_ms` / `upload_gb_s` time the same uploads without the math,
    `stream_gb_s` is the uploaded bytes over `stream_ms`; the first row also has `register_s`,
    the time the layers' registration took (once, at their first call).
    """
    import tempfile

    from ..native import ExpertMatrix, MoEKernel
    from ..native.synth import random_rows
    dev = torch.device(device)
    qt = QT[qtype.upper()]
    block = 256 if qt.name.endswith("_K") else 32
    dqt = qt if inter % block == 0 else QT.Q5_0
    E, H, I = experts, hidden, inter
    owner: set = set()
    seconds0 = _HOST.seconds
    with tempfile.TemporaryDirectory(prefix="ktinject-bench-") as tmp:
        sets = []
        for layer in range(layers):
            raw = (random_rows(qt, E * I, H, seed=3 * layer), random_rows(qt, E * I, H, seed=3 * layer + 1),
                   random_rows(dqt, E * H, I, seed=3 * layer + 2))
            if mapped:
                raw = tuple(_mapped_rows(r, tmp, f"{layer}.{j}") for j, r in enumerate(raw))
            g = ExpertMatrix(int(qt), raw[0], E, I, H, f"bench.{layer}.gate")
            u = ExpertMatrix(int(qt), raw[1], E, I, H, f"bench.{layer}.up")
            d = ExpertMatrix(int(dqt), raw[2], E, H, I, f"bench.{layer}.down")
            sets.append((g, u, d, MoEKernel(g, u, d, threads=threads) if cpu else None))

        def sync():
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

        def stream(xd, idsd, wd, only, st=None):
            for g, u, d, _ in sets:
                stream_moe(xd, idsd, wd, g, u, d, device=dev, chunk_bytes=chunk_mb << 20, backend=backend,
                           register_host=register_host, gather_threads=gather_threads, owner=owner,
                           stats=st, upload_only=only)

        rows = []
        try:
            for T in tokens:
                gen = torch.Generator().manual_seed(T)
                x = torch.randn(T, H, generator=gen)                                   # [T, H]
                ids = torch.rand(T, E, generator=gen).topk(top_k, dim=1).indices       # [T, k]
                w = torch.rand(T, top_k, generator=gen)                                # [T, k]
                xd, idsd, wd = x.to(dev, torch.bfloat16), ids.to(dev), w.to(dev)
                times = {"stream": [], "cpu": [], "upload": []}
                st: dict = {}
                for rep in range(reps + 1):                                            # rep 0 warms up
                    sync()
                    t0 = time.perf_counter()
                    stream(xd, idsd, wd, False, st)
                    sync()
                    t1 = time.perf_counter()
                    stream(xd, idsd, wd, True)
                    sync()
                    t2 = time.perf_counter()
                    if cpu:
                        for *_, kernel in sets:
                            kernel.forward(x, ids, w)
                    t3 = time.perf_counter()
                    if rep:
                        times["stream"].append((t1 - t0) / layers)
                        times["upload"].append((t2 - t1) / layers)
                        times["cpu"].append((t3 - t2) / layers)
                s, u, c = min(times["stream"]), min(times["upload"]), min(times["cpu"])
                row = {"tokens": T, "stream_ms": round(s * 1e3, 3), "cpu_ms": round(c * 1e3, 3) if cpu else None,
                       "speedup": round(c / s, 2) if cpu else None, "upload_ms": round(u * 1e3, 3),
                       # three decimals: a small layer on a busy CPU moves well under 0.05 GB/s (rounded to 0.0 before)
                       "upload_gb_s": round(st["bytes"] / u / 1e9, 3), "stream_gb_s": round(st["bytes"] / s / 1e9, 3),
                       "mode": st["mode"], "chunks": st["chunks"], "copies": st["copies"]}
                if not rows:
                    row["register_s"] = round(_HOST.seconds - seconds0, 3)
                rows.append(row)
        finally:
            if owner:
                _HOST.release(owner)
            sets.clear()                                   # drop the mappings before the files go
    return rows


# ---------------------------------------------------------------- the operator

@register("streamed_experts")
class StreamedExperts(Operator):
    Options = StreamedExpertsOptions
    replaces = CpuExperts.replaces
    device_types = ("cpu",)
    summary = "cpu_experts, plus GPU prefill from min_tokens on: the layer's GGML experts streamed to the GPU"
    # device types of the caller's hidden states that may take the stream path (tests add "cpu")
    stream_device_types: tuple[str, ...] = ("cuda",)

    def __init__(self, cpu: CpuExperts, options: StreamedExpertsOptions, name: str = ""):
        super().__init__()
        self.cpu_experts = cpu
        self.options, self.name = options, name
        self.num_experts, self.hidden, self.inter = cpu.num_experts, cpu.hidden, cpu.inter
        self._pending = None
        self.calls = {"cpu": 0, "stream": 0}      # calls per path (bench and tests)
        self.last_path: Optional[str] = None
        self.last_upload_mode: Optional[str] = None   # direct | gathered | mixed (stream path)
        self.last_upload: dict = {}               # the last stream call's upload facts (bytes, copies, chunks)
        self._host_keys: set = set()              # tensors this operator registered with CUDA (via _HOST)
        self._upload: Optional[tuple] = None      # page-locked copies of gate, up, down (host_memory)
        self._host_finalizer = None

    @classmethod
    def build(cls, original: nn.Module, ctx: BuildContext) -> nn.Module:
        opts = ctx.options or StreamedExpertsOptions()
        sub = BuildContext(ctx.name, ctx.device, ctx.prefill_device, ctx.generate_device, ctx.dtype, ctx.config,
                           opts.cpu_options(), ctx.stored)
        return cls(CpuExperts.build(original, sub), opts, ctx.name)

    @classmethod
    def planned_bytes(cls, original: nn.Module, ctx: BuildContext) -> dict[str, int]:
        opts = ctx.options or StreamedExpertsOptions()
        sub = BuildContext(ctx.name, ctx.device, ctx.prefill_device, ctx.generate_device, ctx.dtype, ctx.config,
                           opts.cpu_options(), ctx.stored)
        return CpuExperts.planned_bytes(original, sub)

    @classmethod
    def staging_bytes(cls, original: nn.Module, options: Optional[StreamedExpertsOptions] = None) -> dict[str, int]:
        """Upper bounds of the stream path's extra memory per GPU (shared by all layers on it), for
        weights stored as `options.quant` (GGUF files: use their real bits per weight instead).

        `device_staging`: two buffers of one chunk of raw rows; `host_pinned`: as many, allocated
        only when uploads are gathered (registration off or failed); `device_bf16`: one chunk's
        dequantized weights (the dequantization temporaries and the routed activations come on top
        and depend on the prompt)."""
        from .cpu_experts import CONVERT_BITS
        opts = options or StreamedExpertsOptions()
        e, two_i, h = (int(s) for s in original.gate_up_proj.shape)
        values = 3 * (two_i // 2) * h                                           # per expert
        raw = int(values * CONVERT_BITS[opts.quant] / 8) + 3 * _ALIGN
        per_chunk = max(1, min(e, (opts.chunk_mb << 20) // raw))
        return {"host_pinned": 2 * per_chunk * raw, "device_staging": 2 * per_chunk * raw,
                "device_bf16": per_chunk * values * 2}

    def load_weights(self, prefix: str, source: Mapping[str, Any]) -> set[str]:
        keys = self.cpu_experts.load_weights(prefix, source)
        self._upload = None
        self._place_host_memory()
        return keys

    def _place_host_memory(self) -> None:
        """host_memory: copy the layer's weights into page-locked memory (auto: when CUDA is there
        and RAM allows), so the stream path uploads them by DMA at the link's speed, with no gather.
        The CPU kernels keep reading the mapping, as measured at 64 tok/s decode (V2-Lite); whether
        they would be as fast on the copies, saving the page cache, is open (docs/prefill.md)."""
        mode = self.options.host_memory
        if mode == "mapped":
            return
        where = self.name or "streamed_experts"
        if not torch.cuda.is_available():
            if mode == "pinned":
                raise ModelError(f"{where}: host_memory: pinned needs CUDA (page-locked memory); "
                                 f"use auto or mapped on this machine")
            return
        kernel = self.cpu_experts.kernel
        mats = (kernel.gate, kernel.up, kernel.down)
        tensors = {m.data.data_ptr(): m.data for m in mats}
        nbytes = sum(pinned_footprint(t.numel() * t.element_size()) for t in tensors.values())
        if mode == "auto":
            room = pinnable_bytes()
            if nbytes > room:
                _warn_once(f"streamed_experts: not enough free RAM to keep the routed experts in page-locked memory "
                           f"({nbytes / 2**20:.0f} MiB for {where}, {max(room, 0) / 2**20:.0f} MiB to spare); "
                           f"such layers gather their uploads from the mapped file (slower GPU prefill)")
                return
        try:
            copies = {p: _page_locked_copy(t) for p, t in tensors.items()}
        except RuntimeError as exc:
            if mode == "pinned":
                raise ModelError(f"{where}: could not allocate {nbytes / 2**20:.0f} MiB of page-locked memory "
                                 f"({exc}); use host_memory: auto or mapped") from None
            _warn_once(f"streamed_experts: page-locked allocation failed ({exc}); gathering uploads instead")
            return
        self._upload = tuple(dataclasses.replace(m, data=copies[m.data.data_ptr()]) for m in mats)

    # ---------------------------------------------------------------- compute

    def path(self, hidden_states: torch.Tensor) -> str:
        """`"stream"` or `"cpu"` for a call with these hidden states [T, H] (always the CPU path
        while a CUDA graph is being captured: the stream path reads the routing counts back)."""
        if hidden_states.shape[0] >= self.options.min_tokens and \
                hidden_states.device.type in self.stream_device_types and \
                not (hidden_states.is_cuda and torch.cuda.is_current_stream_capturing()):
            return "stream"
        return "cpu"

    def _stream(self, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        kernel = self.cpu_experts.kernel
        if kernel is None:
            raise NativeError(f"{self.name or 'streamed_experts'}: weights are not loaded")
        o = self.options
        stats: dict = {}
        gate, up, down = self._upload or (kernel.gate, kernel.up, kernel.down)
        out = stream_moe(hidden_states.detach(), top_k_index.detach(), top_k_weights.detach(),
                         gate, up, down, device=hidden_states.device,
                         chunk_bytes=o.chunk_mb << 20, backend=o.backend, name=self.name or "streamed_experts",
                         register_host=o.register_host, gather_threads=o.gather_threads,
                         owner=self._host_keys, stats=stats)
        if self._host_keys and self._host_finalizer is None:
            # unregister when the operator goes away (not at interpreter exit: nothing to gain there)
            self._host_finalizer = weakref.finalize(self, _release_quietly, self._host_keys)
            self._host_finalizer.atexit = False
        self.last_upload_mode, self.last_upload = stats.get("mode"), stats
        return out

    def release_host_memory(self) -> int:
        """Unregister this operator's expert weights from CUDA (pages no other operator's tensors
        share); the next stream call registers them again. Returns the bytes unregistered."""
        return _HOST.release(self._host_keys) if self._host_keys else 0

    # The generation engine prefills in chunks of this many tokens when the model has this operator
    # (each chunk streams every layer's experts again; the default 512 would move them 4x as often).
    prefill_chunk_tokens = PREFILL_CHUNK

    @property
    def supports_cuda_graph(self) -> bool:
        """Decode (below min_tokens) takes the CPU path, captured as cpu_experts' is."""
        return self.cpu_experts.supports_cuda_graph

    def submit(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> None:
        """Start the routed experts: the stream path queues its GPU work, the CPU path starts the pool."""
        if self._pending is not None:
            raise NativeError(f"{self.name or 'streamed_experts'}: submit() called twice without sync()")
        path = self.path(hidden_states)
        if path == "stream":
            out = self._stream(hidden_states, top_k_index, top_k_weights)
            self._pending = ("stream", out.to(hidden_states.dtype))
        else:
            self.cpu_experts.submit(hidden_states, top_k_index, top_k_weights)
            self._pending = ("cpu", None)
        self.calls[path] += 1
        self.last_path = path

    def sync(self) -> torch.Tensor:
        """The submitted call's result [T, H] on the caller's device and dtype."""
        if self._pending is None:
            raise NativeError(f"{self.name or 'streamed_experts'}: sync() without submit()")
        path, out = self._pending
        self._pending = None
        return out if path == "stream" else self.cpu_experts.sync()

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        self.submit(hidden_states, top_k_index, top_k_weights)
        return self.sync()

    def extra_repr(self) -> str:
        o = self.options
        if self._upload is not None:
            upload = "a page-locked copy of the weights"
        else:
            upload = "registered host memory" if o.register_host else "gathered into pinned buffers"
        last = f", last upload {self.last_upload_mode}" if self.last_upload_mode else ""
        return (f"op=streamed_experts, experts={self.num_experts}, hidden={self.hidden}, inter={self.inter}, "
                f"stream to the caller's GPU from {o.min_tokens} tokens (chunks of {o.chunk_mb} MB, "
                f"backend={o.backend}, upload from {upload}{last}), else native CPU")


def _release_quietly(keys: set) -> None:
    try:
        _HOST.release(keys)
    except Exception as exc:                     # a finalizer must not raise; the pages stay registered
        log.warning("streamed_experts: unregistering host memory failed (it stays page-locked): %s", exc)
