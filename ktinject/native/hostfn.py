"""Stream-ordered CPU work: let a CUDA stream drive the native MoE layer.

A hybrid model keeps its hidden states on the GPU and its routed experts on the CPU. Handing
the states over from Python means waiting on the stream (a device-to-host copy), once per
layer, and it cannot be part of a CUDA graph. Here the stream does the handing over itself:

    copy x, ids, w  -> pinned host buffers     (memcpy nodes)
    ktk_host_submit(job)                         (host function: post the layer to the pool)
    ... shared experts, on the GPU, meanwhile ...
    ktk_host_sync(job)                           (host function: wait for the pool)
    copy out        -> a device buffer           (memcpy node)

Python only records these operations, so it never blocks, and a CUDA graph captures them as
they are: a decode step with CPU experts replays as one graph.

Two ways to signal the CPU (`signal_mode()`, env `KTINJECT_HOSTJOB_SIGNAL=hostfn|bell|auto`):

* **bell** (the default, `auto`, where its self-test passes: `bells_usable`): no host functions.
  The stream sets a page-locked word after the inputs; the native dispatcher thread, polling the
  armed jobs' words, runs the layer and sets a second word, which the stream waits for
  (`cuStreamWaitValue32`) and clears. A doorbell costs a few bus reads where a host function
  costs a round trip through the driver's callback thread (an interrupt and a thread wake-up,
  each way). With bells, jobs of at most 16 tokens (decode) also hand over without copies
  (`zerocopy_usable`, kernels/handoff_triton.py): one kernel writes x, ids and w into the pinned
  buffers and rings the bell, one kernel reads the result back, converts it, adds the shared
  experts and clears `done`: three stream operations per layer instead of ten
  (`KTINJECT_HOSTJOB_ZEROCOPY=0`: the copies, for A/B runs). Measured on the lent H200 + 16-core
  Xeon, V2-Lite decode alternating (docs/benchmarks.md, eighth session): bells 82.0 and 85.7
  tok/s, host functions 80.8 and 74.0; then bells with zero-copy a median of 94.4 tok/s over 5
  runs, with copies 84.4.
* **hostfn** (`KTINJECT_HOSTJOB_SIGNAL=hostfn`, and wherever bells fail their self-test):
  `cuLaunchHostFunc` nodes call `ktk_host_submit` / `ktk_host_sync` on the driver's thread (the
  diagram above).

The CUDA driver API is reached through ctypes (`libcuda.so.1`, present wherever a CUDA GPU is
usable); the host functions are C functions of the native library (native/hostjob.c), so no
Python runs on the driver's thread.

`HostJob` is one layer's set of pinned buffers and its C job record for one batch size; its
buffers are reused by every call with that size, which is safe because every use is ordered on
the stream. Failures inside a host function cannot raise; `raise_pending()` turns the first one
into a `NativeError` (cpu_experts calls it on each call, the generation engine at the end).
"""
from __future__ import annotations

import itertools
import os
import time
import weakref
from typing import Optional

import torch

from ..boundaries import cuda_index
from ..errors import NativeError
from . import load


def driver():
    """The bound CUDA driver (ktinject.native.cuda_driver), or a NativeError."""
    from .cuda_driver import driver as _driver
    return _driver()


def available() -> bool:
    try:
        driver()
        load()
        return True
    except NativeError:
        return False


_NAMES: dict[int, str] = {}          # address of a HostJob's C record -> the layer it belongs to


def raise_pending(where: str = "") -> None:
    """Raise the first failure of a host-driven job since the last check (and clear it), naming
    the layer whose job failed (`where`, the caller, when the job is not known)."""
    lib, ffi = load()
    job = ffi.new("void **")
    rc = int(lib.ktk_host_error(1, job))
    if rc:
        from . import _ERRORS
        name = _NAMES.get(int(ffi.cast("uintptr_t", job[0])), "") or where or "cpu_experts"
        raise NativeError(f"{name}: a stream-ordered MoE job failed on the CPU: "
                          f"{_ERRORS.get(rc, f'error {rc}')} (its output was zeroed)")


SIGNALS = ("hostfn", "bell", "auto")
_SERIALS = itertools.count(1)
_BELLS: dict[int, Optional[str]] = {}    # CUDA device index -> None (doorbells work there) or why not


def _skip_level() -> int:
    """KTINJECT_HOSTJOB_SKIP (measurement, scripts/profile_decode.py): 1 = jobs return zeros at
    once; 2 = nothing is recorded at all (the step is the model's GPU work alone)."""
    v = os.environ.get("KTINJECT_HOSTJOB_SKIP", "0").strip()
    return int(v) if v in ("0", "1", "2") else 0


def bells_usable(device: torch.device) -> Optional[str]:
    """None when doorbells work on `device` (checked once per device: the stream operations on a
    page-locked word run, and a CUDA graph captures and replays them), else why not."""
    idx = cuda_index(device)
    if idx in _BELLS:
        return _BELLS[idx]
    from .cuda_driver import WAIT_EQ
    why = None
    try:
        drv = driver()
        word = torch.zeros(16, dtype=torch.int32, pin_memory=True)
        addr = drv.device_pointer(word.data_ptr())

        def ops(stream):
            drv.check(drv.write_value32(stream, addr, 1, 0), "cuStreamWriteValue32")
            drv.check(drv.wait_value32(stream, addr, 1, WAIT_EQ), "cuStreamWaitValue32")
            drv.check(drv.write_value32(stream, addr + 4, 7, 0), "cuStreamWriteValue32")
            drv.check(drv.write_value32(stream, addr, 0, 0), "cuStreamWriteValue32")

        def settle(stream, what):
            # the stream waits on host memory: never block on it. Past the deadline, release the
            # wait from the CPU (the word it waits for) and report the failure.
            deadline = time.monotonic() + 5.0
            while not stream.query():
                if time.monotonic() > deadline:
                    word[0] = 1
                    stream.synchronize()
                    raise NativeError(f"{what}: the stream's wait on host memory never completed")
                time.sleep(1e-4)
        with torch.cuda.device(idx):
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                ops(side.cuda_stream)
            settle(side, "stream operations")
            if word[1].item() != 7:
                raise NativeError("the stream's write did not reach host memory")
            word[1] = 0
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                ops(torch.cuda.current_stream().cuda_stream)
            with torch.cuda.stream(side):
                graph.replay()
                graph.replay()
            settle(side, "a captured graph")
            if word[1].item() != 7 or word[0].item() != 0:
                raise NativeError("a captured graph's writes did not reach host memory")
    except Exception as exc:                       # any failure: use host functions instead
        why = str(exc) or type(exc).__name__
    _BELLS[idx] = why
    return why


_ZEROCOPY: dict[int, Optional[str]] = {}   # CUDA device index -> None (zero-copy hand-over works) or why not


def zerocopy_max_tokens() -> int:
    """Jobs of at most this many tokens hand over through pinned memory directly (bell signalling;
    KTINJECT_HOSTJOB_ZEROCOPY=0 turns it off: copies, for A/B measurements)."""
    from ..operators.kernels.handoff_triton import MAX_TOKENS
    return 0 if os.environ.get("KTINJECT_HOSTJOB_ZEROCOPY", "1").strip() == "0" else MAX_TOKENS


def zerocopy_usable(device: torch.device) -> Optional[str]:
    """None when the zero-copy hand-over kernels (kernels/handoff_triton.py) work on `device`
    (checked once per device, outside any capture: they compile, and their results and flags
    reach host memory exactly), else why not."""
    idx = cuda_index(device)
    if idx in _ZEROCOPY:
        return _ZEROCOPY[idx]
    if torch.cuda.is_current_stream_capturing():
        return "not checked yet (inside a CUDA graph capture)"
    from ..operators.kernels import triton_available
    if not triton_available():
        _ZEROCOPY[idx] = "Triton is not installed"
        return _ZEROCOPY[idx]
    from ..operators.kernels.handoff_triton import combine, handoff
    why = None
    previous = torch.cuda.get_sync_debug_mode()
    try:
        torch.cuda.set_sync_debug_mode(0)          # the check reads its results back (engine warm-ups forbid that)
        dev = torch.device("cuda", idx)
        g = torch.Generator(device="cpu").manual_seed(7)
        h = torch.randn(3, 1000, generator=g).to(torch.bfloat16)
        ids = torch.randint(0, 64, (3, 6), generator=g, dtype=torch.int32)
        w = torch.rand(3, 6, generator=g).to(torch.float16)
        x_o = torch.zeros(3, 1000, pin_memory=True)
        ids_o = torch.zeros(3, 6, dtype=torch.int64, pin_memory=True)
        w_o = torch.zeros(3, 6, pin_memory=True)
        flags = torch.zeros(32, dtype=torch.int32, pin_memory=True)
        out = torch.randn(3, 1000, generator=g).pin_memory()
        add = torch.randn(3, 1000, generator=g).to(torch.bfloat16)
        with torch.cuda.device(idx):
            handoff(h.to(dev), ids.to(dev), w.to(dev), x_o, ids_o, w_o, flags)
            torch.cuda.synchronize(idx)
            if not (torch.equal(x_o, h.float()) and torch.equal(ids_o, ids.long()) and torch.equal(w_o, w.float())
                    and int(flags[0]) == 1):
                raise NativeError("the hand-over kernel's writes did not reach host memory exactly")
            flags[16] = 1
            res = combine(out, flags[16:], torch.bfloat16, dev, add.to(dev))
            torch.cuda.synchronize(idx)
            if not torch.equal(res.cpu(), out.to(torch.bfloat16) + add) or int(flags[16]) != 0:
                raise NativeError("the combine kernel did not read host memory exactly")
    except Exception as exc:                       # any failure: copies instead
        why = str(exc) or type(exc).__name__
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    _ZEROCOPY[idx] = why
    return why


def signal_mode(device: torch.device) -> str:
    """"bell" or "hostfn" for jobs on `device` (KTINJECT_HOSTJOB_SIGNAL, default auto: doorbells
    where their self-test passes)."""
    want = os.environ.get("KTINJECT_HOSTJOB_SIGNAL", "auto").strip().lower() or "auto"
    if want not in SIGNALS:
        raise NativeError(f"KTINJECT_HOSTJOB_SIGNAL={want!r} is not one of {', '.join(SIGNALS)}")
    if want == "hostfn":
        return "hostfn"
    idx = cuda_index(device)
    if idx not in _BELLS and torch.cuda.is_current_stream_capturing():
        return "hostfn"                    # no self-test inside someone's capture (it captures too)
    why = bells_usable(device)
    if why is None:
        return "bell"
    if want == "bell":
        raise NativeError(f"KTINJECT_HOSTJOB_SIGNAL=bell, but doorbells do not work on {device}: {why}")
    return "hostfn"


def handover_of(model) -> str:
    """How `model`'s stream-ordered jobs made so far hand over: "bell+zerocopy", "bell", "hostfn"
    (several joined by ","), or "" when none was made (Python-driven, or no CUDA)."""
    kinds = {j.signal + ("+zerocopy" if j.zerocopy else "") for m in model.modules()
             for j in getattr(m, "_jobs", {}).values() if isinstance(j, HostJob)}
    return ",".join(sorted(kinds))


class HostJob:
    """Pinned buffers, a device output buffer and the C job record of one layer at batch T."""

    def __init__(self, kernel, T: int, k: int, device: torch.device, name: str = ""):
        lib, ffi = load()
        H = kernel.hidden
        self.T, self.k, self.hidden, self.device = T, k, H, device
        self.serial = next(_SERIALS)              # tells a new job from an old one at the same address
        self._index = cuda_index(device) if device.type == "cuda" else None
        self.x = torch.empty(T, H, dtype=torch.float32, pin_memory=True)
        self.ids = torch.empty(T, k, dtype=torch.int64, pin_memory=True)
        self.w = torch.empty(T, k, dtype=torch.float32, pin_memory=True)
        self.out = torch.zeros(T, H, dtype=torch.float32, pin_memory=True)
        self.out_dev = torch.empty(T, H, dtype=torch.float32, device=device)
        job = ffi.new("ktk_host_job *")
        job.moe, job.pool, job.isa = kernel._ptr, kernel.pool.ptr, kernel.isa
        job.T, job.k, job.hidden = T, k, H
        job.x = ffi.cast("float *", self.x.data_ptr())
        job.ids = ffi.cast("int64_t *", self.ids.data_ptr())
        job.w = ffi.cast("float *", self.w.data_ptr())
        job.out = ffi.cast("float *", self.out.data_ptr())
        self.job = job
        self._kernel = kernel                     # the C layer must outlive the job record
        self._job_addr = int(ffi.cast("uintptr_t", job))
        if name:
            _NAMES[self._job_addr] = name
            weakref.finalize(self, _NAMES.pop, self._job_addr, None)
        self._submit = int(ffi.cast("uintptr_t", ffi.addressof(lib, "ktk_host_submit")))
        self._sync = int(ffi.cast("uintptr_t", ffi.addressof(lib, "ktk_host_sync")))
        self.skip = _skip_level()
        self.signal = signal_mode(device) if device.type == "cuda" else "hostfn"
        if self.signal == "bell":
            # flags[0]: go (set by the stream, cleared by the dispatcher); flags[16]: done (the reverse)
            self.flags = torch.zeros(32, dtype=torch.int32, pin_memory=True)
            rc = int(lib.ktk_bell_add(job, ffi.cast("uint32_t *", self.flags.data_ptr())))
            if rc:
                from . import _ERRORS
                raise NativeError(f"{name or 'cpu_experts'}: arming the job's doorbell failed: "
                                  f"{_ERRORS.get(rc, f'error {rc}')}")
            weakref.finalize(self, lib.ktk_bell_remove, job)    # runs before the buffers go
            with torch.cuda.device(device):
                self._go = driver().device_pointer(self.flags.data_ptr())
            self._done = self._go + 64
        self.zerocopy = (self.signal == "bell" and self.skip != 2 and zerocopy_usable(device) is None
                         and T <= zerocopy_max_tokens())

    def submit(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> None:
        """Record: hand the inputs (device tensors of this job's shape, any float / integer dtype)
        to the pinned buffers, then post the layer to the pool. x: [T, H], ids: [T, k], w: [T, k]."""
        if self.skip == 2:
            return
        drv = driver()
        with torch.cuda.device(self.device):        # the driver calls need this device's context
            if self.zerocopy:                       # one kernel: the inputs, then the doorbell
                from ..operators.kernels.handoff_triton import FLOAT_DTYPES, handoff
                x, w = (t if t.dtype in FLOAT_DTYPES else t.to(torch.float32) for t in (x, w))
                x, ids, w = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, ids, w))
                handoff(x, ids, w, self.x, self.ids, self.w, self.flags)
                return
            x = x.to(torch.float32).contiguous()
            ids = ids.to(torch.int64).contiguous()
            w = w.to(torch.float32).contiguous()
            drv.bind(self._index)
            stream = torch.cuda.current_stream(self.device).cuda_stream
            for dst, src in ((self.x, x), (self.ids, ids), (self.w, w)):
                drv.check(drv.memcpy_dtoh_async(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size(), stream),
                          "cuMemcpyDtoHAsync")
            if self.signal == "bell":
                drv.check(drv.write_value32(stream, self._go, 1, 0), "cuStreamWriteValue32")
            else:
                drv.check(drv.launch_host_func(stream, self._submit, self._job_addr), "cuLaunchHostFunc")

    def sync(self, dtype: torch.dtype = torch.float32, add: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Record: wait for the pool, bring the result to the device. Returns a new tensor (valid
        in stream order): the layer's output [T, H] in `dtype`, plus `add` when given."""
        if self.skip == 2:
            out = self.out_dev.to(dtype) if dtype != torch.float32 else self.out_dev.clone()
            return out if add is None else out + add
        from .cuda_driver import WAIT_EQ
        drv = driver()
        with torch.cuda.device(self.device):
            drv.bind(self._index)
            stream = torch.cuda.current_stream(self.device).cuda_stream
            if self.signal == "bell":
                drv.check(drv.wait_value32(stream, self._done, 1, WAIT_EQ), "cuStreamWaitValue32")
                if self.zerocopy:                   # one kernel: read, convert, add, clear `done`
                    from ..operators.kernels.handoff_triton import combine
                    from ..operators.kernels.handoff_triton import FLOAT_DTYPES
                    kind = dtype if dtype in FLOAT_DTYPES else torch.float32
                    fits = add is None or (add.dtype == kind == dtype and add.shape == self.out.shape
                                           and add.stride(1) == 1 and add.device == self.out_dev.device)
                    out = combine(self.out, self.flags[16:], kind, self.out_dev.device, add if fits else None)
                    out = out if kind == dtype else out.to(dtype)
                    return out if fits else out + add
                drv.check(drv.write_value32(stream, self._done, 0, 0), "cuStreamWriteValue32")
            else:
                drv.check(drv.launch_host_func(stream, self._sync, self._job_addr), "cuLaunchHostFunc")
            drv.check(drv.memcpy_htod_async(self.out_dev.data_ptr(), self.out.data_ptr(), self.out.numel() * 4, stream),
                      "cuMemcpyHtoDAsync")
            # a fresh tensor: the job's buffer is overwritten by the layer's next call
            out = self.out_dev.to(dtype) if dtype != torch.float32 else self.out_dev.clone()
        return out if add is None else out + add
