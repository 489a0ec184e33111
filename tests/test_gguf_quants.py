"""Every GGML type dequantized in torch is bit-exact with `gguf.quants.dequantize` (numpy)."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq

from ktinject.errors import UnsupportedQuantError, WeightError
from ktinject.weights import GGMLTensor
from ktinject.weights import quants

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered")

TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
         "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4"]

# Byte offsets of fp16 scale fields per type; random bytes there could be inf/nan.
FP16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "IQ4_NL": [0],
               "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_XS": [0]}


def random_blocks(name: str, n_blocks: int, seed: int = 0) -> np.ndarray:
    """Valid random blocks: random bytes with sane fp16 scales (and finite floats for F16/BF16/F32)."""
    rng = np.random.default_rng(seed)
    cls = quants.QUANTS[QT[name]]
    if name == "F32":
        return rng.standard_normal((n_blocks, 1)).astype(np.float32).view(np.uint8)
    if name == "F16":
        return rng.standard_normal((n_blocks, 1)).astype(np.float16).view(np.uint8)
    if name == "BF16":
        f = rng.standard_normal((n_blocks, 1)).astype(np.float32).view(np.uint32)
        return (f >> 16).astype(np.uint16).view(np.uint8)
    blocks = rng.integers(0, 256, size=(n_blocks, cls.type_size), dtype=np.uint8)
    for off in FP16_FIELDS.get(name, []):
        scale = (rng.random(n_blocks) * 0.1 + 1e-3).astype(np.float16)
        blocks[:, off:off + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return blocks


@pytest.mark.parametrize("name", TYPES)
def test_bit_exact_with_gguf(name):
    cls = quants.QUANTS[QT[name]]
    n_blocks = 64 if cls.block_size > 1 else 4096
    blocks = random_blocks(name, n_blocks, seed=TYPES.index(name))
    rows = 4
    cols = n_blocks * cls.block_size // rows
    want = gq.dequantize(blocks.reshape(rows, -1), QT[name]).reshape(rows, cols)
    t = GGMLTensor(int(QT[name]), (rows, cols), torch.from_numpy(blocks.reshape(rows, -1).copy()), "t")
    got = t.dequantize()
    assert got.shape == (rows, cols)
    np.testing.assert_array_equal(got.numpy().view(np.uint32), want.astype(np.float32).view(np.uint32))


def test_mxfp4_all_exponents():
    e = np.arange(256, dtype=np.uint8).reshape(256, 1)
    qs = np.random.default_rng(1).integers(0, 256, size=(256, 16), dtype=np.uint8)
    blocks = np.concatenate([e, qs], axis=1)
    want = gq.dequantize(blocks, QT.MXFP4)
    got = quants.MXFP4.dequantize_blocks(torch.from_numpy(blocks))
    np.testing.assert_array_equal(got.numpy(), want)


def test_dtype_device_and_chunking(monkeypatch):
    monkeypatch.setattr(quants, "_CHUNK_BLOCKS", 5)
    blocks = random_blocks("Q4_K", 24)
    t = GGMLTensor(int(QT.Q4_K), (3, 8 * 256), torch.from_numpy(blocks.reshape(3, -1).copy()), "t")
    ref = gq.dequantize(blocks, QT.Q4_K).reshape(3, -1)
    np.testing.assert_array_equal(t.dequantize().numpy(), ref)
    assert t.dequantize(torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.parametrize("name", TYPES)
def test_cuda_matches_cpu(name):
    cls = quants.QUANTS[QT[name]]
    blocks = torch.from_numpy(random_blocks(name, 64))
    cpu = cls.dequantize_blocks(blocks)
    gpu = cls.dequantize_blocks(blocks.cuda()).cpu()
    assert torch.equal(cpu, gpu)


def test_block_facts_match_gguf():
    for qt, cls in quants.QUANTS.items():
        assert (cls.block_size, cls.type_size) == gq.GGML_QUANT_SIZES[qt], qt.name
    assert quants.row_bytes(QT.Q4_K, 512) == 288
    with pytest.raises(WeightError, match="multiple of the Q4_K block size"):
        quants.row_bytes(QT.Q4_K, 300, tensor="blk.0.x")


def test_unsupported_type_names_tensor_and_type():
    t = GGMLTensor(int(QT.IQ2_XXS), (1, 256), torch.zeros(1, 66, dtype=torch.uint8), "blk.3.ffn_down_exps",
                   "m.gguf")
    with pytest.raises(UnsupportedQuantError, match=r"m.gguf: tensor 'blk.3.ffn_down_exps'.*IQ2_XXS"):
        t.dequantize()


def test_byte_count_mismatch():
    t = GGMLTensor(int(QT.Q8_0), (2, 64), torch.zeros(2, 30, dtype=torch.uint8), "w")
    with pytest.raises(WeightError, match="bytes do not hold"):
        t.dequantize()
