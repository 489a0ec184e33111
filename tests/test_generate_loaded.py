"""The GPU operators through the real loader (rules -> plan -> build on meta -> strict load), on
the CPU: mla_attention (with a nested linear_int4), gpu_experts and the generation engine."""
import textwrap

import torch

import ktinject
from ktinject.generate import generate
from ktinject.load import optimize_and_load
from ktinject.operators.gpu_experts import GpuExperts
from ktinject.operators.kernels import int4_pack as P
from ktinject.operators.linear_int4 import Int4Linear
from ktinject.operators.mla_attention import MLAAttention
from ktinject.testing import build_tiny, save_tiny

RULES = """
version: 1
defaults: {{device: cpu, dtype: float32}}
rules:
  - match: {{name: 'model\\.layers\\.\\d+\\.self_attn\\.o_proj'}}
    replace: {{op: {o_proj_op}}}
  - match: {{name: 'model\\.layers\\.\\d+\\.self_attn', class: DeepseekV3Attention}}
    replace: {{op: mla_attention}}
  - match: {{name: 'model\\.layers\\.\\d+\\.mlp\\.experts'}}
    replace: {{op: gpu_experts, kwargs: {{gpu_experts: 3, strategy: front-loading}}}}
    recursive: false
"""


def load(tmp_path, o_proj_op):
    path = save_tiny("deepseek_v3", tmp_path / "m")
    rules = tmp_path / f"r_{o_proj_op}.yaml"
    rules.write_text(textwrap.dedent(RULES.format(o_proj_op=o_proj_op)))
    return optimize_and_load(path, [str(rules)])


@torch.no_grad()
def test_loaded_model_generates_like_transformers(tmp_path):
    model, tok = load(tmp_path, "keep")
    attn = model.model.layers[0].self_attn
    assert isinstance(attn, MLAAttention) and isinstance(model.model.layers[1].mlp.experts, GpuExperts)
    ref = build_tiny("deepseek_v3")
    prompt = "memory bandwidth"
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    seq = ids
    for _ in range(6):
        seq = torch.cat([seq, ref(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    res = ktinject.generate(model, tok, prompt, max_new_tokens=6, chunk_size=4)
    assert res.token_ids == seq[0, ids.shape[1]:].tolist()


@torch.no_grad()
def test_nested_int4_inside_mla(tmp_path):
    model, tok = load(tmp_path, "linear_int4")
    o_proj = model.model.layers[0].self_attn.o_proj
    assert isinstance(o_proj, Int4Linear) and o_proj.qweight.device.type == "cpu"
    ref = build_tiny("deepseek_v3")
    ids = torch.randint(0, 512, (1, 10), generator=torch.Generator().manual_seed(0))
    # the reference with each o_proj set to the dequantized int4 weight: the same math exactly
    for i, layer in enumerate(ref.model.layers):
        layer.self_attn.o_proj.weight.copy_(P.dequantize(model.model.layers[i].self_attn.o_proj.weight_int4))
    a, b = ref(ids).logits, model(ids).logits
    assert 10 * torch.log10(a.pow(2).mean() / (a - b).pow(2).mean()) > 60
    assert generate(model, tok, "abc", max_new_tokens=3).stop_reason in ("length", "eos")
