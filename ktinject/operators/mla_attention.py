"""`mla_attention`: DeepSeek V2/V3 multi-head latent attention with a compressed KV cache.

Replaces `DeepseekV2Attention` / `DeepseekV3Attention` and keeps their call signature, so the
unmodified transformers decoder layer calls it. The math follows the transformers modules:
queries through `q_proj` or the q-LoRA path, the latent `kv_a_proj_with_mqa -> kv_a_layernorm`,
RoPE on the separate rope dims (V2: complex `freqs_cis`; V3: cos/sin, interleaved or not), and
the softmax scale with the YaRN `mscale` correction, taken from the original module.

Cache. The operator owns its cache: one tensor `kv_cache: [B, L, R + r]` (R = kv_lora_rank,
r = qk_rope_head_dim) per layer, holding the normalized latent and the roped shared key of each
token, written at the token's position (`position_ids`). Entries after the current position
are masked by causality (key position <= query position), so a new sequence simply
overwrites from position 0 and nothing needs resetting. `reserve(batch, max_len)` sizes it up
front (the generation engine does this, which also makes decode CUDA-graph safe); otherwise
it grows as needed. When the model passes its own transformers cache object (DynamicCache, StaticCache), the
operator stores one zero per token in it (2 values against R + r: transformers counts an empty
tensor as no tokens), so its bookkeeping (sequence length, masks) stays right while the
latents live here.

Paths (the `extra_repr` names them):
* absorbed, q_len <= `absorb_max_tokens` (decode): W_UK is folded into the query and W_UV
  applied after attending over the latents, so no per-head K/V is ever expanded;
* expanded, longer chunks (prefill): `kv_b_proj` expands the cached latents to per-head K/V
  and `F.scaled_dot_product_attention` runs with a causal position mask.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelError
from .base import BuildContext, Operator
from .kernels import triton_available
from .registry import register

log = logging.getLogger(__name__)

_CHILDREN = ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
             "kv_b_proj", "o_proj")


@dataclass(frozen=True)
class MLAOptions:
    absorb_max_tokens: int = 1      # chunks of at most this many query tokens use the absorbed path
    grow_step: int = 1024           # eager cache growth granularity (tokens)
    fused_decode: bool = True       # one-token steps on CUDA: rope, cache write and attention in Triton

    def __post_init__(self):
        if self.absorb_max_tokens < 0:
            raise ValueError(f"absorb_max_tokens must be >= 0, got {self.absorb_max_tokens}")
        if self.grow_step < 1:
            raise ValueError(f"grow_step must be >= 1, got {self.grow_step}")


# ---- rotary embeddings: one function per form of `position_embeddings` ----------------------
def _rope_complex(x: torch.Tensor, freqs_cis: torch.Tensor, interleave: bool) -> torch.Tensor:
    # x: [B, S, h, r] (pairs interleaved)   freqs_cis: complex [B, S, r/2]
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs_cis.unsqueeze(2)).flatten(3).type_as(x)


def _rope_cos_sin(x: torch.Tensor, cos_sin: tuple, interleave: bool) -> torch.Tensor:
    # x: [B, S, h, r]   cos, sin: [B, S, r]
    cos, sin = (t.unsqueeze(2) for t in cos_sin)
    if interleave:
        half = cos.shape[-1] // 2
        c, s = cos[..., :half], sin[..., :half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    h = x.shape[-1] // 2
    rot = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    return x * cos + rot * sin


def apply_rope(x: torch.Tensor, position_embeddings: Any, interleave: bool) -> torch.Tensor:
    kind = "complex" if isinstance(position_embeddings, torch.Tensor) and position_embeddings.is_complex() \
        else "cos_sin"
    return _ROPE[kind](x, position_embeddings, interleave)


_ROPE = {"complex": _rope_complex, "cos_sin": _rope_cos_sin}


@register("mla_attention")
class MLAAttention(Operator):
    Options = MLAOptions
    replaces = ("DeepseekV2Attention", "DeepseekV3Attention")
    device_types = ("cuda", "cpu")
    summary = "DeepSeek MLA: latent KV cache, absorbed decode, SDPA prefill"

    def __init__(self, original: nn.Module, options: MLAOptions = MLAOptions()):
        super().__init__()
        cfg = original.config
        self.config, self.options = cfg, options
        self.layer_idx = original.layer_idx
        self.num_heads = original.num_heads
        self.q_lora_rank = original.q_lora_rank
        self.kv_lora_rank, self.qk_rope_head_dim = original.kv_lora_rank, original.qk_rope_head_dim
        self.qk_nope_head_dim, self.v_head_dim = original.qk_nope_head_dim, original.v_head_dim
        self.qk_head_dim = original.qk_head_dim
        self.scaling = float(original.scaling)
        self.rope_interleave = bool(getattr(cfg, "rope_interleave", False))
        for name in _CHILDREN:
            setattr(self, name, getattr(original, name, None))
        self.kv_cache: Optional[torch.Tensor] = None       # [B, L, R + r]
        self.reserved = False        # sized by reserve(): decode never syncs with the host or grows
        self.cache_writes = 0        # bumped by every Python-side write or resize of kv_cache
        self._absorbed: Optional[tuple[torch.Tensor, torch.Tensor, bool]] = None   # w_uk, w_uv, uk_rows

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def build(cls, original: nn.Module, ctx: BuildContext) -> nn.Module:
        missing = [a for a in ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "scaling") if not hasattr(original, a)]
        if missing:
            raise ModelError(f"{ctx.name}: {type(original).__name__} lacks {', '.join(missing)}; "
                             "mla_attention replaces DeepSeek V2/V3 attention only")
        mod = cls(original, ctx.options)
        mod.target_device, mod.target_dtype = torch.device(ctx.device), ctx.dtype
        return mod

    def load_weights(self, prefix: str, source: Mapping[str, Any]) -> set[str]:
        """Loads every tensor of the subtree; nested operators load their own part."""
        from ..load import fetch_dense
        used: set[str] = set()
        dev = getattr(self, "target_device", None)
        for cname in _CHILDREN:
            child = getattr(self, cname)
            if child is None:
                continue
            cprefix = f"{prefix}{cname}."
            if isinstance(child, Operator):
                used |= child.load_weights(cprefix, source)
                continue
            for pname, param in list(child.named_parameters(recurse=True)):
                key = cprefix + pname
                t = fetch_dense(source, key, tuple(param.shape), getattr(self, "target_dtype", None) or param.dtype,
                                dev or param.device)
                owner = child.get_submodule(pname.rpartition(".")[0]) if "." in pname else child
                setattr(owner, pname.rpartition(".")[2], nn.Parameter(t, requires_grad=False))
                used.add(key)
        self._absorbed = None
        return used

    # ---- cache --------------------------------------------------------------------------
    def reserve(self, batch: int, max_len: int, device=None, dtype=None) -> None:
        """Allocate the latent cache for `batch` sequences of up to `max_len` tokens."""
        device = device or self.kv_a_layernorm.weight.device
        dtype = dtype or self._compute_dtype()
        with torch.inference_mode(False):   # a normal tensor: later calls outside inference mode update it
            self.kv_cache = torch.zeros(batch, max_len, self.kv_lora_rank + self.qk_rope_head_dim,
                                        device=device, dtype=dtype)
        self.reserved = True
        self.cache_writes += 1

    def release(self) -> None:
        self.kv_cache, self.reserved = None, False
        self.cache_writes += 1

    @property
    def cache_bytes(self) -> int:
        return 0 if self.kv_cache is None else self.kv_cache.numel() * self.kv_cache.element_size()

    def _ensure_capacity(self, batch: int, needed: int, like: torch.Tensor) -> None:
        c = self.kv_cache
        if c is not None and c.shape[0] >= batch and c.shape[1] >= needed and c.dtype == like.dtype \
                and c.device == like.device:
            return
        step = self.options.grow_step
        length = max(needed, 2 * c.shape[1] if c is not None else 0)
        length = -(-length // step) * step
        with torch.inference_mode(False):   # see reserve()
            new = torch.zeros(max(batch, c.shape[0] if c is not None else 0), length, like.shape[-1],
                              device=like.device, dtype=like.dtype)
            if c is not None:
                new[:c.shape[0], :c.shape[1]] = c.to(device=like.device, dtype=like.dtype)
        self.kv_cache = new

    def _absorbed_weights(self, uk_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_uk [H, dn, R], w_uv [H, dv, R]) from kv_b_proj, made once; with uk_rows w_uk is stored
        [H, R, dn] instead, each head's R rows of dn values (the CPU path's layout: see
        _absorbed_attention)."""
        if self._absorbed is None or self._absorbed[2] != uk_rows:
            r = self.kv_lora_rank
            dev = self.kv_a_layernorm.weight.device
            eye = torch.eye(r, device=dev, dtype=self._compute_dtype())
            # kv_b_proj is any linear-like module: its weight^T is its image of the identity.
            w = self.kv_b_proj(eye).float().T    # [H*(dn+dv), R]
            w = w.reshape(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, r)
            dt = self._compute_dtype()
            w_uk = w[:, :self.qk_nope_head_dim].to(dt)                      # [H, dn, R]
            w_uk = (w_uk.transpose(1, 2) if uk_rows else w_uk).contiguous()
            w_uv = w[:, self.qk_nope_head_dim:].to(dt).contiguous()         # [H, dv, R]
            self._absorbed = (w_uk, w_uv, uk_rows)
        return self._absorbed[:2]

    def _compute_dtype(self) -> torch.dtype:
        p = next((p for p in self.kv_a_layernorm.parameters()), None)
        return getattr(self, "target_dtype", None) or (p.dtype if p is not None else torch.float32)

    # ---- forward ------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                cache: Any = None, position_embeddings: Any = None, past_key_values: Any = None,
                **kwargs) -> tuple[torch.Tensor, None]:
        # hidden_states: [B, S, D]
        hf_cache = cache if cache is not None else past_key_values
        bsz, slen, _ = hidden_states.shape
        h, dn, dr, dv, r = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim, \
            self.kv_lora_rank
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(bsz, slen, h, dn + dr)                                     # [B, S, H, dn+dr]
        q_nope, q_pe = q[..., :dn], q[..., dn:]
        ckv = self.kv_a_proj_with_mqa(hidden_states)                          # [B, S, R+r]
        latent = self.kv_a_layernorm(ckv[..., :r])                            # [B, S, R]
        rope = self._fused_rope(hidden_states, slen, hf_cache, position_embeddings)
        if rope is not None:
            return self._fused_decode(q, ckv, latent, rope, hf_cache, kwargs), None
        k_pe = ckv[..., r:].unsqueeze(2)                                      # [B, S, 1, r]
        q_pe = apply_rope(q_pe, position_embeddings, self.rope_interleave)
        k_pe = apply_rope(k_pe, position_embeddings, self.rope_interleave).squeeze(2)
        new_kv = torch.cat([latent, k_pe.to(latent.dtype)], dim=-1)           # [B, S, R+r]

        pos = self._positions(kwargs, hf_cache, bsz, slen, hidden_states.device)   # [B, S]
        if hf_cache is not None:   # bookkeeping only: one-wide entries keep its length right
            stub = self._stub(bsz, slen, new_kv)
            hf_cache.update(stub, stub, self.layer_idx)
        absorbed = slen <= self.options.absorb_max_tokens
        if hf_cache is not None or self.kv_cache is not None:
            # a static step attends over the whole buffer under the position mask (see _cache_step)
            needed = self._cache_step(bsz, pos, new_kv, static=absorbed and new_kv.is_cuda)
            kv_all = self.kv_cache[:bsz]                                      # [B, L, R+r]
            kv_all.scatter_(1, pos.unsqueeze(-1).expand(-1, -1, r + dr), new_kv.to(kv_all.dtype))
            if needed:
                kv_all = kv_all[:, :needed]
            key_pos = torch.arange(kv_all.shape[1], device=pos.device)         # [L]
        else:
            kv_all, key_pos, needed = new_kv, pos[0], slen
        self_causal = needed == slen      # the keys are exactly the chunk's own tokens, in order
        mask = key_pos.view(1, 1, -1) <= pos.unsqueeze(-1)                      # [B, S, L]
        if absorbed:
            out = self._absorbed_attention(q_nope, q_pe, kv_all, mask)
        else:
            out = self._expanded_attention(q_nope, q_pe, kv_all, None if self_causal else mask)
        return self.o_proj(out.reshape(bsz, slen, h * dv)), None

    def _fused_rope(self, x: torch.Tensor, slen: int, hf_cache: Any, pe: Any) -> Optional[tuple]:
        """(mode, a, b) for the fused Triton decode step when it applies: one query token per
        sequence on CUDA with a cache to attend over, Triton installed, a rope form it knows; else None."""
        if not (self.options.fused_decode and slen == 1 and slen <= self.options.absorb_max_tokens
                and self._fused_device(x)
                and (hf_cache is not None or self.kv_cache is not None) and triton_available()
                and self._compute_dtype() in (torch.bfloat16, torch.float16, torch.float32)):
            return None
        from .kernels.mla_triton import ROPE_COMPLEX, ROPE_HALF, ROPE_INTERLEAVED
        if isinstance(pe, torch.Tensor) and pe.is_complex() and pe.dim() == 3 and pe.dtype == torch.complex64:
            a = torch.view_as_real(pe)[:, 0].flatten(1)                       # [B or 1, r] (cos, sin) pairs
            return ROPE_COMPLEX, a, a
        if isinstance(pe, (tuple, list)) and len(pe) == 2 and all(isinstance(t, torch.Tensor) and t.dim() == 3
                                                                     for t in pe):
            a, b = pe[0][:, 0], pe[1][:, 0]                                   # [B or 1, r]
            if a.stride() == b.stride() and a.stride(-1) == 1 and a.shape == b.shape:
                return (ROPE_INTERLEAVED if self.rope_interleave else ROPE_HALF), a, b
        if not getattr(self, "_warned_rope", False):     # correct but slow: say so once
            self._warned_rope = True
            log.warning("layer %s: position embeddings of type %s are not a rope form the fused decode step "
                        "knows; one-token steps run the torch path", self.layer_idx, type(pe).__name__)
        return None

    @staticmethod
    def _fused_device(x: torch.Tensor) -> bool:   # the tests run the kernels on the CPU in Triton's interpreter
        return x.is_cuda

    def _fused_decode(self, q: torch.Tensor, ckv: torch.Tensor, latent: torch.Tensor, rope: tuple,
                      hf_cache: Any, kwargs) -> torch.Tensor:
        """The absorbed one-token step in three kernels (W_UK bmm, split attention, combine + W_UV),
        see kernels/mla_triton.py; the same math as `_absorbed_attention` after the rope."""
        from .kernels.mla_triton import mla_decode
        bsz = q.shape[0]
        h, dn, r = self.num_heads, self.qk_nope_head_dim, self.kv_lora_rank
        pos = self._positions(kwargs, hf_cache, bsz, 1, q.device)             # [B, 1]
        if self._bookkeeping(hf_cache):
            stub = self._stub(bsz, 1, latent)
            hf_cache.update(stub, stub, self.layer_idx)
        self._cache_step(bsz, pos, latent.new_empty(1, 1, r + self.qk_rope_head_dim), static=True)
        w_uk, w_uv = self._absorbed_weights()
        q_nope = q[:, 0, :, :dn].transpose(0, 1)                              # [H, B, dn]
        q_lat = torch.bmm(q_nope.to(w_uk.dtype), w_uk)                        # [H, B, R]
        mode, a, b = rope
        out = mla_decode(q_lat, q[:, 0, :, dn:], latent[:, 0], ckv[:, 0, r:], mode, a, b, pos[:, 0],
                         self.kv_cache, self.scaling, w_uv)                   # [B, H * dv]
        return self.o_proj(out.view(bsz, 1, h * self.v_head_dim))

    def _cache_step(self, bsz: int, pos: torch.Tensor, like: torch.Tensor, static: bool) -> int:
        """Make the cache ready for a step writing at `pos` [B, S]; returns the key length to attend
        over (0: the whole buffer). A step that may be `static` (decode on CUDA) on a reserved cache
        keeps static shapes, CUDA-graph safe, and never reads the positions on the host; otherwise
        the length is read once from them (on the CPU that costs no sync) and the cache grown to it."""
        static = static and self.reserved and self.kv_cache is not None and self.kv_cache.shape[0] >= bsz
        if like.is_cuda and torch.cuda.is_current_stream_capturing() and not static:
            raise ModelError(f"layer {self.layer_idx}: MLA cache must be reserve()d before CUDA-graph capture")
        needed = 0 if static else int(pos.max()) + 1
        if needed:
            self._ensure_capacity(bsz, needed, like)
        self.cache_writes += 1            # counted where Python runs (not in graph replays): see generate._cache_writes
        return needed

    def _bookkeeping(self, hf_cache: Any) -> bool:
        """Whether a one-token step stores its bookkeeping entry in transformers' cache: always,
        except in a cache the generation engine marked `ktinject_explicit_positions` (it passes
        every position and keeps the cache's length itself) once this layer's entry exists."""
        if hf_cache is None:
            return False
        if not getattr(hf_cache, "ktinject_explicit_positions", False):
            return True
        layers = getattr(hf_cache, "layers", None)
        layer = layers[self.layer_idx] if isinstance(layers, (list, tuple)) and self.layer_idx < len(layers) else None
        return not getattr(layer, "is_initialized", False)

    @staticmethod
    def _stub(bsz: int, slen: int, like: torch.Tensor) -> torch.Tensor:
        # transformers caches count an empty tensor as no tokens, so store one zero per token
        return like.new_zeros(bsz, 1, slen, 1)

    def _positions(self, kwargs, hf_cache, bsz, slen, device) -> torch.Tensor:
        pos = kwargs.get("position_ids")
        if pos is None:
            pos = kwargs.get("cache_position")
        if pos is None:
            past = hf_cache.get_seq_length(self.layer_idx) if hf_cache is not None else 0
            pos = torch.arange(slen, device=device) + past
        pos = pos.to(device=device, dtype=torch.long)
        return pos.expand(bsz, slen) if pos.dim() == 1 or pos.shape[0] != bsz else pos

    def _absorbed_attention(self, q_nope, q_pe, kv_all, mask) -> torch.Tensor:
        # q_nope: [B, S, H, dn]  q_pe: [B, S, H, r]  kv_all: [B, L, R+r]  mask: [B, S, L] -> [B, S, H, dv]
        r = self.kv_lora_rank
        # On the CPU the weights go first in bmm: per head a matrix times the step's vectors, which
        # torch's CPU bmm runs 2.2-2.6x faster at one token than the einsums' vectors times matrices
        # (V2-Lite's shapes, one thread: 344 + 405 -> 154 + 156 us a layer; docs/benchmarks.md)
        cpu = q_nope.device.type == "cpu"
        w_uk, w_uv = self._absorbed_weights(uk_rows=cpu)
        dt = kv_all.dtype
        bsz, slen, h = q_nope.shape[:3]
        if cpu:
            q_t = q_nope.to(w_uk.dtype).permute(2, 3, 0, 1).reshape(h, -1, bsz * slen)   # [H, dn, B*S]
            q_lat = torch.bmm(w_uk, q_t).view(h, r, bsz, slen).permute(2, 3, 0, 1).to(dt)  # [B, S, H, R]
        else:
            q_lat = torch.einsum("bshd,hdr->bshr", q_nope.to(w_uk.dtype), w_uk).to(dt)   # [B, S, H, R]
        q_cat = torch.cat([q_lat, q_pe.to(dt)], dim=-1).flatten(1, 2)                      # [B, S*H, R+r]
        scores = torch.bmm(q_cat, kv_all.transpose(1, 2)).float() * self.scaling           # [B, S*H, L]
        scores = scores.view(bsz, slen, h, -1).masked_fill(~mask.unsqueeze(2), float("-inf"))
        probs = scores.softmax(dim=-1).to(dt).view(bsz, slen * h, -1)
        o_lat = torch.bmm(probs, kv_all[..., :r]).view(bsz, slen, h, r)                    # [B, S, H, R]
        if cpu:
            o_t = o_lat.to(w_uv.dtype).permute(2, 3, 0, 1).reshape(h, r, bsz * slen)      # [H, R, B*S]
            return torch.bmm(w_uv, o_t).view(h, -1, bsz, slen).permute(2, 3, 0, 1).to(dt)  # [B, S, H, dv]
        return torch.einsum("bshr,hvr->bshv", o_lat.to(w_uv.dtype), w_uv).to(dt)

    def _expanded_attention(self, q_nope, q_pe, kv_all, mask) -> torch.Tensor:
        # kv_all: [B, L, R+r] -> K: [B, H, L, dn+r], V: [B, H, L, dv]; queries [B, H, S, dn+r]
        r, h, dn, dv = self.kv_lora_rank, self.num_heads, self.qk_nope_head_dim, self.v_head_dim
        bsz, length = kv_all.shape[:2]
        kv = self.kv_b_proj(kv_all[..., :r]).view(bsz, length, h, dn + dv).transpose(1, 2)
        k_pe = kv_all[..., r:].unsqueeze(1).expand(-1, h, -1, -1)
        k = torch.cat([kv[..., :dn], k_pe.to(kv.dtype)], dim=-1)
        v = kv[..., dn:]
        qq = torch.cat([q_nope, q_pe.to(q_nope.dtype)], dim=-1).transpose(1, 2)
        if v.shape[-1] != qq.shape[-1]:     # equal head dims let SDPA pick its fused kernels
            v = F.pad(v, (0, qq.shape[-1] - v.shape[-1]))
        k, v = k.to(qq.dtype), v.to(qq.dtype)
        if mask is None:                      # causal over the chunk's own tokens (flash-eligible)
            out = F.scaled_dot_product_attention(qq, k, v, is_causal=True, scale=self.scaling)
        else:
            out = F.scaled_dot_product_attention(qq, k, v, attn_mask=mask.unsqueeze(1), scale=self.scaling)
        return out[..., :dv].transpose(1, 2)                                  # [B, S, H, dv]

    def extra_repr(self) -> str:
        return (f"op=mla_attention, layer={self.layer_idx}, heads={self.num_heads}, latent={self.kv_lora_rank}"
                f"+{self.qk_rope_head_dim}, decode=absorbed (q_len <= {self.options.absorb_max_tokens}"
                f"{'; one token on CUDA: fused Triton' if self.options.fused_decode and triton_available() else ''}), "
                f"prefill=expanded SDPA, cache={self.cache_bytes} bytes")


def replace_all(model: nn.Module, device: Any = "cpu", dtype: Optional[torch.dtype] = None,
                options: MLAOptions = MLAOptions()) -> nn.Module:
    """Swap every DeepSeek attention of a loaded model for `mla_attention`, reusing its weights.

    For tests and benches on models that are already materialized; the rule-driven loader is
    the normal way in.
    """
    source = dict(model.state_dict())
    dev = torch.device(device)
    for name, mod in list(model.named_modules()):
        if type(mod).__name__ in MLAAttention.replaces:
            ctx = BuildContext(name, dev, dev, dev, dtype, model.config, options)
            new = MLAAttention.build(mod, ctx)
            new.load_weights(name + ".", source)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, new)
    return model
