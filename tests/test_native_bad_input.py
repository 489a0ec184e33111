"""The Python wrapper refuses bad input with a NativeError naming the argument, before C runs;
the C side refuses what gets past it (expert ids, row bytes) with an error code."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from ktinject import native
from ktinject.errors import KtInjectError, NativeError

from test_native_util import rand_rows

pytestmark = pytest.mark.skipif(not native.available(), reason="native extension not built")
E, H, I, K = 4, 256, 256, 2


@pytest.fixture(scope="module")
def kern():
    g, u, d = rand_rows(QT.Q8_0, E * I, H, 1), rand_rows(QT.Q8_0, E * I, H, 2), rand_rows(QT.Q8_0, E * H, I, 3)
    return native.MoEKernel(native.ExpertMatrix(8, g, E, I, H, "gate"), native.ExpertMatrix(8, u, E, I, H, "up"),
                            native.ExpertMatrix(8, d, E, H, I, "down"), threads=2)


def good(T=3):
    return torch.randn(T, H), torch.zeros(T, K, dtype=torch.int64) + torch.tensor([0, 1]), torch.rand(T, K)


@pytest.mark.parametrize("case,match", [
    (lambda x, i, w: (x.double(), i, w), "hidden_states: dtype"),
    (lambda x, i, w: (x, i.int(), w), "top_k_index: dtype"),
    (lambda x, i, w: (x, i, w.half()), "top_k_weights: dtype"),
    (lambda x, i, w: (x[:, :128], i, w), "hidden_states"),
    (lambda x, i, w: (x.t().contiguous().t(), i, w), "contiguous"),
    (lambda x, i, w: (x[None], i, w), "dimensions"),
    (lambda x, i, w: (x, i[:2], w), "must both be"),
    (lambda x, i, w: (x, i, w[:, :1].contiguous()), "must both be"),
    (lambda x, i, w: (x, i + E, w), "out of range"),
    (lambda x, i, w: (x, i - 5, w), "out of range"),
    (lambda x, i, w: (x.numpy(), i, w), "torch.Tensor"),
])
def test_bad_call_raises(kern, case, match):
    with pytest.raises(NativeError, match=match):
        kern(*case(*good()))
    out = kern(*good())                       # still usable afterwards
    assert torch.isfinite(out).all()


def test_c_refuses_out_of_range_ids(kern):
    """Bypass the Python check: the C entry point itself returns KTK_ERANGE."""
    lib, ffi = native.load()
    x, ids, w = good()
    ids[1, 0] = 99
    out = torch.empty_like(x)
    rc = lib.ktk_moe_forward(kern._ptr, kern.pool.ptr, kern.isa, 3, K, ffi.cast("float *", x.data_ptr()),
                             ffi.cast("int64_t *", ids.data_ptr()), ffi.cast("float *", w.data_ptr()),
                             ffi.cast("float *", out.data_ptr()))
    assert rc == -2


@pytest.mark.parametrize("mutate,match", [
    (lambda g: g[:, :-1].contiguous(), "row"),                      # wrong row bytes
    (lambda g: g[:-1].contiguous(), "rows"),                        # missing rows
    (lambda g: g.view(torch.int8), "uint8"),                        # wrong dtype
    (lambda g: g.t(), "contiguous|uint8"),                          # not contiguous
])
def test_bad_weights_raise(mutate, match):
    g, d = rand_rows(QT.Q8_0, E * I, H, 1), rand_rows(QT.Q8_0, E * H, I, 3)
    bad = native.ExpertMatrix(8, mutate(g), E, I, H, "blk.1.ffn_gate_exps")
    with pytest.raises(NativeError, match=match) as exc:
        native.MoEKernel(bad, native.ExpertMatrix(8, g, E, I, H), native.ExpertMatrix(8, d, E, H, I))
    assert "blk.1.ffn_gate_exps" in str(exc.value)


def test_shape_disagreement_and_unsupported_type():
    g, d = rand_rows(QT.Q8_0, E * I, H, 1), rand_rows(QT.Q8_0, E * H, I, 3)
    with pytest.raises(NativeError, match="disagree"):
        native.MoEKernel(native.ExpertMatrix(8, g, E, I, H), native.ExpertMatrix(8, g, E, I, H),
                         native.ExpertMatrix(8, d[:E * H // 2].contiguous(), E // 2, H, I))
    with pytest.raises(NativeError, match="not supported"):
        native.ExpertMatrix(int(QT.Q4_1), g, E, I, H, "x").validate()


def test_gemv_checks(monkeypatch):
    w = rand_rows(QT.Q4_K, 4, 256)
    with pytest.raises(NativeError, match="x: expected"):
        native.gemv(int(QT.Q4_K), w, 256, torch.randn(255))
    with pytest.raises(NativeError, match="rows of"):
        native.gemv(int(QT.Q4_K), w[:, :100].contiguous(), 256, torch.randn(256))
    with pytest.raises(KtInjectError):
        native.Pool(100000)                       # more workers than the pool allows
    assert native.resolve_threads(-1) == max(1, native.cpu_count() - 1)   # all CPUs but one
    monkeypatch.setenv("KTINJECT_THREADS", "two")
    with pytest.raises(KtInjectError, match="KTINJECT_THREADS"):
        native.resolve_threads(0)


def test_missing_extension_is_reported(tmp_path):
    """Without the compiled module: describe() says why, operators raise NativeError at build."""
    import subprocess
    import sys
    code = """
import sys
sys.modules['ktinject.native._ktkernels'] = None          # as if the build had failed
import ktinject.native as n
d = n.describe()
assert d['available'] is False and 'not built' in d['reason'], d
from ktinject.errors import NativeError
from ktinject.operators.base import BuildContext
from ktinject.operators.cpu_experts import CpuExperts, CpuExpertsOptions
from ktinject.testing import build_tiny
m = build_tiny('qwen3_moe')
cpu = __import__('torch').device('cpu')
try:
    CpuExperts.build(m.model.layers[0].mlp.experts, BuildContext('x', cpu, cpu, cpu, None, m.config, CpuExpertsOptions()))
except NativeError as exc:
    assert 'python -m ktinject.native.build' in str(exc), exc
    print('OK')
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip().endswith("OK"), r.stdout + r.stderr
