"""transformers configs from GGUF metadata, and GGUF metadata from transformers configs.

Both directions use one field table per GGUF architecture: `(hf attribute, key suffix, kind)`.
The key is `<arch>.<suffix>` (llama.cpp's names: `deepseek2.expert_feed_forward_length`, ...).
Small per-architecture hooks handle what is not a plain field: DeepSeek's optional q LoRA and
MLA head sizes, V2 vs V3 routing, YaRN rope scaling, Qwen3's head size, Llama experts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import WeightError

INT, FLOAT, BOOL = "int", "float", "bool"

COMMON_FIELDS = (
    ("hidden_size", "embedding_length", INT),
    ("num_hidden_layers", "block_count", INT),
    ("intermediate_size", "feed_forward_length", INT),
    ("num_attention_heads", "attention.head_count", INT),
    ("num_key_value_heads", "attention.head_count_kv", INT),
    ("rms_norm_eps", "attention.layer_norm_rms_epsilon", FLOAT),
    ("max_position_embeddings", "context_length", INT),
    ("num_experts_per_tok", "expert_used_count", INT),
)

REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads")

GATING_SOFTMAX, GATING_SIGMOID = 1, 2          # llama.cpp's expert_gating_func values


@dataclass(frozen=True)
class ArchSpec:
    hf_types: tuple[str, ...]                   # transformers model_type(s) written as this arch
    fields: tuple[tuple[str, str, str], ...]    # extra (hf attribute, key suffix, kind)
    finish: Callable[[dict, "Meta"], str]       # fills derived kwargs, returns the model_type
    extra_meta: Callable[[Any], dict] = field(default=lambda config: {})


class Meta:
    """GGUF key/values with typed getters that name the file and key when something is wrong."""

    def __init__(self, values: dict[str, Any], arch: str, file: str = ""):
        self.values, self.arch, self.file = values, arch, file

    def get(self, suffix: str, default: Any = None) -> Any:
        return self.values.get(f"{self.arch}.{suffix}", default)

    def has(self, suffix: str) -> bool:
        return f"{self.arch}.{suffix}" in self.values


# ---------------------------------------------------------------- per-architecture hooks

def _rope(kw: dict, meta: Meta) -> None:
    params = {"rope_type": "default", "rope_theta": float(meta.get("rope.freq_base", 10000.0))}
    if meta.get("rope.scaling.type") == "yarn":
        mscale = float(meta.get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        params.update(rope_type="yarn", factor=float(meta.get("rope.scaling.factor", 1.0)),
                      original_max_position_embeddings=int(meta.get("rope.scaling.original_context_length", 4096)),
                      beta_fast=float(meta.get("rope.scaling.yarn_beta_fast", 32.0)),
                      beta_slow=float(meta.get("rope.scaling.yarn_beta_slow", 1.0)),
                      mscale=mscale, mscale_all_dim=mscale)
    elif meta.get("rope.scaling.type") == "linear":
        params.update(rope_type="linear", factor=float(meta.get("rope.scaling.factor", 1.0)))
    kw["rope_parameters"] = params


def _finish_deepseek2(kw: dict, meta: Meta) -> str:
    if not kw.get("q_lora_rank"):
        kw["q_lora_rank"] = None                   # key absent or 0: no q LoRA, `attn_q` is used
    rope = kw["qk_rope_head_dim"]
    if meta.has("attention.key_length_mla"):       # files with attn_k_b / attn_v_b
        kw["qk_nope_head_dim"] = int(meta.get("attention.key_length_mla")) - rope
        kw["v_head_dim"] = int(meta.get("attention.value_length_mla"))
    else:
        kw["qk_nope_head_dim"] = int(meta.get("attention.key_length", 192)) - rope
        kw["v_head_dim"] = int(meta.get("attention.value_length", 128))
    kw["num_key_value_heads"] = kw["num_attention_heads"]      # MLA files say 1; HF wants heads
    kw.setdefault("n_group", 1)
    kw.setdefault("topk_group", 1)
    kw.setdefault("routed_scaling_factor", 1.0)
    _rope(kw, meta)
    if int(meta.get("expert_gating_func", GATING_SOFTMAX)) == GATING_SIGMOID:
        kw.setdefault("norm_topk_prob", True)
        kw["rope_interleave"] = True
        return "deepseek_v3"
    kw.setdefault("norm_topk_prob", False)
    kw["topk_method"] = "group_limited_greedy" if kw["n_group"] > 1 else "greedy"
    return "deepseek_v2"


def _meta_deepseek2(config) -> dict:
    rope, nope, v, kv = config.qk_rope_head_dim, config.qk_nope_head_dim, config.v_head_dim, config.kv_lora_rank
    out = {"attention.key_length": kv + rope, "attention.value_length": kv,          # MLA (k_b/v_b) form
           "attention.key_length_mla": nope + rope, "attention.value_length_mla": v,
           "attention.head_count_kv": 1,
           "expert_gating_func": GATING_SIGMOID if config.model_type == "deepseek_v3" else GATING_SOFTMAX}
    if config.q_lora_rank:
        out["attention.q_lora_rank"] = int(config.q_lora_rank)
    rp = getattr(config, "rope_parameters", None) or {}
    if rp.get("rope_type") == "yarn":
        out.update({"rope.scaling.type": "yarn", "rope.scaling.factor": float(rp["factor"]),
                    "rope.scaling.original_context_length": int(rp["original_max_position_embeddings"]),
                    "rope.scaling.yarn_log_multiplier": 0.1 * float(rp.get("mscale_all_dim") or 0.0)})
    return out


def _finish_qwen2moe(kw: dict, meta: Meta) -> str:
    kw.setdefault("norm_topk_prob", False)
    _rope(kw, meta)
    return "qwen2_moe"


def _finish_qwen3moe(kw: dict, meta: Meta) -> str:
    kw.setdefault("norm_topk_prob", True)
    if meta.has("attention.key_length"):
        kw["head_dim"] = int(meta.get("attention.key_length"))
    _rope(kw, meta)
    return "qwen3_moe"


def _meta_qwen3moe(config) -> dict:
    return {"attention.key_length": config.head_dim, "attention.value_length": config.head_dim}


def _finish_llama(kw: dict, meta: Meta) -> str:
    if not kw.get("num_local_experts"):
        raise WeightError("llama architecture without experts is not supported (expected "
                          "llama.expert_count, as Mixtral files have)", file=meta.file or None)
    if meta.has("rope.dimension_count"):
        kw["head_dim"] = int(meta.get("rope.dimension_count"))
    _rope(kw, meta)
    return "mixtral"


def _meta_llama(config) -> dict:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {"rope.dimension_count": head_dim}


def _meta_rope_theta(config) -> dict:
    rp = getattr(config, "rope_parameters", None) or {}
    theta = rp.get("rope_theta", getattr(config, "rope_theta", None))
    return {"rope.freq_base": float(theta)} if theta is not None else {}


ARCHS: dict[str, ArchSpec] = {
    "deepseek2": ArchSpec(("deepseek_v2", "deepseek_v3"), (
        ("n_routed_experts", "expert_count", INT),
        ("n_shared_experts", "expert_shared_count", INT),
        ("moe_intermediate_size", "expert_feed_forward_length", INT),
        ("first_k_dense_replace", "leading_dense_block_count", INT),
        ("kv_lora_rank", "attention.kv_lora_rank", INT),
        ("q_lora_rank", "attention.q_lora_rank", INT),
        ("qk_rope_head_dim", "rope.dimension_count", INT),
        ("routed_scaling_factor", "expert_weights_scale", FLOAT),
        ("norm_topk_prob", "expert_weights_norm", BOOL),
        ("n_group", "expert_group_count", INT),
        ("topk_group", "expert_group_used_count", INT),
    ), _finish_deepseek2, _meta_deepseek2),
    "qwen2moe": ArchSpec(("qwen2_moe",), (
        ("num_experts", "expert_count", INT),
        ("moe_intermediate_size", "expert_feed_forward_length", INT),
        ("shared_expert_intermediate_size", "expert_shared_feed_forward_length", INT),
    ), _finish_qwen2moe),
    "qwen3moe": ArchSpec(("qwen3_moe",), (
        ("num_experts", "expert_count", INT),
        ("moe_intermediate_size", "expert_feed_forward_length", INT),
        ("norm_topk_prob", "expert_weights_norm", BOOL),
    ), _finish_qwen3moe, _meta_qwen3moe),
    "llama": ArchSpec(("mixtral",), (
        ("num_local_experts", "expert_count", INT),
    ), _finish_llama, _meta_llama),
}

def _float(v) -> float:
    """GGUF stores float32: 1e-6 comes back as 9.99999997e-07; take the shortest float32 repr."""
    import numpy as np
    return float(str(np.float32(v)))


CASTS = {INT: int, FLOAT: _float, BOOL: bool}


def arch_for_model_type(model_type: str) -> str:
    for arch, spec in ARCHS.items():
        if model_type in spec.hf_types:
            return arch
    raise WeightError(f"model type {model_type!r} cannot be written as GGUF (supported: "
                      f"{', '.join(sorted(t for s in ARCHS.values() for t in s.hf_types))})")


def config_from_metadata(values: dict[str, Any], tensor_names, file: str = "", tensor_shapes=None):
    """A transformers config for GGUF key/values (`values`) of a file holding `tensor_names`."""
    from transformers import AutoConfig

    arch = values.get("general.architecture")
    if arch not in ARCHS:
        raise WeightError(f"unknown architecture {arch!r} (supported: {', '.join(sorted(ARCHS))})", file=file or None)
    meta, spec = Meta(values, arch, file), ARCHS[arch]
    kw: dict[str, Any] = {}
    for attr, suffix, kind in COMMON_FIELDS + spec.fields:
        if meta.has(suffix):
            try:
                kw[attr] = CASTS[kind](meta.get(suffix))
            except (TypeError, ValueError):
                raise WeightError(f"metadata key '{arch}.{suffix}' is not a {kind}: {meta.get(suffix)!r}",
                                  file=file or None) from None
    for attr in REQUIRED:
        if attr not in kw:
            suffix = next(s for a, s, _ in COMMON_FIELDS if a == attr)
            raise WeightError(f"metadata key '{arch}.{suffix}' is missing", file=file or None)
    vocab = meta.get("vocab_size")
    if vocab is None and "tokenizer.ggml.tokens" in values:
        vocab = len(values["tokenizer.ggml.tokens"])
    if vocab is None and tensor_shapes and "token_embd.weight" in tensor_shapes:
        vocab = tensor_shapes["token_embd.weight"][0]
    if vocab is None:
        raise WeightError(f"cannot tell the vocabulary size ('{arch}.vocab_size' and the token list are missing)",
                          file=file or None)
    kw["vocab_size"] = int(vocab)
    kw["tie_word_embeddings"] = "output.weight" not in set(tensor_names)
    for attr, key in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id"),
                      ("pad_token_id", "tokenizer.ggml.padding_token_id")):
        if key in values:
            kw[attr] = int(values[key])
    model_type = spec.finish(kw, meta)
    try:
        return AutoConfig.for_model(model_type, **kw)
    except (TypeError, ValueError) as exc:
        raise WeightError(f"metadata does not make a valid {model_type} config: {exc}", file=file or None) from None


def metadata_from_config(config) -> tuple[str, dict[str, tuple[Any, str]]]:
    """(arch, {key: (value, kind)}) for a transformers config; kinds are INT/FLOAT/BOOL/"str"."""
    arch = arch_for_model_type(config.model_type)
    spec = ARCHS[arch]
    out: dict[str, tuple[Any, str]] = {}
    for attr, suffix, kind in COMMON_FIELDS + spec.fields:
        value = getattr(config, attr, None)
        if value is not None:
            out[f"{arch}.{suffix}"] = (CASTS[kind](value), kind)
    out[f"{arch}.vocab_size"] = (int(config.vocab_size), INT)
    for suffix, value in {**_meta_rope_theta(config), **spec.extra_meta(config)}.items():
        kind = BOOL if isinstance(value, bool) else INT if isinstance(value, int) else \
            FLOAT if isinstance(value, float) else "str"
        out[f"{arch}.{suffix}"] = (value, kind)
    if arch == "deepseek2" and not config.q_lora_rank:
        out.pop(f"{arch}.attention.q_lora_rank", None)
    return arch, out


# ---------------------------------------------------------------- tokenizer

TOKENIZER_KEYS = {            # GGUF key (after "tokenizer.ggml.") -> transformers' tokenizer_dict name
    "model": "tokenizer_type", "pre": "pre_tokenizer_type", "tokens": "tokens", "scores": "scores",
    "token_type": "token_type", "merges": "merges", "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id", "unknown_token_id": "unk_token_id", "padding_token_id": "pad_token_id",
    "add_space_prefix": "add_prefix_space",
}
# transformers' converters are keyed by architecture in older releases; these names exist in all.
CONVERTER_ARCH = {"gpt2": "gpt2", "llama": "llama"}


def _convert_gguf_tokenizer():
    try:                                           # transformers >= 5.2x
        from transformers.integrations.gguf import convert_gguf_tokenizer
    except ImportError:                            # earlier releases
        from transformers.integrations.ggml import convert_gguf_tokenizer
    return convert_gguf_tokenizer


def _byte_level_bpe(tdict: dict):
    """A byte-level BPE `tokenizers.Tokenizer` over the GGUF vocabulary (no merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    vocab = {tok: i for i, tok in enumerate(tdict["tokens"])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return backend


def tokenizer_from_metadata(values: dict, lazy: Callable[[str], Any], file: str = ""):
    """A `PreTrainedTokenizerFast` from the `tokenizer.ggml.*` keys, through transformers' converters."""
    from transformers import PreTrainedTokenizerFast

    model = values.get("tokenizer.ggml.model")
    if model is None:
        raise WeightError("the file has no tokenizer (no 'tokenizer.ggml.model' key); pass a config directory "
                          "holding one", file=file or None)
    if model not in CONVERTER_ARCH:
        raise WeightError(f"tokenizer type {model!r} cannot be built from GGUF metadata (supported: "
                          f"{', '.join(sorted(CONVERTER_ARCH))}); pass a config directory with the tokenizer",
                          file=file or None)
    tdict: dict[str, Any] = {}
    for key, name in TOKENIZER_KEYS.items():
        full = f"tokenizer.ggml.{key}"
        value = values.get(full)
        if value is None:
            value = lazy(full)
        if value is not None:
            tdict[name] = value
    if model == "gpt2":
        tdict.setdefault("merges", [])            # a byte vocabulary may have none
    if "tokens" not in tdict:
        raise WeightError("metadata key 'tokenizer.ggml.tokens' is missing", file=file or None)
    try:
        if model == "gpt2" and not tdict["merges"]:
            # a byte vocabulary without merges: some transformers releases' converters cannot take it
            backend, extra = _byte_level_bpe(tdict), {}
        else:
            backend, extra = _convert_gguf_tokenizer()(CONVERTER_ARCH[model], tdict)
    except Exception as exc:                      # the converters raise many kinds on odd vocabularies
        raise WeightError(f"transformers cannot build the {model!r} tokenizer of this file: {exc}",
                          file=file or None) from None
    tokens = tdict["tokens"]
    special = {}
    for attr, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unk_token_id"), ("pad_token", "pad_token_id")):
        idx = tdict.get(key)
        if idx is not None and 0 <= int(idx) < len(tokens):
            special[attr] = tokens[int(idx)]
    # llama.cpp adds BOS to SentencePiece vocabularies that do not say otherwise
    for flag, default in (("add_bos_token", model == "llama"), ("add_eos_token", None)):
        value = values.get(f"tokenizer.ggml.{flag}", default)
        if value is not None:
            special[flag] = bool(value)
    # older converters return their own special tokens (with bos/eos swapped in some releases): ids win
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, **{**(extra or {}), **special})
    template = values.get("tokenizer.chat_template")
    if template:
        tok.chat_template = template
    return tok
