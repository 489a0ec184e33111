"""`native.run_chain` (layers posted back to back from C, the bench's default caller) and
`native.Probe` (a bandwidth probe that keeps its buffer between passes)."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from ktinject import native
from ktinject.errors import NativeError
from ktinject.testing import random_routing

from test_native_util import moe_case, ref_moe, rel_err

pytestmark = pytest.mark.skipif(not native.available(), reason="native extension not built")


@pytest.fixture(scope="module")
def layers():
    pool = native.Pool(2)
    cases = [moe_case(QT.Q4_K, QT.Q5_0, E=8, H=256, I=256, seed=s) for s in (0, 10, 20)]
    return pool, [native.MoEKernel(*mats, pool=pool) for mats, _ in cases], [dense for _, dense in cases]


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("calls", [1, 2, 5, 7])
def test_chain_gives_the_last_calls_layer(layers, T, calls):
    """Call i runs layer i % 3 on routing i % 2: the output is that of the last call, bit for bit
    what the same layer gives from Python, and close to the dense reference."""
    pool, kernels, dense = layers
    x = torch.randn(T, 256, generator=torch.Generator().manual_seed(T))
    routes = [random_routing(T, 8, 2, seed) for seed in (1, 2)]
    sec, out = native.run_chain(kernels, x, routes, calls)
    assert sec > 0
    last = calls - 1
    ids, w = routes[last % 2]
    assert torch.equal(out, kernels[last % 3](x, ids, w))
    assert rel_err(out, ref_moe(x, ids, w, *dense[last % 3])) < 0.02


def test_chain_checks_its_input(layers):
    pool, kernels, _ = layers
    x = torch.randn(1, 256)
    ids, w = random_routing(1, 8, 2, 0)
    bad = ids.clone()
    bad[0, 1] = 8
    with pytest.raises(NativeError, match=r"expert id 8 out of range \[0, 8\)"):
        native.run_chain(kernels, x, [(ids, w), (bad, w)], 1)     # checked before any layer runs
    with pytest.raises(NativeError, match="calls must be a positive integer"):
        native.run_chain(kernels, x, [(ids, w)], 0)
    with pytest.raises(NativeError, match="at least one kernel"):
        native.run_chain([], x, [(ids, w)], 1)
    with pytest.raises(NativeError, match=r"kernels\[1\] is a str"):
        native.run_chain([kernels[0], "layer"], x, [(ids, w)], 1)
    with pytest.raises(NativeError, match="hidden_states: dtype"):
        native.run_chain(kernels, x.double(), [(ids, w)], 1)
    with pytest.raises(NativeError, match="routings of different shapes"):
        native.run_chain(kernels, torch.randn(1, 256), [(ids, w), random_routing(1, 8, 3, 0)], 1)
    with pytest.raises(NativeError, match="at least one token"):
        native.run_chain(kernels, torch.randn(0, 256), [(ids[:0], w[:0])], 1)
    other = native.MoEKernel(*moe_case(QT.Q8_0, QT.Q8_0, E=8, H=256, I=256)[0], pool=native.Pool(1))
    with pytest.raises(NativeError, match=r"kernels\[1\] differs from kernels\[0\] in pool"):
        native.run_chain([kernels[0], other], x, [(ids, w)], 1)
    kernels[0].submit(x, ids, w)
    try:
        with pytest.raises(NativeError, match="submit\\(\\) without sync"):
            native.run_chain(kernels, x, [(ids, w)], 1)
    finally:
        kernels[0].sync()


def test_probe_keeps_its_buffer():
    pool = native.Pool(2)
    probe = native.Probe(pool, (12 << 20) + 5)
    assert probe.nbytes == 12 << 20                  # whole 4 MiB chunks
    assert native.Probe(pool, 1).nbytes == 4 << 20   # at least one
    a, b = probe.gbps(reps=2), probe.gbps(reps=1)
    assert a > 0 and b > 0
    with pytest.raises(NativeError, match="a buffer of 0 bytes"):
        native.Probe(pool, 0)
    with pytest.raises(NativeError, match="probe failed"):
        probe.gbps(reps=0)


def test_chain_runs_off_the_workers_cores_and_gives_its_cpus_back():
    """With CPUs to spare the chain pins the calling thread outside the workers' cores while it
    runs (as the doorbell thread does), and restores the thread's own affinity afterwards."""
    import os
    before = os.sched_getaffinity(0)
    pool = native.Pool(1)
    kern = native.MoEKernel(*moe_case(QT.Q8_0, QT.Q8_0, E=4, H=256, I=256)[0], pool=pool)
    x = torch.randn(1, 256)
    sec, out = native.run_chain([kern], x, [random_routing(1, 4, 2, 0)], 3)
    assert sec > 0 and torch.isfinite(out).all()
    assert os.sched_getaffinity(0) == before


@pytest.mark.parametrize("pkg, core, want", [
    ([0] * 8, [0, 0, 1, 1, 2, 2, 3, 3], [0, 2, 4, 6, 1, 3, 5, 7]),      # siblings numbered (0, 1): a VM's way
    ([0] * 8, [0, 1, 2, 3, 0, 1, 2, 3], list(range(8))),                # siblings (0, 4): already spread
    ([0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0, 1, 1], [0, 2, 1, 3, 4, 6, 5, 7]),   # per package
    ([0] * 8, [0, 0, 1, 1, -1, 2, 3, 3], list(range(8))),               # topology unknown: as given
    ([0] * 6, [0, 1, 2, 3, 4, 5], list(range(6))),                      # no hyperthreads
])
def test_workers_go_one_per_core_first(pkg, core, want):
    """The pool's CPU order (with fewer workers than CPUs): each physical core once before any twice."""
    lib, ffi = native.load()
    cpus = ffi.new("int[]", list(range(len(pkg))))
    lib.ktk_cpu_spread(len(pkg), cpus, ffi.new("int[]", pkg), ffi.new("int[]", core))
    assert list(cpus) == want
    lib.ktk_cpu_spread(0, ffi.NULL, ffi.NULL, ffi.NULL)                # no input: nothing to do, no crash
