"""linear_fp8: DeepSeek-V3-style block-scaled FP8 weights and dense weights; the CPU math and,
on the H200, torch._scaled_mm against it."""
import pytest
import torch
import torch.nn.functional as F

from ktinject.errors import LoadError, WeightError
from ktinject.operators import BuildContext, get
from ktinject.operators.linear_fp8 import FP8, Fp8Linear, Fp8Options, dequantize_blockwise


def sqnr(ref, x):
    return 10 * torch.log10(ref.pow(2).mean() / (ref - x).pow(2).mean()).item()


def fp8_checkpoint(n, k, block=128, seed=0):
    """A weight stored the DeepSeek-V3 way: e4m3 values and one inverse scale per block."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    nb, kb = -(-n // block), -(-k // block)
    pad = torch.zeros(nb * block, kb * block)
    pad[:n, :k] = w
    blocks = pad.view(nb, block, kb, block)
    s = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0                 # [nb, kb]
    q = (blocks / s[:, None, :, None]).view(nb * block, kb * block)[:n, :k].to(FP8)
    return q, s


def test_block_checkpoint_roundtrip_cpu():
    q, s = fp8_checkpoint(200, 320)                     # partial blocks on both edges
    ref_w = dequantize_blockwise(q, s, 128)
    bias = torch.randn(200)
    mod = Fp8Linear.from_weight(q, bias, s)
    assert mod.path() == "torch" and mod.weight.dtype == FP8
    x = torch.randn(3, 4, 320)
    assert sqnr(F.linear(x, ref_w, bias), mod(x)) > 25
    assert "path=torch" in repr(mod)


def test_dense_source_and_errors():
    w = torch.randn(64, 128)
    mod = Fp8Linear.from_weight(w)
    x = torch.randn(5, 128)
    assert sqnr(F.linear(x, w), mod(x)) > 25
    q, s = fp8_checkpoint(64, 128)
    with pytest.raises(WeightError, match="weight_scale_inv"):
        Fp8Linear.from_weight(q)
    with pytest.raises(WeightError, match="blocks of 128"):
        Fp8Linear.from_weight(q, scale_inv=torch.ones(2, 2))
    cls = get("linear_fp8")
    with torch.device("meta"):
        orig = torch.nn.Linear(128, 64, bias=False)
    ctx = BuildContext("model.layers.0.self_attn.q_b_proj", torch.device("cpu"), torch.device("cpu"),
                       torch.device("cpu"), torch.bfloat16, None, Fp8Options())
    op = cls.build(orig, ctx)
    assert cls.planned_bytes(orig, ctx) == {"cpu": 64 * 128 + 4 * 64}
    with pytest.raises(LoadError, match="q_b_proj.weight"):
        op.load_weights("model.layers.0.self_attn.q_b_proj.", {})
    used = op.load_weights("p.", {"p.weight": q, "p.weight_scale_inv": s})
    assert used == {"p.weight", "p.weight_scale_inv"}


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_gpu_scaled_mm_matches_math(rows):
    q, s = fp8_checkpoint(2048, 1536)
    ref_w = dequantize_blockwise(q, s, 128).cuda()
    mod = Fp8Linear.from_weight(q, None, s, device="cuda", dtype=torch.bfloat16)
    assert mod.path() == "scaled_mm"
    x = torch.randn(rows, 1536, device="cuda", dtype=torch.bfloat16)
    got = mod(x).float()
    assert sqnr(F.linear(x.float(), ref_w), got) > 22
