"""The C sources under AddressSanitizer + UBSan: build native/*.c with the self-check driver
(native/sanitize_driver.c: every type, every usable ISA path, GEMV and the MoE layer at batch 1
and 48, refused bad arguments) and run it; any finding aborts the run with a report."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from ktinject.native.build import NATIVE, SOURCES

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


def sanitized_run(tmp_path: Path, driver: str, defines: tuple = (), env: dict | None = None) -> str:
    """native/*.c with the C driver `driver` built under AddressSanitizer + UBSan and run (env added to a bare
    one): asserts a clean run whose last line starts with OK, and returns its output (skips where gcc has no
    sanitizer runtime)."""
    exe = tmp_path / Path(driver).stem
    srcs = [str(NATIVE / s) for s in SOURCES] + [str(NATIVE / driver)]
    build = subprocess.run(["gcc", "-O1", "-g", "-fsanitize=address,undefined", "-fno-omit-frame-pointer",
                            "-fno-sanitize-recover=all", "-std=gnu11", "-pthread", *defines, f"-I{NATIVE}", *srcs, "-lm",
                            "-o", str(exe)], capture_output=True, text=True, timeout=300)
    if build.returncode != 0 and "asan" in build.stderr.lower():
        pytest.skip(f"sanitizer runtime unavailable: {build.stderr[-300:]}")
    assert build.returncode == 0, build.stderr[-2000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300,
                         env={"ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0", "UBSAN_OPTIONS": "print_stacktrace=1",
                              "PATH": "/usr/bin:/bin", **(env or {})})
    report = f"{env}\n" + run.stdout[-2000:] + run.stderr[-4000:]
    assert run.returncode == 0, report
    assert "runtime error" not in run.stderr and "AddressSanitizer" not in run.stderr, report
    lines = run.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("OK"), report
    return run.stdout


@pytest.mark.slow
def test_asan_ubsan_clean(tmp_path: Path):
    # the prefill down phase's halves of the experts in one item, or two (KTINJECT_DOWN_SPLIT); items of several chunks
    for split, chunks in (("", ""), ("2", ""), ("2", "2"), ("1", "4")):   # (KTINJECT_DOWN_CHUNKS)
        out = sanitized_run(tmp_path, "sanitize_driver.c", env={"KTINJECT_DOWN_SPLIT": split, "KTINJECT_DOWN_CHUNKS": chunks})
        assert out.strip().endswith("OK (0 failures)"), out[-2000:]
