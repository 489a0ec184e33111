"""`cpu_linear`: GGML-row linears on the CPU against x @ W^T with W dequantized (both paths:
native multi-row dots for few tokens, chunked dequantize + torch for many), weights from a GGUF
kept as stored, float sources quantized at load, bias, the busy-pool path, the overlay."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from ktinject import native
from ktinject.errors import NativeError

pytestmark = pytest.mark.skipif(not native.ensure_built(), reason="native extension not built (no C compiler)")


def _rows(qt, rows=96, n=512, seed=0):
    from ktinject.native.synth import quantize_rows
    w = torch.randn(rows, n, generator=torch.Generator().manual_seed(seed)) * 0.05
    return quantize_rows(w, qt)


@pytest.mark.parametrize("qt", [QT.Q8_0, QT.Q4_K, QT.Q6_K, QT.Q4_0, QT.IQ4_XS, QT.BF16])
@pytest.mark.parametrize("T", [1, 3, 17])
def test_native_linear_equals_dequantized_matmul(qt, T):
    pool = native.default_pool(2)
    w = _rows(qt)
    deq = native.dequant_rows(pool, int(qt), w, 512)
    assert torch.equal(deq, torch.stack([native.dequant_row(int(qt), r, 512) for r in w]))
    x = torch.randn(T, 512, generator=torch.Generator().manual_seed(T))
    ref = x @ deq.T
    y = native.linear(pool, int(qt), w, 512, x)
    # quantized types take 8-bit activations (per 32 values): that rounding, no more; bf16 exact-ish
    tol = 2e-6 if qt == QT.BF16 else 1.5e-2
    assert ((y - ref).abs().max() / ref.abs().max()).item() < tol
    assert torch.equal(native.linear(None, int(qt), w, 512, x), y)        # the caller's thread alone: same


@pytest.mark.parametrize("qt", [QT.Q4_K, QT.Q6_K, QT.Q5_0, QT.Q8_0])
@pytest.mark.parametrize("T", [16, 40, 70])
def test_native_linear_grouped_gemm_from_16_tokens(qt, T, monkeypatch):
    """From 16 tokens the types the 8-bit grouped kernels take run as one GEMM over panels of 16
    tokens (activations per 32 values): within the dots' error of the dequantized matmul, the same
    bits with and without the pool, and a last chunk of rows that is no multiple of 4 (101 rows)."""
    pool = native.default_pool(2)
    w = _rows(qt, rows=101)
    deq = native.dequant_rows(pool, int(qt), w, 512)
    x = torch.randn(T, 512, generator=torch.Generator().manual_seed(T))
    ref = x @ deq.T
    grouped = native.linear_grouped_from(int(qt)) > 0
    y = native.linear(pool, int(qt), w, 512, x)
    assert ((y - ref).abs().max() / ref.abs().max()).item() < 1.5e-2
    assert torch.equal(native.linear(None, int(qt), w, 512, x), y)
    monkeypatch.setenv("KTINJECT_LINEAR_GROUPED_MIN", "0")               # the per-token dots instead
    assert native.linear_grouped_from(int(qt)) == 0
    dots = native.linear(pool, int(qt), w, 512, x)
    assert ((dots - ref).abs().max() / ref.abs().max()).item() < 1.5e-2
    assert torch.equal(dots, y) != grouped                               # another path where it runs


def test_grouped_linear_types():
    """Which types take the grouped GEMM on each path, as `ktinject doctor` reports it."""
    from ktinject.native import ISAS
    usable = native.usable_isas()
    for name in ("avx2", "avx512"):
        if name in usable:
            isa = ISAS.index(name)
            assert native.linear_grouped_from(int(QT.Q4_K), isa) == 16
            assert native.linear_grouped_from(int(QT.BF16), isa) == 0
    assert native.linear_grouped_from(int(QT.Q4_K), ISAS.index("scalar")) == 0
    assert native.linear_path("scalar") == "dots"                       # what `ktinject doctor` prints
    if "avx2" in usable:
        assert native.linear_path("avx2") == "8-bit grouped GEMM from 16 tokens (Q4_0, Q5_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), dots otherwise"
    assert "linear_prefill" in native.describe()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_linear_float_rows_shorter_than_a_block(dtype):
    """Float rows take no activation records: 16 values (less than one 32-value block) work too."""
    from ktinject.operators.cpu_linear import _ELEMENT
    qt = next(t for t, d in _ELEMENT.items() if d == dtype)
    w = torch.randn(5, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(2))
    ref = x @ w.float().T
    for pool in (native.default_pool(2), None):
        y = native.linear(pool, qt, w.view(torch.uint8).reshape(5, -1).contiguous(), 16, x)
        assert ((y - ref).abs().max() / ref.abs().max()).item() < 1e-5


def test_native_linear_checks_its_arguments():
    pool = native.default_pool(2)
    w = _rows(QT.Q8_0)
    with pytest.raises(NativeError, match="rows of"):
        native.linear(pool, int(QT.Q4_K), w, 512, torch.zeros(1, 512))
    with pytest.raises(NativeError, match=r"expected \[T, 512\]"):
        native.linear(pool, int(QT.Q8_0), w, 512, torch.zeros(1, 256))
    with pytest.raises(NativeError, match="float32"):
        native.linear(pool, int(QT.Q8_0), w, 512, torch.zeros(1, 512, dtype=torch.float64))
    with pytest.raises(NativeError, match="contiguous float32 CPU buffer"):
        native.dequant_rows(pool, int(QT.Q8_0), w, 512, out=torch.empty(10))


def test_linear_beside_a_busy_pool():
    """While the routed experts hold the pool, a linear still gives its result (computed on the
    calling thread: the pool refuses a second job) and the experts' result is untouched."""
    from ktinject.native import ExpertMatrix, MoEKernel
    pool = native.default_pool(2)
    E, H, I = 8, 256, 256
    mats = [ExpertMatrix(int(QT.Q8_0), _rows(QT.Q8_0, E * r, c, seed=i), E, r, c)
            for i, (r, c) in enumerate(((I, H), (I, H), (H, I)))]
    kernel = MoEKernel(*mats, threads=2)
    assert kernel.pool is pool
    x = torch.randn(1, H)
    ids, wts = torch.tensor([[0, 3]]), torch.ones(1, 2)
    ref_moe = kernel.forward(x, ids, wts)
    w = _rows(QT.Q4_K, rows=64, n=256)
    ref = native.linear(None, int(QT.Q4_K), w, 256, x)
    kernel.submit(x, ids, wts)
    y = native.linear(pool, int(QT.Q4_K), w, 256, x)
    assert torch.equal(kernel.sync(), ref_moe) and torch.equal(y, ref)


def _op(qt_rows, bias, **kw):
    from ktinject.operators.cpu_linear import CpuLinear, CpuLinearOptions
    rows, n = 80, 512
    op = CpuLinear(n, rows, bias is not None, CpuLinearOptions(**kw), "t.proj")
    source = {"t.proj.weight": qt_rows}
    if bias is not None:
        source["t.proj.bias"] = bias
    assert op.load_weights("t.proj.", source) == set(source)
    return op


@pytest.mark.parametrize("T", [2, 40])
def test_operator_keeps_ggml_weights_and_matches_its_dequantized_linear(T):
    from ktinject.weights.tensor import GGMLTensor
    data = _rows(QT.Q4_K, rows=80)
    t = GGMLTensor(int(QT.Q4_K), (80, 512), data, "blk.0.attn_q.weight", "m.gguf")
    bias = torch.randn(80)
    op = _op(t, bias, gemv_max_tokens=16, chunk_mb=1)
    assert op.ggml_type == int(QT.Q4_K) and op.qweight.data_ptr() == data.data_ptr()    # no copy
    x = torch.randn(1, T, 512, dtype=torch.bfloat16)
    deq = t.dequantize(torch.float32)
    ref = x.float() @ deq.T + bias
    y = op(x)
    assert y.shape == (1, T, 80) and y.dtype == torch.bfloat16
    tol = 1.5e-2 if T <= 16 else 1e-2          # 8-bit activations on the dot path; bf16 output either way
    assert ((y.float() - ref).abs().max() / ref.abs().max()).item() < tol


@pytest.mark.parametrize("quant,tol", [("q8_0", 1.5e-2), ("bf16", 1e-2), ("f16", 2e-3), ("f32", 1e-5), ("auto", 1e-5)])
def test_operator_quantizes_float_weights_at_load(quant, tol):
    w = torch.randn(80, 512) * 0.05
    op = _op(w, None, quant=quant)
    x = torch.randn(3, 512)
    ref = x @ w.T
    assert ((op(x) - ref).abs().max() / ref.abs().max()).item() < tol
    from ktinject.errors import LoadError
    with pytest.raises(LoadError, match="shape differs"):
        _op(torch.randn(81, 512), None)


@pytest.mark.parametrize("quant", ["q8_0", "q4_k"])
def test_a_weight_that_cannot_be_quantized_is_named(quant):
    from ktinject.errors import LoadError
    bad = torch.randn(80, 512) * 0.05
    bad[3, 7] = float("nan")
    with pytest.raises(LoadError, match=rf"t\.proj\.weight: cannot be stored as {quant}: .*finite"):
        _op(bad, None, quant=quant)


def test_overlay_places_every_linear_and_matches_float_reference(tmp_path, monkeypatch):
    """`cpu-linear` (part of the -cpu packs; here before one with `cpu-float`'s reference): every Linear (attention, shared experts, lm_head) becomes
    cpu_linear; with f32 rows the logits are the float overlay's. (The routed experts take their f32 row dots
    in both models: on the grouped path, AMX tiles and AVX512-BF16 dots round the tokens to bf16, which
    would turn the linears' last-bit differences into bf16 steps.)"""
    from ktinject import optimize_and_load
    from ktinject.testing import save_tiny
    monkeypatch.setenv("KTINJECT_TILE_MIN", "100000")
    d = save_tiny("qwen2_moe", tmp_path / "m")            # q/k/v have biases
    exact = tmp_path / "f32.yaml"
    exact.write_text("version: 1\nrules:\n  - match: {class: Linear}\n"
                     "    replace: {op: cpu_linear, device: cpu, kwargs: {quant: f32, gemv_max_tokens: 8}}\n")
    ours, _ = optimize_and_load(d, [str(exact), "qwen2-moe-cpu"])
    ref, _ = optimize_and_load(d, ["cpu-float", "qwen2-moe-cpu"])
    assert not any(type(m).__name__ == "CpuLinear" for m in ref.modules())
    lin = [n for n, m in ours.named_modules() if type(m).__name__ == "CpuLinear"]
    assert "lm_head" in lin and any(n.endswith("self_attn.q_proj") for n in lin)
    ids = torch.randint(3, 400, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for cut in (24, 3):                                   # the dequantize path, the dot path
            a, b = ours(ids[:, :cut]).logits, ref(ids[:, :cut]).logits
            assert ((a - b).abs().max() / b.abs().max()).item() < 1e-4
    auto, _ = optimize_and_load(d, "qwen2-moe-cpu")                  # the pack as shipped
    assert auto.lm_head.ggml_type == int(QT.F32)                     # float32 safetensors: kept exact


@pytest.mark.parametrize("overlay,first", [(None, True), ("cpu-linear", True), ("cpu-float", False)])
def test_cpu_block_runs_pool_shared_experts_before_the_routed_ones(tmp_path, overlay, first):
    """On the CPU, shared experts that are cpu_linear (native pool) run before the routed experts
    are submitted (overlapped, they would find the pool busy and run on one thread); float ones
    (torch's threads) still overlap. Either way the block's output is the same sum."""
    from ktinject import optimize_and_load
    from ktinject.operators.moe import OverlappedMoe
    from ktinject.testing import save_tiny
    d = save_tiny("qwen2_moe", tmp_path / "m")
    model, _ = optimize_and_load(d, [overlay, "qwen2-moe-cpu"] if overlay else "qwen2-moe-cpu")
    block = next(m for m in model.modules() if isinstance(m, OverlappedMoe))
    events = []
    submit = block.experts.submit
    block.experts.submit = lambda *a: (events.append("routed"), submit(*a))[1]
    block.shared_expert.register_forward_pre_hook(lambda *a: events.append("shared"))
    h = torch.randn(1, 3, block.hidden)
    with torch.no_grad():
        out = block(h)
        order = list(events)
        block.experts.submit = submit
        x = h.reshape(-1, block.hidden)
        _, w, ids = block.gate(x)
        want = block.experts.forward(x, ids, w) + torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    assert order == (["shared", "routed"] if first else ["routed", "shared"])
    assert torch.allclose(out.reshape(-1, block.hidden), want, atol=1e-6)


@pytest.mark.parametrize("family,preset", [("deepseek_v2", "q4_k_m"), ("qwen3_moe", "q8_0")])
def test_gguf_weights_are_read_where_the_file_holds_them(tmp_path, family, preset):
    """A GGUF loaded with `cpu-linear`: each linear keeps its tensor in the file's type (the
    operator test above checks that no copy is made); logits as close to the dequantized
    transformers model as the float overlay's."""
    from ktinject import optimize_and_load
    from ktinject.testing import save_tiny
    from ktinject.weights import gguf_write, open_source
    from test_gguf_e2e import CPU_PACK, reference
    path = gguf_write.convert_model(save_tiny(family, tmp_path / "hf"), tmp_path / "m.gguf", preset,
                                    progress=False)[0]
    rules = tmp_path / "lin.yaml"                                    # the shipped overlay, both paths in reach
    rules.write_text("version: 1\nrules:\n  - match: {class: Linear}\n"
                     "    replace: {op: cpu_linear, device: cpu, kwargs: {gemv_max_tokens: 8, prefill_dtype: float32}}\n")
    model, tok = optimize_and_load(path, [str(rules), CPU_PACK[family]])
    src = open_source(path)
    q = model.model.layers[1].self_attn.o_proj
    stored = src["model.layers.1.self_attn.o_proj.weight"]
    assert q.ggml_type == stored.ggml_type
    assert torch.equal(q.qweight, stored.data.reshape(q.qweight.shape))
    ids = torch.tensor([tok("The quick brown fox").input_ids + [5, 77, 300]])
    with torch.no_grad():
        got, want = model(ids).logits, reference(path)(ids).logits
        one = model(ids[:, :4]).logits                               # the dot path (few tokens)
    assert ((got - want).abs().max() / want.abs().max()).item() < 2e-2     # the dequantize path: as cpu-float
    # the dot path rounds activations to 8 bits: ~3% per position in these tiny random models,
    # more where that flips a routing decision (llama.cpp's CPU path does the same)
    per_pos = ((one - want[:, :4]).abs().amax(-1) / want[:, :4].abs().amax(-1))[0]
    assert torch.isfinite(one).all() and per_pos.median().item() < 5e-2, per_pos
    src.close()
    # the dequantize path in bfloat16 (what `auto` picks on AMX / AVX512-BF16 CPUs) rounds both
    # operands to 8 significant bits: within what the dot path's 8-bit activations cost
    rules.write_text(rules.read_text().replace("prefill_dtype: float32", "prefill_dtype: bfloat16"))
    model, _ = optimize_and_load(path, [str(rules), CPU_PACK[family]])
    assert model.model.layers[1].self_attn.o_proj._mm_dtype == torch.bfloat16
    with torch.no_grad():
        bf = model(ids).logits
    per_pos = ((bf - want).abs().amax(-1) / want.abs().amax(-1))[0]
    assert torch.isfinite(bf).all() and per_pos.median().item() < 5e-2, per_pos
    assert not torch.equal(bf, got)


def test_decode_runs_torch_single_threaded_with_native_linears(tmp_path):
    """With `cpu_linear`, the decode loop runs torch's few remaining ops on one thread (its OpenMP
    threads would spin against the native pool's workers); prefill and the caller keep theirs."""
    from ktinject import optimize_and_load
    from ktinject.generate import generate
    from ktinject.phase import current
    from ktinject.testing import save_tiny
    from ktinject.tokenizer import byte_tokenizer
    model, _ = optimize_and_load(save_tiny("qwen3_moe", tmp_path / "m"), ["cpu-linear", "qwen3-moe-cpu"])
    seen = {}
    model.lm_head.register_forward_pre_hook(lambda m, a: (seen.setdefault(current(), torch.get_num_threads()), None)[1])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        tok = byte_tokenizer(model.config.vocab_size)
        generate(model, tok, "abc", max_new_tokens=4)
        assert seen == {"prefill": 2, "generate": 1} and torch.get_num_threads() == 2
        # between tokens, the caller's code runs with its own threads; a closed stream keeps them
        from ktinject.generate import stream_generate
        pieces = stream_generate(model, tok, "abc", max_new_tokens=8)
        for _ in range(3):
            next(pieces)
            assert torch.get_num_threads() == 2
        pieces.close()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_quantize_rows_refuses_rows_that_are_not_whole_blocks():
    from ktinject.native.synth import quantize_rows
    with pytest.raises(ValueError, match="not a multiple of the Q5_K block"):
        quantize_rows(torch.randn(8, 128), QT.Q5_K)          # it used to run blocks across rows


def test_prefill_path_in_several_chunks():
    """More tokens than the dot path takes, and more rows than one dequantized chunk holds."""
    from ktinject.operators.cpu_linear import CpuLinear, CpuLinearOptions
    from ktinject.weights.tensor import GGMLTensor
    rows, n = 1000, 512
    data = _rows(QT.Q6_K, rows=rows, n=n)
    x = torch.randn(9, n)
    ref = x @ native.dequant_rows(None, int(QT.Q6_K), data, n).T
    assert (1 << 20) // (4 * n) < rows                                   # 512 rows a chunk: two chunks
    for dtype, tol in (("float32", 1e-5), ("bfloat16", 1e-2)):          # bf16: 8-bit significands
        op = CpuLinear(n, rows, False, CpuLinearOptions(gemv_max_tokens=4, chunk_mb=1, prefill_dtype=dtype), "t.big")
        op.load_weights("t.big.", {"t.big.weight": GGMLTensor(int(QT.Q6_K), (rows, n), data)})
        y = op(x)
        assert y.dtype == torch.float32 and ((y - ref).abs().max() / ref.abs().max()).item() < tol
        assert ((y - ref).norm() / ref.norm()).item() < tol / 2
        if dtype == "bfloat16":                                          # the same as the bf16 product
            want = (x.bfloat16() @ native.dequant_rows(None, int(QT.Q6_K), data, n).bfloat16().T).float()
            assert ((y - want).abs().max() / want.abs().max()).item() < 1e-5
    with pytest.raises(ValueError, match="input of 256 features"):
        op(torch.randn(2, 256))


def test_prefill_dtype_and_token_limit_follow_the_cpu(monkeypatch):
    """`auto` multiplies in bfloat16 where the CPU has bf16 dot instructions (and the dots stop at 128
    tokens there, 256 elsewhere); float32 and float16 weights keep float32; explicit values win."""
    from ktinject.operators import cpu_linear as cl
    for has, want in ((True, (128, torch.bfloat16)), (False, (256, torch.float32))):
        monkeypatch.setattr(cl, "cpu_multiplies_bf16", lambda has=has: has)
        assert cl.CpuLinearOptions().resolved() == want
        assert cl.CpuLinearOptions().resolved(torch.bfloat16) == want
        assert cl.CpuLinearOptions().resolved(torch.float32) == (256, torch.float32)
        assert cl.CpuLinearOptions().resolved(torch.float16) == (256, torch.float32)
        assert cl.CpuLinearOptions(gemv_max_tokens=40, prefill_dtype="bfloat16").resolved() == (40, torch.bfloat16)
        assert cl.CpuLinearOptions(prefill_dtype="float32").resolved(torch.bfloat16) == (256, torch.float32)
        assert cl.CpuLinearOptions().resolved(grouped=True) == (1024, want[1])      # the grouped 8-bit GEMM
        assert cl.CpuLinearOptions(gemv_max_tokens=50).resolved(grouped=True) == (50, want[1])
    with pytest.raises(ValueError, match="prefill_dtype must be auto, float32 or bfloat16, got 'fp16'"):
        cl.CpuLinearOptions(prefill_dtype="fp16")
    with pytest.raises(ValueError, match="gemv_max_tokens must be >= 0"):
        cl.CpuLinearOptions(gemv_max_tokens=-1)


def test_bf16_rows_multiply_in_bf16_as_stored():
    """BF16 GGML rows on the bfloat16 prefill path: no dequantization, the stored rows themselves."""
    from ktinject.operators.cpu_linear import CpuLinear, CpuLinearOptions
    from ktinject.weights.tensor import GGMLTensor
    w = (torch.randn(40, 256) * 0.05).bfloat16()
    op = CpuLinear(256, 40, False, CpuLinearOptions(prefill_dtype="bfloat16"), "t.bf")
    op.load_weights("t.bf.", {"t.bf.weight": GGMLTensor(int(QT.BF16), (40, 256), w.view(torch.uint8))})
    x = torch.randn(20, 256)                                              # past the 8-token float limit
    assert torch.equal(op(x), (x.bfloat16() @ w.T).float())


def test_unreadable_blocks_and_odd_widths_fall_back_in_order():
    """A GGUF type the kernels cannot read becomes Q8_0 (bf16 where rows are not whole 32-blocks);
    a requested type whose blocks do not fit the width falls back to Q8_0 first."""
    import gguf

    from ktinject.operators.cpu_linear import CpuLinear, CpuLinearOptions
    from ktinject.weights.tensor import GGMLTensor
    q41 = GGMLTensor(int(QT.Q4_1), (16, 256),
                     torch.from_numpy(gguf.quants.quantize((torch.randn(16, 256) * 0.05).numpy(), QT.Q4_1)))
    op = CpuLinear(256, 16, False, CpuLinearOptions(), "t.q41")
    op.load_weights("t.q41.", {"t.q41.weight": q41})
    assert op.ggml_type == int(QT.Q8_0)
    op = CpuLinear(288, 16, False, CpuLinearOptions(quant="q4_k"), "t.odd")
    op.load_weights("t.odd.", {"t.odd.weight": torch.randn(16, 288)})
    assert op.ggml_type == int(QT.Q8_0)                                  # 288 = 9 x 32, not x 256
    op = CpuLinear(100, 16, False, CpuLinearOptions(quant="q8_0"), "t.tiny")
    op.load_weights("t.tiny.", {"t.tiny.weight": torch.randn(16, 100)})
    assert op.ggml_type == int(QT.BF16)
