"""Programmatic dependent launch between our own kernels (sm_90+).

A kernel launched as a *programmatic dependent* of the kernel before it in the stream may start while that one
still runs; it waits for it in its code (`griddepcontrol.wait`) before it reads what that kernel writes. The
int4 K split (`int4_cuda.gemv_ksplit`) issues its weights' loads before that wait, so a one-row GEMV of a small
matrix loads its weights under the tail of the kernel before: o_proj 3.30 -> 2.27 us on an H100 behind one of our
K splits (docs/gpu.md "Programmatic dependent launch"). It pays only where the kernel before lets the dependent
start early (`griddepcontrol.launch_dependents`); behind any other kernel the dependent launch costs 0.07-0.17 us.

So, with `KTINJECT_INT4_PDL` "auto" (the default) or "all", the kernels that let it start early register here
(`note_releasing`): the K split's PDL binaries launched in those modes, and the Triton kernels that then call
`gdc_launch_dependents` first thing (`rms_norm` and the MLA decode step's last kernel, each the kernel right
before a projection in a decoder layer). `after_release(stream)` says whether the node the next captured kernel
would hang on is one of them, and with "auto" the K split launches as that node's dependent. The answer comes from
the CUDA graph being captured (`cuStreamGetCaptureInfo`), so it is exact, torch's own kernels included; outside a
capture it is False (eager calls launch plainly). A wrong answer would cost time, never correctness: the dependent
always waits.

Written in the forty-second session as an opt-in mode ("chain"); measured in the forty-third on an H100 (after
`rms_norm`: q_proj 3.79 -> 3.12 us, 2048 x 2048 3.16 -> 2.64, 4096 x 4096 6.13 -> 5.35; level after a torch kernel)
and made what "auto" does. `KTINJECT_INT4_PDL=sum` (and "off") does none of it: no registration, no graph query,
the Triton kernels compiled with RELEASE off.
"""
from __future__ import annotations

import functools
import os
import threading

import torch

PDL_MODES = ("off", "sum", "auto", "all")       # `KTINJECT_INT4_PDL` (int4_cuda.pdl_mode says what each does)
_lock = threading.Lock()
_releasing: set[int] = set()           # CUfunction handles of kernels that release their dependents early


def _handle(h) -> int:
    """A CUfunction handle as an int: torch's NVRTC kernels hold a ctypes.c_void_p, Triton's an int."""
    v = getattr(h, "value", h)
    return int(v) if v else 0


def note_releasing(handle) -> None:
    """Record a kernel (its CUfunction handle: an int or a ctypes.c_void_p) that calls
    griddepcontrol.launch_dependents before it ends."""
    h = _handle(handle)
    if h and h not in _releasing:                   # (a K split registers at every launch: the lock only once)
        with _lock:
            _releasing.add(h)


def is_releasing(handle) -> bool:
    return _handle(handle) in _releasing


def after_release(stream: torch.cuda.Stream) -> bool:
    """Whether `stream` is being captured into a CUDA graph and its next kernel would follow exactly one node, a
    kernel that releases its dependents early (`note_releasing`)."""
    if not _releasing or not torch.cuda.is_available() or not torch.cuda.is_current_stream_capturing():
        return False
    from ...errors import NativeError
    from ...native.cuda_driver import driver
    try:
        tail = driver().capture_tail_functions(stream.cuda_stream)
    except NativeError:
        return False
    return bool(tail) and len(tail) == 1 and is_releasing(tail[0])


def env_mode() -> str:
    """`KTINJECT_INT4_PDL` as one of `PDL_MODES` (unset or empty: "auto"; "0": "off"), read at each call; any other
    value is refused by name, wherever it is read first (a K split's launch or one of our releasing kernels)."""
    raw = os.environ.get("KTINJECT_INT4_PDL", "auto")
    mode = raw.strip().lower() or "auto"
    mode = "off" if mode == "0" else mode
    if mode not in PDL_MODES:
        raise ValueError(f"KTINJECT_INT4_PDL={raw!r}: it takes one of {PDL_MODES}")
    return mode


def releases_wanted() -> bool:
    """`KTINJECT_INT4_PDL` "auto" (the default) or "all": our Triton kernels before projections release their
    dependents early ("sum" and "off" ask none)."""
    return env_mode() in ("auto", "all")


@functools.lru_cache(maxsize=1)
def _gdc():
    """(Triton's gdc_launch_dependents or None where it has none (Triton 3.3+), a jit function to call in a kernel:
    that one, or a no-op)."""
    import triton
    try:
        from triton.language.extra.cuda import gdc_launch_dependents
        return gdc_launch_dependents, gdc_launch_dependents
    except ImportError:
        @triton.jit
        def no_release():
            pass
        return None, no_release


def triton_gdc_launch_dependents():
    """What a Triton kernel with a `RELEASE` constexpr calls first thing: Triton's gdc_launch_dependents, or a no-op
    jit function where Triton has none (`triton_release` is then never true)."""
    return _gdc()[1]


@functools.lru_cache(maxsize=None)
def _triton_gdc(device_index: int) -> bool:
    if torch.version.hip or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    if torch.cuda.get_device_capability(device_index)[0] < 9:
        return False
    return _gdc()[0] is not None


def triton_release(device: torch.device) -> bool:
    """Whether a Triton kernel on `device` should call gdc_launch_dependents first thing (and register itself
    with `note_release_of`): sm_90+, compiled (not Triton's interpreter), a Triton that has it, and
    `releases_wanted`."""
    return device.type == "cuda" and releases_wanted() and _triton_gdc(device.index if device.index is not None
                                                                         else torch.cuda.current_device())


def note_release_of(compiled) -> None:
    """Register a launched Triton kernel (what `kernel[grid](...)` returns) that released its dependents."""
    handle = getattr(compiled, "function", None)
    if isinstance(handle, int):
        note_releasing(handle)
