"""The kernel measurement tools in scripts/ (docs/benchmarks.md, docs/native.md: `amx_parts`,
`amx_parts layer`, `amx_peak`, `q8_parts`, `dp_peak`) build from the repository's sources as their headers
say, including the build with moe.c's per-part TSC counters (-DKTK_LAYER_TRACE), and say plainly
when there is no AMX to use; `q8_parts` runs on every usable AVX2 / AVX-512 table."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from ktinject.native.build import NATIVE, SOURCES

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _amx_usable() -> bool:
    from ktinject import native
    return bool(native.available() and "amx" in native.usable_isas())


@pytest.mark.parametrize("trace", [False, True], ids=["plain", "layer-trace"])
def test_amx_parts_builds(tmp_path: Path, trace: bool):
    exe = tmp_path / "amx_parts"
    srcs = [str(NATIVE / s) for s in SOURCES]
    defs = ["-DKTK_LAYER_TRACE"] if trace else []
    build = subprocess.run(["gcc", "-O1", "-std=gnu11", "-pthread", *defs, f"-I{NATIVE}",
                            str(SCRIPTS / "amx_parts.c"), *srcs, "-lm", "-o", str(exe)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    if _amx_usable():
        pytest.skip("AMX present: the tool's timings run on the device (scripts/device_e2e.sh amxtrace)")
    run = subprocess.run([str(exe), "layer" if trace else "2048"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "no usable AMX here" in run.stderr


def test_amx_peak_builds(tmp_path: Path):
    probe = subprocess.run(["gcc", "-mamx-tile", "-mamx-bf16", "-x", "c", "-c", "-o", "/dev/null", "-"],
                           input="int x;", capture_output=True, text=True)
    if probe.returncode:
        pytest.skip("this gcc has no AMX options")
    exe = tmp_path / "amx_peak"
    build = subprocess.run(["gcc", "-O2", "-pthread", "-mamx-tile", "-mamx-bf16", str(SCRIPTS / "amx_peak.c"), "-o", str(exe)],
                           capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stderr[-2000:]


def test_dp_peak_builds_and_runs(tmp_path: Path):
    """scripts/dp_peak.c: the AVX512-BF16 roofline and ktk_dp_gemm against it, where the CPU has AVX512-BF16;
    elsewhere it says so."""
    from ktinject import native
    exe = tmp_path / "dp_peak"
    build = subprocess.run(["gcc", "-O1", "-std=gnu11", "-pthread", f"-I{NATIVE}", str(SCRIPTS / "dp_peak.c"),
                            *[str(NATIVE / s) for s in SOURCES], "-lm", "-o", str(exe)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    run = subprocess.run([str(exe), "gemm", "256", "20", "3"], capture_output=True, text=True, timeout=120)
    lib, _ = native.load() if native.available() else (None, None)
    if lib is None or not lib.ktk_avx512bf16_usable():
        assert run.returncode == 1 and "no usable AVX512-BF16 here" in run.stderr
        return
    assert run.returncode == 0 and "ktk_dp_gemm, K 256, 20 tokens, 3 blocks:" in run.stdout, run.stderr
    bad = subprocess.run([str(exe), "gemm", "100"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "K a multiple of 32" in bad.stderr


def test_q8_parts_builds_and_runs(tmp_path: Path):
    from ktinject import native
    exe = tmp_path / "q8_parts"
    build = subprocess.run(["gcc", "-O1", "-std=gnu11", "-pthread", f"-I{NATIVE}", str(SCRIPTS / "q8_parts.c"),
                            *[str(NATIVE / s) for s in SOURCES], "-lm", "-o", str(exe)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    usable = native.usable_isas() if native.available() else []
    for isa in ("avx2", "avx512"):
        run = subprocess.run([str(exe), isa], capture_output=True, text=True, timeout=120)
        if isa in usable:
            assert run.returncode == 0 and f"{isa}: rows_u8" in run.stdout and "GMAC/s" in run.stdout, run.stderr
        else:
            assert run.returncode == 1 and "not usable on this CPU" in run.stderr
