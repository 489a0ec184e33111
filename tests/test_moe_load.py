"""`cpu_experts` and `moe` through the real loader (`optimize_and_load`) with YAML rules, on
tiny models saved as safetensors: the whole model's logits match the original's."""
from __future__ import annotations

import pytest
import torch

from ktinject import native
from ktinject.testing import save_tiny

from test_native_util import rel_err

pytestmark = pytest.mark.skipif(not native.available(), reason="native extension not built")

RULES = {
    "cpu_experts": """
version: 1
defaults: {device: cpu}
rules:
  - match: {name: 'model\\.layers\\.\\d+\\.mlp\\.experts'}
    replace: {op: cpu_experts, kwargs: {threads: 2, quant: bf16}}
    recursive: false
""",
    "moe": """
version: 1
defaults: {device: cpu}
rules:
  - match: {name: 'model\\.layers\\.\\d+\\.mlp', class: [DeepseekV2Moe, Qwen2MoeSparseMoeBlock]}
    replace: {op: moe, kwargs: {threads: 2, quant: bf16}}
""",
}


@pytest.mark.parametrize("family", ["deepseek_v2", "qwen2_moe"])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_loaded_model_matches(tmp_path, family, rule):
    from ktinject.load import optimize_and_load
    from transformers import AutoModelForCausalLM
    path = save_tiny(family, tmp_path / "m")
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES[rule])
    model, _ = optimize_and_load(str(path), str(rules), tokenizer=False)
    kinds = {type(m).__name__ for m in model.modules()}
    assert ("CpuExperts" if rule == "cpu_experts" else "OverlappedMoe") in kinds
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.randint(0, 500, (1, 12))
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids).logits
    assert rel_err(got, want) < 2e-2
