"""`ktinject synth` and `ktinject convert`: real shapes as data, random blocks, runnable files."""
import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from ktinject.cli import main
from ktinject.testing import FAMILIES, save_tiny, tiny_config
from ktinject.weights import as_dense, gguf_file, load_config, load_tokenizer, open_source, synth
from ktinject.weights.quants import QUANTS

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
CPU_PACK = {"deepseek_v2": "deepseek-v2-cpu", "deepseek_v3": "deepseek-v3-cpu", "qwen2_moe": "qwen2-moe-cpu",
            "qwen3_moe": "qwen3-moe-cpu", "mixtral": "mixtral-cpu"}


def test_real_dimensions():
    v2 = synth.model_config("deepseek-v2-lite")
    assert (v2.hidden_size, v2.num_hidden_layers, v2.first_k_dense_replace, v2.intermediate_size) == (2048, 27, 1, 10944)
    assert (v2.moe_intermediate_size, v2.n_routed_experts, v2.num_experts_per_tok, v2.n_shared_experts) == (1408, 64, 6, 2)
    assert (v2.kv_lora_rank, v2.q_lora_rank, v2.num_attention_heads, v2.vocab_size) == (512, None, 16, 102400)
    assert (v2.qk_nope_head_dim, v2.qk_rope_head_dim, v2.v_head_dim) == (128, 64, 128)
    v3 = synth.model_config("deepseek-v3")
    assert (v3.hidden_size, v3.num_hidden_layers, v3.n_routed_experts, v3.q_lora_rank, v3.n_group) == (7168, 61, 256, 1536, 8)
    q3 = synth.model_config("qwen3-30b-a3b")
    assert (q3.hidden_size, q3.num_hidden_layers, q3.num_experts, q3.moe_intermediate_size, q3.head_dim) == (2048, 48, 128, 768, 128)
    q2 = synth.model_config("qwen2-57b-a14b")
    assert (q2.hidden_size, q2.num_experts, q2.moe_intermediate_size, q2.shared_expert_intermediate_size) == (3584, 64, 2560, 20480)
    mx = synth.model_config("mixtral-8x7b", layers=3)
    assert (mx.hidden_size, mx.intermediate_size, mx.num_local_experts, mx.num_hidden_layers) == (4096, 14336, 8, 3)


@pytest.mark.parametrize("qt", sorted(synth.SCALES, key=int))
def test_random_blocks_have_target_std(qt):
    maker = synth.BlockMaker(qt, seed=1)
    blocks = maker.blocks(2048, std=0.01)
    values = QUANTS[qt].dequantize_blocks(blocks)
    assert torch.isfinite(values).all()
    assert 0.005 < float(values.std()) < 0.02, (qt.name, float(values.std()))
    assert abs(float(values.mean())) < 0.005


@pytest.mark.parametrize("family", FAMILIES)
def test_synth_tiny_family_runs(tmp_path, family):
    from ktinject.load import optimize_and_load
    config = tiny_config(family)
    path = synth.synthesize_config(config, tmp_path / "s.gguf", recipe_name="q4_k_m", progress=False)[0]
    src = open_source(path)
    shapes = gguf_file._expected_shapes(load_config(path))
    assert {k: tuple(src[k].shape) for k in src} == shapes
    model, tok = optimize_and_load(path, rules=CPU_PACK[family], dtype=torch.float32)
    with torch.no_grad():
        out = model(torch.tensor([tok("synthetic weights").input_ids])).logits
    assert torch.isfinite(out).all() and out.abs().max() < 1e3


def test_synth_activations_stay_finite_at_depth(tmp_path):
    """16 layers of random weights: the hidden states neither blow up nor vanish."""
    from transformers import AutoModelForCausalLM
    config = tiny_config("qwen3_moe", num_hidden_layers=16)
    path = synth.synthesize_config(config, tmp_path / "deep.gguf", recipe_name="q4_k_m", progress=False)[0]
    src = open_source(path)
    model = AutoModelForCausalLM.from_config(src.config, dtype=torch.float32)
    model.load_state_dict({k: as_dense(v) for k, v in src.items()}, strict=True)
    with torch.no_grad():
        hidden = model(torch.tensor([[1, 50, 60, 70]]), output_hidden_states=True).hidden_states
    norms = [float(h.norm(dim=-1).mean()) for h in hidden]
    assert all(0.1 < n < 1e3 for n in norms), norms


def test_real_shape_plan_without_writing():
    from ktinject.weights.gguf_write import recipe
    plan = {t.name: t for t in synth.plan_tensors(synth.model_config("mixtral-8x7b", layers=1), recipe("q4_k_m"))}
    assert plan["blk.0.ffn_gate_exps.weight"].shape == (8, 14336, 4096)
    assert plan["blk.0.ffn_down_exps.weight"].qtype == QT.Q6_K             # llama.cpp's more-bits layer
    assert plan["blk.0.attn_k.weight"].shape == (1024, 4096)
    assert plan["output.weight"].qtype == QT.Q6_K and plan["blk.0.ffn_gate_inp.weight"].qtype == QT.F32


def test_synth_cli(tmp_path, monkeypatch):
    monkeypatch.setitem(synth.SHAPES, "tiny-mixtral", ("mixtral", {k: v for k, v in tiny_config("mixtral").to_diff_dict().items() if k not in ("model_type", "transformers_version")}))
    out = tmp_path / "mix.gguf"
    assert main(["synth", "--arch", "tiny-mixtral", "--layers", "1", "--recipe", "q4_0", "--no-progress",
                 str(out)]) == 0
    r = gguf.GGUFReader(out)
    t = {x.name: x for x in r.tensors}
    assert list(t["blk.0.ffn_gate_exps.weight"].shape) == [256, 256, 4]
    assert t["blk.0.ffn_gate_exps.weight"].tensor_type == QT.Q4_0
    assert r.fields["llama.block_count"].contents() == 1
    assert r.fields["llama.expert_count"].contents() == 4
    assert load_tokenizer(out)("hi").input_ids == [3 + ord("h"), 3 + ord("i")]


@pytest.mark.slow
def test_synth_deepseek_v2_lite_two_layers(tmp_path):
    out = tmp_path / "v2.gguf"
    assert main(["synth", "--arch", "deepseek-v2-lite", "--layers", "2", "--no-progress", str(out)]) == 0
    t = {x.name: x for x in gguf.GGUFReader(out).tensors}
    assert list(t["blk.1.ffn_gate_exps.weight"].shape) == [2048, 1408, 64]
    assert list(t["blk.0.ffn_down.weight"].shape) == [10944, 2048]
    assert t["blk.0.ffn_down.weight"].tensor_type == QT.Q5_0            # 10944 is not a multiple of 256
    assert list(t["blk.1.attn_k_b.weight"].shape) == [128, 512, 16]
    assert "blk.0.attn_q_a.weight" not in t and list(t["blk.0.attn_q.weight"].shape) == [2048, 3072]
    cfg = load_config(out)
    assert (cfg.num_hidden_layers, cfg.moe_intermediate_size, cfg.q_lora_rank) == (2, 1408, None)


def test_convert_cli_and_errors(tmp_path, capsys):
    hf = save_tiny("mixtral", tmp_path / "hf")
    out = tmp_path / "m.gguf"
    assert main(["convert", str(hf), str(out), "--preset", "q8_0", "--no-progress"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert type(load_config(out)).__name__ == "MixtralConfig"
    assert main(["convert", str(tmp_path / "nothing"), str(out)]) == 2
    assert "nothing" in capsys.readouterr().err
    assert main(["synth", "--arch", "qwen3-30b-a3b", "--layers", "0", str(out)]) == 2
