"""Writing GGUF files: type recipes, encoding, metadata, streaming writer.

* Recipes are data: an ordered list of (regex on the GGUF tensor name, GGML type); first match
  wins. 1-D tensors and the router stay F32 as in llama.cpp. `more_bits` marks the layers
  llama.cpp gives more bits in its `_M` presets (first and last eighth, every third between).
* A type whose block does not divide the row falls back as llama.cpp does (Q4_K -> Q5_0,
  Q5_K -> Q5_1, Q6_K -> Q8_0; then F16 when even 32 does not divide).
* `GGUFOut` streams: tensor infos are declared first (shapes and types are known up front),
  then each tensor is produced, encoded and written one at a time, so memory stays bounded by
  the largest tensor. Split output (`-00001-of-0000N.gguf`) comes from the `gguf` writer.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from ..errors import WeightError
from . import kquant
from .quants import QUANTS

log = logging.getLogger(__name__)

F32_ALWAYS = re.compile(r".*(norm|ffn_gate_inp|exp_probs_b|gate_inp_shexp).*")
FALLBACK = {QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0, QT.Q2_K: QT.Q4_0, QT.Q3_K: QT.Q4_0}


@dataclass(frozen=True)
class Recipe:
    name: str
    rules: tuple[tuple[str, str], ...]            # (regex fullmatched on the GGUF name, type name)
    more_bits: tuple[tuple[str, str], ...] = ()   # same, applied first in `more_bits` layers
    file_type: int = 0                            # general.file_type (llama.cpp's LlamaFileType)
    description: str = ""

    def __post_init__(self):
        for _, t in self.rules + self.more_bits:
            if QT[t] not in QUANTS:
                raise ValueError(f"recipe {self.name}: unknown type {t}")


EXPERTS = r"blk\.\d+\.ffn_(gate|up|down)_exps\.weight"
PRESETS: dict[str, Recipe] = {r.name: r for r in (
    Recipe("q4_k_m", ((r"output\.weight", "Q6_K"), (r".*", "Q4_K")),
           more_bits=((r"blk\.\d+\.(attn_v|attn_v_b|ffn_down|ffn_down_exps|ffn_down_shexp)\.weight", "Q6_K"),),
           file_type=15, description="llama.cpp-like Q4_K_M: Q4_K, Q6_K for output and some v/down"),
    Recipe("q5_k_m", ((r"output\.weight", "Q6_K"), (r".*", "Q5_K")),
           more_bits=((r"blk\.\d+\.(attn_v|attn_v_b|ffn_down|ffn_down_exps|ffn_down_shexp)\.weight", "Q6_K"),),
           file_type=17, description="Q5_K, Q6_K for output and some v/down"),
    Recipe("q3_k_m", ((r"output\.weight", "Q6_K"), (r".*", "Q3_K")),
           more_bits=((r"blk\.\d+\.(attn_v|attn_v_b|ffn_down|ffn_down_exps|ffn_down_shexp)\.weight", "Q4_K"),),
           file_type=12, description="llama.cpp-like Q3_K_M: Q3_K, Q4_K for some v/down, Q6_K output"),
    Recipe("q2_k", ((r"output\.weight", "Q6_K"), (r".*", "Q2_K")),
           more_bits=((r"blk\.\d+\.(attn_v|attn_v_b|ffn_down|ffn_down_exps|ffn_down_shexp)\.weight", "Q3_K"),),
           file_type=10, description="llama.cpp-like Q2_K: Q2_K, Q3_K for some v/down, Q6_K output"),
    Recipe("q6_k", ((r".*", "Q6_K"),), file_type=18, description="Q6_K everywhere"),
    Recipe("q4_k_x", ((EXPERTS, "Q4_K"), (r".*", "Q8_0")), file_type=15,
           description="routed experts Q4_K, everything else Q8_0 (for GPU attention + CPU experts)"),
    Recipe("q8_0", ((r".*", "Q8_0"),), file_type=7, description="Q8_0 everywhere"),
    Recipe("q4_0", ((r".*", "Q4_0"),), file_type=2, description="Q4_0 everywhere"),
    Recipe("bf16", ((r".*", "BF16"),), file_type=32, description="bfloat16"),
    Recipe("f16", ((r".*", "F16"),), file_type=1, description="float16"),
    Recipe("f32", ((r".*", "F32"),), file_type=0, description="float32"),
)}


def recipe(name: str) -> Recipe:
    try:
        return PRESETS[name]
    except KeyError:
        raise WeightError(f"unknown preset {name!r} (known: {', '.join(sorted(PRESETS))})") from None


def more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's `use_more_bits`: first and last eighth of the layers, and every third between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


_LAYER = re.compile(r"blk\.(\d+)\.")


def choose_type(r: Recipe, name: str, shape: tuple[int, ...], n_layers: int) -> QT:
    """The GGML type of GGUF tensor `name` with torch-order `shape` under recipe `r`."""
    if len(shape) == 1 or F32_ALWAYS.fullmatch(name):
        return QT.F32
    m = _LAYER.match(name)
    rules = (r.more_bits if m and more_bits(int(m.group(1)), n_layers) else ()) + r.rules
    qt = next((QT[t] for pat, t in rules if re.fullmatch(pat, name)), QT.F32)
    row = shape[-1]
    while row % QUANTS[qt].block_size:
        qt = FALLBACK.get(qt, QT.F16)
    return qt


# ---------------------------------------------------------------- encoding

def encode(values: torch.Tensor, qt: QT) -> np.ndarray:
    """Float values (torch order) -> what the gguf writer stores: float arrays, or uint8 rows of
    BF16 bytes or blocks (kquant.quantize_rows, the one converter)."""
    values = values.detach().to("cpu", torch.float32).contiguous()
    if qt == QT.F32:
        return values.numpy()
    if qt == QT.F16:
        return values.to(torch.float16).numpy()
    rows = kquant.quantize_rows(values.reshape(-1, values.shape[-1]), qt)
    return rows.reshape(*values.shape[:-1], -1).numpy()


def nbytes_of(shape: tuple[int, ...], qt: QT) -> int:
    cls = QUANTS[qt]
    return int(np.prod(shape, dtype=np.int64)) // cls.block_size * cls.type_size


# ---------------------------------------------------------------- metadata

_KINDS = {"int": "UINT32", "float": "FLOAT32", "bool": "BOOL", "str": "STRING"}


def add_metadata(writer, kv: dict[str, Any]) -> None:
    """Add `{key: (value, kind)}` or `{key: value}` to a `gguf.GGUFWriter`, picking GGUF types."""
    from gguf import GGUFValueType as VT
    for key, item in kv.items():
        value, kind = item if isinstance(item, tuple) else (item, None)
        if isinstance(value, (list, tuple)):
            sub = VT.STRING if all(isinstance(v, str) for v in value) else \
                VT.FLOAT32 if any(isinstance(v, float) for v in value) else VT.INT32
            writer.add_key_value(key, list(value), VT.ARRAY, sub_type=sub)
            continue
        if kind is None:
            kind = "bool" if isinstance(value, bool) else "int" if isinstance(value, int) else \
                "float" if isinstance(value, float) else "str"
        vt = VT[_KINDS[kind]]
        if vt == VT.UINT32 and int(value) < 0:
            vt = VT.INT32
        writer.add_key_value(key, value, vt)


def tokenizer_metadata(tokenizer, vocab_size: int) -> dict[str, Any]:
    """`tokenizer.ggml.*` keys of a byte-level BPE `PreTrainedTokenizerFast` (llama.cpp's "gpt2" model)."""
    import json
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    model = state.get("model", {})
    if model.get("type") != "BPE":
        raise WeightError(f"only BPE tokenizers can be written to GGUF, this one is {model.get('type')!r}")
    vocab = {tok: i for tok, i in model["vocab"].items()}
    for added in state.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    specials = {a["id"] for a in state.get("added_tokens", []) if a.get("special")}
    if max(vocab.values(), default=-1) >= vocab_size:
        raise WeightError(f"tokenizer has ids up to {max(vocab.values())}, the model's vocabulary is {vocab_size}")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [5] * vocab_size                                  # UNUSED, overwritten below
    for tok, i in vocab.items():
        tokens[i] = tok
        types[i] = 3 if i in specials else 1                  # CONTROL / NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    out: dict[str, Any] = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
                           "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                           "tokenizer.ggml.merges": merges}
    if not merges:                    # GGUF has no empty arrays; a bare byte vocabulary has no merges
        del out["tokenizer.ggml.merges"]
    for attr, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id"), ("unk_token_id", "unknown_token_id")):
        idx = getattr(tokenizer, attr, None)
        if idx is not None:
            out[f"tokenizer.ggml.{key}"] = (int(idx), "int")
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        out["tokenizer.chat_template"] = template
    return out


# ---------------------------------------------------------------- streaming writer

@dataclass
class PlannedTensor:
    name: str                                   # GGUF name
    shape: tuple[int, ...]                      # torch order
    qtype: QT
    produce: Callable[[], Any]                  # -> float torch.Tensor (encoded here) or np.ndarray (as stored)


def write_gguf(path: str | Path, arch: str, kv: dict[str, Any], tensors: list[PlannedTensor], *,
               split_max_tensors: int = 0, split_max_size: int = 0, progress: bool = True,
               label: str = "writing") -> list[Path]:
    """Write one GGUF model (split when asked); returns the file paths written."""
    import gguf
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise WeightError(f"cannot create the output directory: {exc}", file=str(path)) from None
    w = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors, split_max_size=split_max_size)
    add_metadata(w, kv)
    for t in tensors:
        if t.qtype in (QT.F32, QT.F16):
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32 if t.qtype == QT.F32 else np.float16),
                              nbytes_of(t.shape, t.qtype))
        else:
            byte_shape = (*t.shape[:-1], nbytes_of(t.shape[-1:], t.qtype))
            w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), nbytes_of(t.shape, t.qtype), raw_dtype=t.qtype)
    files = w.format_shard_names(path) if len(w.tensors) > 1 else [path]
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total = sum(nbytes_of(t.shape, t.qtype) for t in tensors)

    def encoded(t: PlannedTensor):
        data = t.produce()
        if isinstance(data, torch.Tensor):
            try:
                return encode(data, t.qtype)
            except ValueError as exc:       # values the type cannot hold: name the tensor
                raise WeightError(f"cannot write as {t.qtype.name}: {exc}", file=str(path), tensor=t.name) from None
        if isinstance(data, np.ndarray):
            return np.ascontiguousarray(data)
        return data                         # streamed bytes: anything with `nbytes` and `tofile(f)`

    # a two-stage pipeline: one thread reads and encodes the next tensor while this one writes
    # the last (at most two tensors' data are held; the encoders parallelize inside)
    from concurrent.futures import ThreadPoolExecutor
    ahead = ThreadPoolExecutor(max_workers=1)
    done = False
    try:
        with _progress(progress, label, total) as advance:
            pending = ahead.submit(encoded, tensors[0]) if tensors else None
            for i, t in enumerate(tensors):
                arr = pending.result()
                pending = ahead.submit(encoded, tensors[i + 1]) if i + 1 < len(tensors) else None
                want = nbytes_of(t.shape, t.qtype)
                if arr.nbytes != want:
                    raise WeightError(f"encoded {arr.nbytes} bytes, expected {want}", file=str(path), tensor=t.name)
                w.write_tensor_data(arr)
                del arr
                advance(want, t.name)
        done = True
    finally:
        ahead.shutdown(wait=done, cancel_futures=True)
        w.close()
        if not done:                        # no half-written model is left behind
            for f in files:
                Path(f).unlink(missing_ok=True)
    return [Path(f) for f in files]


class _progress:
    """A rich progress bar over bytes written (a no-op when disabled)."""

    def __init__(self, enabled: bool, label: str, total: int):
        self.enabled, self.label, self.total = enabled, label, total

    def __enter__(self):
        if not self.enabled:
            return lambda n, name: None
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                   TransferSpeedColumn)
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                            TimeRemainingColumn(), TextColumn("{task.fields[tensor]}"), transient=False)
        self.bar.__enter__()
        task = self.bar.add_task(self.label, total=self.total, tensor="")
        return lambda n, name: self.bar.update(task, advance=n, tensor=name)

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.__exit__(*exc)
        return False


def file_kv(arch: str, name: str, r: Recipe) -> dict[str, Any]:
    return {"general.name": name, "general.file_type": (r.file_type, "int"), "general.quantization_version": (2, "int")}


def layer_sort_key(name: str):
    """token_embd first, then blocks in order, then the output tensors (llama.cpp's order)."""
    m = _LAYER.match(name)
    if m:
        return (1, int(m.group(1)), name)
    return (0 if name.startswith("token_embd") else 2, 0, name)


# ---------------------------------------------------------------- HF model -> GGUF

def _hf_state(hf_dir: Path, config):
    """The HF model's weights as a Mapping keyed by module state-dict names (streamed if possible)."""
    try:
        from . import open_source
        return open_source(hf_dir, config)
    except ImportError:                 # the safetensors source is not available: load the model
        from transformers import AutoModelForCausalLM
        log.info("safetensors weight source unavailable; loading %s with transformers", hf_dir)
        return AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).state_dict()


def convert_model(hf_dir: str | Path, out: str | Path, preset: str = "q4_k_m", *, split_max_tensors: int = 0,
                  split_max_size: int = 0, progress: bool = True, name: Optional[str] = None) -> list[Path]:
    """Write an HF model directory as GGUF with llama.cpp's names and keys, typed by `preset`."""
    from transformers import AutoConfig
    from . import gguf_config, gguf_names
    hf_dir, r = Path(hf_dir), recipe(preset)
    if not (hf_dir / "config.json").is_file():
        raise WeightError("not a transformers model directory (no config.json)", file=str(hf_dir))
    try:
        config = AutoConfig.from_pretrained(str(hf_dir))
    except (OSError, ValueError) as exc:
        raise WeightError(f"not a transformers model directory: {exc}", file=str(hf_dir)) from None
    arch, kv = gguf_config.metadata_from_config(config)
    kv = {**file_kv(arch, name or hf_dir.name, r), **kv}
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(str(hf_dir))
        kv.update(tokenizer_metadata(tok, config.vocab_size))
    except (OSError, ValueError, WeightError) as exc:
        log.warning("no tokenizer written: %s", exc)
    state = _hf_state(hf_dir, config)
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    _check_complete(hf_dir, config, shapes)
    planned: list[PlannedTensor] = []
    for key in state:
        if getattr(config, "tie_word_embeddings", False) and key == "lm_head.weight":
            continue
        found = gguf_names.gguf_names_for(arch, key)
        if found is None:
            raise WeightError(f"no GGUF name for this {arch} weight", file=str(hf_dir), tensor=key)
        row, names = found
        part_shapes = _part_shapes(row.layout, shapes[key], config)
        for i, (gname, pshape) in enumerate(zip(names, part_shapes)):
            qt = choose_type(r, gname, pshape, config.num_hidden_layers)
            planned.append(PlannedTensor(gname, pshape, qt, _producer(state, key, row.layout, i, config)))
    planned.sort(key=lambda t: layer_sort_key(t.name))
    return write_gguf(out, arch, kv, planned, split_max_tensors=split_max_tensors, split_max_size=split_max_size,
                      progress=progress, label=f"convert {preset}")


def _check_complete(hf_dir: Path, config, shapes: dict[str, tuple[int, ...]]) -> None:
    """Every weight the config's model has, of its shape, and nothing else; else a LoadError
    naming the directory and the tensors (a shard left out of a copy must not give a GGUF
    with layers silently missing)."""
    from ..errors import LoadError
    from .gguf_file import _expected_shapes
    expected = _expected_shapes(config)
    if expected is None:
        return
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected) - tied)
    mismatched = [f"{k} (file {list(shapes[k])}, model {list(expected[k])})"
                  for k in sorted(expected) if k in shapes and shapes[k] != expected[k]]
    if missing or unexpected or mismatched:
        raise LoadError(f"{hf_dir}: the weights do not match the model config.json describes "
                        f"({config.num_hidden_layers} layers)", missing=missing, unexpected=unexpected,
                        mismatched=mismatched)


def _part_shapes(layout: str, shape: tuple[int, ...], config) -> list[tuple[int, ...]]:
    from . import gguf_names
    probe = torch.empty(shape, device="meta")
    return [tuple(p.shape) for p in gguf_names.write_layout(layout, probe, config)]


def _producer(state, key: str, layout: str, index: int, config):
    from . import gguf_names
    from .tensor import as_dense

    def produce():
        value = as_dense(state[key], torch.float32)
        return gguf_names.write_layout(layout, value, config)[index].contiguous()
    return produce
