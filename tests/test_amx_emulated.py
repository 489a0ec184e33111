"""The AMX grouped (prefill) path without AMX: native/amx_emulate_check.c built with
-DKTK_AMX_EMULATE, where amx.c's tile intrinsics run on a software tile unit. For every type it
checks ktk_amx_rows_bf16's tile-major rows value by value and ktk_amx_gemm (token tile pairs and a
last single tile, token counts not a multiple of 16, two C strides) against a double-precision dot,
BF16 rows read in place by the tiles bit for bit against the converted ones, then the SiLU epilogue against libm (huge, infinite and NaN inputs too) and the MoE layer's grouped
path (packing, epilogue, down projection) against the scalar path, and h packed by the gate/up epilogue
bit for bit against h written in rows and packed apart (KTINJECT_AMX_FUSE_H=0); all of it twice, the INT8 tile GEMM
taking its token tiles in pairs, then with an odd count starting with three (KTINJECT_AMX_TRIPLE=1), its passes
group by group (KTINJECT_AMX_GROUP_MAJOR=1) and the down phase's halves of the experts as two items
(KTINJECT_DOWN_SPLIT=2). On a CPU with AVX-512
F/BW/VL/DQ a second build (-DKTK_AMX_EMULATE_WRITERS) runs the real AVX-512 row writers and exp,
with the two AVX512-BF16 conversions emulated. The real tiles are checked on an AMX machine by
tests/test_native_kernels.py."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ktinject.native.build import NATIVE, SOURCES

from test_native_sanitize import sanitized_run

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


FLAGS = _cpu_flags()
WRITERS = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


@pytest.mark.skipif("avx2" not in FLAGS, reason="the token packing needs AVX2")
@pytest.mark.parametrize("writers", [False, pytest.param(True, marks=pytest.mark.skipif(
    not WRITERS <= FLAGS, reason="the real row writers need AVX-512 F/BW/VL/DQ"))], ids=["scalar-rows", "avx512-rows"])
def test_amx_tile_loop_emulated(tmp_path: Path, writers: bool):
    exe = tmp_path / "amx_emulate_check"
    srcs = [str(NATIVE / s) for s in SOURCES] + [str(NATIVE / "amx_emulate_check.c")]
    defs = ["-DKTK_AMX_EMULATE"] + (["-DKTK_AMX_EMULATE_WRITERS"] if writers else [])
    build = subprocess.run(["gcc", "-O1", "-std=gnu11", "-pthread", *defs, f"-I{NATIVE}", *srcs, "-lm", "-o", str(exe)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    # the INT8 tile GEMM's token tiles in pairs, or an odd count starting with three, its passes over all of K one
    # after the other or group by group (KTINJECT_AMX_GROUP_MAJOR); the down phase's two halves of the experts in
    # one item or two (KTINJECT_DOWN_SPLIT), of one chunk or more (KTINJECT_DOWN_CHUNKS); the I8 tokens quantized once or
    # in each expert's packing (KTINJECT_PACK_ONCE); with AVX-512, the packs written past the caches or through them
    # (KTINJECT_PACK_NT)
    for triple, major, split, once, pairs, nts in (("0", "0", "1", "0", "1", "0"), ("1", "1", "2", "1", "2", "1"),
                                                   ("0", "1", "", "", "4", "")):
        env = {**os.environ, "KTINJECT_AMX_TRIPLE": triple, "KTINJECT_AMX_GROUP_MAJOR": major, "KTINJECT_DOWN_SPLIT": split,
               "KTINJECT_PACK_ONCE": once, "KTINJECT_DOWN_CHUNKS": pairs, "KTINJECT_PACK_NT": nts}
        run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, env=env)
        lines = run.stdout.strip().splitlines()
        assert run.returncode == 0 and lines and lines[-1].startswith("OK"), (
            f"KTINJECT_AMX_TRIPLE={triple} KTINJECT_AMX_GROUP_MAJOR={major} KTINJECT_DOWN_SPLIT={split} "
            f"KTINJECT_PACK_ONCE={once} KTINJECT_DOWN_CHUNKS={pairs} KTINJECT_PACK_NT={nts}\n"
            + run.stdout[-3000:] + run.stderr[-1000:])


@pytest.mark.slow
@pytest.mark.skipif("avx2" not in FLAGS, reason="the token packing needs AVX2")
def test_amx_tile_loop_emulated_under_sanitizers(tmp_path: Path):
    """The same check built with AddressSanitizer and UBSan (the real tiles' path otherwise runs under the
    sanitizers only on an AMX machine, tests/test_native_sanitize.py), the down halves split in two items."""
    sanitized_run(tmp_path, "amx_emulate_check.c", ("-DKTK_AMX_EMULATE",), {"KTINJECT_DOWN_SPLIT": "2"})
    sanitized_run(tmp_path, "amx_emulate_check.c", ("-DKTK_AMX_EMULATE",), {"KTINJECT_DOWN_SPLIT": "2",
                                                                          "KTINJECT_DOWN_CHUNKS": "2"})
