"""`cpu_experts` and `moe` against the transformers modules they replace, on the tiny models
of all five families; GGUF-style weights (FusedTensor of GGMLTensors, mixed types) against the
reference on dequantized weights; options and load errors.

Tolerances (relative L2 error): bf16 storage 1e-2 (weights rounded to bf16, activations f32);
q8_0 storage 3e-2 (8-bit weights and on-the-fly 8-bit activations)."""
from __future__ import annotations

import copy

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from ktinject import native
from ktinject.errors import LoadError, ModelError, UnsupportedQuantError
from ktinject.operators import registry
from ktinject.operators.base import BuildContext
from ktinject.testing import FAMILIES, first_moe_block, random_routing
from ktinject.weights.tensor import FusedTensor, GGMLTensor

from test_native_util import dequant, rand_rows, ref_moe, rel_err

pytestmark = pytest.mark.skipif(not native.available(), reason="native extension not built")
CPU = torch.device("cpu")


def _ctx(model, options, name="model.layers.1.mlp"):
    return BuildContext(name, CPU, CPU, CPU, None, model.config, options)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_registered():
    assert {"cpu_experts", "moe"} <= set(registry.names())
    cls = registry.get("cpu_experts")
    assert "DeepseekV2Experts" in cls.replaces and "MixtralExperts" in cls.replaces


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("quant,tol", [("bf16", 1e-2), ("q8_0", 3e-2)])
def test_cpu_experts_matches_transformers(family, quant, tol):
    model, block = first_moe_block(family)
    orig = block.experts
    Op = registry.get("cpu_experts")
    op = Op.build(copy.deepcopy(orig).to("meta"), _ctx(model, Op.Options(threads=2, quant=quant)))
    keys = op.load_weights("e.", {"e.gate_up_proj": orig.gate_up_proj.data, "e.down_proj": orig.down_proj.data})
    assert keys == {"e.gate_up_proj", "e.down_proj"}
    k = model.config.num_experts_per_tok
    for T in (1, 40):
        x = torch.randn(T, model.config.hidden_size)
        ids, w = random_routing(T, op.num_experts, k, seed=T)
        with torch.no_grad():
            ref = orig(x, ids, w)
        out = op(x, ids, w)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert rel_err(out, ref) < tol, (family, quant, T)


def test_cpu_experts_returns_caller_dtype_and_async():
    model, block = first_moe_block("qwen3_moe")
    orig = block.experts
    Op = registry.get("cpu_experts")
    op = Op.build(orig, _ctx(model, Op.Options(threads=2)))
    op.load_weights("", {"gate_up_proj": orig.gate_up_proj.data, "down_proj": orig.down_proj.data})
    x = torch.randn(6, model.config.hidden_size).to(torch.bfloat16)
    ids, w = random_routing(6, op.num_experts, 2)
    op.submit(x, ids.to(torch.int32), w.to(torch.bfloat16))
    out = op.sync()
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    with torch.no_grad():
        ref = orig(x.float(), ids, w.to(torch.bfloat16).float())
    assert rel_err(out.float(), ref) < 2e-2


@pytest.mark.parametrize("gq,dq", [(QT.Q4_K, QT.Q5_0), (QT.IQ4_XS, QT.IQ4_XS), (QT.Q2_K, QT.Q3_K)],
                         ids=["q4_k-q5_0", "iq4_xs", "q2_k-q3_k"])
def test_cpu_experts_on_gguf_blocks(gq, dq):
    """GGUF layout: gate and up as a FusedTensor of two GGMLTensors (Q4_K), down in Q5_0 (what
    llama.cpp writes for rows of 1408 values), or all IQ4_XS; zero copy, against the dequantized
    reference; Q2_K gate / up with a Q3_K down as in a 2-bit file."""
    model, block = first_moe_block("deepseek_v2")
    E, H, I = block.experts.gate_up_proj.shape[0], model.config.hidden_size, model.config.moe_intermediate_size
    g, u, d = rand_rows(gq, E * I, H, 1), rand_rows(gq, E * I, H, 2), rand_rows(dq, E * H, I, 3)
    gu = FusedTensor((GGMLTensor(int(gq), (E, I, H), g, "blk.1.ffn_gate_exps.weight", "m.gguf"),
                      GGMLTensor(int(gq), (E, I, H), u, "blk.1.ffn_up_exps.weight", "m.gguf")), dim=1)
    down = GGMLTensor(int(dq), (E, H, I), d, "blk.1.ffn_down_exps.weight", "m.gguf")
    Op = registry.get("cpu_experts")
    op = Op.build(block.experts, _ctx(model, Op.Options(threads=2)))
    op.load_weights("p.", {"p.gate_up_proj": gu, "p.down_proj": down})
    assert op.kernel.gate.data.data_ptr() == g.data_ptr()            # zero copy
    G, U, D = dequant(gq, g, H).reshape(E, I, H), dequant(gq, u, H).reshape(E, I, H), \
        dequant(dq, d, I).reshape(E, H, I)
    for T in (1, 50):
        x = torch.randn(T, H)
        ids, w = random_routing(T, E, 2, seed=T)
        assert rel_err(op(x, ids, w), ref_moe(x, ids, w, G, U, D)) < 4e-2


def test_unsupported_ggml_type_is_an_error_unless_converted():
    model, block = first_moe_block("mixtral")
    E, I2, H = block.experts.gate_up_proj.shape
    q41 = GGMLTensor(int(QT.Q4_1), (E, I2, H), torch.zeros(E * I2, 20 * H // 32, dtype=torch.uint8),
                     "blk.0.ffn_gate_up_exps.weight", "m.gguf")
    Op = registry.get("cpu_experts")
    op = Op.build(block.experts, _ctx(model, Op.Options(threads=2)))
    src = {"gate_up_proj": q41, "down_proj": block.experts.down_proj.data}
    with pytest.raises(UnsupportedQuantError, match="Q4_1.*convert_unsupported") as exc:
        op.load_weights("", src)
    assert "m.gguf" in str(exc.value) and "blk.0.ffn_gate_up_exps.weight" in str(exc.value)
    op2 = Op.build(block.experts, _ctx(model, Op.Options(threads=2, convert_unsupported=True, quant="q8_0")))
    op2.load_weights("", src)
    assert op2.kernel.gate.ggml_type == int(QT.Q8_0)


def test_load_errors_name_the_tensor():
    model, block = first_moe_block("qwen2_moe")
    Op = registry.get("cpu_experts")
    op = Op.build(block.experts, _ctx(model, Op.Options(threads=2)))
    with pytest.raises(LoadError, match="mlp.experts.down_proj"):
        op.load_weights("mlp.experts.", {"mlp.experts.gate_up_proj": block.experts.gate_up_proj.data})
    bad = {"x.gate_up_proj": block.experts.gate_up_proj.data[:, :-32], "x.down_proj": block.experts.down_proj.data}
    with pytest.raises(LoadError, match="x.gate_up_proj"):
        op.load_weights("x.", bad)


def test_options_validate():
    Op = registry.get("cpu_experts")
    with pytest.raises(ValueError, match="quant"):
        Op.Options(quant="q3_k")
    with pytest.raises(ValueError, match="threads"):
        Op.Options(threads=1.5)
    assert Op.Options(threads=-1).threads == -1          # all CPUs but one
    with pytest.raises(ValueError, match="isa"):
        Op.Options(isa="neon")
    model, block = first_moe_block("qwen3_moe")
    model.config.hidden_act = "gelu"
    with pytest.raises(ModelError, match="gelu"):
        Op.build(block.experts, _ctx(model, Op.Options()))


def test_planned_bytes_follow_the_storage():
    model, block = first_moe_block("deepseek_v3")
    Op = registry.get("cpu_experts")
    n = sum(p.numel() for p in block.experts.parameters())
    assert Op.planned_bytes(block.experts, _ctx(model, Op.Options(quant="bf16"))) == {"cpu": 2 * n}
    assert Op.planned_bytes(block.experts, _ctx(model, Op.Options(quant="q4_k"))) == {"cpu": int(n * 4.5 / 8)}
    M = registry.get("moe")
    b = M.planned_bytes(block, _ctx(model, M.Options(quant="q8_0")))
    assert b["cpu"] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_block_matches_transformers(family):
    model, block = first_moe_block(family)
    M = registry.get("moe")
    op = M.build(copy.deepcopy(block).to("meta"), _ctx(model, M.Options(threads=2, quant="bf16")))
    src = {f"mlp.{k}": v for k, v in block.state_dict().items()}
    assert op.load_weights("mlp.", src) == set(src)
    for shape in ((1, 1), (2, 7)):
        x = torch.randn(*shape, model.config.hidden_size)
        with torch.no_grad():
            ref, out = block(x), op(x)
        assert out.shape == ref.shape
        assert rel_err(out, ref) < 1e-2, family


def test_moe_uses_an_already_replaced_experts_child():
    model, block = first_moe_block("deepseek_v2")
    Op, M = registry.get("cpu_experts"), registry.get("moe")
    meta = copy.deepcopy(block).to("meta")
    meta.experts = Op.build(meta.experts, _ctx(model, Op.Options(threads=2, quant="q8_0"), "mlp.experts"))
    op = M.build(meta, _ctx(model, M.Options()))
    assert op.experts is meta.experts
    src = {f"mlp.{k}": v for k, v in block.state_dict().items()}
    op.load_weights("mlp.", src)
    x = torch.randn(1, 3, model.config.hidden_size)
    with torch.no_grad():
        assert rel_err(op(x), block(x)) < 3e-2


def test_moe_rejects_unknown_blocks():
    model, _ = first_moe_block("mixtral")
    M = registry.get("moe")
    with pytest.raises(ModelError, match="not a supported MoE block"):
        M.build(torch.nn.Linear(4, 4), _ctx(model, M.Options()))


@pytest.mark.gpu
def test_moe_overlaps_gpu_shared_experts():
    """Router and shared experts on CUDA, routed experts on the CPU: same output as the block."""
    model, block = first_moe_block("deepseek_v2")
    M = registry.get("moe")
    cuda = torch.device("cuda")
    op = M.build(copy.deepcopy(block).to("meta"), BuildContext("mlp", cuda, cuda, cuda, None, model.config,
                                                                M.Options(threads=4)))
    src = {f"mlp.{k}": v for k, v in block.state_dict().items()}
    op.load_weights("mlp.", src)
    x = torch.randn(2, 5, model.config.hidden_size)
    with torch.no_grad():
        ref = block(x)
        out = op(x.to(cuda))
    assert out.device.type == "cuda"
    assert rel_err(out.cpu(), ref) < 1e-2
