"""plan(): pure data over a config; the hybrid packs planned without CUDA; precedence rules."""
from __future__ import annotations

import json
import textwrap

import pytest
import torch

from ktinject.errors import PlacementError, RuleError
from ktinject.rules.plan import plan
from ktinject.rules.skeleton import build_skeleton
from ktinject.testing import FAMILIES, tiny_config

PACK = {f: f.replace("_", "-") for f in FAMILIES}


def write(tmp_path, text, name="r.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text).lstrip("\n"))
    return p


@pytest.mark.parametrize("family", FAMILIES)
def test_hybrid_pack_layout(family):
    config = tiny_config(family)
    p = plan(config, PACK[family])
    by = p.by_name()
    assert by["model.embed_tokens"].device == "cpu" and by["model.embed_tokens"].rule
    moe_layers = [e for e in p.entries if e.name.endswith("mlp.experts")]
    assert moe_layers and all(e.op == "cpu_experts" and e.device == "cpu" and not e.recursive for e in moe_layers)
    blocks = [by[e.name.rsplit(".", 1)[0]] for e in moe_layers]
    assert all(b.op == "moe" and b.device == "cuda" and b.recursive for b in blocks)
    # nothing inside a recursive: false subtree is planned separately
    assert not any(".mlp.experts." in e.name for e in p.entries)
    assert all(e.device == "cuda" for e in p.entries if ".self_attn" in e.name)
    assert by["lm_head"].op == "linear" and by["lm_head"].device == "cuda"
    assert by["model.norm"].device == "cuda" and by["model.norm"].op == "rms_norm"     # defaults' device
    norms = [e for e in p.entries if e.name.endswith("norm")]
    assert len(norms) > 2 * config.num_hidden_layers and all(e.op == "rms_norm" and e.device == "cuda" for e in norms)
    for e in p.entries:
        if "shared_expert" in e.name:
            assert e.device == "cuda"
    if family.startswith("deepseek"):
        assert by["model.layers.0.mlp"].device == "cuda" and by["model.layers.0.mlp"].rule   # dense layer
    assert p.unmatched_rules == ()
    # routed experts dominate the CPU total: all expert bytes are there, stored as bf16 by
    # cpu_experts (the float32 checkpoint is converted at load); the moe blocks count none of them
    assert all(b.bytes.get("cpu", 0) == 0 for b in blocks)
    expert_bytes = sum(e.bytes["cpu"] for e in moe_layers)
    e_count = getattr(config, "n_routed_experts", None) or getattr(config, "num_experts", None) or \
        config.num_local_experts
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    n_moe = len(moe_layers)
    routed = n_moe * e_count * 3 * inter * config.hidden_size
    assert expert_bytes == routed * 2
    # the hybrid packs store everything else in bfloat16 (defaults.dtype)
    assert p.default_dtype == "bfloat16"
    assert p.totals["cpu"] == expert_bytes + config.vocab_size * config.hidden_size * 2
    total_params = sum(t.numel() for t in _reference_tensors(family))
    assert sum(p.totals.values()) == total_params * 2


def _reference_tensors(family):
    from ktinject.rules.skeleton import build_skeleton
    m = build_skeleton(tiny_config(family))
    return [*m.parameters(), *m.buffers()]


@pytest.mark.parametrize("family", FAMILIES)
def test_cpu_overlay_moves_everything_to_cpu(family):
    p = plan(tiny_config(family), PACK[family] + "-cpu")
    assert set(p.totals) == {"cpu"}
    assert {e.device for e in p.entries} == {"cpu"}
    assert p.default_dtype == "float32"                  # the CPU overlays keep float32
    hybrid = plan(tiny_config(family), PACK[family], dtype=torch.float32)
    assert sum(p.totals.values()) == sum(hybrid.totals.values())   # (cpu_linear plans `auto` at float size)
    # every Linear cpu_linear and the embedding cpu_embedding (the cpu-linear rules, which win over the
    # family's lm_head and embedding rules); otherwise the family's rules, except the experts' own rule
    # (every core: no GPU to drive)
    skeleton = build_skeleton(tiny_config(family))
    linears = {n for n, m in skeleton.named_modules() if isinstance(m, torch.nn.Linear)}
    ops = {e.name: e.op for e in p.matched}
    assert linears and all(ops.get(n) == "cpu_linear" for n in linears)
    assert ops["model.embed_tokens"] == "cpu_embedding"
    ours = [e.rule for e in p.matched if "-cpu.yaml" not in e.rule and "cpu-linear.yaml" not in e.rule]
    assert ours == [e.rule for e in hybrid.matched if not e.name.endswith("mlp.experts")
                    and e.name not in linears and e.name != "model.embed_tokens"]
    assert {e.kwargs.get("threads", 0) for e in p.matched if e.name.endswith("mlp.experts")} == {0}
    assert {e.kwargs.get("threads") for e in hybrid.matched if e.name.endswith("mlp.experts")} == {-1}
    # with cpu-float first, the float layout: the family's own rules for the linears and the embedding
    floats = plan(tiny_config(family), ["cpu-float", PACK[family] + "-cpu"])
    fops = {e.name: e.op for e in floats.matched}
    assert fops["lm_head"] == "linear" and fops["model.embed_tokens"] == "keep"
    assert "cpu_linear" not in fops.values() and "cpu_embedding" not in fops.values()


def test_first_match_wins_and_inheritance(tmp_path):
    r = write(tmp_path, r"""
        version: 1
        defaults: {device: cpu}
        rules:
          - match: {name: 'model\.layers\.0\.self_attn'}
            replace: {op: keep, device: cuda:1}
          - match: {name: 'model\.layers\.\d+\.self_attn'}
            replace: {op: keep, device: cuda}
          - match: {class: Linear}
            replace: {op: linear}
          - match: {name: 'nothing\.matches'}
            replace: {op: keep}
        """)
    p = plan(tiny_config("mixtral"), r)
    by = p.by_name()
    assert by["model.layers.0.self_attn"].device == "cuda:1" and by["model.layers.0.self_attn"].rule.endswith(":4")
    assert by["model.layers.1.self_attn"].device == "cuda" and by["model.layers.1.self_attn"].rule.endswith(":6")
    # children of a matched keep are visited: q_proj matches the Linear rule and inherits cuda:1
    q = by["model.layers.0.self_attn.q_proj"]
    assert q.op == "linear" and q.device == "cuda:1" and q.rule.endswith(":8")
    assert by["model.layers.0.mlp"].device == "cpu" and by["model.layers.0.mlp"].rule is None
    assert by["lm_head"].op == "linear" and by["lm_head"].device == "cpu"
    assert len(p.unmatched_rules) == 1 and ":10" in p.unmatched_rules[0]
    assert by[""].device == "cpu"


def test_class_match_by_qualified_name_and_base_class(tmp_path):
    r = write(tmp_path, """
        version: 1
        rules:
          - match: {class: transformers.models.mixtral.modeling_mixtral.MixtralRMSNorm}
            replace: {op: keep, device: cuda}
          - match: {name: 'model\\.layers\\.\\d+', class: Module}
            replace: {op: keep, device: cuda:2}
            recursive: false
        """)
    p = plan(tiny_config("mixtral"), r)
    by = p.by_name()
    assert by["model.norm"].device == "cuda" and by["model.norm"].rule.endswith(":3")
    assert by["model.layers.0"].device == "cuda:2"
    assert not any(e.name.startswith("model.layers.0.") for e in p.entries)
    assert by["model.layers.0"].bytes["cuda:2"] > 0 and by["model.layers"].rule is None


def test_phase_split_rule_is_planned_with_both_devices(tmp_path):
    r = write(tmp_path, r"""
        version: 1
        rules:
          - match: {name: 'model\.layers\.\d+\.mlp\.experts'}
            replace: {op: experts, prefill_device: cuda, generate_device: cpu}
        """)
    p = plan(tiny_config("qwen3_moe"), r)
    e = p.entry("model.layers.0.mlp.experts")
    assert e.split and e.prefill_device == "cuda" and e.device == "cpu"
    assert e.bytes["cuda"] == e.bytes["cpu"] > 0 and not e.recursive


def test_placement_error_without_cuda_and_recorded_fallback(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("checks the no-CUDA path")
    with pytest.raises(PlacementError) as info:
        plan(tiny_config("deepseek_v2"), "deepseek-v2", check_devices=True)
    assert "-cpu" in str(info.value)
    r = write(tmp_path, r"""
        version: 1
        defaults: {device: cpu}
        rules:
          - match: {name: 'lm_head'}
            replace: {op: linear, device: cuda, fallback_device: cpu}
        """)
    p = plan(tiny_config("mixtral"), r, check_devices=True)
    e = p.entry("lm_head")
    assert e.device == "cpu" and "cuda -> cpu" in e.fallback and p.fallbacks == (e,)
    assert plan(tiny_config("mixtral"), r).entry("lm_head").device == "cuda"   # pure plan: no device check


def test_op_that_cannot_replace_the_class(tmp_path):
    r = write(tmp_path, r"""
        version: 1
        rules:
          - match: {name: 'model\.norm'}
            replace: {op: linear}
        """)
    with pytest.raises(RuleError) as info:
        plan(tiny_config("mixtral"), r)
    assert info.value.line == 3 and "Linear" in info.value.allowed and "MixtralRMSNorm" in str(info.value)


def test_dtype_precedence(tmp_path):
    r = write(tmp_path, r"""
        version: 1
        defaults: {dtype: bfloat16}
        rules:
          - match: {name: 'lm_head'}
            replace: {op: linear, dtype: float16}
        """)
    p = plan(tiny_config("mixtral"), r)
    assert p.default_dtype == "bfloat16" and p.entry("lm_head").dtype == "float16"
    assert p.entry("model.norm").dtype == "bfloat16"
    assert p.entry("lm_head").bytes["cpu"] == 512 * 256 * 2
    p32 = plan(tiny_config("mixtral"), r, dtype=torch.float32)
    assert p32.entry("model.norm").dtype == "float32" and p32.entry("lm_head").dtype == "float16"


def test_plan_is_json_and_pure(tmp_path):
    config = tiny_config("deepseek_v3")
    a, b = plan(config, "deepseek-v3"), plan(config, "deepseek-v3")
    assert a == b
    data = json.loads(a.to_json())
    assert data["totals"] == dict(a.totals) and data["unmatched_rules"] == []
    mod = {m["name"]: m for m in data["modules"]}
    assert mod["model.layers.1.mlp.experts"]["op"] == "cpu_experts" and mod["model.layers.1.mlp.experts"]["rule"]


def test_plan_accepts_a_skeleton():
    from ktinject.rules.skeleton import build_skeleton
    sk = build_skeleton(tiny_config("qwen2_moe"))
    assert all(p.is_meta for p in sk.parameters())
    assert not sk.model.rotary_emb.inv_freq.is_meta
    assert plan(sk, "qwen2-moe").totals == plan(tiny_config("qwen2_moe"), "qwen2-moe").totals


def test_example_rule_file_plans():
    from pathlib import Path
    example = Path(__file__).resolve().parents[1] / "examples" / "custom_rule.yaml"
    p = plan(tiny_config("deepseek_v2"), example)
    by = p.by_name()
    assert by["model.layers.1.mlp.experts"].device == "cuda" and by["model.layers.2.mlp.experts"].device == "cuda"
    assert by["lm_head"].dtype == "float32" and by["model.norm"].dtype == "bfloat16"
    # the tiny model has two MoE layers, both taken by the example: the pack's experts rule and its
    # lm_head rule are overridden (reported apart from rules that match nothing)
    assert not p.unmatched_rules
    assert len(p.overridden_rules) == 2 and all("deepseek-v2.yaml" in r for r in p.overridden_rules)


def test_overridden_rules_are_reported_apart_from_unmatched(tmp_path):
    r = write(tmp_path, r"""
        version: 1
        include: [qwen3-moe]
        rules:
          - match: {name: 'lm_head'}
            replace: {op: keep}
          - match: {name: 'model\.nothing'}
            replace: {op: keep}
        """)
    p = plan(tiny_config("qwen3_moe"), str(r))
    assert len(p.unmatched_rules) == 1 and "nothing" in p.unmatched_rules[0]
    assert len(p.overridden_rules) == 1 and "qwen3-moe.yaml" in p.overridden_rules[0] \
        and "lm_head" in p.overridden_rules[0]
    assert p.to_dict()["overridden_rules"] == list(p.overridden_rules)


def test_plan_counts_the_gguf_bytes_the_cpu_operators_keep(tmp_path):
    """With a GGUF file's header (`stored`, as `ktinject explain` and the loader pass it), the operators that keep
    the file's blocks count the file's bytes: cpu_experts its two stacked tensors, cpu_linear and cpu_embedding
    their weight; the `moe` and `mla_attention` blocks above them count nothing of what their children hold.
    Without it the plan counts upper bounds (float sizes, the bf16 conversion)."""
    from ktinject import optimize_and_load
    from ktinject.testing import save_tiny
    from ktinject.weights import gguf_write, open_source
    path = gguf_write.convert_model(save_tiny("deepseek_v2", tmp_path / "hf"), tmp_path / "m.gguf", "q4_k_m",
                                    progress=False)[0]
    src = open_source(path)
    try:
        config = src.config
        p = plan(config, "deepseek-v2-cpu", stored=src.stored)
        upper = plan(config, "deepseek-v2-cpu")
        by = {e.name: e for e in p.entries}
        assert by["model.layers.0.self_attn.kv_b_proj"].op == "cpu_linear"
        for e in p.entries:
            n = sum(e.bytes.values())
            if e.op == "cpu_experts":
                assert n == src.stored(e.name + ".gate_up_proj").nbytes + src.stored(e.name + ".down_proj").nbytes
            elif e.op in ("cpu_linear", "cpu_embedding"):
                bias = 4 * src[e.name + ".bias"].numel() if e.name + ".bias" in src else 0
                st = src.stored(e.name + ".weight")
                if st.layout == "plain":
                    assert n == st.nbytes + bias, e.name
                else:   # (kv_b_proj, split in two in the file, is joined at load: its float size)
                    assert n == sum(x.bytes["cpu"] for x in upper.entries if x.name == e.name), e.name
            elif e.op in ("moe", "mla_attention"):
                assert n == 0, (e.name, e.bytes)
        assert by["model.layers.1.mlp.experts"].op == "cpu_experts"
        file_bytes = sum(src.stored(k).nbytes for k in src)
        assert file_bytes <= p.totals["cpu"] < 1.25 * file_bytes   # (kv_b_proj, norms and router in float32)
        assert upper.totals["cpu"] > 1.5 * p.totals["cpu"]
    finally:
        src.close()
    model, _ = optimize_and_load(path, "deepseek-v2-cpu", tokenizer=False)
    assert model.ktinject_plan.totals == p.totals
