"""GPU kernels (Triton) and the pure-torch packing / reference math behind the GPU operators.

Triton is imported lazily by the kernel modules' launchers, so this package imports on any
machine; `int4_pack` is plain torch and runs everywhere.
"""
