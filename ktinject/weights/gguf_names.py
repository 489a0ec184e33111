"""GGUF tensor names <-> transformers state-dict names, per architecture, as data.

One table per GGUF architecture. A row says: this transformers key is made of these GGUF
tensors, through this layout. The same rows drive reading (`gguf_file.py`) and writing
(`gguf_write.py`). `{bid}` stands for the layer index.

Layouts (each both ways):

* `plain`    one tensor, same values. GGUF lists dims fastest first (`ne`), so an HF
             `[out, in]` weight is stored as ne `[in, out]`; torch order is simply `ne` reversed.
* `gate_up`  HF `experts.gate_up_proj [E, 2I, H]` (gate first) <-> `ffn_gate_exps` + `ffn_up_exps`,
             each `[E, I, H]`; read as a zero-copy `FusedTensor((gate, up), dim=1)`.
* `rope_q`, `rope_k`  Llama/Mixtral q/k rows: llama.cpp's converter reorders each head's rows
             from HF's rotate-half pairing to interleaved pairs; undone on read, applied on write.
* `kv_b_split`  DeepSeek MLA `kv_b_proj [heads*(nope+v), kv_lora]` <-> `attn_k_b`
             (`[heads, kv_lora, nope]`, i.e. the nope part transposed per head) + `attn_v_b`
             (`[heads, v, kv_lora]`). Older files carry one `attn_kv_b` (a `plain` row).

When a key has several rows (old and new DeepSeek files), reading takes the first whose
tensors are all present, writing takes the first with `write=True`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..errors import WeightError
from .tensor import GGMLTensor, FusedTensor


@dataclass(frozen=True)
class Row:
    hf: str                            # transformers state-dict key template
    gguf: tuple[str, ...]              # GGUF tensor name templates it is made of
    layout: str = "plain"
    write: bool = True                 # the row `convert` uses for this key

    def hf_regex(self) -> re.Pattern:
        return re.compile(re.escape(self.hf).replace(r"\{bid\}", r"(?P<bid>\d+)"))

    def gguf_regexes(self) -> tuple[re.Pattern, ...]:
        return tuple(re.compile(re.escape(g).replace(r"\{bid\}", r"(?P<bid>\d+)").replace(r"\{xid\}", r"\d+"))
                     for g in self.gguf)

    def gguf_parts(self, fmt: dict, present) -> tuple[str, ...]:
        """Concrete GGUF names; `{xid}` templates expand to experts 0.. as far as the file has them."""
        if not any("{xid}" in g for g in self.gguf):
            return tuple(g.format(**fmt) for g in self.gguf)
        n = 0
        while self.gguf[0].format(**fmt, xid=n) in present:
            n += 1
        return tuple(g.format(**fmt, xid=x) for g in self.gguf for x in range(n)) if n else ()


def _rows(pairs, layout="plain", write=True):
    return [Row(hf, (g,) if isinstance(g, str) else tuple(g), layout, write) for hf, g in pairs]


L = "model.layers.{bid}."
B = "blk.{bid}."

COMMON = _rows([
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
    (L + "input_layernorm.weight", B + "attn_norm.weight"),
    (L + "post_attention_layernorm.weight", B + "ffn_norm.weight"),
    (L + "self_attn.o_proj.weight", B + "attn_output.weight"),
    (L + "mlp.gate.weight", B + "ffn_gate_inp.weight"),
    (L + "mlp.experts.down_proj", B + "ffn_down_exps.weight"),
]) + _rows([(L + "mlp.experts.gate_up_proj", (B + "ffn_gate_exps.weight", B + "ffn_up_exps.weight"))],
           layout="gate_up")

DENSE_MLP = _rows([
    (L + "mlp.gate_proj.weight", B + "ffn_gate.weight"),
    (L + "mlp.up_proj.weight", B + "ffn_up.weight"),
    (L + "mlp.down_proj.weight", B + "ffn_down.weight"),
])

QKV = _rows([
    (L + "self_attn.q_proj.weight", B + "attn_q.weight"),
    (L + "self_attn.k_proj.weight", B + "attn_k.weight"),
    (L + "self_attn.v_proj.weight", B + "attn_v.weight"),
])

TABLES: dict[str, list[Row]] = {
    "deepseek2": COMMON + DENSE_MLP + _rows([
        (L + "self_attn.q_proj.weight", B + "attn_q.weight"),
        (L + "self_attn.q_a_proj.weight", B + "attn_q_a.weight"),
        (L + "self_attn.q_a_layernorm.weight", B + "attn_q_a_norm.weight"),
        (L + "self_attn.q_b_proj.weight", B + "attn_q_b.weight"),
        (L + "self_attn.kv_a_proj_with_mqa.weight", B + "attn_kv_a_mqa.weight"),
        (L + "self_attn.kv_a_layernorm.weight", B + "attn_kv_a_norm.weight"),
        (L + "mlp.gate.e_score_correction_bias", B + "exp_probs_b.bias"),
        (L + "mlp.shared_experts.gate_proj.weight", B + "ffn_gate_shexp.weight"),
        (L + "mlp.shared_experts.up_proj.weight", B + "ffn_up_shexp.weight"),
        (L + "mlp.shared_experts.down_proj.weight", B + "ffn_down_shexp.weight"),
    ]) + _rows([(L + "self_attn.kv_b_proj.weight", (B + "attn_k_b.weight", B + "attn_v_b.weight"))],
               layout="kv_b_split")
      + _rows([(L + "self_attn.kv_b_proj.weight", B + "attn_kv_b.weight")], write=False),
    "qwen2moe": COMMON + QKV + _rows([
        (L + "self_attn.q_proj.bias", B + "attn_q.bias"),
        (L + "self_attn.k_proj.bias", B + "attn_k.bias"),
        (L + "self_attn.v_proj.bias", B + "attn_v.bias"),
        (L + "mlp.shared_expert.gate_proj.weight", B + "ffn_gate_shexp.weight"),
        (L + "mlp.shared_expert.up_proj.weight", B + "ffn_up_shexp.weight"),
        (L + "mlp.shared_expert.down_proj.weight", B + "ffn_down_shexp.weight"),
        (L + "mlp.shared_expert_gate.weight", B + "ffn_gate_inp_shexp.weight"),
    ]),
    "qwen3moe": COMMON + QKV + _rows([
        (L + "self_attn.q_norm.weight", B + "attn_q_norm.weight"),
        (L + "self_attn.k_norm.weight", B + "attn_k_norm.weight"),
    ]),
    "llama": COMMON + _rows([(L + "self_attn.q_proj.weight", B + "attn_q.weight")], layout="rope_q")
    + _rows([(L + "self_attn.k_proj.weight", B + "attn_k.weight")], layout="rope_k")
    + _rows([(L + "self_attn.v_proj.weight", B + "attn_v.weight")])
    # Mixtral files converted before April 2024 keep one tensor per expert (read only)
    + _rows([(L + "mlp.experts.gate_up_proj", (B + "ffn_gate.{xid}.weight", B + "ffn_up.{xid}.weight"))],
            layout="stacked_gate_up", write=False)
    + _rows([(L + "mlp.experts.down_proj", B + "ffn_down.{xid}.weight")], layout="stacked", write=False),
}

# GGUF tensors that carry nothing transformers loads (recomputed from the config).
IGNORED = (re.compile(r"rope_freqs\.weight"), re.compile(r"blk\.\d+\.attn_rot_embd\.weight"))


def table(arch: str, file: str = "") -> list[Row]:
    try:
        return TABLES[arch]
    except KeyError:
        raise WeightError(f"unknown architecture {arch!r} (supported: {', '.join(sorted(TABLES))})",
                          file=file or None) from None


# ---------------------------------------------------------------- layouts

def _rope_perm(rows: int, n_head: int) -> torch.Tensor:
    """Row order llama.cpp writes: for each head, HF rows (i, i + d/2) become neighbours."""
    d = rows // n_head
    return torch.arange(rows).reshape(n_head, 2, d // 2).transpose(1, 2).reshape(rows)


def _take_rows(t, index: torch.Tensor):
    """Rows of a 2-D weight in a new order; GGML tensors stay quantized (rows are whole blocks)."""
    if isinstance(t, GGMLTensor):
        return GGMLTensor(t.ggml_type, t.shape, t.data[index].contiguous(), t.name, t.file)
    return t[index]


def _heads(config, key: str) -> int:
    if key == "rope_k":
        return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    return int(config.num_attention_heads)


@dataclass(frozen=True)
class Layout:
    read: Callable[[tuple, Any], Any]          # (GGUF tensors in row order, config) -> HF tensor
    write: Callable[[torch.Tensor, Any], tuple]  # (HF tensor, config) -> GGUF tensors in row order


def _read_rope(kind):
    def read(parts, config):
        (t,) = parts
        perm = _rope_perm(int(t.shape[0]), _heads(config, kind))
        return _take_rows(t, torch.argsort(perm))
    return read


def _write_rope(kind):
    def write(t, config):
        return (t[_rope_perm(int(t.shape[0]), _heads(config, kind))],)
    return write


def _mla_dims(config):
    return int(config.num_attention_heads), int(config.qk_nope_head_dim), int(config.v_head_dim)


def _read_kv_b(parts, config):
    from .tensor import as_dense
    n_head, nope, v = _mla_dims(config)
    k_b = as_dense(parts[0], torch.float32)                # [heads, kv_lora, nope]
    v_b = as_dense(parts[1], torch.float32)                # [heads, v, kv_lora]
    kv_lora = k_b.shape[-2]
    k_b = k_b.reshape(n_head, kv_lora, nope).transpose(1, 2)
    v_b = v_b.reshape(n_head, v, kv_lora)
    return torch.cat((k_b, v_b), dim=1).reshape(n_head * (nope + v), kv_lora)


def _write_kv_b(t, config):
    n_head, nope, v = _mla_dims(config)
    kv = t.reshape(n_head, nope + v, t.shape[-1])          # [heads, nope+v, kv_lora]
    return kv[:, :nope].transpose(1, 2).contiguous(), kv[:, nope:].contiguous()


def _read_gate_up(parts, config):
    gate, up = parts
    if isinstance(gate, torch.Tensor) and isinstance(up, torch.Tensor):
        return torch.cat((gate, up), dim=1)
    return FusedTensor((gate, up), dim=1, name=getattr(gate, "name", ""))


def _stack(parts):
    """Equal-shaped per-expert weights `[out, in]` -> `[E, out, in]` (GGML blocks stay quantized)."""
    if all(isinstance(p, GGMLTensor) for p in parts):
        first = parts[0]
        for p in parts:
            if p.ggml_type != first.ggml_type or tuple(p.shape) != tuple(first.shape):
                raise WeightError(f"experts differ in type or shape ({p.type_name} {list(p.shape)} vs "
                                  f"{first.type_name} {list(first.shape)})", file=p.file or None, tensor=p.name)
        return GGMLTensor(first.ggml_type, (len(parts),) + tuple(first.shape), torch.cat([p.data for p in parts]),
                          first.name, first.file)
    from .tensor import as_dense
    return torch.stack([as_dense(p) for p in parts])


def _read_stacked_gate_up(parts, config):
    half = len(parts) // 2                                   # gate_0..gate_E-1, up_0..up_E-1
    return _read_gate_up((_stack(parts[:half]), _stack(parts[half:])), config)


def _read_only(t, config):
    raise WeightError("this layout is read only (ktinject writes merged expert tensors)")


def _write_gate_up(t, config):
    half = t.shape[1] // 2                                   # t: [E, 2I, H], gate first
    return t[:, :half], t[:, half:]


LAYOUTS: dict[str, Layout] = {
    "plain": Layout(lambda parts, config: parts[0], lambda t, config: (t,)),
    "gate_up": Layout(_read_gate_up, _write_gate_up),
    "rope_q": Layout(_read_rope("rope_q"), _write_rope("rope_q")),
    "rope_k": Layout(_read_rope("rope_k"), _write_rope("rope_k")),
    "kv_b_split": Layout(_read_kv_b, _write_kv_b),
    "stacked_gate_up": Layout(_read_stacked_gate_up, _read_only),
    "stacked": Layout(lambda parts, config: _stack(parts), _read_only),
}


# ---------------------------------------------------------------- resolving names

@dataclass(frozen=True)
class Binding:
    """One HF key bound to the GGUF tensors it is read from."""
    hf: str
    gguf: tuple[str, ...]
    layout: str


def bind_gguf(arch: str, names, file: str = "") -> tuple[dict[str, Binding], list[str]]:
    """Map the GGUF tensor `names` of a file to HF keys. Returns (bindings, names left over)."""
    rows = table(arch, file)
    present = set(names)
    out: dict[str, Binding] = {}
    used: set[str] = set()
    for name in sorted(present):
        for row in rows:
            for pattern in row.gguf_regexes():
                m = pattern.fullmatch(name)
                if not m:
                    continue
                bid = m.groupdict().get("bid")
                fmt = {"bid": bid} if bid is not None else {}
                hf = row.hf.format(**fmt)
                parts = row.gguf_parts(fmt, present)
                if not parts or not all(p in present for p in parts):
                    continue
                if hf in out:                  # a second form of the same weight (e.g. kv_b + k_b/v_b)
                    used.update(parts)
                    continue
                out[hf] = Binding(hf, parts, row.layout)
                used.update(parts)
    left = sorted(n for n in present - used if not any(p.fullmatch(n) for p in IGNORED))
    return out, left


def gguf_names_for(arch: str, hf_key: str) -> Optional[tuple[Row, tuple[str, ...]]]:
    """The row (with write=True) and concrete GGUF names for an HF key, or None if unmapped."""
    for row in table(arch):
        if not row.write:
            continue
        m = row.hf_regex().fullmatch(hf_key)
        if m:
            bid = m.groupdict().get("bid")
            fmt = {"bid": bid} if bid is not None else {}
            return row, tuple(g.format(**fmt) for g in row.gguf)
    return None


def read_layout(layout: str, parts: tuple, config):
    return LAYOUTS[layout].read(parts, config)


def write_layout(layout: str, t: torch.Tensor, config) -> tuple:
    return LAYOUTS[layout].write(t, config)
