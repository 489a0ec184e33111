"""Stream-ordered MoE jobs (native/hostjob.c): the C host functions a CUDA stream calls, driven
here directly on the CPU: same result as the Python-driven layer; failures zero the output and
are reported by `hostfn.raise_pending`, never lost."""
from __future__ import annotations

import pytest
import torch

from ktinject import native
from ktinject.errors import NativeError

pytestmark = pytest.mark.skipif(not native.ensure_built(), reason="native extension not built (no C compiler)")


def _kernel(E=8, H=64, I=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    mats = []
    for rows, cols in ((I, H), (I, H), (H, I)):
        w = (torch.randn(E * rows, cols, generator=g) * 0.1).to(torch.bfloat16)
        mats.append(native.ExpertMatrix(30, w.view(torch.uint8).contiguous(), E, rows, cols))
    return native.MoEKernel(*mats, threads=2)


def _job(kernel, x, ids, w, out):
    lib, ffi = native.load()
    job = ffi.new("ktk_host_job *")
    job.moe, job.pool, job.isa = kernel._ptr, kernel.pool.ptr, kernel.isa
    job.T, job.k, job.hidden = ids.shape[0], ids.shape[1], x.shape[1]
    job.x = ffi.cast("float *", x.data_ptr())
    job.ids = ffi.cast("int64_t *", ids.data_ptr())
    job.w = ffi.cast("float *", w.data_ptr())
    job.out = ffi.cast("float *", out.data_ptr())
    return lib, job


def test_host_functions_equal_forward():
    kernel = _kernel()
    g = torch.Generator().manual_seed(1)
    for T in (1, 3):
        x = torch.randn(T, 64, generator=g)
        ids = torch.randint(0, 8, (T, 2), generator=g)
        w = torch.rand(T, 2, generator=g)
        ref = kernel.forward(x, ids, w)
        out = torch.full_like(x, float("nan"))
        lib, job = _job(kernel, x, ids, w, out)
        lib.ktk_host_submit(job)          # returns at once; the pool computes
        lib.ktk_host_sync(job)
        assert job.status == 0
        assert torch.equal(out, ref)
    from ktinject.native import hostfn
    hostfn.raise_pending()                # nothing pending


def test_failed_job_zeroes_output_and_is_reported():
    from ktinject.native import hostfn
    kernel = _kernel()
    x, w = torch.randn(1, 64), torch.ones(1, 2)
    ids = torch.tensor([[0, 8]])          # expert 8 of 8: out of range
    out = torch.full_like(x, 7.0)
    lib, job = _job(kernel, x, ids, w, out)
    lib.ktk_host_submit(job)
    lib.ktk_host_sync(job)                # a no-op after a failed submit: nothing to wait for
    assert job.status == -2 and torch.count_nonzero(out) == 0
    _, ffi = native.load()
    hostfn._NAMES[int(ffi.cast("uintptr_t", job))] = "model.layers.7.mlp.experts"   # what HostJob records
    with pytest.raises(NativeError, match=r"model\.layers\.7\.mlp\.experts: .*expert id out of range"):
        hostfn.raise_pending("model.layers.8.mlp.experts")    # reported at a later layer's call, naming the failed one
    hostfn._NAMES.pop(int(ffi.cast("uintptr_t", job)))
    hostfn.raise_pending()                # reported once, then clear
    # the layer still works afterwards
    ok = torch.tensor([[0, 7]])
    assert torch.isfinite(kernel.forward(x, ok, w)).all()


def test_busy_pool_is_an_error_not_a_race():
    from ktinject.native import hostfn
    kernel = _kernel()
    x, w, ids = torch.randn(1, 64), torch.ones(1, 2), torch.tensor([[1, 2]])
    out1, out2 = torch.empty_like(x), torch.full_like(x, 5.0)
    lib, job1 = _job(kernel, x, ids, w, out1)
    _, job2 = _job(kernel, x, ids, w, out2)
    lib.ktk_host_submit(job1)
    lib.ktk_host_submit(job2)             # same layer in flight: refused
    lib.ktk_host_sync(job1)
    lib.ktk_host_sync(job2)
    assert job1.status == 0 and job2.status == -4 and torch.count_nonzero(out2) == 0
    with pytest.raises(NativeError, match="already in flight"):
        hostfn.raise_pending()


def test_cpu_experts_takes_the_python_path_without_cuda():
    from ktinject.operators.cpu_experts import CpuExperts, CpuExpertsOptions
    op = CpuExperts(8, 64, 96, CpuExpertsOptions(threads=2))
    op.kernel = _kernel()
    x = torch.randn(2, 64)
    assert op._stream_job(x, torch.zeros(2, 2, dtype=torch.long)) is None
    if not torch.cuda.is_available():
        assert op.supports_cuda_graph is False
    with pytest.raises(ValueError, match="stream_max_tokens"):
        CpuExpertsOptions(stream_max_tokens=0)


def test_reloading_weights_drops_jobs_bound_to_the_old_kernel():
    from ktinject.operators.cpu_experts import CpuExperts, CpuExpertsOptions
    from ktinject.testing import first_moe_block
    model, block = first_moe_block("qwen3_moe")
    E, two_i, H = block.experts.gate_up_proj.shape
    op = CpuExperts(E, H, two_i // 2, CpuExpertsOptions(threads=2))
    src = {"e.gate_up_proj": block.experts.gate_up_proj.data, "e.down_proj": block.experts.down_proj.data}
    op.load_weights("e.", src)
    op._jobs["stale"] = object()          # what a CUDA decode would have created
    op._loaded_prefix = None              # force a real reload
    op.load_weights("e.", src)
    assert op._jobs == {}
