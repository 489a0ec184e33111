"""Safetensors model directories: `config.json`, one or several `*.safetensors` (sharded ones with
`model.safetensors.index.json`) and the tokenizer files.

Each file's header is read and checked by hand (offsets inside the file, sizes that agree with
dtype and shape), then the file is memory-mapped copy-on-write: every tensor handed out is a
zero-copy view of the mapping, so nothing is read before a module asks for it and a tensor
kept at its stored dtype on the CPU costs no extra memory. `release(key)` lets the loader drop
the mapped pages of a tensor it has copied elsewhere, which keeps peak RSS near what the
plan puts on the CPU.
"""
from __future__ import annotations

import json
import logging
import mmap
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from ..errors import WeightError
from .hf_names import Leaf, Recipe, leaves, map_names
from .tensor import FusedTensor

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
MAX_HEADER = 100 << 20
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_PAGE = mmap.PAGESIZE
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def detect(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def load_config(path: Path, config_dir: Optional[Path] = None):
    from transformers import AutoConfig
    where = Path(config_dir) if config_dir else path
    try:
        return AutoConfig.from_pretrained(str(where))
    except (OSError, ValueError, KeyError) as exc:
        raise WeightError(f"cannot read the model config: {exc}", file=str(where / "config.json")) from None


def load_tokenizer(path: Path, config_dir: Optional[Path] = None):
    """The directory's tokenizer, or None (with a warning) when it has none."""
    from transformers import AutoTokenizer
    where = Path(config_dir) if config_dir else path
    if not any((where / f).is_file() for f in TOKENIZER_FILES):
        log.warning("%s has no tokenizer files (%s)", where, ", ".join(TOKENIZER_FILES))
        return None
    try:
        return AutoTokenizer.from_pretrained(str(where))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("no usable tokenizer in %s: %s", where, exc)
        return None


def open_source(path: Path, config: Any = None) -> "SafetensorsSource":
    return SafetensorsSource(path, config)


class _File:
    """One safetensors file: its checked header and a copy-on-write mapping."""

    def __init__(self, path: Path):
        self.path = path
        self.name = str(path)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise WeightError(f"cannot open: {exc.strerror}", file=self.name) from None
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, 8, 0)
            if len(head) < 8:
                raise WeightError("truncated safetensors file (no header)", file=self.name)
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise WeightError(f"bad safetensors header length {n} (file is {size} bytes)", file=self.name)
            try:
                header = json.loads(os.pread(fd, n, 8))
            except (ValueError, UnicodeDecodeError) as exc:
                raise WeightError(f"safetensors header is not JSON: {exc}", file=self.name) from None
            self.base = 8 + n
            self.tensors = self._check(header, size - self.base)
            self.mm = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY) if size else None
        finally:
            os.close(fd)
        self.buf = torch.frombuffer(self.mm, dtype=torch.uint8) if self.mm is not None and size else None

    def _check(self, header: Any, data_bytes: int) -> dict[str, tuple]:
        if not isinstance(header, dict):
            raise WeightError("safetensors header is not a mapping", file=self.name)
        out = {}
        for key, info in header.items():
            if key == "__metadata__":
                continue
            try:
                dtype, shape, (a, b) = DTYPES[info["dtype"]], [int(s) for s in info["shape"]], info["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise WeightError(f"bad header entry {info!r} (dtypes: {', '.join(sorted(DTYPES))})",
                                  file=self.name, tensor=key) from None
            numel = 1
            for s in shape:
                numel *= s
            if not (isinstance(a, int) and isinstance(b, int) and 0 <= a <= b <= data_bytes) or \
                    b - a != numel * dtype.itemsize or min(shape, default=0) < 0:
                raise WeightError(f"data offsets {[a, b]} do not fit shape {shape} of {info['dtype']} in "
                                  f"{data_bytes} data bytes", file=self.name, tensor=key)
            out[key] = (dtype, tuple(shape), self.base + a, self.base + b)
        return out

    def tensor(self, key: str) -> torch.Tensor:
        dtype, shape, a, b = self.tensors[key]
        if a == b:
            return torch.empty(shape, dtype=dtype)
        raw = self.buf[a:b]
        if a % dtype.itemsize:       # unaligned: copy (never happens with files written by safetensors)
            raw = raw.clone()
        return raw.view(dtype).view(shape)

    def release(self, key: str) -> None:
        _, _, a, b = self.tensors[key]
        self.release_bytes(a, b)

    def release_bytes(self, a: int, b: int) -> None:
        """Drop the mapped pages fully inside [a, b) (offsets in the file)."""
        lo, hi = -(-a // _PAGE) * _PAGE, (b // _PAGE) * _PAGE
        if self.mm is not None and hi > lo and hasattr(self.mm, "madvise"):
            self.mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def owns(self, t: torch.Tensor) -> Optional[tuple[int, int]]:
        """The file byte range of `t` when it is a contiguous view of this mapping, else None."""
        if self.buf is None or not t.is_contiguous() or t.device.type != "cpu":
            return None
        base, ptr = self.buf.data_ptr(), t.data_ptr()
        n = t.numel() * t.element_size()
        if base <= ptr and ptr + n <= base + self.buf.numel():
            return ptr - base, ptr - base + n
        return None


class SafetensorsSource(Mapping):
    """`Mapping[module state-dict name, torch.Tensor | FusedTensor]` over a safetensors directory."""

    def __init__(self, path: Path, config: Any = None):
        self.path = Path(path)
        self.files: dict[str, _File] = {}
        self.where: dict[str, _File] = {}      # checkpoint name -> file
        for f in self._file_list():
            st = _File(f)
            self.files[f.name] = st
            for key in st.tensors:
                if key in self.where:
                    raise WeightError(f"tensor stored twice (also in {self.where[key].path.name})", file=st.name,
                                      tensor=key)
                self.where[key] = st
        self.recipes: dict[str, Recipe] = map_names(self.where, config)

    def _file_list(self) -> list[Path]:
        index = self.path / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                names = sorted(set(weight_map.values()))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise WeightError(f"bad index: {exc}", file=str(index)) from None
            for n in names:
                if not isinstance(n, str) or "/" in n or "\\" in n or n.startswith("."):
                    raise WeightError(f"index names a file outside the directory: {n!r}", file=str(index))
            missing = [n for n in names if not (self.path / n).is_file()]
            if missing:
                raise WeightError(f"shards listed in the index are missing: {', '.join(missing)}", file=str(index))
            return [self.path / n for n in names]
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise WeightError("no *.safetensors files", file=str(self.path))
        return files

    def _build(self, recipe: Recipe, key: str):
        if isinstance(recipe, Leaf):
            t = self.where[recipe.name].tensor(recipe.name)
            return t.unsqueeze(0) if recipe.unsqueeze else t
        parts = tuple(self._build(p, key) for p in recipe.parts)
        try:
            return FusedTensor(parts, recipe.dim, key)
        except Exception as exc:  # noqa: BLE001 - shape errors of inconsistent parts
            raise WeightError(f"cannot fuse parts: {exc}", file=self.origin(key), tensor=key) from None

    def __getitem__(self, key: str):
        recipe = self.recipes[key]
        out = self._build(recipe, key)
        if isinstance(out, FusedTensor):
            _check_fusable(out, key, self.origin(key))
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self.recipes)

    def __len__(self) -> int:
        return len(self.recipes)

    def __contains__(self, key: object) -> bool:
        return key in self.recipes

    def origin(self, key: str) -> str:
        recipe = self.recipes.get(key)
        if recipe is None:
            return str(self.path)
        return self.where[leaves(recipe)[0].name].name

    def file_names(self, key: str) -> list[str]:
        """The checkpoint tensor names a module key is made of."""
        return [leaf.name for leaf in leaves(self.recipes[key])]

    def release(self, key: str) -> None:
        """Drop the mapped pages behind `key` (safe: they are re-read from the file if touched again)."""
        recipe = self.recipes.get(key)
        if recipe is not None:
            for leaf in leaves(recipe):
                self.where[leaf.name].release(leaf.name)

    def release_tensor(self, t: torch.Tensor) -> None:
        """Drop the pages behind `t` if (and only if) it is a view of one of this source's mappings."""
        for f in self.files.values():
            span = f.owns(t)
            if span is not None:
                f.release_bytes(*span)
                return

    def close(self) -> None:
        self.recipes, self.where, self.files = {}, {}, {}


def _check_fusable(t: FusedTensor, key: str, file: str) -> None:
    for p in t.parts:
        if isinstance(p, FusedTensor):
            _check_fusable(p, key, file)
    ref = list(t.parts[0].shape)
    for p in t.parts[1:]:
        s = list(p.shape)
        if len(s) != len(ref) or any(a != b for i, (a, b) in enumerate(zip(s, ref)) if i != t.dim):
            raise WeightError(f"parts of different shapes cannot be fused: {ref} and {s}", file=file, tensor=key)
