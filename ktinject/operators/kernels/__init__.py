"""GPU kernels (Triton) and the pure-torch packing / reference math behind the GPU operators.

Triton is imported lazily by the kernel modules' launchers, so this package imports on any
machine; `int4_pack` is plain torch and runs everywhere.
"""
import functools
import importlib.util

import torch


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """Triton is installed (its kernels then compile on first use)."""
    return importlib.util.find_spec("triton") is not None


def tl_dtype(dtype: torch.dtype):
    """The Triton element type of a bf16 / f16 / f32 torch dtype (for kernels' constexpr dtypes)."""
    import triton.language as tl
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]
