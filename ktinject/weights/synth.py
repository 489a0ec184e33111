"""Random-weight GGUF files with the exact shapes and metadata of public models.

`synthesize(arch_name, out, layers=None, recipe="q4_k_m")` writes a GGUF that loads like the
real model (same tensor names, shapes, types, metadata keys), with random weights and the
byte tokenizer, so real-size speed can be measured with no download.

Fast and bounded: quantized tensors are not quantized from floats; their blocks are made
directly (random quant bytes from a shared random pool, plus sane fp16 scales written into
each block's scale fields) and streamed to disk in chunks, so it runs near disk speed and
holds at most one chunk in memory. Scales are calibrated per type so every weight has a
standard deviation of about `gain / sqrt(fan_in)`: activations stay finite through all layers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from gguf import GGMLQuantizationType as QT

from ..errors import WeightError
from . import gguf_config, gguf_names
from .gguf_write import PlannedTensor, choose_type, file_kv, layer_sort_key, nbytes_of, recipe, tokenizer_metadata, \
    write_gguf
from .quants import QUANTS

GAIN = 0.5                          # weight std * sqrt(fan_in)
CHUNK_BYTES = 32 << 20              # bytes produced per step of one tensor

_YARN = dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0)

# Real dimensions of the public models (from their config.json files).
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "deepseek-v2-lite": ("deepseek_v2", dict(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64,
        n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_group=1, topk_group=1, topk_method="greedy",
        norm_topk_prob=False, routed_scaling_factor=1.0, max_position_embeddings=163840, rms_norm_eps=1e-6,
        rope_parameters=dict(_YARN, rope_theta=10000.0, mscale=0.707, mscale_all_dim=0.707),
        bos_token_id=1, eos_token_id=2)),
    "deepseek-v3": ("deepseek_v3", dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256,
        n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3, kv_lora_rank=512, q_lora_rank=1536,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_group=8, topk_group=4, norm_topk_prob=True,
        routed_scaling_factor=2.5, max_position_embeddings=163840, rms_norm_eps=1e-6,
        rope_parameters=dict(_YARN, rope_theta=10000.0, mscale=1.0, mscale_all_dim=1.0),
        bos_token_id=1, eos_token_id=2)),
    "qwen3-30b-a3b": ("qwen3_moe", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0), tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2)),
    "qwen2-57b-a14b": ("qwen2_moe", dict(
        vocab_size=151936, hidden_size=3584, intermediate_size=18944, moe_intermediate_size=2560,
        shared_expert_intermediate_size=20480, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
        max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0), bos_token_id=1, eos_token_id=2)),
    "mixtral-8x7b": ("mixtral", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=32768, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0), bos_token_id=1, eos_token_id=2)),
}


def model_config(name: str, layers: Optional[int] = None):
    """The transformers config of a named public model (fewer layers when asked)."""
    from transformers import AutoConfig
    try:
        model_type, kw = SHAPES[name]
    except KeyError:
        raise WeightError(f"unknown model {name!r} (known: {', '.join(sorted(SHAPES))})") from None
    kw = dict(kw)
    if layers is not None:
        if layers < 1:
            raise WeightError(f"--layers must be at least 1, got {layers}")
        kw["num_hidden_layers"] = layers
        if "first_k_dense_replace" in kw:
            kw["first_k_dense_replace"] = min(kw["first_k_dense_replace"], layers)
    return AutoConfig.for_model(model_type, **kw)


# ---------------------------------------------------------------- random blocks per type

@dataclass(frozen=True)
class ScaleFields:
    d: tuple[int, ...]                 # byte offsets of fp16 scale fields
    mins: tuple[int, ...] = ()         # byte offsets of fp16 min fields (set to -min_ratio * d or +...)
    min_ratio: float = 0.0             # min = min_ratio * d, centring the block's values on zero
    exponent: Optional[int] = None     # MXFP4: offset of the e8m0 shared exponent


SCALES = {
    QT.Q4_0: ScaleFields((0,)), QT.Q5_0: ScaleFields((0,)), QT.Q8_0: ScaleFields((0,)),
    QT.IQ4_NL: ScaleFields((0,)), QT.IQ4_XS: ScaleFields((0,)), QT.Q3_K: ScaleFields((108,)),
    QT.Q6_K: ScaleFields((208,)),
    QT.Q4_1: ScaleFields((0,), (2,), -7.5), QT.Q5_1: ScaleFields((0,), (2,), -15.5),
    QT.Q2_K: ScaleFields((80,), (82,), 1.5), QT.Q4_K: ScaleFields((0,), (2,), 7.5),
    QT.Q5_K: ScaleFields((0,), (2,), 15.5),
    QT.MXFP4: ScaleFields((), exponent=0),
}


class BlockMaker:
    """Random GGML blocks of one type with a target standard deviation."""

    def __init__(self, qt: QT, seed: int = 0):
        if qt not in SCALES:
            raise WeightError(f"synth cannot make random {qt.name} blocks")
        self.qt, self.cls, self.fields = qt, QUANTS[qt], SCALES[qt]
        self.gen = torch.Generator().manual_seed(seed)
        self.pool = torch.randint(0, 256, (CHUNK_BYTES // 4,), dtype=torch.uint8, generator=self.gen)
        self.unit_std = self._std_at_unit_scale()

    def _set_scales(self, blocks: torch.Tensor, d: torch.Tensor) -> None:
        f = self.fields
        if f.exponent is not None:                 # e8m0: value scale 2^(e-128)
            e = (torch.log2(d).round() + 128).clamp(2, 254).to(torch.uint8)
            blocks[:, f.exponent] = e
            return
        d16 = d.to(torch.float16).view(torch.uint8).reshape(-1, 2)
        for off in f.d:
            blocks[:, off:off + 2] = d16
        if f.mins:
            m16 = (d * f.min_ratio).to(torch.float16).view(torch.uint8).reshape(-1, 2)
            for off in f.mins:
                blocks[:, off:off + 2] = m16

    def _std_at_unit_scale(self) -> float:
        blocks = self._raw(4096)
        self._set_scales(blocks, torch.ones(blocks.shape[0]))
        return float(self.cls.dequantize_blocks(blocks).std())

    def _raw(self, n_blocks: int) -> torch.Tensor:
        """Random bytes [n_blocks, type_size]: a slice of the pool at a random offset (wrapping)."""
        need = n_blocks * self.cls.type_size
        start = int(torch.randint(0, self.pool.numel(), (1,), generator=self.gen))
        if start + need <= self.pool.numel():
            return self.pool[start:start + need].clone().reshape(n_blocks, self.cls.type_size)
        idx_parts, got = [], 0
        while got < need:
            take = min(need - got, self.pool.numel() - start)
            idx_parts.append(self.pool[start:start + take])
            got, start = got + take, 0
        return torch.cat(idx_parts).reshape(n_blocks, self.cls.type_size)

    def blocks(self, n_blocks: int, std: float) -> torch.Tensor:
        blocks = self._raw(n_blocks)
        jitter = 0.75 + 0.5 * torch.rand(n_blocks, generator=self.gen)
        self._set_scales(blocks, jitter * (std / self.unit_std))
        return blocks


class StreamedBlocks:
    """A tensor's bytes made chunk by chunk as the writer asks (`nbytes` + `tofile` like numpy)."""

    def __init__(self, maker: BlockMaker, n_blocks: int, std: float):
        self.maker, self.n_blocks, self.std = maker, n_blocks, std
        self.nbytes = n_blocks * maker.cls.type_size

    def tofile(self, fout) -> None:
        from .kquant import _one_thread            # cheap ops on big chunks: one thread is fastest
        step = max(1, CHUNK_BYTES // self.maker.cls.type_size)
        with _one_thread():
            for start in range(0, self.n_blocks, step):
                n = min(step, self.n_blocks - start)
                fout.write(memoryview(self.maker.blocks(n, self.std).numpy()).cast("B"))

    def byteswap(self, inplace=False):           # only called for big-endian output, which we never write
        raise WeightError("synth writes little-endian files only")


def _std_for(name: str, shape: tuple[int, ...]) -> float:
    if name.startswith("token_embd"):
        return 1.0
    return GAIN / math.sqrt(shape[-1])


def _float_values(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if len(shape) == 1:
        if name.endswith("exp_probs_b.bias"):
            return 0.01 * torch.randn(shape, generator=gen)
        return 1.0 + 0.05 * torch.randn(shape, generator=gen)                  # norm weights near 1
    return torch.randn(shape, generator=gen) * _std_for(name, shape)


# ---------------------------------------------------------------- the whole file

def plan_tensors(config, r, seed: int = 0) -> list[PlannedTensor]:
    """Every GGUF tensor of the model for `config`, typed by recipe `r`, with random producers."""
    from .gguf_file import _expected_shapes
    arch = gguf_config.arch_for_model_type(config.model_type)
    shapes = _expected_shapes(config)
    makers: dict[QT, BlockMaker] = {}
    gen = torch.Generator().manual_seed(seed)
    planned = []
    for key, shape in shapes.items():
        found = gguf_names.gguf_names_for(arch, key)
        if found is None:
            raise WeightError(f"no GGUF name for this {arch} weight", tensor=key)
        row, names = found
        probe = torch.empty(shape, device="meta")
        for gname, part in zip(names, gguf_names.write_layout(row.layout, probe, config)):
            pshape = tuple(part.shape)
            qt = choose_type(r, gname, pshape, config.num_hidden_layers)
            if qt in (QT.F32, QT.F16, QT.BF16):
                produce = (lambda n=gname, s=pshape: _float_values(n, s, gen))
            else:
                if qt not in makers:
                    makers[qt] = BlockMaker(qt, seed + len(makers))
                n_blocks = nbytes_of(pshape, qt) // QUANTS[qt].type_size
                produce = (lambda m=makers[qt], n=n_blocks, s=_std_for(gname, pshape): StreamedBlocks(m, n, s))
            planned.append(PlannedTensor(gname, pshape, qt, produce))
    planned.sort(key=lambda t: layer_sort_key(t.name))
    return planned


def synthesize(name: str, out: str | Path, *, layers: Optional[int] = None, recipe_name: str = "q4_k_m",
               seed: int = 0, split_max_tensors: int = 0, split_max_size: int = 0, progress: bool = True) -> list[Path]:
    """Write a random-weight GGUF of the named public model; returns the file(s) written."""
    return synthesize_config(model_config(name, layers), out, recipe_name=recipe_name, seed=seed,
                             split_max_tensors=split_max_tensors, split_max_size=split_max_size, progress=progress,
                             label=name)


def synthesize_config(config, out: str | Path, *, recipe_name: str = "q4_k_m", seed: int = 0,
                      split_max_tensors: int = 0, split_max_size: int = 0, progress: bool = True,
                      label: str = "") -> list[Path]:
    """Write a random-weight GGUF for any supported transformers config (with the byte tokenizer)."""
    from ..tokenizer import byte_tokenizer
    r = recipe(recipe_name)
    arch, kv = gguf_config.metadata_from_config(config)
    label = label or config.model_type
    kv = {**file_kv(arch, f"{label} (random weights)", r), **kv,
          **tokenizer_metadata(byte_tokenizer(config.vocab_size), config.vocab_size)}
    tensors = plan_tensors(config, r, seed)
    return write_gguf(out, arch, kv, tensors, split_max_tensors=split_max_tensors, split_max_size=split_max_size,
                      progress=progress, label=f"synth {label}")
