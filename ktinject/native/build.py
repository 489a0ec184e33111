"""cffi (API, out-of-line) build of the native kernels: `ktinject.native._ktkernels`.

Used three ways: by setup.py at `pip install` (through `cffi_modules`, failures tolerated),
for an in-place development build (`python -m ktinject.native.build` writes the extension
next to this file), and by the sanitizer test (`sources()` lists the C files).
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import cffi

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
NATIVE = ROOT / "native"
MODULE = "ktinject.native._ktkernels"
SOURCES = ("cpu.c", "pool.c", "quant_scalar.c", "quant_avx2.c", "quant_avx512.c", "amx.c", "moe.c", "probe.c", "hostjob.c", "kquant.c")
CFLAGS = ["-O3", "-std=gnu11", "-fno-strict-aliasing", "-pthread", "-Wall", "-Wno-unused-function"]

CDEF = """
int ktk_cpu_features(void);
int ktk_compiled_isas(void);
int ktk_best_isa(void);
int ktk_amx_permission(void);
typedef struct ktk_pool ktk_pool;
ktk_pool *ktk_pool_new(int nthreads, int pin);
void ktk_pool_free(ktk_pool *p);
int ktk_pool_threads(const ktk_pool *p);
int ktk_pool_numa_nodes(const ktk_pool *p);
int ktk_type_block(int type);
int ktk_type_size(int type);
int64_t ktk_row_bytes(int type, int64_t n);
int ktk_dequant_row(int type, const uint8_t *src, float *dst, int64_t n);
int ktk_dequant_row_isa(int isa, int type, const uint8_t *src, float *dst, int64_t n);
int ktk_gemv(int isa, int type, const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t n,
             const float *x, float *y);
typedef struct {
    int gate_type, up_type, down_type;
    int64_t n_experts, hidden, inter;
    const uint8_t *gate;
    const uint8_t *up;
    const uint8_t *down;
    int64_t gate_rb, up_rb, down_rb;
    int64_t gate_es, up_es, down_es;
} ktk_moe_desc;
typedef struct ktk_moe ktk_moe;
ktk_moe *ktk_moe_new(const ktk_moe_desc *d, int *err);
void ktk_moe_free(ktk_moe *m);
int ktk_moe_submit(ktk_moe *m, ktk_pool *p, int isa, int64_t T, int64_t k, const float *x,
                   const int64_t *ids, const float *w, float *out);
int ktk_moe_sync(ktk_moe *m, ktk_pool *p);
int ktk_moe_forward(ktk_moe *m, ktk_pool *p, int isa, int64_t T, int64_t k, const float *x,
                    const int64_t *ids, const float *w, float *out);
double ktk_probe_read_gbps(ktk_pool *p, int isa, size_t bytes, int reps);
typedef struct {
    ktk_moe *moe;
    ktk_pool *pool;
    int isa;
    int64_t T, k, hidden;
    const float *x;
    const int64_t *ids;
    const float *w;
    float *out;
    int status;
} ktk_host_job;
void ktk_host_submit(void *job);
void ktk_host_sync(void *job);
int ktk_host_error(int clear, void **job);
int ktk_bell_add(ktk_host_job *job, uint32_t *flags);
int ktk_bell_remove(ktk_host_job *job);
int ktk_bell_poll(void);
long ktk_bell_rings(void);
int ktk_bell_thread(void);
int ktk_pool_trace(ktk_pool *p, double *out, int n);
int ktk_pool_pin_outside(ktk_pool *p);
int ktk_quantize_k(int type, const float *x, int64_t n, uint8_t *out);
int ktk_quantize_legacy(int type, const float *x, int64_t n, uint8_t *out);
"""


def sources(root: Path = ROOT) -> list[str]:
    return [str(root / "native" / s) for s in SOURCES]


def make_ffi(relative: bool = False, extra_cflags: list[str] | None = None) -> cffi.FFI:
    """The FFI builder. `relative`: source paths relative to the project root (setup.py runs there)."""
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
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
