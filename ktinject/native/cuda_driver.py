"""The few CUDA driver API calls ktinject makes itself, bound once through ctypes on
`libcuda.so.1` (present wherever a CUDA GPU is usable; no build step, no extra dependency).

* host functions and async copies on a stream (`ktinject.native.hostfn`: stream-ordered CPU
  experts, capturable in CUDA graphs);
* stream memory operations on page-locked words (`hostfn`'s doorbells: the same, without
  host functions);
* host memory registration (`streamed_experts`: DMA straight from a memory-mapped GGUF file);
* programmatic dependent launches (`cuLaunchKernelEx`) and the kernel a stream being captured
  would hang its next node on (`capture_tail_functions`; `operators/kernels/pdl.py`).

Driver calls, unlike the runtime's (`torch.cuda.cudart()`), leave no pending error behind for
torch's next kernel-launch check to raise. Each wrapper returns None or an error string, or
raises `NativeError` through `check`.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Optional

from ..errors import NativeError

READ_ONLY, PORTABLE = 0x08, 0x01          # CU_MEMHOSTREGISTER_READ_ONLY | _PORTABLE
WAIT_EQ = 0x1                             # CU_STREAM_WAIT_VALUE_EQ
PROGRAMMATIC_STREAM_SERIALIZATION = 6     # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
CAPTURE_ACTIVE = 1                        # CU_STREAM_CAPTURE_STATUS_ACTIVE
NODE_KERNEL = 0                           # CU_GRAPH_NODE_TYPE_KERNEL
_vp, _P = ctypes.c_void_p, ctypes.POINTER
# cuStreamGetCaptureInfo_v3(stream, status*, id*, graph*, const CUgraphNode **deps, const CUgraphEdgeData **edges,
# size_t *n); _v2 the same without edges; cuGraphNodeGetType(node, CUgraphNodeType*); cuGraphKernelNodeGetParams
# (_v2)(node, CUDA_KERNEL_NODE_PARAMS*)
CAPTURE_INFO_V3_ARGS = [_vp, _P(ctypes.c_int), _P(ctypes.c_uint64), _P(_vp), _P(_P(_vp)), _P(_vp), _P(ctypes.c_size_t)]
CAPTURE_INFO_V2_ARGS = [_vp, _P(ctypes.c_int), _P(ctypes.c_uint64), _P(_vp), _P(_P(_vp)), _P(ctypes.c_size_t)]
NODE_TYPE_ARGS = [_vp, _P(ctypes.c_int)]
KERNEL_NODE_PARAMS_ARGS = [_vp, _vp]


class LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, padding to 8 bytes, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class LaunchConfig(ctypes.Structure):     # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(LaunchAttribute)), ("num_attrs", ctypes.c_uint)]

_lock = threading.Lock()
_driver: Optional["CudaDriver"] = None
_error: Optional[str] = None


class CudaDriver:
    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        self.lib = lib
        self._primary: dict[int, ctypes.c_void_p] = {}      # device -> its primary context (bind)
        P, vp = ctypes.POINTER, ctypes.c_void_p
        self.launch_host_func = lib.cuLaunchHostFunc
        self.launch_host_func.argtypes = [vp, vp, vp]
        self.memcpy_dtoh_async = lib.cuMemcpyDtoHAsync_v2
        self.memcpy_dtoh_async.argtypes = [vp, ctypes.c_uint64, ctypes.c_size_t, vp]
        self.memcpy_htod_async = lib.cuMemcpyHtoDAsync_v2
        self.memcpy_htod_async.argtypes = [ctypes.c_uint64, vp, ctypes.c_size_t, vp]
        self._register = getattr(lib, "cuMemHostRegister_v2", None) or lib.cuMemHostRegister
        self._register.argtypes = [vp, ctypes.c_size_t, ctypes.c_uint]
        lib.cuMemHostUnregister.argtypes = [vp]
        # stream memory operations (doorbells, hostfn.py): write / wait on a 32-bit word the GPU
        # reaches in page-locked host memory
        self.write_value32 = getattr(lib, "cuStreamWriteValue32_v2", None) or lib.cuStreamWriteValue32
        self.write_value32.argtypes = [vp, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        self.wait_value32 = getattr(lib, "cuStreamWaitValue32_v2", None) or lib.cuStreamWaitValue32
        self.wait_value32.argtypes = [vp, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        self._device_pointer = getattr(lib, "cuMemHostGetDevicePointer_v2", None) or lib.cuMemHostGetDevicePointer
        self._device_pointer.argtypes = [P(ctypes.c_uint64), vp, ctypes.c_uint]
        self._launch_ex = getattr(lib, "cuLaunchKernelEx", None)             # (CUDA 12.0+ drivers)
        if self._launch_ex is not None:
            self._launch_ex.argtypes = [P(LaunchConfig), vp, P(vp), vp]
            self._launch_ex.restype = ctypes.c_int
        # what a stream being captured would hang its next node on (`capture_tail_functions`): CUDA 12.3+
        # drivers have the _v3 form (with edge data), older ones _v2
        self._capture_info_v3 = getattr(lib, "cuStreamGetCaptureInfo_v3", None)
        self._capture_info_v2 = getattr(lib, "cuStreamGetCaptureInfo_v2", None)
        self._node_type = getattr(lib, "cuGraphNodeGetType", None)
        self._kernel_node_params = (getattr(lib, "cuGraphKernelNodeGetParams_v2", None)
                                    or getattr(lib, "cuGraphKernelNodeGetParams", None))
        for f, args in ((self._capture_info_v3, CAPTURE_INFO_V3_ARGS), (self._capture_info_v2, CAPTURE_INFO_V2_ARGS),
                        (self._node_type, NODE_TYPE_ARGS), (self._kernel_node_params, KERNEL_NODE_PARAMS_ARGS)):
            if f is not None:
                f.argtypes, f.restype = args, ctypes.c_int
        lib.cuGetErrorString.argtypes = [ctypes.c_int, P(ctypes.c_char_p)]
        lib.cuCtxGetCurrent.argtypes = [P(vp)]
        for f in (self.launch_host_func, self.memcpy_dtoh_async, self.memcpy_htod_async, self._register,
                  lib.cuMemHostUnregister, lib.cuGetErrorString, lib.cuCtxGetCurrent, self.write_value32,
                  self.wait_value32, self._device_pointer):
            f.restype = ctypes.c_int
        lib.cuInit(0)                                    # a no-op once torch initialized CUDA

    def error(self, rc: int) -> str:
        msg = ctypes.c_char_p()
        self.lib.cuGetErrorString(rc, ctypes.byref(msg))
        return f"{(msg.value or b'?').decode(errors='replace')} (CUresult {rc})"

    def check(self, rc: int, what: str) -> None:
        if rc:
            raise NativeError(f"CUDA driver call {what} failed: {self.error(rc)}")

    def ensure_context(self, device: Optional[int]) -> Optional[str]:
        """Make sure a context is current on this thread (the device's primary one, as the runtime
        binds it); None or why not."""
        ctx = ctypes.c_void_p()
        if self.lib.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and ctx.value:
            return None
        if device is None:
            return "no current CUDA context"
        try:
            self.bind(int(device))
        except NativeError as exc:
            return f"no current CUDA context ({exc})"
        return None

    def bind(self, device: int) -> None:
        """Make `device`'s primary context current on this thread for the driver calls that follow
        (the runtime's device switch alone need not rebind the driver's context; stream handle 0
        means the legacy stream of whatever context is current)."""
        ctx = self._primary.get(device)
        if ctx is None:
            dev, ctx = ctypes.c_int(), ctypes.c_void_p()
            self.check(self.lib.cuDeviceGet(ctypes.byref(dev), int(device)), "cuDeviceGet")
            self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            self._primary[device] = ctx
        self.check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def register(self, ptr: int, nbytes: int, device: Optional[int] = None) -> Optional[str]:
        """Page-lock host memory for DMA, read-only (GGUF maps are); None or the error."""
        err = self.ensure_context(device)
        if err:
            return err
        rc = self._register(ctypes.c_void_p(ptr), nbytes, READ_ONLY | PORTABLE)
        return None if rc == 0 else self.error(rc)

    def device_pointer(self, host_ptr: int) -> int:
        """The device address of page-locked host memory (the same number under unified addressing)."""
        out = ctypes.c_uint64()
        self.check(self._device_pointer(ctypes.byref(out), ctypes.c_void_p(host_ptr), 0), "cuMemHostGetDevicePointer")
        return out.value

    def launch_programmatic(self, func, grid: tuple, block: tuple, shared_mem: int, stream: int, params) -> None:
        """Launch the kernel `func` (a CUfunction) on `stream` (a CUstream handle) as a programmatic dependent of
        the kernel before it (sm_90+: the two may overlap; the kernel itself waits on that one with
        griddepcontrol.wait before it touches what that one writes). `params`: the kernel's argument array
        (void **). Raises NativeError where the driver refuses."""
        if self._launch_ex is None:
            raise NativeError("this CUDA driver has no cuLaunchKernelEx (programmatic dependent launch)")
        attr = LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION)
        attr.value[0] = 1                                # programmaticStreamSerializationAllowed
        cfg = LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), shared_mem,
                           ctypes.c_void_p(stream), ctypes.pointer(attr), 1)
        self.check(self._launch_ex(ctypes.byref(cfg), func, params, None), "cuLaunchKernelEx")

    def capture_tail_functions(self, stream: int) -> Optional[list]:
        """The CUfunction handles (ints) of the nodes that the next node captured on `stream` (a CUstream handle)
        would depend on, 0 for a node that is not a kernel; None where `stream` is not being captured or the driver
        cannot say. Outside a capture nothing is recorded, so there is no kernel before to name."""
        status, n = ctypes.c_int(), ctypes.c_size_t()
        deps = ctypes.POINTER(ctypes.c_void_p)()
        if self._capture_info_v3 is not None:
            edges = ctypes.c_void_p()
            rc = self._capture_info_v3(ctypes.c_void_p(stream), ctypes.byref(status), None, None, ctypes.byref(deps),
                                       ctypes.byref(edges), ctypes.byref(n))
        elif self._capture_info_v2 is not None:
            rc = self._capture_info_v2(ctypes.c_void_p(stream), ctypes.byref(status), None, None, ctypes.byref(deps),
                                       ctypes.byref(n))
        else:
            return None
        if rc or status.value != CAPTURE_ACTIVE or self._node_type is None or self._kernel_node_params is None:
            return None
        out = []
        for i in range(n.value):
            kind, params = ctypes.c_int(), (ctypes.c_void_p * 16)()   # CUDA_KERNEL_NODE_PARAMS(_v2): func first
            node = ctypes.c_void_p(deps[i])
            if self._node_type(node, ctypes.byref(kind)) or kind.value != NODE_KERNEL or \
                    self._kernel_node_params(node, ctypes.cast(params, ctypes.c_void_p)):
                out.append(0)
            else:
                out.append(params[0] or 0)
        return out

    def unregister(self, ptr: int) -> Optional[str]:
        rc = self.lib.cuMemHostUnregister(ctypes.c_void_p(ptr))
        return None if rc == 0 else self.error(rc)


def driver() -> CudaDriver:
    """The bound driver, or a NativeError saying why it cannot be used."""
    global _driver, _error
    with _lock:
        if _driver is None and _error is None:
            import torch
            if not torch.cuda.is_available():
                _error = "CUDA is not available"
            else:
                try:
                    _driver = CudaDriver()
                except (OSError, AttributeError) as exc:
                    _error = f"the CUDA driver library cannot be used through ctypes ({exc})"
    if _driver is None:
        raise NativeError(f"CUDA driver API unavailable: {_error}")
    return _driver
