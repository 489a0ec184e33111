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


def test_signal_default_is_auto(monkeypatch):
    from ktinject.native import hostfn
    monkeypatch.delenv("KTINJECT_HOSTJOB_SIGNAL", raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)    # (CPU-only machines)
    monkeypatch.setattr(hostfn, "bells_usable", lambda device: None)
    assert hostfn.signal_mode(torch.device("cuda", 0)) == "bell"
    monkeypatch.setattr(hostfn, "bells_usable", lambda device: "no stream memory operations")
    assert hostfn.signal_mode(torch.device("cuda", 0)) == "hostfn"       # auto falls back quietly
    monkeypatch.setenv("KTINJECT_HOSTJOB_SIGNAL", "bell")
    with pytest.raises(NativeError, match="doorbells do not work on cuda:0: no stream memory operations"):
        hostfn.signal_mode(torch.device("cuda", 0))


_HANDOFF_INTERP = """
import torch
from ktinject.operators.kernels.handoff_triton import handoff, combine, MAX_TOKENS
from ktinject.errors import NativeError
g = torch.Generator().manual_seed(0)
for T, H, K, dt in ((1, 2048, 6, torch.float16), (3, 1000, 8, torch.float32), (MAX_TOKENS, 300, 2, torch.float16)):
    h = torch.randn(T, H + 5, generator=g).to(dt)[:, :H]            # a strided view
    ids = torch.randint(0, 64, (T, K), generator=g, dtype=torch.int32)
    w = torch.rand(T, K, generator=g).to(dt)
    x_o, ids_o, w_o = torch.zeros(T, H), torch.zeros(T, K, dtype=torch.int64), torch.zeros(T, K)
    flags = torch.zeros(32, dtype=torch.int32)
    handoff(h, ids, w, x_o, ids_o, w_o, flags)
    assert torch.equal(x_o, h.float()) and torch.equal(ids_o, ids.long()) and torch.equal(w_o, w.float())
    assert flags.tolist() == [1] + [0] * 31
    out = torch.randn(T, H, generator=g)
    add = torch.randn(T, H, generator=g).to(dt)
    flags[16] = 1
    res = combine(out, flags[16:], dt, torch.device("cpu"), add)
    assert res.dtype == dt and torch.equal(res, out.to(dt) + add), (res - (out.to(dt) + add)).abs().max()
    assert int(flags[16]) == 0 and int(flags[0]) == 1
    assert torch.equal(combine(out, flags[16:], torch.float32, torch.device("cpu")), out)
for bad in (lambda: handoff(torch.zeros(MAX_TOKENS + 1, 8), torch.zeros(MAX_TOKENS + 1, 2, dtype=torch.int64),
                            torch.zeros(MAX_TOKENS + 1, 2), torch.zeros(MAX_TOKENS + 1, 8),
                            torch.zeros(MAX_TOKENS + 1, 2, dtype=torch.int64), torch.zeros(MAX_TOKENS + 1, 2),
                            torch.zeros(32, dtype=torch.int32)),
            lambda: handoff(torch.zeros(1, 8), torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, 2),
                            torch.zeros(1, 9), torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, 2),
                            torch.zeros(32, dtype=torch.int32)),
            lambda: combine(torch.zeros(1, 8), torch.zeros(16, dtype=torch.int32), torch.float16,
                            torch.device("cpu"), torch.zeros(1, 8))):
    try:
        bad()
        raise SystemExit("accepted a bad hand-over")
    except NativeError:
        pass
print("ok")
"""


def test_handoff_kernels_in_triton_interpreter():
    """The zero-copy hand-over kernels' arithmetic (run by Triton's interpreter on CPU tensors):
    x to float32 from a strided f16/f32 view, ids to int64, w to float32, `go` rung; the result
    rounded to the activation dtype plus the shared experts, `done` cleared; bad shapes refused."""
    pytest.importorskip("triton")
    from ktinject.testing import run_in_triton_interpreter
    run_in_triton_interpreter(_HANDOFF_INTERP)


@pytest.mark.gpu
@pytest.mark.parametrize("signal,zerocopy", [("bell", "1"), ("bell", "0"), ("hostfn", "1")])
def test_gpu_stream_jobs_equal_the_layer(monkeypatch, signal, zerocopy):
    """On a GPU: the self-tests pass, the default (auto) picks doorbells, and a stream-driven job
    (eager and replayed from a graph; doorbells with and without the zero-copy hand-over, and
    host functions) equals the Python-driven layer, converted to bf16 plus an added tensor."""
    from ktinject.native import hostfn
    dev = torch.device("cuda")
    assert hostfn.bells_usable(dev) is None
    assert hostfn.zerocopy_usable(dev) is None
    monkeypatch.delenv("KTINJECT_HOSTJOB_SIGNAL", raising=False)
    assert hostfn.signal_mode(dev) == "bell"                             # the default
    monkeypatch.setenv("KTINJECT_HOSTJOB_SIGNAL", signal)
    monkeypatch.setenv("KTINJECT_HOSTJOB_ZEROCOPY", zerocopy)
    kernel = _kernel()
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(1, 64, generator=g), torch.rand(1, 2, generator=g)
    ids = torch.randint(0, 8, (1, 2), generator=g)
    add = torch.randn(1, 64, generator=g).to(torch.bfloat16)
    job = hostfn.HostJob(kernel, 1, 2, dev, "test.layer")
    assert job.signal == signal
    assert job.zerocopy == (signal == "bell" and zerocopy == "1")
    xd, idd, wd, addd = x.to(dev).to(torch.bfloat16), ids.to(dev), w.to(dev), add.to(dev)

    def ref(scale):
        return kernel.forward((x * scale).to(torch.bfloat16).float(), ids, w).to(torch.bfloat16) + add

    def step():
        job.submit(xd, idd, wd)
        return job.sync(torch.bfloat16, addd)
    out = step()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), ref(1))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gout = step()
    for i in range(3):
        xd.copy_((x * (i + 2)).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(gout.cpu(), ref(i + 2))
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
