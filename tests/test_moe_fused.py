"""`moe`'s fused paths on CUDA: the softmax top-k router in two Triton kernels and the shared SiLU
MLP as gate_up GEMM + `silu_mul` + down_proj, against transformers' own modules.

The kernels run here in Triton's interpreter (float32 and float16: it has no bf16 arithmetic) and
on CUDA in the `gpu` tests (bf16, inside a CUDA graph too). Expert ids must be equal on every
token whose k-th and (k+1)-th scores are apart (random inputs have no ties); weights within a few
float32 ulps where the original returns float32, within rounding of a logit where it rounds the
logits to bf16/f16 (Qwen, Mixtral)."""
from __future__ import annotations

import copy
import importlib
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from ktinject.errors import RuleError
from ktinject.operators import registry
from ktinject.operators.base import BuildContext
from ktinject.operators.kernels.mlp_triton import fusable_mlp, fuse_gate_up, gate_up_views
from ktinject.operators.kernels.router_triton import RouterSpec, router_spec
from ktinject.testing import FAMILIES, first_moe_block, run_in_triton_interpreter, tiny_config

ROUTER_CLASSES = {"deepseek_v2": "DeepseekV2TopkRouter", "deepseek_v3": "DeepseekV3TopkRouter",
                  "qwen2_moe": "Qwen2MoeTopKRouter", "qwen3_moe": "Qwen3MoeTopKRouter",
                  "mixtral": "MixtralTopKRouter"}
# the tiny families' routers, and wider ones as in the real models (V2-Lite 64 x 6, V2's scale 16,
# Qwen3-30B's 128 x 8, Qwen1.5-MoE's 60 x 4: E not a power of two)
ROUTER_CASES = {
    "deepseek_v2": ("deepseek_v2", {}),
    "deepseek_v2-64x6-scaled": ("deepseek_v2", dict(n_routed_experts=64, num_experts_per_tok=6,
                                                    routed_scaling_factor=16.0)),
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe-128x8": ("qwen3_moe", dict(num_experts=128, num_experts_per_tok=8)),
    "qwen3_moe-no-norm": ("qwen3_moe", dict(norm_topk_prob=False)),
    "qwen2_moe-60x4": ("qwen2_moe", dict(num_experts=60, num_experts_per_tok=4)),
    "qwen2_moe-norm": ("qwen2_moe", dict(norm_topk_prob=True)),
    "mixtral": ("mixtral", {}),
}
# by the dtype the original rounds its logits to: relative tolerance of the weights, and the gap
# between the k-th and (k+1)-th logit (relative to their magnitude) below which ids may differ: two
# ulps of that dtype (a logit of either side may round the other way), 32 of float32 (sum order)
LOGIT_TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}
TIE_GAP = {torch.float32: 2 ** -18, torch.float16: 2 ** -9, torch.bfloat16: 2 ** -6}


def make_router(case: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    """transformers' own router class of the case, random weights, in `dtype` (DeepSeek's too: the
    packs load it in bf16)."""
    family, over = ROUTER_CASES[case]
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    router = getattr(mod, ROUTER_CLASSES[family])(tiny_config(family, **over))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(0.05 * torch.randn(router.weight.shape, generator=g))
    return router.to(dtype).requires_grad_(False)


@torch.no_grad()
def check_route(router: nn.Module, h: torch.Tensor, got_w: torch.Tensor, got_ids: torch.Tensor) -> int:
    """Fused (weights, ids) against `router(h)`: same dtypes and shapes, ids in descending weight,
    the same expert set and weights to LOGIT_TOL on every token without a near tie (a logit rounded
    otherwise could swap those); returns the number of such tokens (callers check most are)."""
    logits, want_w, want_ids = router(h)
    k = router.top_k
    assert got_ids.dtype == want_ids.dtype == torch.int64 and got_w.dtype == want_w.dtype, (got_w.dtype, want_w.dtype)
    assert got_ids.shape == want_ids.shape == got_w.shape == (h.shape[0], k)
    assert (got_w[:, :-1] >= got_w[:, 1:]).all()
    top = logits.float().topk(k + 1, dim=-1).values
    clear = (top[:, k - 1] - top[:, k]) > TIE_GAP[logits.dtype] * top[:, k - 1:].abs().max(-1).values
    gi, go = got_ids.sort(-1)
    wi, wo = want_ids.sort(-1)
    assert torch.equal(gi[clear], wi[clear])
    gw, ww = got_w.gather(1, go)[clear].float(), want_w.gather(1, wo)[clear].float()
    torch.testing.assert_close(gw, ww, rtol=LOGIT_TOL[logits.dtype], atol=1e-7)
    if len(gw) >= 5:      # a logit rounds otherwise now and then; most tokens agree to float32 ulps
        same = ((gw - ww).abs() <= 1e-5 * ww.abs()).all(-1).float().mean()
        assert same >= 0.8, float(same)
    return int(clear.sum())


# ---------------------------------------------------------------- adapter (no Triton needed)

@pytest.mark.parametrize("family", FAMILIES)
def test_router_spec_reads_each_family(family):
    model, block = first_moe_block(family)
    assert type(block.gate).__name__ == ROUTER_CLASSES[family]
    spec = router_spec(block.gate)
    c = model.config
    if family == "deepseek_v3":                  # sigmoid + correction bias + groups: its own forward
        assert spec is None
        return
    assert spec.weight is block.gate.weight and spec.top_k == c.num_experts_per_tok
    if family == "deepseek_v2":                  # (renorm, scale, logits_fp32, weights_fp32)
        want = (False, c.routed_scaling_factor, True, True)
    elif family == "mixtral":
        want = (True, 1.0, False, True)
    else:
        want = (c.norm_topk_prob, 1.0, False, False)
    assert spec == RouterSpec(spec.weight, spec.top_k, *want)
    # the return dtypes the spec promises are the module's
    for dtype in (torch.float32, torch.bfloat16):
        gate = copy.deepcopy(block.gate).to(dtype)
        with torch.no_grad():
            logits, w, ids = gate(torch.randn(3, c.hidden_size).to(dtype))
        assert logits.dtype == (torch.float32 if spec.logits_fp32 else dtype)
        assert w.dtype == (torch.float32 if spec.weights_fp32 else logits.dtype) and ids.dtype == torch.int64


def test_router_spec_refuses_other_routers():
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
    grouped = DeepseekV2TopkRouter(tiny_config("deepseek_v2", topk_method="group_limited_greedy", n_group=4,
                                               topk_group=2))
    assert router_spec(grouped) is None
    assert router_spec(first_moe_block("deepseek_v3")[1].gate) is None
    assert router_spec(nn.Linear(8, 4)) is None

    class Custom(Qwen3MoeTopKRouter):            # a subclass may compute anything
        pass
    assert router_spec(Custom(tiny_config("qwen3_moe"))) is None
    assert router_spec(Qwen3MoeTopKRouter(tiny_config("qwen3_moe", num_experts_per_tok=17, num_experts=32))) is None
    assert router_spec(Qwen3MoeTopKRouter(tiny_config("qwen3_moe"))) is not None


def test_fusable_mlp_and_views():
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2MLP
    _, block = first_moe_block("deepseek_v2")
    mlp = copy.deepcopy(block.shared_experts)
    assert "grad" in fusable_mlp(mlp)            # trainable weights are left alone
    mlp.requires_grad_(False)
    assert fusable_mlp(mlp) is None
    ref = copy.deepcopy(mlp)
    gate_up = fuse_gate_up(mlp)
    I, D = ref.gate_proj.weight.shape
    assert gate_up.shape == (2 * I, D) and gate_up_views(mlp, gate_up)
    assert mlp.gate_proj.weight.data_ptr() == gate_up.data_ptr()                     # views, no second copy
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == gate_up.untyped_storage().data_ptr()
    assert isinstance(mlp.up_proj.weight, nn.Parameter) and not mlp.up_proj.weight.requires_grad
    sd, ref_sd = mlp.state_dict(), ref.state_dict()
    assert list(sd) == list(ref_sd) and all(torch.equal(sd[k], ref_sd[k]) for k in sd)
    mlp.half()                                   # .to() copies Parameters one by one: no longer views
    assert not gate_up_views(mlp, gate_up)
    assert gate_up_views(mlp, fuse_gate_up(mlp))

    cfg = tiny_config("deepseek_v2")
    biased = DeepseekV2MLP(tiny_config("deepseek_v2", mlp_bias=True), intermediate_size=64).requires_grad_(False)
    assert "bias" in fusable_mlp(biased) and fuse_gate_up(biased) is None
    gelu = DeepseekV2MLP(tiny_config("deepseek_v2", hidden_act="gelu"), intermediate_size=64).requires_grad_(False)
    assert "not SiLU" in fusable_mlp(gelu)
    other = DeepseekV2MLP(cfg, intermediate_size=64).requires_grad_(False)

    class Quantized(nn.Linear):                  # e.g. an operator in place of gate_proj
        pass
    other.gate_proj = Quantized(cfg.hidden_size, 64, bias=False).requires_grad_(False)
    assert "plain nn.Linear" in fusable_mlp(other)
    assert "not one of" in fusable_mlp(nn.Sequential())


class _Inline(nn.Module):
    """Routed experts with submit/sync that just call transformers' experts (no native library)."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.inner = experts

    def submit(self, h, ids, w):
        self.out = self.inner(h, ids, w)

    def sync(self):
        return self.out


def _moe(family: str, device: str = "cpu", dtype: torch.dtype = torch.float32, **opts):
    """(model, the original block, an `moe` operator over a copy of it) with weights in place."""
    model, block = first_moe_block(family)
    block = block.to(device=device, dtype=dtype).requires_grad_(False)
    ref = copy.deepcopy(block)
    block.experts = _Inline(block.experts)
    M = registry.get("moe")
    dev = torch.device(device)
    op = M.build(block, BuildContext("model.layers.1.mlp", dev, dev, dev, dtype, model.config, M.Options(**opts)))
    op.load_weights("model.layers.1.mlp.", {})                  # everything already placed
    return model, ref, op


def test_options_and_cpu_path_unchanged():
    M = registry.get("moe")
    assert M.Options().fused_router and M.Options().fused_shared
    assert registry.make_options(M, {"fused_router": False, "fused_shared": False}).fused_shared is False
    with pytest.raises(RuleError, match="wrong type"):
        registry.make_options(M, {"fused_router": "no"})
    model, ref, op = _moe("deepseek_v2")
    weights = [p for p in op.parameters()]
    x = torch.randn(2, 3, model.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(op(x), ref(x))
    assert op.fused_paths() == {"router": False, "shared": False}         # CPU weights
    assert "fused_router=False, fused_shared=False" in repr(op)
    assert op._gate_up is None and all(a is b for a, b in zip(op.parameters(), weights))


# ---------------------------------------------------------------- kernels in Triton's interpreter

_INTERP = """
import sys
sys.path.insert(0, {tests!r})
import copy
import torch
from ktinject.operators.kernels.mlp_triton import fuse_gate_up, fused_mlp, silu_mul
from ktinject.operators.kernels.router_triton import GEMV_MAX_TOKENS, fused_route, router_spec
from ktinject.testing import first_moe_block
from test_moe_fused import ROUTER_CASES, check_route, make_router

g = torch.Generator().manual_seed(3)
assert GEMV_MAX_TOKENS < 40
for case in ROUTER_CASES:
    for dtype in (torch.float32, torch.float16):
        router = make_router(case, dtype)
        spec = router_spec(router)
        clear = 0
        for T in (1, 12, 40):                     # 40: the logits from F.linear, then the top-k kernel
            h = torch.randn(T, router.weight.shape[1], generator=g).to(dtype)
            w, ids = fused_route(h, spec)
            clear += check_route(router, h, w, ids)
        assert clear >= 0.5 * 53, (case, dtype, clear)
    assert fused_route(torch.zeros(0, router.weight.shape[1], dtype=dtype), spec)[1].shape == (0, spec.top_k)

# silu_mul: both roundings of act_fn(gate) * up (numpy's exp here, not torch's: a few float32 ulps
# apart, which move an f16 rounding about once in a thousand)
for dt, ulp in ((torch.float32, 2 * 2 ** -23), (torch.float16, 2 ** -10)):
    x = (torch.randn(5, 2 * 1408, generator=g) * 3).to(dt)
    got, want = silu_mul(x), torch.nn.functional.silu(x[:, :1408]) * x[:, 1408:]
    assert got.dtype == dt and got.shape == want.shape
    err = (got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-30)
    assert err.max() <= 2 * ulp and (got != want).float().mean() <= (0.2 if dt == torch.float32 else 1e-3), dt
t = torch.randn(4, 8, generator=g)[:, ::2]               # strided: made contiguous
assert torch.allclose(silu_mul(t), torch.nn.functional.silu(t[:, :2]) * t[:, 2:])

# the shared MLP on one [2I, D] weight against the module (DeepSeek, Qwen2-MoE)
for family, child in (("deepseek_v2", "shared_experts"), ("qwen2_moe", "shared_expert")):
    mlp = getattr(first_moe_block(family)[1], child).requires_grad_(False)
    ref = copy.deepcopy(mlp)
    gate_up = fuse_gate_up(mlp)
    x = torch.randn(3, mlp.gate_proj.weight.shape[1], generator=g)
    torch.testing.assert_close(fused_mlp(mlp, gate_up, x), ref(x), rtol=1e-5, atol=1e-6)
    mlp, ref = mlp.half(), ref.half()
    torch.testing.assert_close(fused_mlp(mlp, fuse_gate_up(mlp), x.half()), ref(x.half()), rtol=4e-3, atol=1e-3)
print("ok")
"""


def test_kernels_in_triton_interpreter():
    pytest.importorskip("triton")
    run_in_triton_interpreter(textwrap.dedent(_INTERP.format(tests=str(Path(__file__).parent))), timeout=900)


# ---------------------------------------------------------------- CUDA

BF16 = torch.bfloat16
SHARED = {"deepseek_v2": "shared_experts", "deepseek_v3": "shared_experts", "qwen2_moe": "shared_expert"}


@pytest.fixture(autouse=True)
def _full_precision_matmuls(monkeypatch):
    """The references in full precision: cuBLAS may otherwise sum a bf16/f16 GEMM's split-K partials
    in bf16/f16 (torch's default), and the reference logits then round differently from the
    kernel's float32 sums far more often; no TF32 for DeepSeek's float32 logits either."""
    if torch.cuda.is_available():
        m = torch.backends.cuda.matmul
        monkeypatch.setattr(m, "allow_bf16_reduced_precision_reduction", False)
        monkeypatch.setattr(m, "allow_fp16_reduced_precision_reduction", False)
        monkeypatch.setattr(m, "allow_tf32", False)


def _bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """The shared MLP against the module: an ulp of gate or up where the one GEMM sums in another
    order than the two moves an output by about an ulp of the output's scale, no more."""
    got, want = got.float(), want.float()
    tol = 2 ** -7 * want.abs() + 2 ** -8 * want.abs().max()
    assert ((got - want).abs() <= tol).all(), float((got - want).abs().max())


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(ROUTER_CASES))
def test_gpu_fused_router_equals_transformers(case):
    pytest.importorskip("triton")
    from ktinject.operators.kernels.router_triton import fused_route
    g = torch.Generator().manual_seed(5)
    for dtype in (BF16, torch.float16, torch.float32):
        router = make_router(case, dtype).cuda()
        spec = router_spec(router)
        clear = 0
        for T in (1, 7, 40, 300):
            h = torch.randn(T, router.weight.shape[1], generator=g).to(dtype).cuda()
            w, ids = fused_route(h, spec)
            clear += check_route(router, h, w, ids)
        assert clear >= 0.5 * 348, (case, dtype, clear)


@pytest.mark.gpu
def test_gpu_silu_mul_keeps_the_roundings():
    """Given gate and up, `silu_mul` is torch's `silu(gate) * up` bit for bit (libdevice's expf and an
    IEEE division are what torch's CUDA kernel computes)."""
    pytest.importorskip("triton")
    from ktinject.operators.kernels.mlp_triton import silu_mul
    g = torch.Generator().manual_seed(6)
    for dt in (BF16, torch.float16, torch.float32):
        for shape in ((1, 2 * 1408), (7, 2 * 2816), (64, 2 * 512), (3, 2 * 100)):
            x = (torch.randn(shape, generator=g) * 4).to(dt).cuda()
            I = shape[1] // 2
            got, want = silu_mul(x), torch.nn.functional.silu(x[:, :I]) * x[:, I:]
            assert torch.equal(got, want), (dt, shape, int((got != want).sum()))


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_fused_moe_equals_the_block(family):
    pytest.importorskip("triton")
    model, ref, op = _moe(family, "cuda", BF16)
    paths = op.fused_paths()
    assert paths == {"router": family != "deepseek_v3", "shared": family in SHARED}, paths
    assert f"fused_router={paths['router']}, fused_shared={paths['shared']}" in repr(op)
    if family in SHARED:                          # concatenated at load; the Parameters are its halves
        mlp = getattr(op, SHARED[family])
        assert op._gate_up is not None and gate_up_views(mlp, op._gate_up)
        assert mlp.gate_proj.weight.untyped_storage().data_ptr() == op._gate_up.untyped_storage().data_ptr()
    g = torch.Generator().manual_seed(7)
    H = model.config.hidden_size
    for T in (1, 6, 40):
        x = torch.randn(T, H, generator=g).to(BF16).cuda()
        with torch.no_grad():
            if paths["router"]:
                check_route(ref.gate, x, *op.route(x))
            if family in SHARED:
                _bf16_close(op.shared_mlp(x), getattr(ref, SHARED[family])(x))
            out, want = op(x[None]), ref(x[None])
        assert out.shape == want.shape and out.dtype == want.dtype
        assert float((out.float() - want.float()).norm() / want.float().norm()) < 1e-2, (family, T)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["deepseek_v2", "qwen2_moe", "qwen3_moe"])
def test_gpu_fused_paths_capture_in_a_cuda_graph(family):
    """Router and shared MLP captured once, replayed on new inputs: the same results as eager calls,
    no host synchronisation, no weight allocated during the capture."""
    pytest.importorskip("triton")
    model, ref, op = _moe(family, "cuda", BF16)
    x = torch.randn(1, model.config.hidden_size, device="cuda", dtype=BF16)
    shared = family in SHARED

    def step():
        w, ids = op.route(x)
        return w, ids, (op.shared_mlp(x) if shared else None)

    torch.cuda.set_sync_debug_mode("error")      # a host sync in the eager call is an error
    try:
        with torch.no_grad():
            first = step()                        # compiles the kernels
    finally:
        torch.cuda.set_sync_debug_mode(0)
    weights = [p.data_ptr() for p in op.parameters()]
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        w, ids, s = step()
    assert [p.data_ptr() for p in op.parameters()] == weights
    g = torch.Generator().manual_seed(8)
    for _ in range(3):
        x.copy_(torch.randn(x.shape, generator=g).to(BF16))
        graph.replay()
        torch.cuda.synchronize()
        with torch.no_grad():
            ew, eids, es = step()
        assert torch.equal(w, ew) and torch.equal(ids, eids)
        check_route(ref.gate, x, w, ids)
        if shared:
            assert torch.equal(s, es)
            _bf16_close(s, getattr(ref, SHARED[family])(x))
    assert not torch.equal(w, first[0]) or not torch.equal(ids, first[1])


@pytest.mark.gpu
def test_gpu_fusion_off_and_lazy():
    pytest.importorskip("triton")
    model, ref, op = _moe("deepseek_v2", "cuda", BF16, fused_router=False, fused_shared=False)
    assert op.fused_paths() == {"router": False, "shared": False} and op._gate_up is None
    x = torch.randn(3, model.config.hidden_size, device="cuda", dtype=BF16)
    with torch.no_grad():
        _, want_w, want_ids = ref.gate(x)
        w, ids = op.route(x)
        assert torch.equal(w, want_w) and torch.equal(ids, want_ids)          # the module's own forward
        assert torch.equal(op.shared_mlp(x), ref.shared_experts(x)) and op._gate_up is None
    # loaded on the CPU, moved to CUDA later: fused at the first eager CUDA call
    model, ref, op = _moe("deepseek_v2", "cpu", BF16)
    op.cuda()
    ref.cuda()
    assert op._gate_up is None
    with torch.no_grad():
        _bf16_close(op.shared_mlp(x), ref.shared_experts(x))
    assert op._gate_up is not None and op._gate_up.is_cuda and gate_up_views(op.shared_experts, op._gate_up)


def test_unfused_measurement_overlay_turns_every_fused_path_off(tmp_path):
    """scripts/rules/unfused.yaml (the A/B overlay of docs/benchmarks.md) loads over the shipped
    pack and turns off MLA's fused step and both fused paths of `moe`."""
    import ktinject
    from ktinject.testing import save_tiny
    overlay = Path(__file__).resolve().parents[1] / "scripts" / "rules" / "unfused.yaml"
    model, _ = ktinject.optimize_and_load(save_tiny("deepseek_v2", tmp_path / "m"), [str(overlay), "deepseek-v2-cpu"])
    attn = [m for n, m in model.named_modules() if n.endswith("self_attn")]
    moes = [m for m in model.modules() if type(m).__name__ == "OverlappedMoe"]
    assert attn and moes
    assert all(not a.options.fused_decode for a in attn)
    assert all(not m.options.fused_router and not m.options.fused_shared for m in moes)
