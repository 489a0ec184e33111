"""Hub checkpoint names -> module names (hf_names tables) and the safetensors source over them."""
from __future__ import annotations

import types

import torch
from safetensors.torch import save_file

from ktinject.weights.hf_names import Fuse, Leaf, map_names
from ktinject.weights.safetensors_dir import SafetensorsSource
from ktinject.weights.tensor import FusedTensor


def cfg(model_type, layers=2):
    return types.SimpleNamespace(model_type=model_type, num_hidden_layers=layers)


def test_mixtral_names_are_renamed_and_stacked():
    names = [f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight" for e in range(3) for w in ("w1", "w2", "w3")]
    names += ["model.layers.0.block_sparse_moe.gate.weight", "model.norm.weight", "model.rotary_emb.inv_freq"]
    out = map_names(names, cfg("mixtral"))
    assert set(out) == {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj",
                        "model.layers.0.mlp.gate.weight", "model.norm.weight"}
    gu = out["model.layers.0.mlp.experts.gate_up_proj"]
    assert isinstance(gu, Fuse) and gu.dim == 0 and len(gu.parts) == 3
    # expert 1: gate (w1) then up (w3), concatenated along the rows
    assert gu.parts[1] == Fuse((Leaf("model.layers.0.block_sparse_moe.experts.1.w1.weight", True),
                                Leaf("model.layers.0.block_sparse_moe.experts.1.w3.weight", True)), dim=1)
    down = out["model.layers.0.mlp.experts.down_proj"]
    assert down.parts[2] == Leaf("model.layers.0.block_sparse_moe.experts.2.w2.weight", True)


def test_incomplete_expert_sets_are_left_unfused():
    names = [f"model.layers.0.mlp.experts.{e}.{p}.weight" for e in range(3) for p in ("gate_proj", "up_proj",
                                                                                        "down_proj")]
    names.remove("model.layers.0.mlp.experts.1.up_proj.weight")
    out = map_names(names, cfg("qwen3_moe"))
    assert "model.layers.0.mlp.experts.gate_up_proj" not in out
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in out
    names = [f"model.layers.0.mlp.experts.{e}.{p}.weight" for e in (0, 2) for p in ("gate_proj", "up_proj",
                                                                                     "down_proj")]
    assert "model.layers.0.mlp.experts.down_proj" not in map_names(names, cfg("qwen3_moe"))   # gap in ids


def test_deepseek_v3_drops_mtp_layers():
    names = ["model.layers.0.input_layernorm.weight", "model.layers.2.input_layernorm.weight",
             "model.layers.2.eh_proj.weight"]
    assert set(map_names(names, cfg("deepseek_v3", layers=2))) == {"model.layers.0.input_layernorm.weight"}
    assert len(map_names(names, cfg("deepseek_v2", layers=2))) == 3     # other families keep everything


def test_source_is_zero_copy_and_fuses_lazily(tmp_path):
    g = torch.Generator().manual_seed(0)
    sd = {f"model.layers.0.mlp.experts.{e}.{p}.weight": torch.randn(4, 6, generator=g)
          for e in range(2) for p in ("gate_proj", "up_proj")}
    sd.update({f"model.layers.0.mlp.experts.{e}.down_proj.weight": torch.randn(6, 4, generator=g) for e in range(2)})
    sd["model.norm.weight"] = torch.randn(6, generator=g).to(torch.bfloat16)
    (tmp_path / "config.json").write_text("{}")
    save_file(sd, str(tmp_path / "model.safetensors"))
    src = SafetensorsSource(tmp_path, cfg("qwen3_moe"))
    assert set(src) == {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj",
                        "model.norm.weight"}
    norm = src["model.norm.weight"]
    assert norm.dtype == torch.bfloat16 and torch.equal(norm, sd["model.norm.weight"])
    assert src.files["model.safetensors"].owns(norm) is not None      # a view of the mapping
    gu = src["model.layers.0.mlp.experts.gate_up_proj"]
    assert isinstance(gu, FusedTensor) and gu.shape == (2, 8, 6)
    from ktinject.load import fetch_dense
    dense = fetch_dense(src, "model.layers.0.mlp.experts.gate_up_proj", (2, 8, 6), None, "cpu")
    want = torch.stack([torch.cat([sd[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"],
                                   sd[f"model.layers.0.mlp.experts.{e}.up_proj.weight"]]) for e in range(2)])
    assert torch.equal(dense, want)
    # pages dropped after the copy are read back from the file when touched again
    assert torch.equal(src["model.layers.0.mlp.experts.down_proj"].parts[1][0],
                       sd["model.layers.0.mlp.experts.1.down_proj.weight"])
    assert src.origin("model.norm.weight").endswith("model.safetensors")
