"""`cpu_embedding`: token embeddings whose table stays in GGML blocks, against nn.Embedding on the
dequantized table; ids checked; float weights; the cpu-linear overlay on a GGUF keeps the file's rows."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from ktinject import native
from ktinject.errors import LoadError
from ktinject.operators.cpu_embedding import CpuEmbedding, CpuEmbeddingOptions
from ktinject.weights.tensor import GGMLTensor

pytestmark = pytest.mark.skipif(not native.ensure_built(), reason="native extension not built (no C compiler)")


def _table(qt, rows=300, dim=512, seed=0):
    from ktinject.native.synth import quantize_rows
    w = torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed)) * 0.05
    if qt == QT.BF16:
        return w.bfloat16().view(torch.uint8).reshape(rows, -1).contiguous()
    return quantize_rows(w, qt)


def _op(t, rows=300, dim=512, dtype=torch.float32):
    op = CpuEmbedding(rows, dim, CpuEmbeddingOptions(threads=2), "model.embed_tokens", dtype)
    assert op.load_weights("model.embed_tokens.", {"model.embed_tokens.weight": t}) == {"model.embed_tokens.weight"}
    return op


@pytest.mark.parametrize("qt", [QT.Q4_K, QT.Q6_K, QT.Q8_0, QT.Q5_0, QT.BF16])
def test_looks_up_the_dequantized_rows(qt):
    data = _table(qt)
    t = GGMLTensor(int(qt), (300, 512), data, "token_embd.weight", "m.gguf")
    op = _op(t)
    assert op.ggml_type == int(qt) and op.qweight.data_ptr() == data.data_ptr()       # the file's rows, no copy
    ids = torch.tensor([[0, 299, 7, 7], [5, 1, 2, 150]])
    table = t.dequantize(torch.float32)                                               # gguf's reference math
    want = torch.nn.functional.embedding(ids, table)
    got = op(ids)
    assert got.shape == (2, 4, 512) and got.dtype == torch.float32
    assert torch.allclose(got, want, rtol=0, atol=1e-6 * float(table.abs().max()))
    assert torch.equal(got[0, 2], got[0, 3])
    assert torch.equal(got.reshape(-1, 512), native.dequant_rows(None, int(qt), data[ids.reshape(-1)], 512))
    assert _op(t, dtype=torch.bfloat16)(ids).dtype == torch.bfloat16


def test_ids_are_checked():
    op = _op(GGMLTensor(int(QT.Q8_0), (300, 512), _table(QT.Q8_0)))
    with pytest.raises(IndexError, match="token id 300 is outside the table of 300 rows"):
        op(torch.tensor([[1, 300]]))
    with pytest.raises(IndexError, match="token id -1 is outside"):
        op(torch.tensor([-1]))
    with pytest.raises(TypeError, match="token ids of dtype torch.float32"):
        op(torch.tensor([1.0]))
    assert op(torch.zeros(0, dtype=torch.int64)).shape == (0, 512)


def test_float_weights_and_load_errors():
    w = torch.randn(300, 512)
    op = _op(w)
    assert op.ggml_type == -1
    ids = torch.tensor([3, 299])
    assert torch.equal(op(ids), w[ids])
    # a bf16 table stays bf16 (zero copy), its rows cast to the model's float32; a float32 table in a bf16
    # model is narrowed once
    wb = w.bfloat16()
    op = _op(wb)
    assert op.dense.dtype == torch.bfloat16 and op.dense.data_ptr() == wb.data_ptr()
    assert op(ids).dtype == torch.float32 and torch.equal(op(ids), wb[ids].float())
    op = _op(w, dtype=torch.bfloat16)
    assert op.dense.dtype == torch.bfloat16 and torch.equal(op(ids), w[ids].bfloat16())
    with pytest.raises(LoadError, match="shape differs"):
        _op(torch.randn(301, 512))
    with pytest.raises(LoadError, match="not found"):
        CpuEmbedding(300, 512, CpuEmbeddingOptions(), "e", torch.float32).load_weights("e.", {})
    with pytest.raises(ValueError, match="threads must be >= 0"):
        CpuEmbeddingOptions(threads=-1)


def test_max_norm_is_refused():
    from ktinject.errors import ModelError
    from ktinject.operators.base import BuildContext
    cpu = torch.device("cpu")
    ctx = BuildContext("model.embed_tokens", cpu, cpu, cpu, None, None, CpuEmbeddingOptions())
    with pytest.raises(ModelError, match=r"model\.embed_tokens: cpu_embedding does not renormalize rows \(max_norm=1\.0\)"):
        CpuEmbedding.build(torch.nn.Embedding(10, 8, max_norm=1.0), ctx)
    assert isinstance(CpuEmbedding.build(torch.nn.Embedding(10, 8), ctx), CpuEmbedding)


def test_overlay_keeps_the_gguf_table(tmp_path):
    """`cpu-linear` on a GGUF: the embedding is cpu_embedding over the file's own rows, and the
    model's outputs are those of the dense table's lookup."""
    from ktinject import optimize_and_load
    from ktinject.testing import save_tiny
    from ktinject.weights import gguf_write, open_source
    path = gguf_write.convert_model(save_tiny("deepseek_v2", tmp_path / "hf"), tmp_path / "m.gguf", "q4_k_m",
                                    progress=False)[0]
    model, tok = optimize_and_load(path, ["cpu-linear", "deepseek-v2-cpu"])
    emb = model.model.embed_tokens
    assert type(emb).__name__ == "CpuEmbedding"
    src = open_source(path)
    stored = src["model.embed_tokens.weight"]
    assert emb.ggml_type == stored.ggml_type and torch.equal(emb.qweight, stored.data.reshape(emb.qweight.shape))
    ids = torch.tensor([tok("The quick brown fox").input_ids])
    dense = stored.dequantize(torch.float32)
    assert torch.allclose(emb(ids), dense[ids], rtol=0, atol=1e-6 * float(dense.abs().max()))
    src.close()
    # the bench's bytes per decoded token leave the table out (a token reads one row of it)
    from ktinject.bench_model import dense_bytes_per_token
    from ktinject.generate import _host_embedding, _input_device
    everything = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]
                     if t.device.type == "cpu")
    assert dense_bytes_per_token(model, "cpu") <= everything - emb.qweight.numel()
    assert _input_device(model) == torch.device("cpu") and _host_embedding(model, torch.device("cpu")) is None
