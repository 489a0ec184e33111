"""Tiny models of the five supported families, built from their transformers configs.

Used by the tests of every issue, by the built-in default model, and by examples. Shapes
are small but keep the structure of the real models: dense first layers for DeepSeek,
shared experts (with the sigmoid gate on Qwen2-MoE), grouped routing with a correction
bias on DeepSeek-V3, grouped-query attention on Qwen/Mixtral, MLA on DeepSeek.
Row lengths are multiples of 256 where the K-quants need it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

FAMILIES = ("deepseek_v2", "deepseek_v3", "qwen2_moe", "qwen3_moe", "mixtral")


def _deepseek_v2(**over):
    from transformers import DeepseekV2Config
    kw = dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
              n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=64,
              q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_group=1,
              topk_group=1, topk_method="greedy", routed_scaling_factor=1.0, max_position_embeddings=512,
              tie_word_embeddings=False)
    kw.update(over)
    return DeepseekV2Config(**kw)


def _deepseek_v3(**over):
    from transformers import DeepseekV3Config
    kw = dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
              n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=64,
              q_lora_rank=96, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_group=4,
              topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=512,
              tie_word_embeddings=False)
    kw.update(over)
    return DeepseekV3Config(**kw)


def _qwen2_moe(**over):
    from transformers import Qwen2MoeConfig
    kw = dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
              shared_expert_intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
              max_position_embeddings=512, tie_word_embeddings=False)
    kw.update(over)
    return Qwen2MoeConfig(**kw)


def _qwen3_moe(**over):
    from transformers import Qwen3MoeConfig
    kw = dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8,
              num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
              tie_word_embeddings=False)
    kw.update(over)
    return Qwen3MoeConfig(**kw)


def _mixtral(**over):
    from transformers import MixtralConfig
    kw = dict(vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
              max_position_embeddings=512, tie_word_embeddings=False)
    kw.update(over)
    return MixtralConfig(**kw)


CONFIGS: dict[str, Callable] = {
    "deepseek_v2": _deepseek_v2,
    "deepseek_v3": _deepseek_v3,
    "qwen2_moe": _qwen2_moe,
    "qwen3_moe": _qwen3_moe,
    "mixtral": _mixtral,
}


def tiny_config(family: str, **overrides):
    """A small transformers config of `family` (see FAMILIES); keyword overrides apply."""
    try:
        return CONFIGS[family](**overrides)
    except KeyError:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}") from None


@torch.no_grad()
def build_tiny(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A tiny randomly initialised model of `family`, deterministic for a seed, in eval mode.

    Router weights and DeepSeek-V3's correction bias are random too (transformers initialises
    some of them to zero), so routing differs between tokens and tests exercise many experts.
    """
    from transformers import AutoModelForCausalLM
    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(0.02 * 4).to(p.dtype))
        elif "norm" in name:
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=gen))
    return model.eval()


def save_tiny(family: str, directory: str | Path, seed: int = 0, dtype: torch.dtype = torch.float32,
              **overrides) -> Path:
    """Build a tiny model and save it as a safetensors model directory with a tokenizer."""
    from .tokenizer import byte_tokenizer
    directory = Path(directory)
    model = build_tiny(family, seed=seed, dtype=dtype, **overrides)
    model.save_pretrained(directory)
    byte_tokenizer(model.config.vocab_size).save_pretrained(directory)
    return directory


@torch.no_grad()
def bf16_error_bound(family: str, ids: torch.Tensor, got: torch.Tensor, device: str = "cuda") -> tuple[float, float]:
    """(relative error of `got` against the float32 tiny model, the same error of transformers' own
    bfloat16 run on `device`): random tiny models amplify rounding, so a bfloat16 layout is judged
    against what transformers itself reaches in bfloat16 on the same input."""
    want = build_tiny(family)(ids).logits
    same = build_tiny(family).to(device=device, dtype=torch.bfloat16)(ids.to(device)).logits.float().cpu()
    rel = float((got.float().cpu() - want).norm() / want.norm())
    return rel, float((same - want).norm() / want.norm())


def first_moe_block(family: str, seed: int = 0):
    """(tiny model, its first MoE block) of `family`."""
    model = build_tiny(family, seed=seed)
    for layer in model.model.layers:
        if hasattr(layer.mlp, "experts"):
            return model, layer.mlp
    raise ValueError(f"the tiny {family} model has no MoE layer")


def random_routing(tokens: int, experts: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random routing: distinct top-k expert ids [T, k] (int64) and weights [T, k] (float32)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, experts, generator=g).topk(k, dim=1).indices.contiguous()
    return ids, torch.rand(tokens, k, generator=g).contiguous()


def run_in_triton_interpreter(script: str, timeout: int = 300) -> None:
    """Run `script` (Python source that prints "ok" when its checks pass) in a fresh interpreter
    with TRITON_INTERPRET=1, so Triton kernels execute on the CPU; AssertionError with its stderr
    otherwise. The variable must be set before triton is imported, hence the subprocess."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def greedy_recomputed(model, prompt_ids: list[int], n: int) -> list[int]:
    """n greedy tokens after `prompt_ids`, each from a forward of the whole sequence so far (no
    cache): the reference a generation engine's cached, chunked or graph-replayed decode must equal."""
    from .generate import _input_device
    device = _input_device(model)   # (cpu_embedding, the -cpu packs' embedding, has no .weight)
    seq = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq], device=device)).logits[0, -1].argmax()))
    return seq[len(prompt_ids):]
