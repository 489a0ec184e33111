"""Our K-quant quantizers, native (C) and torch: layout read back exactly by gguf's reference, error
(SQNR) thresholds, edge blocks; the two implementations agree."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq

from ktinject.weights import kquant, quants

# Minimum SQNR (dB) on N(0, 1) data; Q4_0/Q5_0/Q8_0 from the gguf package make ~21.3/27.4/45.4.
THRESHOLDS = {"Q4_K": 22.5, "Q5_K": 28.5, "Q6_K": 34.5}
BASELINE = {"Q4_K": "Q4_0", "Q5_K": "Q5_0", "Q6_K": "Q5_1"}
IMPLS = ["native", "torch"]


def _quantizer(impl: str, name: str):
    if impl == "native" and not kquant.native_available():
        pytest.skip("native library not built")
    if impl == "native":                   # the C code itself (QUANTIZERS would follow KTINJECT_KQUANT)
        return lambda x: kquant.native_blocks(name, x)
    return kquant.TORCH_QUANTIZERS[name]


def _data(kind: str, n_blocks: int = 512, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        return torch.randn(n_blocks, 256, generator=g)
    if kind == "laplace":
        u = torch.rand(n_blocks, 256, generator=g) - 0.5
        return -torch.sign(u) * torch.log1p(-2 * u.abs())
    if kind == "outliers":
        x = torch.randn(n_blocks, 256, generator=g) * 0.02
        x[:, ::37] *= 50
        return x
    raise ValueError(kind)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", sorted(kquant.QUANTIZERS))
@pytest.mark.parametrize("kind", ["gaussian", "laplace", "outliers"])
def test_sqnr_beats_legacy_and_threshold(name, kind, impl):
    x = _data(kind)
    blocks = _quantizer(impl, name)(x)
    assert blocks.dtype == torch.uint8 and blocks.shape == (512, quants.QUANTS[QT[name]].type_size)
    # the gguf package's numpy dequantizer is the reference reader of the layout
    ref = gq.dequantize(blocks.numpy(), QT[name]).reshape(x.shape)
    ours = quants.QUANTS[QT[name]].dequantize_blocks(blocks)
    np.testing.assert_array_equal(ours.numpy(), ref)
    sqnr = kquant.sqnr_db(x, torch.from_numpy(ref))
    legacy = QT[BASELINE[name]]
    base = kquant.sqnr_db(x, torch.from_numpy(gq.dequantize(gq.quantize(x.numpy(), legacy), legacy)))
    assert sqnr > base, (name, kind, sqnr, base)
    if kind == "gaussian":
        assert sqnr > THRESHOLDS[name], (name, sqnr)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", sorted(kquant.QUANTIZERS))
@pytest.mark.parametrize("case", ["zeros", "constant", "negative", "small", "underflow", "huge", "one_spike"])
def test_edge_blocks(name, case, impl):
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(3))
    x = {"zeros": torch.zeros(8, 256), "constant": torch.full((8, 256), 0.3), "negative": -x.abs() - 0.1,
         "small": x * 1e-3, "underflow": x * 1e-7, "huge": x * 1e4, "one_spike": torch.zeros(8, 256).index_fill_(1, torch.tensor([5]), 2.0)}[case]
    y = quants.QUANTS[QT[name]].dequantize_blocks(_quantizer(impl, name)(x))
    assert torch.isfinite(y).all()
    if case == "zeros":
        assert torch.equal(y, torch.zeros_like(x))
    elif case == "underflow":        # scales below fp16's range: the format can only give zeros
        assert y.abs().max() <= x.abs().max()
    else:
        assert kquant.sqnr_db(x, y) > 15, case


def test_scale_packing_round_trip():
    g = torch.Generator().manual_seed(0)
    sc = torch.randint(0, 64, (100, 8), generator=g, dtype=torch.uint8)
    mn = torch.randint(0, 64, (100, 8), generator=g, dtype=torch.uint8)
    got_sc, got_mn = quants.k_scale_min(kquant._pack_scales_k(sc, mn))
    assert torch.equal(got_sc, sc) and torch.equal(got_mn, mn)


def test_multi_dim_input_and_empty():
    x = torch.randn(3, 2, 512)
    blocks = kquant.quantize_q4_k(x)
    assert blocks.shape == (12, 144)
    assert kquant.quantize_q6_k(torch.empty(0, 256)).numel() == 0
    if kquant.native_available():
        assert kquant.QUANTIZERS["Q5_K"](torch.empty(0, 256)).shape == (0, 176)
        assert kquant.QUANTIZERS["Q4_K"](x).shape == (12, 144)


@pytest.mark.parametrize("name", sorted(kquant.QUANTIZERS))
def test_native_agrees_with_torch(name, monkeypatch):
    """Same algorithm: the same bytes for nearly every block (the float sums run in another order,
    so a candidate tie can round the other way), the same error; many chunks over threads give
    the same bytes as one call; KTINJECT_KQUANT=torch selects the torch version."""
    if not kquant.native_available():
        pytest.skip("native library not built")
    x = torch.cat([_data(k, 700, seed=5) for k in ("gaussian", "laplace", "outliers")])
    nat, ref = kquant.QUANTIZERS[name](x), kquant.TORCH_QUANTIZERS[name](x)
    assert nat.shape == ref.shape and nat.dtype == ref.dtype
    same = (nat == ref).all(dim=1).float().mean().item()
    assert same > 0.9, same
    dq = quants.QUANTS[QT[name]].dequantize_blocks
    assert abs(kquant.sqnr_db(x, dq(nat)) - kquant.sqnr_db(x, dq(ref))) < 0.02
    saved = torch.get_num_threads()
    torch.set_num_threads(1)                          # one worker: one call after another
    try:
        one = kquant.QUANTIZERS[name](x)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(one, nat)
    monkeypatch.setenv("KTINJECT_KQUANT", "torch")
    assert torch.equal(kquant.QUANTIZERS[name](x), ref)


@pytest.mark.parametrize("name", ["Q4_0", "Q5_0", "Q8_0"])
def test_legacy_types_quantized_in_parallel_are_the_package_bytes(name):
    """`convert` spreads the gguf package's numpy quantizers over threads by groups of rows: the
    same bytes as one call on the whole tensor."""
    from ktinject.weights import gguf_write
    x = torch.randn(3000, 64, generator=torch.Generator().manual_seed(1))
    want = gq.quantize(x.numpy(), QT[name])
    got = kquant._rows_in_parallel(x.numpy(), lambda rows: gq.quantize(rows, QT[name]), workers=4)
    assert got.shape == want.shape and np.array_equal(got, want)
    np.testing.assert_array_equal(gguf_write.encode(x, QT[name]), want)


@pytest.mark.parametrize("name", ["Q4_0", "Q5_0", "Q8_0"])
def test_native_legacy_types_write_the_package_bytes(name, monkeypatch):
    """The native Q4_0 / Q5_0 / Q8_0 quantizers: byte for byte what gguf's numpy code writes, on
    Gaussian rows, zeros, exact ties (quarter steps) and tiny values; NaN and fp16 overflow refused."""
    if not kquant.native_available():
        pytest.skip("native library not built")
    from ktinject.weights import gguf_write
    g = torch.Generator().manual_seed(4)
    x = torch.randn(400, 96, generator=g)
    x[::7] = 0
    x[1::5] = torch.round(x[1::5] * 4) / 4
    x[2::9] *= 1e-6
    want = gq.quantize(x.numpy(), QT[name])
    got = kquant.legacy_quantizer(name)(x)
    assert got.shape == want.shape and np.array_equal(got.numpy(), want)
    np.testing.assert_array_equal(gguf_write.encode(x, QT[name]), want)
    for bad in (float("nan"), 1e12):
        y = x.clone()
        y[3, 5] = bad
        with pytest.raises(ValueError):
            gguf_write.encode(y, QT[name])
    monkeypatch.setenv("KTINJECT_KQUANT", "torch")
    assert kquant.legacy_quantizer(name) is None
    for bad in (float("nan"), 1e12):       # the gguf package's path refuses them too
        y = x.clone()
        y[3, 5] = bad
        with pytest.raises(ValueError):
            gguf_write.encode(y, QT[name])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", sorted(kquant.QUANTIZERS))
def test_constant_sub_blocks_come_back(name, impl):
    """A sub-block whose values all round alike (constant, or nearly) fits its scale alone or its
    min alone: it comes back close, not as zeros (the general fit is singular there)."""
    q = _quantizer(impl, name)
    dq = quants.QUANTS[QT[name]].dequantize_blocks
    g = torch.Generator().manual_seed(2)
    for value in (0.25, 1.0, -0.3, 7.5):
        x = torch.full((4, 256), value)
        x[1] += 1e-7 * torch.randn(256, generator=g)                      # nearly constant
        x[2, 32:64] = -value                                               # one sub-block of the other sign
        y = dq(q(x))
        assert (y - x).abs().max() <= 0.02 * abs(value), (name, impl, value, (y - x).abs().max())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", sorted(kquant.QUANTIZERS))
def test_non_finite_and_overflowing_values_are_refused(name, impl):
    q = _quantizer(impl, name)
    x = torch.randn(4, 256)
    for bad, match in ((float("nan"), "finite"), (float("inf"), "finite"), (1e12, "large|finite")):
        y = x.clone()
        y[2, 100] = bad
        with pytest.raises(ValueError, match=match):
            q(y)


def test_convert_names_the_tensor_it_cannot_write(tmp_path):
    """A weight the chosen type cannot hold (NaN here): a WeightError naming the file and the
    tensor, and no half-written GGUF left behind."""
    from safetensors.torch import load_file, save_file

    from ktinject.errors import WeightError
    from ktinject.testing import save_tiny
    from ktinject.weights import gguf_write
    hf = save_tiny("qwen3_moe", tmp_path / "hf", num_hidden_layers=1)
    (shard,) = sorted(hf.glob("*.safetensors"))
    state = load_file(shard)
    key = "model.layers.0.self_attn.o_proj.weight"
    state[key][0, 0] = float("nan")
    save_file(state, shard, metadata={"format": "pt"})
    out = tmp_path / "bad.gguf"
    with pytest.raises(WeightError) as info:
        gguf_write.convert_model(hf, out, "q8_0", progress=False)
    text = str(info.value)
    assert str(out) in text and "attn_output" in text and "finite" in text, text
    assert not out.exists()


# the torch-only 2- and 3-bit quantizers (tests, `synth --recipe q2_k / q3_k_m`): no gguf-package
# type of as few bits to beat, so floors measured on N(0, 1) (11.2 / 16.7 dB) less a margin
LOW_BIT_FLOORS = {"Q2_K": 10.5, "Q3_K": 16.0}


@pytest.mark.parametrize("name", sorted(kquant.LOW_BIT_QUANTIZERS))
@pytest.mark.parametrize("kind", ["gaussian", "laplace", "outliers"])
def test_low_bit_quantizers(name, kind):
    x = _data(kind)
    blocks = kquant.LOW_BIT_QUANTIZERS[name](x)
    assert blocks.dtype == torch.uint8 and blocks.shape == (512, quants.QUANTS[QT[name]].type_size)
    ref = gq.dequantize(blocks.numpy(), QT[name]).reshape(x.shape)
    np.testing.assert_array_equal(quants.QUANTS[QT[name]].dequantize_blocks(blocks).numpy(), ref)
    sqnr = kquant.sqnr_db(x, torch.from_numpy(ref))
    if kind == "gaussian":
        assert sqnr > LOW_BIT_FLOORS[name], (name, sqnr)
    else:
        assert sqnr > LOW_BIT_FLOORS[name] - 3, (name, kind, sqnr)
    # every scale code the packing writes comes back: a spread of sub-block magnitudes
    spread = torch.randn(64, 16, 16, generator=torch.Generator().manual_seed(1)) * torch.logspace(-2, 0, 16).view(1, 16, 1)
    y = quants.QUANTS[QT[name]].dequantize_blocks(kquant.LOW_BIT_QUANTIZERS[name](spread.reshape(64, 256)))
    assert kquant.sqnr_db(spread.reshape(64, 256), y.reshape(64, 256)) > LOW_BIT_FLOORS[name] - 3


@pytest.mark.parametrize("name", sorted(kquant.LOW_BIT_QUANTIZERS))
@pytest.mark.parametrize("case", ["zeros", "constant", "negative", "underflow", "one_spike"])
def test_low_bit_edge_blocks(name, case):
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(3))
    x = {"zeros": torch.zeros(8, 256), "constant": torch.full((8, 256), 0.3), "negative": -x.abs() - 0.1,
         "underflow": x * 1e-7, "one_spike": torch.zeros(8, 256).index_fill_(1, torch.tensor([5]), 2.0)}[case]
    y = quants.QUANTS[QT[name]].dequantize_blocks(kquant.LOW_BIT_QUANTIZERS[name](x))
    assert torch.isfinite(y).all()
    if case == "zeros":
        assert torch.equal(y, torch.zeros_like(x))
    elif case == "underflow":
        assert y.abs().max() <= x.abs().max()
    else:
        assert kquant.sqnr_db(x, y) > 9, (name, case, kquant.sqnr_db(x, y))
    with pytest.raises(ValueError, match="finite"):
        kquant.LOW_BIT_QUANTIZERS[name](torch.full((1, 256), float("nan")))
