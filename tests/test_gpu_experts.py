"""gpu_experts against the transformers experts module: all on the "GPU", split with the CPU,
int4, the placement strategies, inside the whole tiny model; the CUDA paths on the H200."""
import copy
import json

import pytest
import torch

from ktinject.errors import ModelError
from ktinject.operators import BuildContext, get, make_options
from ktinject.operators.gpu_experts import GpuExperts, GpuExpertsOptions, select_gpu_experts
from ktinject.testing import build_tiny


def build_op(model, name, device="cpu", dtype=None, **opts):
    dev = torch.device(device)
    orig = model.get_submodule(name)
    ctx = BuildContext(name, dev, dev, dev, dtype, model.config, GpuExpertsOptions(**opts))
    op = GpuExperts.build(orig, ctx)
    used = op.load_weights(name + ".", dict(model.state_dict()))
    assert used == {name + ".gate_up_proj", name + ".down_proj"}
    return op, orig


def routed(model, t=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    e, k = model.config.num_experts if hasattr(model.config, "num_experts") else model.config.n_routed_experts, \
        model.config.num_experts_per_tok
    x = torch.randn(t, model.config.hidden_size, generator=g)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    return x, idx, w


def close(a, b, tol=1e-4):
    return (a - b).abs().max().item() <= tol * max(1.0, a.abs().max().item())


@pytest.mark.parametrize("family", ["deepseek_v2", "qwen3_moe", "mixtral"])
@pytest.mark.parametrize("n_gpu", [-1, 3, 0])
@torch.no_grad()
def test_matches_transformers_experts(family, n_gpu):
    model = build_tiny(family)
    name = "model.layers.1.mlp.experts"
    op, orig = build_op(model, name, gpu_experts=n_gpu)
    x, idx, w = routed(model)
    assert close(orig(x, idx, w), op(x, idx, w))
    assert op.supports_cuda_graph == (n_gpu == -1)
    assert len(op.gpu_ids) == (op.num_experts if n_gpu == -1 else n_gpu)


@torch.no_grad()
def test_int4_share_is_close():
    model = build_tiny("deepseek_v3")
    op, orig = build_op(model, "model.layers.2.mlp.experts", gpu_experts=5, quant="int4", group_size=64)
    x, idx, w = routed(model, t=9)
    ref, got = orig(x, idx, w), op(x, idx, w)
    sqnr = 10 * torch.log10(ref.pow(2).mean() / (ref - got).pow(2).mean())
    assert sqnr > 18
    assert "5 on cpu as int4" in repr(op) and "3 on cpu" in repr(op)


def test_strategies_and_profile(tmp_path):
    cfg = build_tiny("deepseek_v2", num_hidden_layers=4).config       # MoE layers 1, 2, 3; 8 experts
    counts = [5, 0, 9, 1, 7, 3, 2, 8]
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"version": 1, "counts": {"model.layers.2.mlp.experts": counts}}))
    sel = lambda name, **o: select_gpu_experts(name, cfg, 8, GpuExpertsOptions(**o))   # noqa: E731
    assert sel("model.layers.2.mlp.experts", gpu_experts=3) == [0, 1, 2]
    assert sel("model.layers.2.mlp.experts", gpu_experts=3, profile=str(prof)) == [2, 4, 7]
    assert sel("model.layers.2.mlp.experts", gpu_experts=3, strategy="frequency", profile=str(prof)) == [2, 4, 7]
    # front-loading: budget 4 x 3 layers = 12: layer 1 gets 8, layer 2 gets 4, layer 3 none
    fl = [len(sel(f"model.layers.{i}.mlp.experts", gpu_experts=4, strategy="front-loading")) for i in (1, 2, 3)]
    assert fl == [8, 4, 0]
    with pytest.raises(ModelError, match="frequency"):
        sel("model.layers.1.mlp.experts", gpu_experts=3, strategy="frequency", profile=str(prof))
    with pytest.raises(ValueError, match="profile"):
        GpuExpertsOptions(strategy="frequency")
    with pytest.raises(Exception, match="strategy"):
        make_options(get("gpu_experts"), {"strategy": "random"})
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ModelError, match="not an expert profile"):
        sel("model.layers.1.mlp.experts", gpu_experts=2, profile=str(bad))


@torch.no_grad()
def test_whole_model_front_loading():
    model = build_tiny("deepseek_v3")
    ours = copy.deepcopy(model)
    for i in (1, 2):
        name = f"model.layers.{i}.mlp.experts"
        op, _ = build_op(ours, name, gpu_experts=4, strategy="front-loading")
        ours.model.layers[i].mlp.experts = op
    ids = torch.randint(0, 512, (2, 11), generator=torch.Generator().manual_seed(0))
    assert close(model(ids).logits, ours(ids).logits)
    assert len(ours.model.layers[1].mlp.experts.gpu_ids) == 8 and not ours.model.layers[2].mlp.experts.gpu_ids


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["bf16", "int4"])
@pytest.mark.parametrize("n_gpu", [-1, 5])
@torch.no_grad()
def test_gpu_paths(quant, n_gpu):
    model = build_tiny("deepseek_v2", dtype=torch.bfloat16)
    name = "model.layers.1.mlp.experts"
    op, orig = build_op(model, name, device="cuda", dtype=torch.bfloat16, gpu_experts=n_gpu, quant=quant)
    # the same operator on the CPU runs the reference (grouped, torch) math on the same quantized weights
    cpu_op, _ = build_op(model, name, device="cpu", dtype=torch.float32, gpu_experts=n_gpu, quant=quant)
    for t in (1, 4, 40):               # slots path (T*k <= 64) and grouped path
        x, idx, w = routed(model, t=t, seed=t)
        x = x.to(torch.bfloat16)
        ref = orig(x.float().to(torch.bfloat16), idx, w).float()
        same_math = cpu_op(x.float(), idx, w).float()
        got = op(x.cuda(), idx.cuda(), w.cuda()).float().cpu()
        db = lambda r, g: float(10 * torch.log10(r.pow(2).mean() / (r - g).pow(2).mean()))   # noqa: E731
        assert db(same_math, got) > 30, (t, db(same_math, got))
        # against the unquantized experts: int4 group-128 noise only (about 16-20 dB on random weights)
        assert db(ref, got) > (12 if quant == "int4" else 30), (t, db(ref, got))
    assert op.path(2) == "slots" and op.path(80) == "grouped"
