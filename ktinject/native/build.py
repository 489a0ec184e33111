"""cffi (API, out-of-line) build of the native kernels: `ktinject.native._ktkernels`.

Used three ways: by setup.py at `pip install` (through `cffi_modules`, failures tolerated),
for an in-place development build (`python -m ktinject.native.build` writes the extension
next to this file), and by the sanitizer test (`sources()` lists the C files).
"""
from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

import cffi

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
NATIVE = ROOT / "native"
MODULE = "ktinject.native._ktkernels"
SOURCES = ("cpu.c", "pool.c", "quant_scalar.c", "quant_avx2.c", "quant_avx512.c", "amx.c", "moe.c", "probe.c", "hostjob.c", "kquant.c", "linear.c", "r16.c", "i8.c")
CFLAGS = ["-O3", "-std=gnu11", "-fno-strict-aliasing", "-pthread", "-Wall", "-Wno-unused-function"]


def cdef(header: Path | None = None) -> str:
    """The cffi declarations: native/ktk.h itself (one source of truth for C and Python), less its
    include guard and #includes, which cffi's parser does not take (it knows the stdint types)."""
    text = (header or NATIVE / "ktk.h").read_text()
    return "\n".join(line for line in text.splitlines()
                     if not re.match(r"\s*#\s*(ifndef|endif|include)\b", line)
                     and not re.match(r"\s*#\s*define\s+KTK_H\s*$", line))


def sources(root: Path = ROOT) -> list[str]:
    return [str(root / "native" / s) for s in SOURCES]


def make_ffi(relative: bool = False, extra_cflags: list[str] | None = None) -> cffi.FFI:
    """The FFI builder. `relative`: source paths relative to the project root (setup.py runs there)."""
    ffi = cffi.FFI()
    ffi.cdef(cdef())
    srcs = [f"native/{s}" for s in SOURCES] if relative else sources()
    inc = ["native"] if relative else [str(NATIVE)]
    ffi.set_source(MODULE, '#include "ktk.h"', sources=srcs, include_dirs=inc,
                   extra_compile_args=CFLAGS + list(extra_cflags or []), libraries=["pthread", "m"])
    return ffi


# setup.py: cffi_modules=["ktinject/native/build.py:ffibuilder"] (cwd = project root)
ffibuilder = make_ffi(relative=True)


def build_inplace(verbose: bool = False) -> Path:
    """Compile the extension into ktinject/native/ (development build). Returns its path."""
    ffi = make_ffi(relative=False)
    tmp = ROOT / "build" / "ktk"
    tmp.mkdir(parents=True, exist_ok=True)
    so = Path(ffi.compile(tmpdir=str(tmp), verbose=verbose))
    dest = ROOT / "ktinject" / "native" / so.name
    if so.resolve() != dest.resolve():
        dest.write_bytes(so.read_bytes())
    return dest


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if sys.platform != "linux" or os.uname().machine not in ("x86_64", "AMD64"):
        log.warning("the native kernels target x86-64 Linux; building anyway")
    path = build_inplace(verbose="-v" in sys.argv)
    log.info("built %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
