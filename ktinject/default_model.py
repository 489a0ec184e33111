"""The built-in default model: a small DeepSeek-V2-architecture MoE made on the spot.

It lets `ktinject run` work on a fresh machine with no download. Weights are random but
deterministic (fixed seed); the tokenizer is the project's byte tokenizer. The model is
written once as a safetensors directory under `$KTINJECT_HOME` (default
`~/.cache/ktinject`) and then loaded through the normal path like any other model.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

NAME = "default-deepseek-v2-moe-v1"
SEED = 1234
# ~45 MB of float32: 4 layers (1 dense), 16 routed experts of width 256, top-2, 1 shared expert.
OVERRIDES = dict(vocab_size=512, hidden_size=256, intermediate_size=768, moe_intermediate_size=256,
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16,
                 n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                 max_position_embeddings=2048)


def home() -> Path:
    return Path(os.environ.get("KTINJECT_HOME") or Path.home() / ".cache" / "ktinject")


def default_model_path() -> Path:
    """The default model's directory, created (atomically) on first use."""
    target = home() / NAME
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    from .testing import save_tiny
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("creating the default model in %s", target)
    tmp = Path(tempfile.mkdtemp(prefix=NAME + ".", dir=target.parent))
    from transformers.utils import logging as hf_logging
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        save_tiny("deepseek_v2", tmp, seed=SEED, **OVERRIDES)
        try:
            tmp.rename(target)
        except OSError:            # another process made it first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if bars:
            hf_logging.enable_progress_bar()
    return target
