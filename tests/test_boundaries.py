"""Device boundaries along the trunk, and moving tensors across them once per forward."""
from __future__ import annotations

import pytest
import torch

from ktinject.boundaries import Boundary, TransferMemo, attach_memo, canonical
from ktinject.load import install_device_hooks
from ktinject.rules.plan import plan
from ktinject.testing import bf16_error_bound, build_tiny, tiny_config

TWO_GPU = [("deepseek-v2-2gpu", "deepseek_v2", 27, 14), ("deepseek-v3-2gpu", "deepseek_v3", 61, 31),
           ("qwen3-moe-2gpu", "qwen3_moe", 48, 24)]


@pytest.mark.parametrize("pack,family,layers,split", TWO_GPU)
def test_two_gpu_overlay_plans_layer_ranges(pack, family, layers, split):
    p = plan(tiny_config(family, num_hidden_layers=layers), pack)
    e = p.by_name()
    for i in range(layers):
        want = "cuda:1" if i >= split else "cuda:0"
        assert e[f"model.layers.{i}"].device == want
        assert e[f"model.layers.{i}.self_attn"].device == want          # GPU parts follow their layer
        experts = e.get(f"model.layers.{i}.mlp.experts")
        if experts is not None:
            assert experts.device == "cpu"                             # routed experts stay on the CPU
    assert e["model.embed_tokens"].device == "cpu"
    assert p.boundaries == (Boundary("model.layers.0", "cpu", "cuda:0"),
                            Boundary(f"model.layers.{split}", "cuda:0", "cuda:1"),
                            Boundary("model.norm", "cuda:1", "cuda:0"))
    assert not p.unmatched_rules
    assert {b["module"] for b in p.to_dict()["boundaries"]} == {"model.layers.0", f"model.layers.{split}",
                                                                 "model.norm"}


def test_single_device_plans_have_no_boundaries():
    assert plan(tiny_config("mixtral"), "mixtral-cpu").boundaries == ()
    # a bare "cuda" and "cuda:0" are the same device: no boundary between them
    assert [b.module for b in plan(tiny_config("qwen3_moe"), "qwen3-moe").boundaries] == ["model.layers.0"]


def test_memo_moves_a_tensor_once_per_device_until_cleared():
    memo = TransferMemo()
    t = torch.randn(4, 8)
    a = memo.move(t, torch.device("meta"))
    b = memo.move(t, torch.device("meta"))
    assert a is b and a.device.type == "meta" and memo.transfers == 1
    assert memo.move(t, torch.device("cpu")) is t and memo.transfers == 1   # already there: no copy
    nested = memo.move_all({"x": (t, [t]), "n": 3}, torch.device("meta"))
    assert nested["x"][0] is a and nested["x"][1][0] is a and nested["n"] == 3 and memo.transfers == 1
    t.add_(1)                                                              # changed in place: copy again
    assert memo.move(t, torch.device("meta")) is not a and memo.transfers == 2
    memo.clear()
    assert memo.move(t, torch.device("meta")) is not a and memo.transfers == 3


def test_memo_takes_inference_tensors():
    memo = TransferMemo()
    with torch.inference_mode():
        t = torch.randn(3)
        assert memo.move(t, torch.device("meta")) is memo.move(t, torch.device("meta"))
    assert memo.transfers == 1


def test_root_forward_clears_the_memo():
    model = build_tiny("qwen3_moe")
    memo = attach_memo(model)
    assert attach_memo(model) is memo                                      # one memo per model
    memo.move(torch.ones(2), torch.device("meta"))
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7]]))
    assert not memo._moved                                                 # cleared after the forward


def test_hooks_share_the_models_memo():
    model = build_tiny("deepseek_v2")
    n = install_device_hooks(model, plan(model, "deepseek-v2"))
    assert n > 0 and isinstance(model.ktinject_transfers, TransferMemo)


@pytest.mark.gpu
@pytest.mark.parametrize("family,pack", [("deepseek_v2", "deepseek-v2"), ("qwen3_moe", "qwen3-moe")])
def test_cpu_cuda_layer_split_matches_reference(family, pack, tmp_path):
    """Layer 0 (all of it) on the CPU, the others on cuda:0: the one-GPU stand-in for two GPUs."""
    from ktinject import optimize_and_load
    from ktinject.testing import save_tiny
    rules = tmp_path / "split.yaml"
    rules.write_text(f"version: 1\ninclude: [{pack}]\nrules:\n"
                     "  - match: {name: 'model\\.layers\\.0'}\n    replace: {op: keep, device: cpu}\n")
    d = save_tiny(family, tmp_path / family)
    model, _ = optimize_and_load(d, str(rules))
    assert [str(b) for b in model.ktinject_plan.boundaries] == ["model.layers.1: cpu -> cuda"]
    assert model.model.layers[0].self_attn.o_proj.weight.device.type == "cpu"
    assert model.model.layers[1].self_attn.o_proj.weight.device.type == "cuda"
    ids = torch.randint(3, 500, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(ids).logits
    # the hybrid packs compute in bfloat16 with bf16 routed experts: bounded by transformers' own
    # bfloat16 error on the same input
    rel, bf16_rel = bf16_error_bound(family, ids, got)
    assert rel < max(3 * bf16_rel, 1e-2), (rel, bf16_rel)


def _hooked(model, name):
    return bool(model.get_submodule(name)._forward_pre_hooks)


@pytest.mark.parametrize("pack,family,layers,split", TWO_GPU)
def test_two_gpu_hooks_cover_trunk_operators_only(pack, family, layers, split):
    """On the injected skeleton (meta): the final norm and lm_head (trunk stages, operators on
    cuda:0 after a layer on cuda:1) take their inputs through the hooks, so the hidden state
    crosses back once and stays there; operators inside a layer (the MoE block, the CPU experts)
    keep moving their own inputs and returning results to their caller's device."""
    from ktinject.load import apply
    from ktinject.rules.skeleton import build_skeleton
    config = tiny_config(family, num_hidden_layers=split + 2)
    skeleton = build_skeleton(config, torch.bfloat16)
    p = plan(skeleton, pack)
    apply(skeleton, p, config)
    assert install_device_hooks(skeleton, p) > 0
    assert _hooked(skeleton, "model.norm") and _hooked(skeleton, "lm_head")
    assert _hooked(skeleton, f"model.layers.{split}")
    assert not _hooked(skeleton, f"model.layers.{split}.input_layernorm")       # an operator in the layer
    assert not _hooked(skeleton, f"model.layers.{split}.mlp")
    assert not _hooked(skeleton, f"model.layers.{split}.mlp.experts")
    assert skeleton.ktinject_device_restore


def test_cpu_hooks_move_plain_modules_inputs_only():
    from ktinject.load import _make_hook
    from ktinject.phase import PhaseDispatch
    memo = TransferMemo()
    hook = _make_hook(memo, torch.device("meta"))
    x = torch.ones(2)
    args, kwargs = hook(torch.nn.Identity(), (x,), {"y": x})
    assert args[0].device.type == "meta" and kwargs["y"] is args[0]          # moved once
    cpu = torch.device("cpu")
    dispatch = PhaseDispatch(torch.nn.Identity(), torch.nn.Identity(), cpu, cpu)
    assert _make_hook(memo, cpu)(dispatch, (x,), {}) is None                 # moves its inputs itself


def test_dispatcher_hooks_go_by_the_devices_resolved_at_load():
    """A dispatcher's hook uses the phase devices resolved when it was installed (a bare `cuda`
    becomes the GPU current at load), not the dispatcher's own possibly bare ones."""
    from ktinject import phase
    from ktinject.load import _hook_device, _make_hook
    from ktinject.phase import PhaseDispatch
    gpu = torch.cuda.current_device() if torch.cuda.is_available() else 0
    assert _hook_device("cuda") == torch.device("cuda", gpu)
    assert _hook_device("cuda:1") == torch.device("cuda", 1) and _hook_device("cpu") == torch.device("cpu")
    cpu = torch.device("cpu")
    dispatch = PhaseDispatch(torch.nn.Identity(), torch.nn.Identity(), cpu, torch.device("cuda"))
    hook = _make_hook(TransferMemo(), cpu, {"prefill": cpu, "generate": cpu})
    with phase.use("generate"):            # its own device would be the bare `cuda`: not used
        assert hook(dispatch, (torch.ones(2),), {}) is None


def test_device_restore_runs_when_the_forward_raises(monkeypatch):
    """A stage switched the current GPU, then the forward raised: the caller's device comes back
    (torch.cuda's device calls stand in for two GPUs here)."""
    from ktinject.boundaries import attach_device_restore, make_current
    current = [0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: current.__setitem__(0, int(i)))

    class Boom(torch.nn.Module):
        def forward(self, x):
            make_current(torch.device("cuda", 1))                        # a stage on cuda:1
            raise ValueError("boom")
    m = Boom()
    attach_device_restore(m)
    attach_device_restore(m)                                              # once per model
    assert len(m._forward_pre_hooks) == 1
    with pytest.raises(ValueError):
        m(torch.ones(1))
    assert current[0] == 0


def test_two_gpu_overlay_composes_with_hot_experts(tmp_path):
    """`include: [deepseek-v2-hot, deepseek-v2-2gpu]`: each layer's hot experts on its layer's GPU."""
    from ktinject.rules.skeleton import build_skeleton
    rules = tmp_path / "hot2.yaml"
    rules.write_text("version: 1\ninclude: [deepseek-v2-hot, deepseek-v2-2gpu]\n")
    p = plan(build_skeleton(tiny_config("deepseek_v2", num_hidden_layers=16), torch.bfloat16), str(rules))
    by = {e.name: e for e in p.entries}
    for layer, dev in ((1, "cuda:0"), (15, "cuda:1")):
        e = by[f"model.layers.{layer}.mlp.experts"]
        assert e.op == "gpu_experts" and canonical(e.device) == dev, (layer, e.op, e.device)
    assert [str(b) for b in p.boundaries][1] == "model.layers.14: cuda -> cuda:1"
