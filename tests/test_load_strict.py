"""Strict loading: missing / unexpected / mismatched tensors are one LoadError naming each;
bad files and bad options are clean errors."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ktinject import optimize_and_load
from ktinject.errors import KtInjectError, LoadError, ModelError, PlacementError, WeightError
from ktinject.testing import save_tiny


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return save_tiny("mixtral", tmp_path_factory.mktemp("m") / "mixtral")


def _copy(base, dst, edit):
    shutil.copytree(base, dst)
    sd = load_file(str(dst / "model.safetensors"))
    edit(sd)
    save_file(sd, str(dst / "model.safetensors"))
    return dst


def test_missing_unexpected_and_mismatched_are_named(base, tmp_path):
    def edit(sd):
        del sd["model.norm.weight"]
        del sd["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
        sd["model.layers.0.self_attn.extra.weight"] = torch.zeros(3)
        sd["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(8, 8)
        sd["lm_head.weight"] = torch.zeros(512, 255)
    d = _copy(base, tmp_path / "bad", edit)
    with pytest.raises(LoadError) as info:
        optimize_and_load(d, "mixtral-cpu")
    err = info.value
    text = str(err)
    assert "model.norm.weight" in err.missing
    # the incomplete expert set: the fused tensors are missing, the leftover parts unexpected
    assert "model.layers.1.mlp.experts.gate_up_proj" in err.missing
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in err.unexpected
    assert "model.layers.0.self_attn.extra.weight" in err.unexpected
    assert any(m.startswith("model.layers.0.self_attn.q_proj.weight") for m in err.mismatched)
    assert any(m.startswith("lm_head.weight (file [512, 255], model [512, 256])") for m in err.mismatched)
    assert "missing" in text and "unexpected" in text and "shape mismatch" in text


def test_rules_fail_before_weights_are_read(base, tmp_path):
    bad = tmp_path / "r.yaml"
    bad.write_text("version: 1\nrules:\n  - match: {name: x}\n    replace: {op: nope}\n")
    with pytest.raises(KtInjectError) as info:
        optimize_and_load(base, bad)
    assert ":4:" in str(info.value)


def test_cuda_plan_without_cuda_is_placement_error(base):
    if torch.cuda.is_available():
        pytest.skip("checks the no-CUDA path")
    with pytest.raises(PlacementError):
        optimize_and_load(base, "mixtral")


def test_bad_options_and_paths(base, tmp_path):
    with pytest.raises(ModelError):
        optimize_and_load(base, "mixtral-cpu", colour="blue")
    with pytest.raises(ModelError):
        optimize_and_load(base, "mixtral-cpu", dtype="float8")
    with pytest.raises(WeightError):
        optimize_and_load(tmp_path / "nothing", "mixtral-cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightError):
        optimize_and_load(tmp_path / "empty", "mixtral-cpu")


@pytest.mark.parametrize("corrupt", ["truncate", "header_len", "offsets", "json"])
def test_corrupt_safetensors_is_weight_error(base, tmp_path, corrupt):
    d = tmp_path / "c"
    shutil.copytree(base, d)
    f = d / "model.safetensors"
    raw = bytearray(f.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    if corrupt == "truncate":
        raw = raw[: len(raw) // 2]
    elif corrupt == "header_len":
        raw[:8] = (len(raw) * 2).to_bytes(8, "little")
    elif corrupt == "json":
        raw[8:12] = b"{{{{"
    else:
        header = json.loads(raw[8:8 + n])
        key = next(k for k in header if k != "__metadata__")
        header[key]["data_offsets"][1] += 4
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (n - len(text))
        assert len(text) == n
        raw[8:8 + n] = text
    f.write_bytes(bytes(raw))
    with pytest.raises(WeightError) as info:
        optimize_and_load(d, "mixtral-cpu")
    assert "model.safetensors" in str(info.value)


def test_index_with_missing_shard(tmp_path):
    from ktinject.testing import build_tiny
    build_tiny("qwen3_moe").save_pretrained(tmp_path, max_shard_size="1MB")
    shard = sorted(tmp_path.glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(WeightError) as info:
        optimize_and_load(tmp_path, "qwen3-moe-cpu")
    assert shard.name in str(info.value)
