"""Weight sources: a `Mapping[str, WeightLike]` over a model's files, keyed by transformers
state-dict names, plus the model's config and tokenizer read from the same place.

Formats are a table: each entry says how to recognise a path and how to open it. A path is
a safetensors model directory, a `.gguf` file, the first part of a split GGUF, or a
directory holding GGUF files.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import WeightError
from .tensor import FusedTensor, GGMLTensor, WeightLike, as_dense


@dataclass(frozen=True)
class WeightFormat:
    name: str
    module: str                          # module implementing detect/open_source/load_config/load_tokenizer

    def impl(self):
        return importlib.import_module(self.module)


# Order matters: the first format whose detect() accepts the path wins.
FORMATS = (
    WeightFormat("gguf", "ktinject.weights.gguf_file"),
    WeightFormat("safetensors", "ktinject.weights.safetensors_dir"),
)


def detect_format(path: str | Path) -> WeightFormat:
    p = Path(path)
    if not p.exists():
        raise WeightError("no such file or directory", file=str(p))
    for fmt in FORMATS:
        if fmt.impl().detect(p):
            return fmt
    raise WeightError("not a model: expected a safetensors model directory (config.json + *.safetensors), "
                      "a .gguf file, or a directory of .gguf files", file=str(p))


def open_source(path: str | Path, config: Any = None):
    """The weight source (a Mapping) for a model path. `config` is the transformers config."""
    return detect_format(path).impl().open_source(Path(path), config)


def load_config(path: str | Path, config_dir: str | Path | None = None):
    """The transformers config for a model path (`config_dir`, an HF directory, overrides)."""
    return detect_format(path).impl().load_config(Path(path), config_dir)


def load_tokenizer(path: str | Path, config_dir: str | Path | None = None):
    return detect_format(path).impl().load_tokenizer(Path(path), config_dir)


__all__ = ["FORMATS", "FusedTensor", "GGMLTensor", "WeightFormat", "WeightLike", "as_dense", "detect_format",
           "load_config", "load_tokenizer", "open_source"]
