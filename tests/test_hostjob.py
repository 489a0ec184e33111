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


def _ring(flags, timeout=10.0):
    """Do what the GPU stream does around a job: set `go`, wait for `done`, clear it."""
    import time
    flags[0] = 1
    t0 = time.monotonic()
    while int(flags[16]) != 1:
        assert time.monotonic() - t0 < timeout, "the dispatcher never rang done"
        time.sleep(1e-4)
    assert int(flags[0]) == 0             # the dispatcher cleared go before running
    flags[16] = 0


def test_doorbells_run_jobs_on_the_dispatcher_thread():
    """Doorbell jobs (no host functions): the native dispatcher thread sees `go`, runs the layer,
    sets `done`; the same flags serve every ring (as a replayed CUDA graph's constant writes);
    a failed job still rings `done` with zeros and is reported; a removed bell is not run."""
    from ktinject.native import hostfn
    kernel = _kernel()
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(2, 64, generator=g), torch.rand(2, 2, generator=g)
    ids = torch.randint(0, 8, (2, 2), generator=g)
    out = torch.full_like(x, float("nan"))
    lib, job = _job(kernel, x, ids, w, out)
    flags = torch.zeros(32, dtype=torch.int32)
    _, ffi = native.load()
    assert lib.ktk_bell_add(job, ffi.cast("uint32_t *", flags.data_ptr())) == 0
    assert lib.ktk_bell_add(job, ffi.cast("uint32_t *", flags.data_ptr())) == -1     # armed twice: refused
    try:
        assert lib.ktk_bell_thread() == 1
        rings = lib.ktk_bell_rings()
        ref = kernel.forward(x, ids, w)
        for _ in range(3):
            out.fill_(float("nan"))
            _ring(flags)
            assert torch.equal(out, ref)
        assert lib.ktk_bell_rings() == rings + 3
        ids[1, 0] = 99                                        # out of range: the job fails
        _ring(flags)
        assert torch.count_nonzero(out) == 0
        with pytest.raises(NativeError, match="expert id out of range"):
            hostfn.raise_pending()
    finally:
        assert lib.ktk_bell_remove(job) == 1
    assert lib.ktk_bell_remove(job) == 0
    flags[0] = 1                                              # not armed any more: nobody answers
    import time
    time.sleep(0.02)
    assert int(flags[16]) == 0 and int(flags[0]) == 1


def test_signal_mode_choice(monkeypatch):
    from ktinject.native import hostfn
    monkeypatch.setenv("KTINJECT_HOSTJOB_SIGNAL", "doorbell")
    with pytest.raises(NativeError, match="KTINJECT_HOSTJOB_SIGNAL"):
        hostfn.signal_mode(torch.device("cuda", 0))
    monkeypatch.setenv("KTINJECT_HOSTJOB_SIGNAL", "hostfn")
    assert hostfn.signal_mode(torch.device("cuda", 0)) == "hostfn"
    for v, level in (("0", 0), ("1", 1), ("2", 2), ("x", 0)):
        monkeypatch.setenv("KTINJECT_HOSTJOB_SKIP", v)
        assert hostfn._skip_level() == level


@pytest.mark.gpu
def test_gpu_doorbells_work_and_are_chosen(monkeypatch):
    """On a GPU: the self-test passes, auto picks doorbells (the default stays host functions), and a stream-driven job (eager
    and replayed from a graph) equals the Python-driven layer."""
    from ktinject.native import hostfn
    assert hostfn.bells_usable(torch.device("cuda")) is None
    monkeypatch.setenv("KTINJECT_HOSTJOB_SIGNAL", "auto")
    assert hostfn.signal_mode(torch.device("cuda")) == "bell"
    monkeypatch.delenv("KTINJECT_HOSTJOB_SIGNAL")
    assert hostfn.signal_mode(torch.device("cuda")) == "hostfn"          # the default
    monkeypatch.setenv("KTINJECT_HOSTJOB_SIGNAL", "bell")
    kernel = _kernel()
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(1, 64, generator=g), torch.rand(1, 2, generator=g)
    ids = torch.randint(0, 8, (1, 2), generator=g)
    ref = kernel.forward(x, ids, w)
    job = hostfn.HostJob(kernel, 1, 2, dev, "test.layer")
    assert job.signal == "bell"
    xd, idd, wd = x.to(dev), ids.to(dev), w.to(dev)

    def step():
        job.submit(xd, idd, wd)
        return job.sync() * 1.0
    out = step()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), ref)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gout = step()
    for i in range(3):
        xd.copy_(x * (i + 1))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.allclose(gout.cpu(), kernel.forward(x * (i + 1), ids, w), rtol=0, atol=0)
    hostfn.raise_pending()


def test_job_record_must_agree_with_its_layer():
    """A record whose `hidden` is not the layer's is refused, and its buffer left alone: the size
    it claims is not trusted for the zeroing either."""
    from ktinject.native import hostfn
    kernel = _kernel()
    x, ids, w = torch.randn(1, 64), torch.tensor([[0, 1]]), torch.ones(1, 2)
    out = torch.full((1, 64), 7.0)
    lib, job = _job(kernel, x, ids, w, out)
    job.hidden = 4096                     # larger than the buffers
    lib.ktk_host_submit(job)
    lib.ktk_host_sync(job)
    assert job.status == -1 and torch.all(out == 7.0)
    with pytest.raises(NativeError):
        hostfn.raise_pending()
    job.hidden, job.x = 64, native.load()[1].NULL
    lib.ktk_host_submit(job)
    assert job.status == -1
    with pytest.raises(NativeError):
        hostfn.raise_pending()


def test_generation_stops_at_the_token_a_failed_job_spoiled():
    """A failure waiting in the library (as a stream-ordered job leaves it) ends `stream_generate`
    at the next token, not after the whole completion."""
    from ktinject.generate import stream_generate
    from ktinject.testing import build_tiny
    from ktinject.tokenizer import byte_tokenizer
    kernel = _kernel()
    x, w, out = torch.randn(1, 64), torch.ones(1, 2), torch.zeros(1, 64)
    lib, job = _job(kernel, x, torch.tensor([[0, 8]]), w, out)      # expert 8 of 8
    model = build_tiny("qwen3_moe")
    tok = byte_tokenizer(model.config.vocab_size)
    pieces = stream_generate(model, tok, "abc", max_new_tokens=50)
    lib.ktk_host_submit(job)
    with pytest.raises(NativeError, match="expert id out of range"):
        for n, _ in enumerate(pieces):
            assert n < 2


def test_driver_binds_a_primary_context_once_and_stops_at_the_first_failure():
    """`CudaDriver.bind` / `ensure_context` against a stand-in for libcuda: the primary context is
    retained once per device, and a failed lookup stops there (no retain of a garbage device)."""
    from ktinject.native.cuda_driver import CudaDriver
    calls = []

    class FakeLib:
        def cuCtxGetCurrent(self, out):
            return 0                                    # no context current: out stays NULL

        def cuDeviceGet(self, out, index):
            calls.append(("get", index))
            return 101 if index == 7 else 0             # device 7 does not exist

        def cuDevicePrimaryCtxRetain(self, out, dev):
            calls.append("retain")
            return 0

        def cuCtxSetCurrent(self, ctx):
            calls.append("set")
            return 0

        def cuGetErrorString(self, rc, out):
            return 0

    drv = object.__new__(CudaDriver)
    drv.lib, drv._primary = FakeLib(), {}
    assert drv.ensure_context(0) is None and drv.ensure_context(0) is None
    assert calls == [("get", 0), "retain", "set", "set"]            # retained once, made current twice
    calls.clear()
    why = drv.ensure_context(7)
    assert "no current CUDA context" in why and "cuDeviceGet" in why and calls == [("get", 7)]
    assert drv.ensure_context(None) == "no current CUDA context"
