"""`rms_norm`: the families' RMSNorm in one kernel. The torch path equals the transformers modules
bit for bit; the Triton kernel (run here in Triton's interpreter, and on CUDA in the `gpu` tests)
equals them up to the order of the float32 sum of squares: within two ulps of the output dtype."""
from __future__ import annotations

import textwrap

import pytest
import torch

from ktinject.errors import ModelError, RuleError
from ktinject.operators import registry
from ktinject.operators.base import BuildContext
from ktinject.operators.kernels import triton_available
from ktinject.operators.norm import RMS_NORM_CLASSES, rms_norm_reference
from ktinject.testing import FAMILIES, build_tiny, run_in_triton_interpreter


def _norms(family):
    model = build_tiny(family)
    return model, [(n, m) for n, m in model.named_modules() if type(m).__name__ in RMS_NORM_CLASSES]


def _build(model, name, module, dtype=None, **opts):
    Op = registry.get("rms_norm")
    ctx = BuildContext(name, torch.device("cpu"), torch.device("cpu"), torch.device("cpu"), dtype, model.config,
                       Op.Options(**opts))
    op = Op.build(module, ctx)
    assert op.load_weights("n.", {"n.weight": module.weight.data}) == {"n.weight"}
    return op


@pytest.mark.parametrize("family", FAMILIES)
def test_every_norm_of_the_family_equals_transformers(family):
    model, norms = _norms(family)
    assert len(norms) > 2 * model.config.num_hidden_layers          # layers' two, the final one, latent/q/k norms
    g = torch.Generator().manual_seed(0)
    for name, mod in norms:
        with torch.no_grad():
            mod.weight.copy_(1 + 0.1 * torch.randn(mod.weight.shape, generator=g))
        for dtype in (torch.float32, torch.bfloat16):
            m = mod.to(dtype)
            op = _build(model, name, m)
            assert op.eps == m.variance_epsilon and op.weight.dtype == dtype
            x = torch.randn(3, 5, m.weight.shape[0], generator=g).to(dtype)
            with torch.no_grad():
                assert torch.equal(op(x), m(x)), (name, dtype)


def test_options_and_errors():
    Op = registry.get("rms_norm")
    assert set(Op.replaces) >= {"DeepseekV2RMSNorm", "Qwen3MoeRMSNorm", "MixtralRMSNorm"}
    with pytest.raises(ValueError, match="backend"):
        Op.Options(backend="cuda")
    with pytest.raises(RuleError, match="backend"):
        registry.make_options(Op, {"backend": "fast"})
    model, norms = _norms("qwen3_moe")
    with pytest.raises(ModelError, match="1-D `weight`"):
        _build(model, "model.layers.0.mlp", torch.nn.Linear(4, 4))
    op = _build(model, *norms[0])
    with pytest.raises(ModelError, match="features"):
        op(torch.randn(2, op.hidden + 1))
    assert not op.uses_triton(torch.randn(2, op.hidden))               # CPU tensors: the torch path
    assert "op=rms_norm" in repr(op)
    if triton_available():                                             # asked for the kernel: no silent torch path
        strict = _build(model, norms[0][0], norms[0][1], backend="triton")
        with pytest.raises(ModelError, match="backend triton, but the input"):
            strict(torch.randn(2, strict.hidden))


_INTERP = textwrap.dedent("""
    import torch
    from ktinject.operators.norm import rms_norm_reference, rms_norm_triton
    torch.manual_seed(0)
    # row widths of the families (hidden, MLA's q_lora / kv_lora, Qwen3's head_dim) and odd ones;
    # rows past a power of two are masked. f32 and f16 (the interpreter has no bf16 arithmetic).
    for cols in (2048, 1536, 512, 128, 100, 7168):
        for dt in (torch.float32, torch.float16):
            x = (torch.randn(4, 3, cols) * 3).to(dt)
            w = (1 + 0.1 * torch.randn(cols)).to(dt)
            got, want = rms_norm_triton(x, w, 1e-6), rms_norm_reference(x, w, 1e-6)
            assert got.shape == want.shape and got.dtype == want.dtype == dt, (cols, dt)
            ulp = 2 ** -23 if dt == torch.float32 else 2 ** -10
            bad = (got.float() - want.float()).abs() > 2 * ulp * want.float().abs().clamp_min(1e-3)
            assert int(bad.sum()) <= max(1, want.numel() // 1000), (cols, dt, int(bad.sum()))
    w32 = torch.ones(256)                                           # f32 weight on f16 input: promoted
    assert rms_norm_triton(torch.randn(2, 256).half(), w32, 1e-5).dtype == torch.float32
    t = torch.randn(6, 256)[:, ::2]                                  # a strided last dim is made contiguous
    assert torch.allclose(rms_norm_triton(t, torch.ones(128), 1e-6), rms_norm_reference(t, torch.ones(128), 1e-6))
    print("ok")
""")


def test_triton_kernel_in_interpreter():
    pytest.importorskip("triton")
    run_in_triton_interpreter(_INTERP)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_triton_norm_equals_transformers_and_graphs_capture_it():
    pytest.importorskip("triton")
    from ktinject.operators.norm import rms_norm_triton
    g = torch.Generator().manual_seed(1)
    for shape in ((1, 2048), (7, 4096), (3, 32, 128), (5, 7168), (2, 1536), (1, 512)):
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            x = (torch.randn(shape, generator=g) * 2).to(dt).cuda()
            w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dt).cuda()
            got, want = rms_norm_triton(x, w, 1e-6), rms_norm_reference(x, w, 1e-6)
            assert got.dtype == want.dtype
            # where the float32 sums round differently, the first rounding (to dt) may move by an ulp
            # and the product's rounding by another: two ulps of dt at most
            tol = 2 * {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 2 ** -21}[dt]
            assert ((got.float() - want.float()).abs() <= tol * want.float().abs() + 1e-6).all(), (shape, dt)
    model, norms = _norms("deepseek_v2")
    name, mod = norms[0]
    op = _build(model, name, mod.to(torch.bfloat16), dtype=torch.bfloat16).cuda()
    x = torch.randn(1, op.hidden, device="cuda", dtype=torch.bfloat16)
    assert op.uses_triton(x)
    y = op(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gy = op(x)
    x.copy_(torch.randn_like(x))                          # new values (a norm ignores a mere rescale)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(gy, op(x)) and not torch.equal(gy, y)
