"""Mixed-device layouts: which modules get input-moving hooks; the hybrid packs on a real GPU."""
from __future__ import annotations

import pytest
import torch

from ktinject.load import install_device_hooks
from ktinject.rules.plan import plan
from ktinject.testing import bf16_error_bound, FAMILIES, build_tiny, greedy_recomputed, save_tiny


def _hooked(model):
    return {n for n, m in model.named_modules() if m._forward_pre_hooks}


def test_hooks_only_where_a_parent_spans_devices():
    model = build_tiny("deepseek_v2")
    p = plan(model, "deepseek-v2")           # hybrid plan, not loaded: only the structure matters
    n = install_device_hooks(model, p)
    hooked = _hooked(model) - {""}           # the root's own hooks clear the transfer memo
    assert n == len(hooked) > 0
    assert "model.embed_tokens" in hooked and "lm_head" in hooked and "model.rotary_emb" in hooked
    assert "model.layers.1" in hooked and "model.layers.1.self_attn" in hooked
    assert "model.layers.1.mlp.gate" in hooked and "model.layers.1.mlp.shared_experts" in hooked
    # inside a single-device subtree nothing is hooked
    assert "model.layers.1.self_attn.q_proj" not in hooked and "model.layers.0.mlp.gate_proj" not in hooked


def test_layers_all_on_one_device_still_receive_the_cpu_embedding():
    """'-gpu' overlays: every layer on the GPU, the embedding on the CPU. The layers' ModuleList
    has no forward (a hook there never fires), so each layer carries the hook."""
    model = build_tiny("deepseek_v2")
    p = plan(model, "deepseek-v2-gpu")
    install_device_hooks(model, p)
    hooked = _hooked(model)
    assert {"model.layers.0", "model.layers.1", "model.embed_tokens", "model.norm"} <= hooked
    assert "model.layers" not in hooked


def test_no_hooks_for_single_device_plans():
    model = build_tiny("mixtral")
    assert install_device_hooks(model, plan(model, "mixtral-cpu")) == 0 and not _hooked(model)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_hybrid_pack_on_gpu_matches_reference(family, tmp_path):
    from ktinject import optimize_and_load
    d = save_tiny(family, tmp_path / family)
    model, _ = optimize_and_load(d, family.replace("_", "-"))
    assert model.model.embed_tokens.weight.device.type == "cpu"
    assert model.lm_head.weight.device.type == "cuda"
    ids = torch.randint(3, 500, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model(ids).logits
    # the hybrid packs compute in bfloat16 with bf16 routed experts: bounded by transformers' own
    # bfloat16 error on the same input
    rel, bf16_rel = bf16_error_bound(family, ids, got)
    assert rel < max(3 * bf16_rel, 1e-2), (rel, bf16_rel)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_generate_with_hybrid_pack(family, tmp_path, monkeypatch):
    """Embedding on the CPU, lm_head on the GPU, routed experts on the CPU: the engine's greedy
    decode, one CUDA graph replay per token (CPU experts through stream-ordered jobs: by default
    doorbells and the zero-copy hand-over; the embedding looked up on the host), equals greedy
    decoding by full recomputation of the same loaded model (float32, so no near-tie flips); so
    do the copies, host functions, and the eager, Python-driven path."""
    from ktinject import generate, optimize_and_load
    d = save_tiny(family, tmp_path / family)
    model, tok = optimize_and_load(d, family.replace("_", "-"), dtype="float32")
    prompt = tok("The memory bandwidth", return_tensors="pt")["input_ids"][0].tolist()
    res = generate(model, tok, prompt, max_new_tokens=10)
    assert res.token_ids == greedy_recomputed(model, prompt, len(res.token_ids)) and len(res.token_ids) > 0
    assert res.decode_mode == "cuda-graph", res.decode_mode
    from ktinject.native.hostfn import handover_of
    assert handover_of(model) == "bell+zerocopy"                                   # the default where it works
    eager = generate(model, tok, prompt, max_new_tokens=10, cuda_graph="off")     # stream-ordered, no graph
    assert eager.token_ids == res.token_ids
    for knob, mode, handover in (("KTINJECT_HOSTJOB_ZEROCOPY", "0", "bell"), ("KTINJECT_HOSTJOB_SIGNAL", "hostfn", "hostfn")):
        with monkeypatch.context() as env:
            env.setenv(knob, mode)
            other_model, _ = optimize_and_load(d, family.replace("_", "-"), dtype="float32")   # jobs made this way
            other = generate(other_model, tok, prompt, max_new_tokens=10)
            assert other.token_ids == res.token_ids and other.decode_mode == "cuda-graph", (knob, other.decode_mode)
            assert handover_of(other_model) == handover
            del other_model
    monkeypatch.setenv("KTINJECT_STREAM_ORDERED", "0")                             # Python-driven CPU experts
    old = generate(model, tok, prompt, max_new_tokens=10)
    assert old.token_ids == res.token_ids
    assert old.decode_mode.startswith("eager") and "does not support CUDA graphs" in old.decode_mode
