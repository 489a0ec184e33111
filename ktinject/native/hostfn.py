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
they are: a decode step with CPU experts replays as one graph. The CUDA driver API is reached
through ctypes (`libcuda.so.1`, present wherever a CUDA GPU is usable); the host functions are C
functions of the native library (native/hostjob.c), so no Python runs on the driver's thread.

`HostJob` is one layer's set of pinned buffers and its C job record for one batch size; its
buffers are reused by every call with that size, which is safe because every use is ordered on
the stream. Failures inside a host function cannot raise; `raise_pending()` turns the first one
into a `NativeError` (cpu_experts calls it on each call, the generation engine at the end).
"""
from __future__ import annotations

import weakref

import torch

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


class HostJob:
    """Pinned buffers, a device output buffer and the C job record of one layer at batch T."""

    def __init__(self, kernel, T: int, k: int, device: torch.device, name: str = ""):
        lib, ffi = load()
        H = kernel.hidden
        self.T, self.k, self.hidden, self.device = T, k, H, device
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

    def submit(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> None:
        """Record: copy the inputs (device tensors of this job's shape) to the pinned buffers,
        then post the layer to the pool. x: [T, H] f32, ids: [T, k] i64, w: [T, k] f32."""
        drv = driver()
        with torch.cuda.device(self.device):        # the driver calls need this device's context
            stream = torch.cuda.current_stream(self.device).cuda_stream
            for dst, src in ((self.x, x), (self.ids, ids), (self.w, w)):
                drv.check(drv.memcpy_dtoh_async(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size(), stream),
                          "cuMemcpyDtoHAsync")
            drv.check(drv.launch_host_func(stream, self._submit, self._job_addr), "cuLaunchHostFunc")

    def sync(self) -> torch.Tensor:
        """Record: wait for the pool, copy the result to the device. Returns the device buffer
        (valid in stream order; the next call of this job overwrites it)."""
        drv = driver()
        with torch.cuda.device(self.device):
            stream = torch.cuda.current_stream(self.device).cuda_stream
            drv.check(drv.launch_host_func(stream, self._sync, self._job_addr), "cuLaunchHostFunc")
            drv.check(drv.memcpy_htod_async(self.out_dev.data_ptr(), self.out.data_ptr(), self.out.numel() * 4, stream),
                      "cuMemcpyHtoDAsync")
        return self.out_dev
