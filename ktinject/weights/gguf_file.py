"""GGUF files as a weight source: memory-mapped, zero copy, single or split files.

`open_source(path, config)` returns a `GGUFSource`, a `Mapping[str, WeightLike]` keyed by the
transformers state-dict names of the model built from `config` (names and layouts from
`gguf_names.py`). Values:

* quantized tensors -> `GGMLTensor` (the raw blocks, a view of the mapped file);
* F32 / F16 / BF16 tensors -> plain `torch.Tensor` views of the mapped file (copy-on-write
  mapping: writing to them never touches the file);
* routed experts' `gate_up_proj` -> `FusedTensor((gate, up), dim=1)`;
* Llama/Mixtral q/k -> rows reordered (still quantized, a copy); DeepSeek `kv_b_proj` from
  `attn_k_b` + `attn_v_b` -> a dense float32 tensor (it is small).

A path is a `.gguf` file, the first part of a split model (`name-00001-of-0000N.gguf`), or a
directory holding one model's GGUF file(s). Files are untrusted: every inconsistency is a
`WeightError` naming the file and the tensor.
"""
from __future__ import annotations

import logging
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch

from ..errors import WeightError
from . import gguf_config, gguf_names
from .quants import quant_class
from .tensor import GGMLTensor, Stored

log = logging.getLogger(__name__)

SPLIT_RE = re.compile(r"(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")
FLOAT_DTYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}   # GGML F32, F16, BF16
LAZY_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")


# ---------------------------------------------------------------- finding the files

def detect(path: Path) -> bool:
    path = Path(path)
    if path.is_file():
        return path.suffix == ".gguf" or _has_magic(path)
    return path.is_dir() and any(path.glob("*.gguf")) and not any(path.glob("*.safetensors"))


def _has_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def model_files(path: Path) -> list[Path]:
    """The file(s) of one model: a single file, or every part of a split model in order."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.gguf"))
        if not files:
            raise WeightError("no .gguf file in this directory", file=str(path))
        firsts = [f for f in files if SPLIT_RE.fullmatch(f.name) and SPLIT_RE.fullmatch(f.name)["no"] == "00001"]
        singles = [f for f in files if not SPLIT_RE.fullmatch(f.name)]
        if len(firsts) + len(singles) != 1:
            raise WeightError(f"directory holds more than one GGUF model ({', '.join(f.name for f in files)}); "
                              "name the file", file=str(path))
        path = (firsts or singles)[0]
    m = SPLIT_RE.fullmatch(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    parts = [path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.exists()]
    if missing:
        raise WeightError(f"split model is missing part(s) {', '.join(missing)}", file=str(path))
    return parts


# ---------------------------------------------------------------- one file

class _Reader:
    """One GGUF file: header through `gguf.GGUFReader`, tensor table checked by us."""

    def __init__(self, path: Path):
        import gguf
        self.path = str(path)
        self.strings: dict[int, tuple[int, int]] = {}      # value offset -> (first item offset, count)

        class Checked(gguf.GGUFReader):
            # Replace the reader's tensor building (which reshapes blindly) with checked records.
            def _build_tensors(inner, start_offs, fields):
                inner.tensors = []
                inner.checked = [self._check(inner, start_offs, f) for f in fields]

            # Walk string arrays (150k-token vocabularies) with struct instead of building one
            # numpy array per string: ~50x faster; they are decoded only when asked for.
            def _get_field_parts(inner, orig_offs, raw_type):
                if raw_type == gguf.GGUFValueType.ARRAY and inner.byte_order == "I":
                    head = inner._get(orig_offs, np.uint32)
                    if len(head) and head[0] == gguf.GGUFValueType.STRING:
                        return self._walk_strings(inner, orig_offs)
                    nptype = inner.gguf_scalar_to_np.get(gguf.GGUFValueType(head[0])) if len(head) else None
                    if nptype is not None:               # numbers: one read, not one per item
                        alen = inner._get(orig_offs + 4, np.uint64)
                        arr = inner._get(orig_offs + 12, nptype, int(alen[0]) if len(alen) else 0)
                        if not len(alen) or len(arr) != int(alen[0]):
                            raise ValueError("array runs past the end of the file")
                        return 12 + int(arr.nbytes), [head, alen, arr], [2], \
                            [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType(head[0])]
                return super()._get_field_parts(orig_offs, raw_type)

        try:
            self.reader = Checked(path, mode="c")
        except WeightError:
            raise
        except (ValueError, KeyError, IndexError, TypeError, OverflowError, UnicodeDecodeError, OSError) as exc:
            raise WeightError(f"not a readable GGUF file: {_why(exc)}", file=self.path) from None
        self.size = len(self.reader.data)
        self.tensors: dict[str, tuple[int, tuple[int, ...], int, int]] = {}
        for name, ggml_type, shape, offset, nbytes in self.reader.checked:
            if name in self.tensors:
                raise WeightError("tensor appears twice", file=self.path, tensor=name)
            self.tensors[name] = (ggml_type, shape, offset, nbytes)

    def _check(self, reader, start_offs, field):
        _len, name_data, _n_dims, dims, raw_type, offset = field.parts
        name = bytes(name_data).decode("utf-8", errors="replace")
        shape = tuple(int(d) for d in reversed(dims.tolist()))          # torch order: ne reversed
        ggml_type = int(raw_type[0])
        cls = quant_class(ggml_type, name, self.path)       # UnsupportedQuantError names tensor and type
        if any(s <= 0 for s in shape) or not shape:
            raise WeightError(f"bad shape {list(shape)}", file=self.path, tensor=name)
        if shape[-1] % cls.block_size:
            raise WeightError(f"row length {shape[-1]} is not a multiple of the {cls.qtype.name} block size "
                              f"{cls.block_size}", file=self.path, tensor=name)
        numel = int(np.prod(shape, dtype=np.float64))
        nbytes = numel // cls.block_size * cls.type_size
        start = int(start_offs + int(offset[0]))
        if start + nbytes > len(reader.data):
            raise WeightError(f"tensor data ends at byte {start + nbytes}, past the end of the file "
                              f"({len(reader.data)} bytes): truncated file?", file=self.path, tensor=name)
        return name, ggml_type, shape, start, nbytes

    def _walk_strings(self, reader, offs: int):
        """(size, parts, data indices, types) of an array of strings, recording where it lies."""
        import gguf
        buf, end = memoryview(reader.data), len(reader.data)
        if offs + 12 > end:
            raise ValueError("string array header past the end of the file")
        count = struct.unpack_from("<Q", buf, offs + 4)[0]
        pos = first = offs + 12
        for _ in range(count):
            if pos + 8 > end:
                raise ValueError("string array runs past the end of the file")
            pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
        if pos > end:
            raise ValueError("string array runs past the end of the file")
        self.strings[offs] = (first, count)
        return pos - offs, [], [], [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]

    def _strings(self, first: int, count: int) -> list[str]:
        buf, out, pos = memoryview(self.reader.data), [], first
        for _ in range(count):
            n = struct.unpack_from("<Q", buf, pos)[0]
            out.append(bytes(buf[pos + 8:pos + 8 + n]).decode("utf-8", errors="replace"))
            pos += 8 + n
        return out

    def value(self, field) -> Any:
        value_offs = field.offset + 8 + len(field.name.encode("utf-8")) + 4     # key string, then type
        if value_offs in self.strings:
            return self._strings(*self.strings[value_offs])
        return _field_value(field, self.path)

    def metadata(self) -> dict[str, Any]:
        out = {}
        for name, field in self.reader.fields.items():
            if name.startswith("GGUF.") or name in LAZY_KEYS:
                continue
            out[name] = self.value(field)
        return out

    def lazy(self, key: str):
        field = self.reader.fields.get(key)
        return None if field is None else self.value(field)

    def tensor(self, name: str):
        ggml_type, shape, start, nbytes = self.tensors[name]
        raw = torch.from_numpy(self.reader.data[start:start + nbytes])            # uint8 view, zero copy
        if ggml_type in FLOAT_DTYPES:
            return raw.view(FLOAT_DTYPES[ggml_type]).reshape(shape)
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        return GGMLTensor(ggml_type, shape, raw.reshape(rows, nbytes // rows), name, self.path)


def _field_value(field, file):
    try:
        value = field.contents()
    except (ValueError, IndexError, UnicodeDecodeError) as exc:
        raise WeightError(f"metadata key '{field.name}' is unreadable: {_why(exc)}", file=file) from None
    return value


_NP_REPR = re.compile(r"\bnp\.\w+\(([^()]*)\)")


def _why(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    text = _NP_REPR.sub(r"\1", text)          # gguf's messages hold numpy reprs: np.uint32(7) -> 7
    return text if len(text) < 200 else text[:200] + "..."


# ---------------------------------------------------------------- the model's files

class GGUFModel:
    """Every file of one model: merged metadata (from the first file) and tensor table."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.files = model_files(self.path)
        self.readers = [_Reader(p) for p in self.files]
        self.metadata = self.readers[0].metadata()
        self.where: dict[str, _Reader] = {}
        for r in self.readers:
            for name in r.tensors:
                if name in self.where:
                    raise WeightError(f"tensor appears in two files ({self.where[name].path})", file=r.path, tensor=name)
                self.where[name] = r
        expected = self.metadata.get("split.tensors.count")
        if expected is not None and int(expected) != len(self.where):
            raise WeightError(f"split model should hold {expected} tensors, its parts hold {len(self.where)}",
                              file=str(self.files[0]))
        self.arch = self.metadata.get("general.architecture")
        if not isinstance(self.arch, str):
            raise WeightError("metadata key 'general.architecture' is missing", file=str(self.files[0]))

    @property
    def file(self) -> str:
        return str(self.files[0])

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: r.tensors[n][1] for n, r in self.where.items()}

    def config(self):
        return gguf_config.config_from_metadata(self.metadata, self.where.keys(), self.file, self.shapes())


class GGUFSource(Mapping):
    """`Mapping[str, WeightLike]` over a GGUF model, keyed by transformers state-dict names."""

    def __init__(self, path: Path, config=None):
        self.model = GGUFModel(path)
        self.config = config if config is not None else self.model.config()
        self.arch = self.model.arch
        self.bindings, left = gguf_names.bind_gguf(self.arch, self.model.where.keys(), self.model.file)
        if left:
            raise WeightError(f"{len(left)} tensor(s) map to no {self.arch} module: {', '.join(left[:10])}"
                              + (" ..." if len(left) > 10 else ""), file=self.origin_of(left[0]), tensor=left[0])
        self.expected = _expected_shapes(self.config)
        self._check_against_model()

    def _check_against_model(self) -> None:
        if self.expected is None:
            return
        missing = [k for k in self.expected if k not in self.bindings]
        if missing:
            names = [_gguf_name(self.arch, k) for k in missing]
            raise WeightError(f"{len(missing)} tensor(s) the {type(self.config).__name__} needs are missing: "
                              + ", ".join(names[:10]) + (" ..." if len(names) > 10 else ""),
                              file=self.model.file, tensor=names[0])
        extra = [k for k in self.bindings if k not in self.expected]
        if extra:
            names = [self.bindings[k].gguf[0] for k in extra]
            raise WeightError(f"{len(extra)} tensor(s) have no place in the {type(self.config).__name__}: "
                              + ", ".join(names[:10]), file=self.origin(extra[0]), tensor=names[0])
        for key, binding in self.bindings.items():
            got = self._raw_shape(binding)
            want = self.expected[key]
            if [d for d in got if d != 1] != [d for d in want if d != 1]:      # [H] fits [1, H]
                raise WeightError(f"shape {list(got)} does not fit {key} {list(want)}",
                                  file=self.origin(key), tensor=binding.gguf[0])

    def _raw_shape(self, binding) -> tuple[int, ...]:
        shapes = [self.model.where[n].tensors[n][1] for n in binding.gguf]
        if binding.layout == "gate_up":
            return (shapes[0][0], shapes[0][1] + shapes[1][1]) + tuple(shapes[0][2:])
        if binding.layout == "stacked":
            return (len(shapes),) + tuple(shapes[0])
        if binding.layout == "stacked_gate_up":
            return (len(shapes) // 2, 2 * shapes[0][0]) + tuple(shapes[0][1:])
        if binding.layout == "kv_b_split":
            (h, kv, nope), (_, v, _) = shapes[0], shapes[1]
            return (h * (nope + v), kv)
        return shapes[0]

    # Mapping protocol
    def __getitem__(self, key: str):
        binding = self.bindings[key]
        parts = tuple(self.model.where[n].tensor(n) for n in binding.gguf)
        value = gguf_names.read_layout(binding.layout, parts, self.config)
        want = self.expected.get(key) if self.expected else None
        return _reshaped(value, want) if want is not None and tuple(value.shape) != tuple(want) else value

    def __contains__(self, key) -> bool:             # without building the value
        return key in self.bindings

    def stored(self, key: str):
        """The layout and the (GGML type, bytes) of each file tensor behind `key`, from the header (no
        tensor data read; None for a key the file lacks): what `plan` counts for operators that keep
        the file's blocks (`ktinject explain`)."""
        binding = self.bindings.get(key)
        if binding is None:
            return None
        info = [self.model.where[n].tensors[n] for n in binding.gguf]
        return Stored(binding.layout, tuple((int(t[0]), int(t[3])) for t in info))

    def __iter__(self) -> Iterator[str]:
        return iter(self.bindings)

    def __len__(self) -> int:
        return len(self.bindings)

    def origin(self, key: str) -> str:
        binding = self.bindings.get(key)
        return self.origin_of(binding.gguf[0]) if binding else self.model.file

    def origin_of(self, gguf_name: str) -> str:
        r = self.model.where.get(gguf_name)
        return r.path if r else self.model.file

    def gguf_names(self, key: str) -> tuple[str, ...]:
        return self.bindings[key].gguf

    def close(self) -> None:
        for r in self.model.readers:
            r.reader = None
        self.model.readers = []

    def __repr__(self) -> str:
        return f"GGUFSource({self.model.file!r}, arch={self.arch}, {len(self)} tensors)"


def _gguf_name(arch: str, key: str) -> str:
    found = gguf_names.gguf_names_for(arch, key)
    return " + ".join(found[1]) if found else key


def _reshaped(value, shape):
    """Same values, the model's shape (e.g. a `[H]` GGUF vector for a `[1, H]` weight)."""
    if isinstance(value, GGMLTensor):
        if value.shape[-1] != shape[-1]:
            return value
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        return GGMLTensor(value.ggml_type, tuple(shape), value.data.reshape(rows, -1), value.name, value.file)
    if isinstance(value, torch.Tensor):
        return value.reshape(shape)
    return value


def _expected_shapes(config) -> Optional[dict[str, tuple[int, ...]]]:
    """State-dict shapes of the transformers model for `config`, built on the meta device."""
    if config is None:
        return None
    from transformers import AutoModelForCausalLM
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as exc:           # transformers raises many kinds for a bad config
        raise WeightError(f"cannot build the model for this config: {_why(exc)}") from None
    out = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        out.pop("lm_head.weight", None)
    return out


# ---------------------------------------------------------------- the format table's entry points

def open_source(path: Path, config=None) -> GGUFSource:
    return GGUFSource(Path(path), config)


def load_config(path: Path, config_dir=None):
    if config_dir is not None:
        from transformers import AutoConfig
        return AutoConfig.from_pretrained(str(config_dir))
    return GGUFModel(Path(path)).config()


def load_tokenizer(path: Path, config_dir=None):
    from .gguf_config import tokenizer_from_metadata
    if config_dir is not None:
        from transformers import AutoTokenizer
        try:
            return AutoTokenizer.from_pretrained(str(config_dir))
        except (OSError, ValueError):
            log.info("no tokenizer in %s; reading it from the GGUF metadata", config_dir)
    model = GGUFModel(Path(path))
    return tokenizer_from_metadata(model.metadata, model.readers[0].lazy, model.file)
