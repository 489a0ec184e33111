"""linear_fp8: DeepSeek-V3-style block-scaled FP8 weights and dense weights; the CPU math and,
on the H200, torch._scaled_mm against it."""
import textwrap

import pytest
import torch
import torch.nn.functional as F

from ktinject.errors import LoadError, WeightError
from ktinject.operators import BuildContext, get
from ktinject.operators.kernels.fp8_triton import launch_config, slices
from ktinject.operators.linear_fp8 import FP8, Fp8Linear, Fp8Options, dequantize_blockwise
from ktinject.testing import run_in_triton_interpreter


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
    mod = Fp8Linear.from_weight(q, None, s, options=Fp8Options(backend="scaled_mm"), device="cuda", dtype=torch.bfloat16)
    assert mod.path(rows) == "scaled_mm"
    x = torch.randn(rows, 1536, device="cuda", dtype=torch.bfloat16)
    got = mod(x).float()
    assert sqnr(F.linear(x.float(), ref_w), got) > 22


_INTERP_GEMV = textwrap.dedent("""
    import torch
    from ktinject.operators.kernels.fp8_triton import DOT, ROW, Launch, fp8_gemv, launch_config
    from ktinject.operators.linear_fp8 import Fp8Linear, Fp8Options, quantize_rowwise
    torch.manual_seed(0)
    # (rows, N, K, dtype, bias): one row with K a multiple of the block and not, N past the block and tiny,
    # 2-16 rows through tl.dot (fp16 and fp32 here: the interpreter's bf16 dot is broken)
    for m, n, k, dt, bias in [(1, 40, 1088, torch.bfloat16, True), (1, 600, 512, torch.float32, False),
                              (1, 7, 100, torch.float16, True), (3, 40, 320, torch.float16, True),
                              (16, 33, 512, torch.float32, True), (5, 70, 200, torch.float16, False)]:
        q, s = quantize_rowwise(torch.randn(n, k))
        x = torch.randn(m, k).to(dt)
        b = torch.randn(n).to(dt) if bias else None
        y = fp8_gemv(x, q, s, b)
        assert y.dtype == dt and y.shape == (m, n)
        ref = x.float() @ (q.float() * s[:, None]).T + (b.float() if bias else 0)
        err = ((y.float() - ref).norm() / ref.norm()).item()
        assert err < (1e-5 if dt == torch.float32 else 1e-2), (m, n, k, dt, err)
    # K in slices (fp32 partials added with atomics): one and several rows, K whole blocks or not, bias once
    for m, n, k, split in [(1, 40, 1088, 3), (1, 9, 2048, 4), (5, 24, 700, 2), (16, 33, 512, 16)]:
        qs, ss = quantize_rowwise(torch.randn(n, k))
        x, b = torch.randn(m, k), torch.randn(n)
        y = fp8_gemv(x, qs, ss, b, split_k=split)
        ref = x @ (qs.float() * ss[:, None]).T + b
        assert y.dtype == torch.float32 and ((y - ref).norm() / ref.norm()).item() < 1e-5, (m, n, k, split)
    # the split by the shape (launch_config): K >= 16384 at one row, K >= 6144 at 2-16; a launch given whole
    for m, n, k, launch in [(1, 9, 16500, None), (3, 40, 6144, None), (2, 20, 512, Launch(DOT, 16, 16, 128, 4, 2, 3)),
                            (1, 20, 1000, Launch(ROW, 1, 4, 256, 4, 1, 2))]:
        qs, ss = quantize_rowwise(torch.randn(n, k))
        x = torch.randn(m, k)
        assert launch or launch_config(m, n, k).split == 4
        y = fp8_gemv(x, qs, ss, launch=launch)
        ref = x @ (qs.float() * ss[:, None]).T
        assert ((y - ref).norm() / ref.norm()).item() < 1e-5, (m, n, k, launch)
    for bad, match in [(lambda: fp8_gemv(torch.randn(1, 64), torch.randn(8, 64), torch.ones(8)), "float8"),
                       (lambda: fp8_gemv(torch.randn(1, 64), q[:, :64].contiguous(), s, split_k=17), "split_k"),
                       (lambda: fp8_gemv(torch.randn(3, 64), q[:, :64].contiguous(), s,
                                         launch=Launch(ROW, 1, 4, 64, 4, 1, 1)), "does not fit 3 rows"),
                       (lambda: fp8_gemv(torch.randn(1, 64), q[:, :64].contiguous(), s,
                                         launch=Launch(ROW, 1, 6, 64, 4, 1, 1)), "powers of two"),
                       (lambda: fp8_gemv(torch.randn(17, 64), q[:, :64].contiguous(), s), "1 to 16 rows"),
                       (lambda: fp8_gemv(torch.randn(1, 200), q, s[:3]), "scale")]:
        try:
            bad()
        except ValueError as exc:
            assert match in str(exc), exc
        else:
            raise AssertionError(match)
    # the operator: gemv up to gemv_max_batch rows, then the fallback path (torch off CUDA)
    Fp8Linear._kernels_on_cpu = True
    w, b = torch.randn(48, 256), torch.randn(48)
    mod = Fp8Linear.from_weight(w, b, options=Fp8Options(backend="gemv", gemv_max_batch=4), dtype=torch.float16)
    ref = Fp8Linear.from_weight(w, b, options=Fp8Options(backend="torch"), dtype=torch.float16)
    assert mod.path(4) == "gemv" and mod.path(5) == "torch" and "gemv at <= 4 rows, torch above" in repr(mod)
    for rows in (1, 3, 6):
        x = torch.randn(2, rows, 256, dtype=torch.float16) if 2 * rows <= 4 else torch.randn(rows, 256).half()
        got, want = mod(x).float(), ref(x).float()
        assert got.shape == want.shape and ((got - want).norm() / want.norm()).item() < 1e-2, rows
    print("ok")
""")


def test_fp8_gemv_in_interpreter():
    pytest.importorskip("triton")
    run_in_triton_interpreter(_INTERP_GEMV)


def test_split_note_says_where_k_is_split():
    from ktinject.operators.kernels.fp8_triton import split_note
    assert split_note(4096, 4096) == ""                                   # K 4096: never split
    assert split_note(576, 7168) == "K slices 4 at 2-16 rows (fp32 atomics: the last bits vary run to run)"
    assert split_note(7168, 16384, max_rows=4).startswith("K slices 4 at one row, 4 at 2-4 rows")
    assert split_note(576, 7168, max_rows=1) == "" and split_note(576, 7168, split_k=1) == ""
    assert split_note(100, 1024, split_k=2, max_rows=2) == \
        "K slices 2 at 2 rows (fp32 atomics: the last bits vary run to run)"    # one row: one 1024-wide step, no split


def test_gemv_backend_off_cuda_and_options():
    mod = Fp8Linear.from_weight(torch.randn(16, 64), options=Fp8Options(backend="gemv"))
    assert mod.path(1) == "torch" and "path=torch" in repr(mod)     # no Triton GEMV on the CPU: the math
    assert mod(torch.randn(2, 0, 64)).shape == (2, 0, 16)           # no rows: no dequantized weight either
    with pytest.raises(ValueError, match="gemv_max_batch"):
        Fp8Options(gemv_max_batch=17)
    with pytest.raises(ValueError, match="gemv_split_k"):
        Fp8Options(gemv_split_k=17)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("shape", [(2048, 1536), (576, 7168), (18432, 7168)])
def test_gpu_fp8_gemv_matches_math(rows, shape):
    """backend auto on the H200: the fp8 GEMV (1-16 rows) against the dequantized block checkpoint, in a CUDA
    graph too."""
    n, k = shape
    q, s = fp8_checkpoint(n, k)
    ref_w = dequantize_blockwise(q, s, 128).cuda()
    bias = torch.randn(n)
    mod = Fp8Linear.from_weight(q, bias, s, device="cuda", dtype=torch.bfloat16)
    assert mod.path(rows) == "gemv" and mod.path(17) == "scaled_mm" and "gemv at <= 16 rows, scaled_mm above" in repr(mod)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    got = mod(x)
    assert sqnr(F.linear(x.float(), ref_w, bias.cuda()), got.float()) > 25   # (no activation rounding here)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mod(x)
    graph.replay()
    torch.cuda.synchronize()
    if slices(launch_config(rows, n, k), k)[1] > 1:      # K slices added by atomics: the last bits vary run to run
        assert sqnr(F.linear(x.float(), ref_w, bias.cuda()), out.float()) > 25
    else:
        assert torch.equal(out, got)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16])
def test_gpu_fp8_gemv_split_k(rows):
    """gemv_split_k: K in slices added with fp32 atomics (V3's 576-row kv_a_proj), in a CUDA graph too."""
    n, k = 576, 7168
    q, s = fp8_checkpoint(n, k)
    ref_w = dequantize_blockwise(q, s, 128).cuda()
    bias = torch.randn(n)
    mod = Fp8Linear.from_weight(q, bias, s, options=Fp8Options(gemv_split_k=4), device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    want = F.linear(x.float(), ref_w, bias.cuda())
    got = mod(x)
    assert got.dtype == torch.bfloat16 and sqnr(want, got.float()) > 25
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mod(x)
    graph.replay()
    torch.cuda.synchronize()
    assert sqnr(want, out.float()) > 25          # (the atomics' order varies: not bitwise equal to `got`)
