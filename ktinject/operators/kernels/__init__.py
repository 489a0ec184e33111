"""GPU kernels (Triton) and the pure-torch packing / reference math behind the GPU operators.

Triton is imported lazily by the kernel modules' launchers, so this package imports on any
machine; `int4_pack` is plain torch and runs everywhere.
"""
import functools
import importlib.util


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """Triton is installed (its kernels then compile on first use)."""
    return importlib.util.find_spec("triton") is not None
