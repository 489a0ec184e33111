"""The '-gpu' (everything on the GPU) and '-hot' (N hot experts per layer on the GPU) overlays:
planned as documented, and correct when loaded (remapped to the CPU here; on CUDA in gpu tests)."""
from __future__ import annotations

import pytest
import torch

from ktinject import optimize_and_load
from ktinject.rules.plan import plan
from ktinject.testing import FAMILIES, bf16_error_bound, build_tiny, save_tiny, tiny_config

PACK = {f: f.replace("_", "-") for f in FAMILIES}
EXPERTS = {"deepseek_v2": "n_routed_experts", "deepseek_v3": "n_routed_experts", "qwen2_moe": "num_experts",
           "qwen3_moe": "num_experts", "mixtral": "num_local_experts"}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("overlay", ["-gpu", "-hot"])
def test_overlay_plans(family, overlay):
    config = tiny_config(family, **{EXPERTS[family]: 16})
    p = plan(config, PACK[family] + overlay)
    experts = [e for e in p.entries if e.name.endswith("mlp.experts")]
    assert experts and all(e.op == "gpu_experts" and e.device == "cuda" and not e.recursive for e in experts)
    blocks = [p.by_name()[e.name.rsplit(".", 1)[0]] for e in experts]
    assert all(b.op == "keep" for b in blocks)               # the model's own MoE block calls them
    assert not p.unmatched_rules and len(p.overridden_rules) == 2
    hybrid = plan(config, PACK[family])
    assert sum(p.totals.values()) >= sum(hybrid.totals.values()) * 0.5
    if overlay == "-gpu":
        assert all(set(e.bytes) == {"cuda"} for e in experts)
        assert set(p.totals) == {"cuda", "cpu"} and p.totals["cpu"] == p.by_name()["model.embed_tokens"].bytes["cpu"]
    else:                                                   # 8 of 16 experts on the GPU, the rest on the CPU
        assert all(e.bytes["cuda"] > 0 and e.bytes["cpu"] > 0 for e in experts)


REMAP = """version: 1
include: [{pack}]
remap: {{cuda: cpu}}
defaults: {{dtype: float32}}
"""


@pytest.mark.parametrize("family", ["deepseek_v2", "qwen2_moe", "mixtral"])
@pytest.mark.parametrize("overlay", ["-gpu", "-hot"])
def test_overlay_math_on_cpu(family, overlay, tmp_path):
    wide = {EXPERTS[family]: 16}                 # 16 experts: '-hot' keeps 8 on the "GPU", 8 on the CPU
    d = save_tiny(family, tmp_path / family, **wide)
    rules = tmp_path / "cpu.yaml"
    rules.write_text(REMAP.format(pack=PACK[family] + overlay))
    model, _ = optimize_and_load(d, str(rules), tokenizer=False)
    ids = torch.randint(3, 500, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, want = model(ids).logits, build_tiny(family, **wide)(ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("overlay", ["-gpu", "-hot"])
def test_overlay_on_gpu(family, overlay, tmp_path):
    d = save_tiny(family, tmp_path / family)
    model, _ = optimize_and_load(d, PACK[family] + overlay)
    ids = torch.randint(3, 500, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = model(ids).logits
    rel, bf16_rel = bf16_error_bound(family, ids, got)
    assert rel < max(3 * bf16_rel, 1e-2), (rel, bf16_rel)
