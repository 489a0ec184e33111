"""Bad GGUF files are untrusted input: each problem is a WeightError naming the file (and tensor)."""
import struct

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from ktinject.errors import KtInjectError, UnsupportedQuantError, WeightError
from ktinject.testing import save_tiny
from ktinject.weights import gguf_write, load_config, load_tokenizer, open_source

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_bad")
    hf = save_tiny("qwen3_moe", root / "hf", num_hidden_layers=1)
    return gguf_write.convert_model(hf, root / "good.gguf", "q8_0", progress=False)[0]


def rewrite(src, dst, *, drop=(), add=(), kv=None, arch=None):
    """Copy a GGUF file tensor by tensor (raw bytes), dropping/adding tensors and overriding keys."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, arch or r.fields["general.architecture"].contents())
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or (kv and name in kv):
            continue
        sub = field.types[-1] if field.types[0] == VT.ARRAY else None
        w.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    for name, (value, vt) in (kv or {}).items():
        if value is not None:
            w.add_key_value(name, value, vt)
    for t in r.tensors:
        if t.name in drop:
            continue
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)     # quantized data is byte-shaped
    for name, data, qt in add:
        w.add_tensor(name, data, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _fails(path, *, tensor=None, match=None, kind=WeightError, what=open_source):
    with pytest.raises(kind) as info:
        what(path)
    text = str(info.value)
    assert str(path) in text, text
    if tensor:
        assert f"'{tensor}'" in text, text
    if match:
        assert match in text, text
    return text


def test_good_file_loads(good):
    assert len(open_source(good)) > 0


def test_wrong_magic(good, tmp_path):
    bad = tmp_path / "magic.gguf"
    bad.write_bytes(b"GGML" + good.read_bytes()[4:])
    _fails(bad, match="magic")


def test_unknown_value_type_is_named_plainly(good, tmp_path):
    data = bytearray(good.read_bytes())
    keylen = struct.unpack_from("<Q", data, 24)[0]            # the first key: length, name, then its value type
    struct.pack_into("<I", data, 32 + keylen, 0xFFFFFFFF)
    bad = tmp_path / "vtype.gguf"
    bad.write_bytes(bytes(data))
    text = _fails(bad, match="4294967295 is not a valid GGUFValueType")
    assert "np." not in text, text


@pytest.mark.parametrize("version", [1, 99])
def test_unsupported_version(good, tmp_path, version):
    data = bytearray(good.read_bytes())
    data[4:8] = struct.pack("<I", version)
    bad = tmp_path / "version.gguf"
    bad.write_bytes(bytes(data))
    _fails(bad, match="version")


@pytest.mark.parametrize("keep", [0, 3, 10, 24, 200, 5000])
def test_truncated_header(good, tmp_path, keep):
    bad = tmp_path / "trunc.gguf"
    bad.write_bytes(good.read_bytes()[:keep])
    _fails(bad, what=load_config)


def test_tensor_data_past_end(good, tmp_path):
    last = gguf.GGUFReader(good).tensors
    last = max(last, key=lambda t: t.data_offset).name
    bad = tmp_path / "short.gguf"
    bad.write_bytes(good.read_bytes()[:-100])
    _fails(bad, tensor=last, match="past the end")


def test_row_not_multiple_of_block(good, tmp_path):
    # a Q8_0 tensor whose row of 48 values is not whole 32-value blocks: patch the shape in the header
    bad = tmp_path / "block.gguf"
    rewrite(good, bad, add=[("blk.0.extra.weight", np.zeros((2, 34), np.uint8), QT.Q8_0)])
    data = bytearray(bad.read_bytes())
    name = b"blk.0.extra.weight"
    at = data.index(name) + len(name)                 # then: n_dims u32, ne[0] u64, ne[1] u64
    assert struct.unpack_from("<IQ", data, at) == (2, 32)
    struct.pack_into("<Q", data, at + 4, 48)
    bad.write_bytes(bytes(data))
    _fails(bad, tensor="blk.0.extra.weight", match="block size")


def test_unknown_architecture(good, tmp_path):
    bad = rewrite(good, tmp_path / "arch.gguf", arch="gpt2")
    _fails(bad, match="unknown architecture 'gpt2'", what=load_config)
    _fails(bad, match="unknown architecture", what=open_source)


def test_missing_tensor(good, tmp_path):
    bad = rewrite(good, tmp_path / "missing.gguf", drop={"blk.0.attn_q.weight"})
    _fails(bad, tensor="blk.0.attn_q.weight", match="missing")


def test_left_over_tensor(good, tmp_path):
    bad = rewrite(good, tmp_path / "extra.gguf", add=[("blk.0.mystery.weight", np.zeros(4, np.float32), None)])
    _fails(bad, tensor="blk.0.mystery.weight", match="map to no")


def test_shape_does_not_fit_model(good, tmp_path):
    bad = rewrite(good, tmp_path / "shape.gguf", kv={"qwen3moe.expert_feed_forward_length": (128, VT.UINT32)})
    _fails(bad, tensor="blk.0.ffn_down_exps.weight", match="does not fit model.layers.0.mlp.experts.down_proj")


def test_unsupported_type_names_tensor_and_type(good, tmp_path):
    blocks = np.zeros((1, 66), np.uint8)
    bad = rewrite(good, tmp_path / "iq2.gguf", add=[("blk.0.odd.weight", blocks, QT.IQ2_XXS)])
    text = _fails(bad, tensor="blk.0.odd.weight", kind=UnsupportedQuantError)
    assert "IQ2_XXS" in text


def test_missing_required_metadata(good, tmp_path):
    bad = rewrite(good, tmp_path / "meta.gguf", kv={"qwen3moe.embedding_length": (None, None)})
    _fails(bad, match="qwen3moe.embedding_length", what=load_config)


def test_no_tokenizer_in_file(good, tmp_path):
    keys = {k: (None, None) for k in gguf.GGUFReader(good).fields if k.startswith("tokenizer.")}
    bad = rewrite(good, tmp_path / "notok.gguf", kv=keys)
    _fails(bad, match="no tokenizer", what=load_tokenizer)


def test_missing_split_part(good, tmp_path):
    (tmp_path / "m-00001-of-00002.gguf").write_bytes(good.read_bytes())
    _fails(tmp_path / "m-00001-of-00002.gguf", match="m-00002-of-00002.gguf")


def test_random_corruption_never_crashes(good, tmp_path):
    """Flip bytes in the header: the file either loads or fails with a KtInjectError, nothing else."""
    data = good.read_bytes()
    header_end = gguf.GGUFReader(good).data_offset
    rng = np.random.default_rng(0)
    bad = tmp_path / "fuzz.gguf"
    for _ in range(60):
        buf = bytearray(data)
        for pos in rng.integers(8, header_end, size=3):
            buf[pos] = int(rng.integers(0, 256))
        bad.write_bytes(bytes(buf))
        try:
            src = open_source(bad)
            load_config(bad)
            src.close()
        except KtInjectError:
            pass


def test_convert_refuses_an_incomplete_or_foreign_hf_directory(tmp_path):
    """A shard left out of a copy, a weight too many or of another shape: `convert` names the
    directory and the tensors instead of writing a GGUF with layers silently missing."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from ktinject.errors import LoadError
    hf = save_tiny("deepseek_v2", tmp_path / "hf", num_hidden_layers=2)
    (shard,) = sorted(hf.glob("*.safetensors"))
    state = load_file(shard)
    for case, edit, label, name in (
            ("missing", lambda s: s.pop("model.layers.1.mlp.gate.weight"), "missing (1)",
             "model.layers.1.mlp.gate.weight"),
            ("extra", lambda s: s.__setitem__("model.layers.9.mlp.gate.weight", torch.zeros(4, 4)),
             "unexpected (1)", "model.layers.9.mlp.gate.weight"),
            ("shape", lambda s: s.__setitem__("model.norm.weight", torch.zeros(3)), "shape mismatch (1)",
             "model.norm.weight (file [3], model [")):
        d = tmp_path / case
        shutil.copytree(hf, d)
        s = dict(state)
        edit(s)
        save_file(s, d / shard.name, metadata={"format": "pt"})
        with pytest.raises(LoadError) as info:
            gguf_write.convert_model(d, tmp_path / f"{case}.gguf", "q8_0", progress=False)
        text = str(info.value)
        assert str(d) in text and label in text and name in text, text
        assert not (tmp_path / f"{case}.gguf").exists()
