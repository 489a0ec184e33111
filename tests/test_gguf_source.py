"""GGUF weight source: names, layouts, values, config and tokenizer from metadata, split files."""
import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from ktinject.testing import FAMILIES, save_tiny
from ktinject.weights import FusedTensor, GGMLTensor, as_dense, gguf_config, gguf_file, gguf_names, gguf_write
from ktinject.weights import load_config, load_tokenizer, open_source

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
IGNORED_CONFIG_KEYS = {"transformers_version", "architectures", "_name_or_path", "dtype", "torch_dtype",
                       "bos_token_id", "eos_token_id", "pad_token_id"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> (HF dir, {preset: gguf path})."""
    root = tmp_path_factory.mktemp("gguf_src")
    out = {}
    for fam in FAMILIES:
        hf = save_tiny(fam, root / fam)
        files = {p: gguf_write.convert_model(hf, root / f"{fam}-{p}.gguf", p, progress=False)[0]
                 for p in ("f32", "q4_k_m")}
        out[fam] = (hf, files)
    return out


def _hf_state(hf_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).state_dict()


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_values_identical(tiny, family):
    hf, files = tiny[family]
    sd = _hf_state(hf)
    src = open_source(files["f32"])
    assert set(src) == set(sd)
    for key, want in sd.items():
        got = as_dense(src[key], torch.float32)
        assert got.shape == want.shape, key
        assert torch.equal(got, want), key
    src.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_keys_types_and_values(tiny, family):
    hf, files = tiny[family]
    sd = _hf_state(hf)
    src = open_source(files["q4_k_m"])
    assert set(src) == set(sd)
    arch = src.arch
    for key, want in sd.items():
        value = src[key]
        assert tuple(value.shape) == tuple(want.shape), key
        if key.endswith("experts.gate_up_proj"):
            assert isinstance(value, FusedTensor) and all(isinstance(p, GGMLTensor) for p in value.parts)
        elif want.dim() == 1:
            assert isinstance(value, torch.Tensor) and value.dtype == torch.float32, key
        # what we read back is exactly what the writer encoded from the original values
        row, names = gguf_names.gguf_names_for(arch, key)
        parts = gguf_names.write_layout(row.layout, want, src.config)
        for name, part in zip(names, parts):
            qt = gguf_write.choose_type(gguf_write.recipe("q4_k_m"), name, tuple(part.shape),
                                        src.config.num_hidden_layers)
            stored = src.model.where[name].tensor(name)
            if isinstance(stored, GGMLTensor):
                assert stored.ggml_type == int(qt), name
                expect = torch.from_numpy(gguf_write.encode(part, qt)).reshape(stored.data.shape)
                assert torch.equal(stored.data, expect), name
            else:
                assert torch.equal(stored.float(), part.float()), name
        dense = as_dense(value, torch.float32)
        rel = (dense - want).norm() / want.norm().clamp(min=1e-12)
        assert rel < 0.1, (key, float(rel))


def test_expert_layout_and_zero_copy(tiny):
    hf, files = tiny["qwen3_moe"]
    src = open_source(files["q4_k_m"])
    fused = src["model.layers.0.mlp.experts.gate_up_proj"]          # [E, 2I, H]
    gate, up = fused.parts
    assert gate.shape == (8, 256, 256) and gate.data.shape == (8 * 256, 144)
    assert gate.type_name == "Q4_K" and gate.name == "blk.0.ffn_gate_exps.weight"
    mm = src.model.where[gate.name].reader.data
    base = mm.ctypes.data
    assert base <= gate.data.data_ptr() < base + mm.nbytes             # a view of the mapped file
    e3 = gate.select(3).dequantize()
    assert torch.equal(e3, gate.dequantize()[3])
    assert src.origin("model.layers.0.mlp.experts.gate_up_proj") == str(files["q4_k_m"])


@pytest.mark.parametrize("family", FAMILIES)
def test_config_and_tokenizer_round_trip(tiny, family):
    from transformers import AutoConfig, AutoTokenizer
    hf, files = tiny[family]
    want = AutoConfig.from_pretrained(hf).to_dict()
    got = load_config(files["q4_k_m"]).to_dict()
    diff = {k: (want.get(k), got.get(k)) for k in set(want) | set(got)
            if k not in IGNORED_CONFIG_KEYS and want.get(k) != got.get(k)}
    if family == "mixtral":                   # written explicitly as rope.dimension_count
        assert diff.pop("head_dim") == (None, 64)
    assert not diff
    tok_hf, tok = AutoTokenizer.from_pretrained(hf), load_tokenizer(files["q4_k_m"])
    text = "Hello, wörld!\n  tabs\tand 123"
    assert tok(text).input_ids == tok_hf(text).input_ids
    assert tok.decode(tok(text).input_ids) == text
    assert (tok.bos_token, tok.eos_token) == (tok_hf.bos_token, tok_hf.eos_token)
    # an HF config directory overrides the metadata
    assert type(load_config(files["q4_k_m"], hf)).__name__ == type(load_config(hf)).__name__


def test_llama_cpp_metadata_keys(tiny):
    hf, files = tiny["deepseek_v2"]
    r = gguf.GGUFReader(files["q4_k_m"])
    f = {k: v.contents() for k, v in r.fields.items() if not k.startswith("tokenizer.ggml.")}
    assert f["general.architecture"] == "deepseek2"
    assert f["deepseek2.block_count"] == 3 and f["deepseek2.embedding_length"] == 256
    assert f["deepseek2.expert_count"] == 8 and f["deepseek2.expert_used_count"] == 2
    assert f["deepseek2.expert_feed_forward_length"] == 256 and f["deepseek2.leading_dense_block_count"] == 1
    assert f["deepseek2.attention.kv_lora_rank"] == 64 and "deepseek2.attention.q_lora_rank" not in f
    assert f["deepseek2.attention.key_length_mla"] == 48 and f["deepseek2.rope.dimension_count"] == 16
    assert f["general.file_type"] == 15 and "tokenizer.ggml.tokens" in r.fields
    names = {t.name: t for t in r.tensors}
    assert {"blk.1.attn_k_b.weight", "blk.1.attn_v_b.weight", "blk.1.ffn_gate_exps.weight",
            "blk.1.ffn_gate_shexp.weight", "blk.0.ffn_down.weight", "output.weight"} <= set(names)
    assert list(names["blk.1.ffn_gate_exps.weight"].shape) == [256, 256, 8]          # ne: fastest first
    assert names["blk.1.attn_norm.weight"].tensor_type == QT.F32
    assert names["blk.1.ffn_gate_inp.weight"].tensor_type == QT.F32
    assert names["output.weight"].tensor_type == QT.Q6_K
    assert names["blk.1.attn_k_b.weight"].tensor_type == QT.Q5_0      # rows of 32: Q4_K falls back to Q5_0


def test_deepseek_v3_routing_metadata(tiny):
    hf, files = tiny["deepseek_v3"]
    cfg = load_config(files["f32"])
    assert type(cfg).__name__ == "DeepseekV3Config"
    assert (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor, cfg.q_lora_rank) == (4, 2, 2.5, 96)
    src = open_source(files["f32"])
    assert src.gguf_names("model.layers.1.mlp.gate.e_score_correction_bias") == ("blk.1.exp_probs_b.bias",)


def _meta(**over):
    base = {"general.architecture": "deepseek2", "deepseek2.embedding_length": 2048, "deepseek2.block_count": 27,
            "deepseek2.attention.head_count": 16, "deepseek2.attention.head_count_kv": 16,
            "deepseek2.vocab_size": 102400, "deepseek2.rope.dimension_count": 64,
            "deepseek2.attention.key_length": 192, "deepseek2.attention.value_length": 128,
            "deepseek2.attention.kv_lora_rank": 512, "deepseek2.expert_count": 64,
            "deepseek2.rope.scaling.type": "yarn", "deepseek2.rope.scaling.factor": 40.0,
            "deepseek2.rope.scaling.original_context_length": 4096,
            "deepseek2.rope.scaling.yarn_log_multiplier": 0.0707}
    base.update(over)
    return {k: v for k, v in base.items() if v is not None}


@pytest.mark.parametrize("q_lora", [None, 0, 1536])
def test_q_lora_absent_zero_or_set(q_lora):
    cfg = gguf_config.config_from_metadata(_meta(**{"deepseek2.attention.q_lora_rank": q_lora}), ["output.weight"])
    assert cfg.q_lora_rank == (q_lora or None)
    assert (cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.num_key_value_heads) == (128, 128, 16)
    assert cfg.rope_parameters["rope_type"] == "yarn" and abs(cfg.rope_parameters["mscale_all_dim"] - 0.707) < 1e-6


def test_mla_form_head_sizes_and_v3_gating():
    cfg = gguf_config.config_from_metadata(_meta(**{
        "deepseek2.attention.key_length": 576, "deepseek2.attention.value_length": 512,
        "deepseek2.attention.key_length_mla": 192, "deepseek2.attention.value_length_mla": 128,
        "deepseek2.attention.head_count_kv": 1, "deepseek2.expert_gating_func": 2,
        "deepseek2.expert_group_count": 8, "deepseek2.expert_group_used_count": 4}), [])
    assert type(cfg).__name__ == "DeepseekV3Config" and cfg.tie_word_embeddings
    assert (cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.num_key_value_heads, cfg.n_group) == (128, 128, 16, 8)


def test_qwen3_expert_feed_forward_length_is_read():
    meta = {"general.architecture": "qwen3moe", "qwen3moe.embedding_length": 2048, "qwen3moe.block_count": 48,
            "qwen3moe.attention.head_count": 32, "qwen3moe.attention.head_count_kv": 4, "qwen3moe.vocab_size": 151936,
            "qwen3moe.feed_forward_length": 6144, "qwen3moe.expert_feed_forward_length": 768,
            "qwen3moe.expert_count": 128, "qwen3moe.expert_used_count": 8, "qwen3moe.attention.key_length": 128}
    cfg = gguf_config.config_from_metadata(meta, ["output.weight"])
    assert (cfg.moe_intermediate_size, cfg.head_dim, cfg.num_experts) == (768, 128, 128)


@pytest.mark.parametrize("as_dir", [False, True])
def test_split_files(tiny, tmp_path, as_dir):
    hf, files = tiny["qwen2_moe"]
    parts = gguf_write.convert_model(hf, tmp_path / "m.gguf", "q8_0", split_max_tensors=12, progress=False)
    assert len(parts) >= 3 and parts[0].name == f"m-00001-of-{len(parts):05d}.gguf"
    single = gguf_write.convert_model(hf, tmp_path / "single" / "s.gguf", "q8_0", progress=False)[0]
    src = open_source(tmp_path if as_dir else parts[0])
    ref = open_source(single)
    assert set(src) == set(ref)
    for key in ref:
        assert torch.equal(as_dense(src[key]), as_dense(ref[key])), key
    assert {src.origin(k) for k in src} == {str(p) for p in parts}
    assert type(load_config(parts[0])).__name__ == "Qwen2MoeConfig"


def test_old_style_attn_kv_b(tiny, tmp_path, monkeypatch):
    hf, files = tiny["deepseek_v2"]
    rows = [gguf_names.Row(r.hf, r.gguf, r.layout, write=not r.write) if "kv_b_proj" in r.hf else r
            for r in gguf_names.TABLES["deepseek2"]]
    monkeypatch.setitem(gguf_names.TABLES, "deepseek2", rows)
    path = gguf_write.convert_model(hf, tmp_path / "old.gguf", "f32", progress=False)[0]
    monkeypatch.undo()
    src = open_source(path)
    assert src.gguf_names("model.layers.0.self_attn.kv_b_proj.weight") == ("blk.0.attn_kv_b.weight",)
    new = open_source(files["f32"])
    for key in new:
        assert torch.equal(as_dense(src[key]), as_dense(new[key])), key


def test_tied_embeddings(tmp_path):
    hf = save_tiny("qwen3_moe", tmp_path / "hf", tie_word_embeddings=True)
    path = gguf_write.convert_model(hf, tmp_path / "t.gguf", "q8_0", progress=False)[0]
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert "output.weight" not in names
    cfg = load_config(path)
    assert cfg.tie_word_embeddings
    assert "lm_head.weight" not in open_source(path)


def test_directory_detection(tiny, tmp_path):
    from ktinject.weights import detect_format
    hf, files = tiny["mixtral"]
    assert detect_format(files["f32"]).name == "gguf"
    assert detect_format(hf).name == "safetensors"
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "m.gguf").write_bytes(files["f32"].read_bytes())
    assert detect_format(tmp_path / "one").name == "gguf"


def test_fast_metadata_parse_matches_gguf_reader(tiny):
    hf, files = tiny["deepseek_v3"]
    ours = gguf_file._Reader(files["q4_k_m"])
    ref = gguf.GGUFReader(files["q4_k_m"])
    for name, field in ref.fields.items():
        if name.startswith("GGUF."):
            continue
        got, want = ours.lazy(name), field.contents()
        assert got == pytest.approx(want) if isinstance(want, float) else got == want, name
    assert len(ours.lazy("tokenizer.ggml.tokens")) == 512


def test_old_mixtral_per_expert_tensors(tiny, tmp_path):
    """Files converted before April 2024 hold `blk.N.ffn_gate.E.weight` per expert: same model."""
    from gguf import GGUFValueType as VT
    hf, files = tiny["mixtral"]
    merged = gguf_write.convert_model(hf, tmp_path / "merged.gguf", "q8_0", progress=False)[0]
    r = gguf.GGUFReader(merged)
    w = gguf.GGUFWriter(tmp_path / "old.gguf", "llama")
    for name, field in r.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            sub = field.types[-1] if field.types[0] == VT.ARRAY else None
            w.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    for t in r.tensors:
        data = np.array(t.data)
        if "_exps" in t.name:                               # [E, rows, row_bytes] -> E tensors
            for e in range(data.shape[0]):
                w.add_tensor(t.name.replace("_exps", f".{e}"), data[e], raw_dtype=t.tensor_type)
        else:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    old, new = open_source(tmp_path / "old.gguf"), open_source(merged)
    assert set(old) == set(new)
    assert old.gguf_names("model.layers.1.mlp.experts.down_proj") == tuple(
        f"blk.1.ffn_down.{e}.weight" for e in range(4))
    gate_up = old["model.layers.1.mlp.experts.gate_up_proj"]
    assert isinstance(gate_up, FusedTensor) and gate_up.parts[0].type_name == "Q8_0"
    for key in new:
        assert torch.equal(as_dense(old[key]), as_dense(new[key])), key


def test_sentencepiece_tokenizer_from_metadata():
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + ["▁", "▁h", "▁hi", "h", "i"]
    values = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
              "tokenizer.ggml.unknown_token_id": 0}
    arrays = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": [0.0] * 259 + [-1.0, -2, -3, -4, -5],
              "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * 5}
    tok = gguf_config.tokenizer_from_metadata(values, arrays.get, "x.gguf")
    assert tok("hi").input_ids == [1, tokens.index("▁hi")]                 # BOS added, as llama.cpp does
    assert tok.decode(tok("hi").input_ids, skip_special_tokens=True) == "hi"
    with pytest.raises(Exception, match="x.gguf.*'rwkv'"):
        gguf_config.tokenizer_from_metadata({"tokenizer.ggml.model": "rwkv"}, arrays.get, "x.gguf")
