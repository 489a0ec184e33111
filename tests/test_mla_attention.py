"""mla_attention against the transformers DeepSeek V2/V3 attention, inside the whole tiny model."""
import copy

import pytest
import torch
from transformers import DynamicCache

from ktinject.errors import LoadError, ModelError
from ktinject.operators import BuildContext, get
from ktinject.operators.mla_attention import MLAAttention, MLAOptions
from ktinject.testing import build_tiny, greedy_recomputed

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
CASES = [("deepseek_v2", {}), ("deepseek_v3", {}), ("deepseek_v3", {"rope_interleave": False}),
         ("deepseek_v3", {"rope_parameters": YARN}), ("deepseek_v2", {"q_lora_rank": 48})]


def inject(model, device="cpu", dtype=None, **opts):
    """Replace every attention module, loading weights from the model's own state dict."""
    source = dict(model.state_dict())
    for name, mod in list(model.named_modules()):
        if type(mod).__name__ in MLAAttention.replaces:
            dev = torch.device(device)
            ctx = BuildContext(name, dev, dev, dev, dtype, model.config, MLAOptions(**opts))
            new = MLAAttention.build(copy.deepcopy(mod).to("meta"), ctx)
            used = new.load_weights(name + ".", source)
            assert used == {k for k in source if k.startswith(name + ".")}
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, new)
    return model


def pair(family, seed=0, **over):
    ref = build_tiny(family, seed=seed, **over)
    return ref, inject(copy.deepcopy(ref))


def close(a, b, tol=2e-4):
    return (a - b).abs().max().item() <= tol * max(1.0, a.abs().max().item())


@pytest.mark.parametrize("family,over", CASES)
@torch.no_grad()
def test_prefill_and_decode_match_transformers(family, over):
    ref, ours = pair(family, **over)
    assert isinstance(ours.model.layers[0].self_attn, MLAAttention)
    ids = torch.randint(0, ref.config.vocab_size, (2, 14), generator=torch.Generator().manual_seed(3))
    assert close(ref(ids).logits, ours(ids).logits)
    ca, cb = DynamicCache(config=ref.config), DynamicCache(config=ours.config)
    la = ref(ids[:, :6], past_key_values=ca, use_cache=True).logits
    lb = ours(ids[:, :6], past_key_values=cb, use_cache=True).logits
    assert close(la, lb)
    for t in range(6, 14):
        la = ref(ids[:, t:t + 1], past_key_values=ca, use_cache=True).logits
        lb = ours(ids[:, t:t + 1], past_key_values=cb, use_cache=True).logits
        assert close(la, lb), t
    assert cb.get_seq_length() == 14
    # the transformers cache holds one value per token; the latents live in the operator
    attn = ours.model.layers[0].self_attn
    assert attn.kv_cache.shape[-1] == ref.config.kv_lora_rank + ref.config.qk_rope_head_dim


@torch.no_grad()
def test_chunked_prefill_and_explicit_positions():
    ref, ours = pair("deepseek_v3", rope_parameters=YARN)
    ids = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(1))
    full = ref(ids).logits
    for layer in ours.model.layers:
        layer.self_attn.reserve(1, 64)
    outs = []
    for start in range(0, 20, 7):      # chunks of 7, 7, 6 with explicit position_ids and no HF cache
        chunk = ids[:, start:start + 7]
        pos = torch.arange(start, start + chunk.shape[1]).unsqueeze(0)
        outs.append(ours(chunk, position_ids=pos, use_cache=False).logits)
    assert close(full, torch.cat(outs, 1))
    # a new sequence overwrites from position 0: no reset needed
    again = ours(ids[:, :5], position_ids=torch.arange(5).unsqueeze(0), use_cache=False).logits
    assert close(full[:, :5], again)


@torch.no_grad()
def test_absorbed_path_equals_expanded_path():
    ref, ours = pair("deepseek_v2", seed=2)
    ids = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(5))
    a = ours(ids).logits
    for layer in ours.model.layers:
        layer.self_attn.options = MLAOptions(absorb_max_tokens=64)
    assert close(a, ours(ids).logits)
    assert "absorbed" in repr(ours.model.layers[0].self_attn)


def test_registry_errors_and_cache_size():
    assert get("mla_attention") is MLAAttention
    model = build_tiny("deepseek_v2")
    with pytest.raises(ModelError, match="mla_attention"):
        ctx = BuildContext("model.layers.0.mlp", torch.device("cpu"), torch.device("cpu"), torch.device("cpu"),
                           None, model.config, MLAOptions())
        MLAAttention.build(model.model.layers[0].mlp, ctx)
    attn = model.model.layers[0].self_attn
    ctx = BuildContext("model.layers.0.self_attn", torch.device("cpu"), torch.device("cpu"), torch.device("cpu"),
                       None, model.config, MLAOptions())
    op = MLAAttention.build(copy.deepcopy(attn), ctx)
    with pytest.raises(LoadError, match="model.layers.0.self_attn.kv_b_proj.weight"):
        src = {k: v for k, v in model.state_dict().items() if "kv_b_proj" not in k}
        op.load_weights("model.layers.0.self_attn.", src)
    op.reserve(1, 100, dtype=torch.bfloat16)
    cfg = model.config
    assert op.cache_bytes == 100 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
    with pytest.raises(Exception, match="absorb_max_tokens"):
        MLAOptions(absorb_max_tokens=-1)


@pytest.mark.gpu
@torch.no_grad()
def test_gpu_bf16_decode_matches_transformers():
    ref = build_tiny("deepseek_v3", dtype=torch.bfloat16).cuda()
    ours = inject(copy.deepcopy(ref), device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 512, (1, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    ca, cb = DynamicCache(config=ref.config), DynamicCache(config=ours.config)
    la = ref(ids[:, :32], past_key_values=ca, use_cache=True).logits.float()
    lb = ours(ids[:, :32], past_key_values=cb, use_cache=True).logits.float()
    assert close(la, lb, 3e-2)
    for t in range(32, 40):
        la = ref(ids[:, t:t + 1], past_key_values=ca, use_cache=True).logits.float()
        lb = ours(ids[:, t:t + 1], past_key_values=cb, use_cache=True).logits.float()
        assert close(la, lb, 3e-2)


def test_cache_made_in_inference_mode_serves_later_plain_calls(tmp_path):
    """`generate` runs under inference_mode; the MLA latent cache it allocates must still take
    updates from a later plain (no_grad) forward of the same model."""
    from ktinject import generate, optimize_and_load
    from ktinject.testing import save_tiny
    d = save_tiny("deepseek_v2", tmp_path / "m")
    model, tok = optimize_and_load(d, "deepseek-v2-cpu")
    prompt = tok("memory bandwidth", return_tensors="pt")["input_ids"][0].tolist()
    res = generate(model, tok, prompt, max_new_tokens=4)
    assert res.token_ids == greedy_recomputed(model, prompt, len(res.token_ids))
