"""`streamed_experts`: the CPU path (below the threshold or on CPU inputs) is `cpu_experts`; the
stream path's math (`stream_moe`, run here with device="cpu") equals the transformers experts on
the same weights for Q4_K / Q8_0 / Q5_0 GGML blocks and for bf16; the `-gpu-prefill` overlays
plan; options are validated; uploads from (fake-)registered memory, threaded gathers and the
early first chunk give the same bits as plain copies; the torch dequantizers equal `quants`. The
`gpu` tests run the real CUDA path (registered host memory or pinned staging, copy stream).

Tolerances (relative L2 error, per token against the size of the summed terms for `ref_moe`):
the stream path rounds weights and activations to bf16: 2e-2 against the weights it was given."""
from __future__ import annotations

import copy

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from ktinject import native
from ktinject.errors import ModelError, NativeError, RuleError
from ktinject.native.moe import ExpertMatrix
from ktinject.operators import registry
from ktinject.operators.base import BuildContext
from ktinject.operators import streamed_experts as se
from ktinject.testing import FAMILIES, build_tiny, first_moe_block, random_routing, save_tiny, tiny_config

from test_native_util import dequant, rand_rows, ref_moe, rel_err

pytestmark = pytest.mark.skipif(not native.available(), reason="native extension not built")
CPU = torch.device("cpu")
PACK = {f: f.replace("_", "-") for f in FAMILIES}
EXPERT_CLASS = {"deepseek_v2": "DeepseekV2Experts", "deepseek_v3": "DeepseekV3Experts",
                "qwen2_moe": "Qwen2MoeExperts", "qwen3_moe": "Qwen3MoeExperts", "mixtral": "MixtralExperts"}


def _ctx(model, options, name="model.layers.1.mlp.experts"):
    return BuildContext(name, CPU, CPU, CPU, None, model.config, options)


def _op(family, **opts):
    model, block = first_moe_block(family)
    orig = block.experts
    Op = registry.get("streamed_experts")
    op = Op.build(copy.deepcopy(orig).to("meta"), _ctx(model, Op.Options(threads=2, **opts)))
    keys = op.load_weights("e.", {"e.gate_up_proj": orig.gate_up_proj.data, "e.down_proj": orig.down_proj.data})
    assert keys == {"e.gate_up_proj", "e.down_proj"}
    return model, orig, op


def _ggml_mats(types, E, I, H, seed=0):
    """gate, up [E, I, H] and down [E, H, I] as ExpertMatrix of random model-like blocks, and their
    dequantized float weights (gguf-py's reference dequantization)."""
    tg, tu, td = types
    g, u, d = rand_rows(tg, E * I, H, seed), rand_rows(tu, E * I, H, seed + 1), rand_rows(td, E * H, I, seed + 2)
    mats = (ExpertMatrix(int(tg), g, E, I, H, "blk.1.ffn_gate_exps.weight"),
            ExpertMatrix(int(tu), u, E, I, H, "blk.1.ffn_up_exps.weight"),
            ExpertMatrix(int(td), d, E, H, I, "blk.1.ffn_down_exps.weight"))
    dense = (dequant(tg, g, H).reshape(E, I, H), dequant(tu, u, H).reshape(E, I, H),
             dequant(td, d, I).reshape(E, H, I))
    return mats, dense


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def stream_on_cpu(monkeypatch):
    """Let CPU callers take the stream path (its math and bookkeeping run the same there)."""
    monkeypatch.setattr(se.StreamedExperts, "stream_device_types", ("cuda", "cpu"))


# ---------------------------------------------------------------- registry, options, plan

def test_registered_and_replaces_what_cpu_experts_does():
    Op = registry.get("streamed_experts")
    assert Op is se.StreamedExperts
    assert set(Op.replaces) == set(registry.get("cpu_experts").replaces)
    assert Op.device_types == ("cpu",)


def test_options_validate():
    Op = registry.get("streamed_experts")
    assert Op.Options().min_tokens == 256
    for bad, match in (({"min_tokens": 0}, "min_tokens"), ({"chunk_mb": 0}, "chunk_mb"),
                       ({"backend": "cutlass"}, "backend"), ({"quant": "q3_k"}, "quant"),
                       ({"threads": 1.5}, "threads"), ({"isa": "neon"}, "isa"),
                       ({"gather_threads": -1}, "gather_threads"), ({"register_host": "yes"}, "register_host"),
                       ({"host_memory": "locked"}, "host_memory")):
        with pytest.raises(ValueError, match=match):
            Op.Options(**bad)
    with pytest.raises(RuleError, match="min_token"):
        registry.make_options(Op, {"min_token": 4})
    with pytest.raises(RuleError, match="wrong type"):
        registry.make_options(Op, {"min_tokens": "many"})
    with pytest.raises(RuleError, match="min_tokens"):
        registry.make_options(Op, {"min_tokens": -3})
    assert registry.make_options(Op, {"min_tokens": 64, "quant": "q8_0"}).cpu_options().quant == "q8_0"
    o = registry.make_options(Op, {"register_host": False, "gather_threads": 4})
    assert (o.register_host, o.gather_threads) == (False, 4) and not Op.Options().register_host   # opt-in (docs/prefill.md)
    model, block = first_moe_block("qwen3_moe")
    model.config.hidden_act = "gelu"
    with pytest.raises(ModelError, match="gelu"):
        Op.build(block.experts, _ctx(model, Op.Options()))


def test_planned_bytes_are_cpu_experts_and_staging_is_reported():
    model, block = first_moe_block("deepseek_v3")
    Op, C = registry.get("streamed_experts"), registry.get("cpu_experts")
    for quant in ("bf16", "q4_k"):
        assert Op.planned_bytes(block.experts, _ctx(model, Op.Options(quant=quant))) == \
            C.planned_bytes(block.experts, _ctx(model, C.Options(quant=quant)))
    st = Op.staging_bytes(block.experts, Op.Options(chunk_mb=1))
    E, I2, H = block.experts.gate_up_proj.shape
    per_expert = 3 * (I2 // 2) * H
    assert st["device_bf16"] == min(E, (1 << 20) // (per_expert * 2 + 3 * 256)) * per_expert * 2
    assert st["host_pinned"] == st["device_staging"] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_prefill_overlay_plans(family):
    from ktinject.rules.plan import plan
    config = tiny_config(family)
    p = plan(config, PACK[family] + "-gpu-prefill")
    base = plan(config, PACK[family])
    experts = [e for e in p.entries if e.name.endswith("mlp.experts")]
    assert experts and all(e.op == "streamed_experts" and e.device == "cpu" and not e.recursive
                           and e.kwargs == {"min_tokens": 256, "threads": -1} for e in experts)
    assert p.totals == base.totals                       # same bytes as the hybrid pack
    by, bb = p.by_name(), base.by_name()
    for e in p.entries:                                   # everything else is planned as by the pack
        if not e.name.endswith("mlp.experts"):
            assert (e.op, e.device, e.recursive) == (bb[e.name].op, bb[e.name].device, bb[e.name].recursive)
    assert by["model.layers.1.mlp"].op == "moe"
    # the included pack's cpu_experts rule is overridden by the overlay's, not a rule matching nothing
    assert not p.unmatched_rules and not base.unmatched_rules
    assert len(p.overridden_rules) == 1
    shadowed = p.overridden_rules[0]
    assert f"packs/{PACK[family]}.yaml:" in shadowed and EXPERT_CLASS[family] in shadowed


# ---------------------------------------------------------------- the CPU path

@pytest.mark.parametrize("family", FAMILIES)
def test_below_threshold_and_cpu_inputs_use_the_cpu_kernel(family):
    model, orig, op = _op(family, min_tokens=16)
    k = model.config.num_experts_per_tok
    for T in (1, 15, 40):                 # below, just below, above the threshold (CPU inputs: CPU path)
        x = torch.randn(T, model.config.hidden_size)
        ids, w = random_routing(T, op.num_experts, k, seed=T)
        assert op.path(x) == "cpu"
        with torch.no_grad():
            ref = orig(x, ids, w)
        out = op(x, ids, w)
        assert op.last_path == "cpu" and out.shape == ref.shape and out.dtype == ref.dtype
        assert rel_err(out, ref) < 1e-2, (family, T)
    assert op.calls == {"cpu": 3, "stream": 0}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
def test_host_memory_without_cuda():
    """auto and mapped keep the weights where they were loaded (no page-locked memory without
    CUDA); pinned is an error naming the module and the way out."""
    for mode in ("auto", "mapped"):
        _, _, op = _op("qwen3_moe", host_memory=mode)
        assert op._upload is None and "gathered" in repr(op)
    with pytest.raises(ModelError, match="host_memory: pinned needs CUDA"):
        _op("qwen3_moe", host_memory="pinned")


def test_pinned_budget_counts_what_the_allocator_takes(monkeypatch, tmp_path):
    assert [se.pinned_footprint(n) for n in (1, 4096, 4097, 104 << 20)] == [1, 4096, 8192, 128 << 20]
    room = se.pinnable_bytes()
    assert isinstance(room, int)
    meminfo = "MemTotal:       16000000 kB\nMemAvailable:   10000000 kB\n"
    real_open = open

    def fake_open(path, *a, **k):
        if path == "/proc/meminfo":
            import io
            return io.StringIO(meminfo)
        if path == "/sys/fs/cgroup/memory.max":
            import io
            return io.StringIO(str(8_000_000 * 1024) + "\n")
        if path == "/sys/fs/cgroup/memory.current":
            import io
            return io.StringIO(str(6_000_000 * 1024) + "\n")
        return real_open(path, *a, **k)
    monkeypatch.setattr("builtins.open", fake_open)
    # the cgroup's 8 GB limit with 6 GB used leaves 2 GB, less a reserve of max(2 GB, 4 GiB)
    assert se.pinnable_bytes() == 2_000_000 * 1024 - (4 << 30)


def test_engine_prefill_chunk_follows_the_operator():
    from ktinject.generate import DEFAULT_CHUNK, prefill_chunk_size
    model, orig, op = _op("qwen3_moe")
    assert prefill_chunk_size(torch.nn.Sequential(orig)) == DEFAULT_CHUNK == 512
    assert prefill_chunk_size(torch.nn.Sequential(orig, op)) == se.PREFILL_CHUNK >= 4096
    assert op.supports_cuda_graph == op.cpu_experts.supports_cuda_graph


def test_async_pair_and_errors():
    model, orig, op = _op("qwen3_moe")
    x = torch.randn(6, model.config.hidden_size).to(torch.bfloat16)
    ids, w = random_routing(6, op.num_experts, 2)
    op.submit(x, ids.to(torch.int32), w.to(torch.bfloat16))
    with pytest.raises(NativeError, match="twice"):
        op.submit(x, ids, w)
    out = op.sync()
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    with pytest.raises(NativeError, match="without submit"):
        op.sync()
    Op = registry.get("streamed_experts")
    fresh = Op.build(orig, _ctx(model, Op.Options(threads=2, min_tokens=1)))
    with pytest.raises(NativeError, match="not loaded"):
        fresh._stream(x, ids, w)


# ---------------------------------------------------------------- the stream path's math (device="cpu")

@pytest.mark.parametrize("types", [(QT.Q4_K, QT.Q4_K, QT.Q4_K), (QT.Q8_0, QT.Q8_0, QT.Q8_0),
                                   (QT.Q4_K, QT.Q4_K, QT.Q5_0)])
@pytest.mark.parametrize("backend", ["grouped_mm", "loop"])
def test_stream_math_on_ggml_blocks(types, backend):
    E, I, H, k = 8, 256, 256, 2
    mats, (G, U, D) = _ggml_mats(types, E, I, H)
    T = 48
    x = torch.randn(T, H)
    g = torch.Generator().manual_seed(1)
    scores = torch.rand(T, E, generator=g)
    scores[:, 3] = -1.0                                               # expert 3 gets no token: skipped
    ids, w = scores.topk(k, dim=1).indices, torch.rand(T, k, generator=g)
    ref = ref_moe(x, ids, w, G, U, D)
    per_expert = sum(se._aligned(m.rows * m.data.shape[1]) for m in mats)
    for chunk in (1 << 30, 3 * per_expert, 1):                       # one chunk, a few, one expert each
        st = se.Staging(CPU)
        out = se.stream_moe(x, ids, w, *mats, device="cpu", chunk_bytes=chunk, backend=backend, staging=st)
        assert out.dtype == torch.float32 and out.shape == (T, H)
        assert rel_err(out, ref) < 2e-2, (types, backend, chunk)
        assert st.host[0] is not None and st.host[0].numel() >= per_expert


def test_stream_math_matches_the_transformers_module_on_bf16(stream_on_cpu):
    """Dense weights stored as bf16 by the owned cpu_experts (fused gate_up: strided rows), through
    the operator's stream path: equals the transformers module on the same weights."""
    for family in ("deepseek_v2", "mixtral"):
        model, orig, op = _op(family, min_tokens=8, chunk_mb=1)
        k = model.config.num_experts_per_tok
        assert op.cpu_experts.kernel.gate.expert_stride == 2 * op.inter          # the strided (fused) layout
        x = torch.randn(24, model.config.hidden_size)
        ids, w = random_routing(24, op.num_experts, k, seed=5)
        with torch.no_grad():
            ref = orig(x, ids, w)
        assert op.path(x) == "stream" and op.path(x[:7]) == "cpu"
        out = op(x, ids, w)
        assert op.last_path == "stream" and out.dtype == x.dtype
        assert rel_err(out, ref) < 2e-2, family
        op.submit(x.to(torch.bfloat16), ids, w)                         # async pair on the stream path
        out2 = op.sync()
        assert out2.dtype == torch.bfloat16 and rel_err(out2.float(), ref) < 3e-2
        assert op.calls["stream"] == 2


def test_stream_rejects_bad_expert_ids():
    mats, _ = _ggml_mats((QT.Q8_0, QT.Q8_0, QT.Q8_0), 4, 256, 256)
    x, w = torch.randn(3, 256), torch.rand(3, 2)
    for bad in (4, -1):
        ids = torch.tensor([[0, 1], [2, bad], [3, 0]])
        with pytest.raises(ModelError, match=f"layers.9.mlp.experts.*{bad}"):
            se.stream_moe(x, ids, w, *mats, device="cpu", staging=se.Staging(CPU), name="model.layers.9.mlp.experts")
    empty = se.stream_moe(x[:0], torch.zeros(0, 2, dtype=torch.long), w[:0], *mats, device="cpu")
    assert empty.shape == (0, 256)


def test_segments_merge_contiguous_experts():
    m = ExpertMatrix(8, torch.zeros(16 * 4, 34, dtype=torch.uint8), 16, 4, 32)
    assert se._segments(m, [0, 1, 2, 5, 6, 9]) == [(0, 12), (20, 8), (36, 4)]
    strided = ExpertMatrix(8, torch.zeros(16 * 8, 34, dtype=torch.uint8), 16, 4, 32, stride=8, offset=4)
    assert se._segments(strided, [0, 1]) == [(4, 4), (12, 4)]
    assert se._chunks([0, 2, 3, 7, 9], 10, 25) == [[0, 2], [3, 7], [9]]
    assert se._chunks([1, 2], 10, 5) == [[1], [2]]


def _overlay_rules(tmp_path, family, extra=""):
    """The family's -gpu-prefill overlay with the threshold lowered to 8 tokens and float32 outside
    the experts (so the comparison sees only the experts' bf16 rounding, not routing flips)."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(f"version: 1\ninclude: [{PACK[family]}-gpu-prefill]\n{extra}defaults: {{dtype: float32}}\n"
                     "rules:\n  - match: {name: 'model\\.layers\\.\\d+\\.mlp\\.experts'}\n"
                     "    replace: {op: streamed_experts, device: cpu, kwargs: {min_tokens: 8, threads: 2}}\n"
                     "    recursive: false\n")
    return str(rules)


@pytest.mark.parametrize("family", FAMILIES)
def test_whole_model_with_the_overlay_on_cpu(tmp_path, family, stream_on_cpu):
    """The overlay with every device remapped to the CPU: the `moe` block drives the stream path
    through submit/sync from 8 tokens on, the CPU kernel below; logits match the original model."""
    from ktinject.load import optimize_and_load
    path = save_tiny(family, tmp_path / "m")
    model, _ = optimize_and_load(str(path), _overlay_rules(tmp_path, family, "remap: {cuda: cpu}\n"),
                                 tokenizer=False)
    ops = [m for m in model.modules() if isinstance(m, se.StreamedExperts)]
    assert ops and all(m.experts in ops for m in model.modules() if type(m).__name__ == "OverlappedMoe")
    ref = build_tiny(family)
    for n, path_taken in ((12, "stream"), (5, "cpu")):
        ids = torch.randint(3, 500, (1, n), generator=torch.Generator().manual_seed(n))
        with torch.no_grad():
            got, want = model(ids).logits, ref(ids).logits
        assert all(op.last_path == path_taken for op in ops)
        assert rel_err(got, want) < 2e-2, path_taken        # observed <= 6e-3 (stream), 3e-3 (cpu)


# ---------------------------------------------------------------- the real CUDA path

@pytest.mark.gpu
def test_gpu_stream_path_direct():
    """Hidden states on CUDA from min_tokens on: the stream path runs on that GPU (pinned staging,
    device buffers there), equals the reference on Q4_K/Q5_0 blocks; below it, the CPU kernel."""
    E, I, H, k = 8, 256, 256, 2
    mats, (G, U, D) = _ggml_mats((QT.Q4_K, QT.Q4_K, QT.Q5_0), E, I, H, seed=3)
    model, block = first_moe_block("deepseek_v2")
    Op = registry.get("streamed_experts")
    op = Op.build(copy.deepcopy(block.experts).to("meta"), _ctx(model, Op.Options(threads=2, min_tokens=32)))
    from ktinject.weights.tensor import FusedTensor, GGMLTensor
    gu = FusedTensor((GGMLTensor(int(QT.Q4_K), (E, I, H), mats[0].data, "blk.1.ffn_gate_exps.weight", "m.gguf"),
                      GGMLTensor(int(QT.Q4_K), (E, I, H), mats[1].data, "blk.1.ffn_up_exps.weight", "m.gguf")), dim=1)
    dn = GGMLTensor(int(QT.Q5_0), (E, H, I), mats[2].data, "blk.1.ffn_down_exps.weight", "m.gguf")
    op.load_weights("p.", {"p.gate_up_proj": gu, "p.down_proj": dn})
    for T, expect in ((64, "stream"), (8, "cpu")):
        x = torch.randn(T, H)
        ids, w = random_routing(T, E, k, seed=T)
        ref = ref_moe(x, ids, w, G, U, D)
        xc = x.to("cuda", torch.bfloat16)
        out = op(xc, ids.cuda(), w.cuda())
        assert op.last_path == expect and out.device.type == "cuda" and out.dtype == torch.bfloat16
        # stream: bf16 weights and activations; cpu: the native kernel's 8-bit activations (<4e-2 in
        # test_moe_operators), both returned in bf16
        assert rel_err(out.float().cpu(), ref) < (3e-2 if expect == "stream" else 5e-2), expect
    st = se.staging_for(torch.device("cuda"))
    assert st.dev[0] is not None and st.dev[0].is_cuda
    # host_memory auto: the layer's weights were copied to page-locked memory at load, so the
    # upload is by DMA straight from them; the CPU kernel (T=8 above) reads the mapping
    assert all(se.is_page_locked_copy(m.data) for m in op._upload) and "page-locked copy" in repr(op)
    assert not se.is_page_locked_copy(op.cpu_experts.kernel.gate.data)
    assert op.calls == {"cpu": 1, "stream": 1} and op.last_upload_mode == "direct", op.last_upload
    # host_memory mapped: heap weights (not a file mapping) are gathered: registering their pages
    # would lock pages shared with other allocations (test_only_file_mapped_pages_are_registered)
    mapped = Op.build(copy.deepcopy(block.experts).to("meta"),
                      _ctx(model, Op.Options(threads=2, min_tokens=32, host_memory="mapped")))
    mapped.load_weights("p.", {"p.gate_up_proj": gu, "p.down_proj": dn})
    x = torch.randn(64, H)
    ids, w = random_routing(64, E, k, seed=64)
    out_m = mapped(x.to("cuda", torch.bfloat16), ids.cuda(), w.cuda())
    out_p = op(x.to("cuda", torch.bfloat16), ids.cuda(), w.cuda())
    assert mapped.last_upload_mode == "gathered" and mapped._upload is None
    assert torch.equal(out_m, out_p)                   # the same bits whichever way they crossed
    # several chunks through both buffer pairs, both backends, f32 callers
    for backend in ("grouped_mm", "loop"):
        x = torch.randn(100, H)
        ids, w = random_routing(100, E, k, seed=7)
        out = se.stream_moe(x.cuda(), ids.cuda(), w.cuda(), *mats, chunk_bytes=1, backend=backend)
        torch.cuda.synchronize()
        assert out.is_cuda and rel_err(out.cpu(), ref_moe(x, ids, w, G, U, D)) < 2e-2, backend


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_overlay_whole_model(family, tmp_path, monkeypatch):
    """The family's -gpu-prefill overlay on CUDA (threshold lowered to 8 tokens by an including
    file, float32 outside the experts): a 16-token prompt streams every MoE layer's experts to the
    GPU, a 4-token one uses the CPU kernel; logits close to the original model's either way."""
    from ktinject import optimize_and_load
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    d = save_tiny(family, tmp_path / family)
    model, _ = optimize_and_load(d, _overlay_rules(tmp_path, family))
    ops = [m for m in model.modules() if isinstance(m, se.StreamedExperts)]
    assert ops and model.lm_head.weight.device.type == "cuda"
    ref = build_tiny(family)
    for n, expect in ((16, "stream"), (4, "cpu")):
        ids = torch.randint(3, 500, (1, n), generator=torch.Generator().manual_seed(n))
        with torch.no_grad():
            got = model(ids).logits.float().cpu()
            want = ref(ids).logits
        assert all(op.last_path == expect for op in ops), family
        assert rel_err(got, want) < 2e-2, (family, expect)   # on the CPU: <= 6e-3 (stream), 3e-3 (cpu)
    assert all(op.calls == {"cpu": 1, "stream": 1} for op in ops)
    assert se.staging_for(model.lm_head.weight.device).dev[0].is_cuda



@pytest.mark.gpu
@pytest.mark.parametrize("family", ["deepseek_v2", "qwen3_moe"])
def test_gpu_overlay_generate_graph_decode_between_stream_prefills(family, tmp_path):
    """generate() with the overlay (threshold 8): the prompt streams the experts, decode replays a
    CUDA graph through the CPU path, and a second generation streams again after the graph
    exists; the tokens equal eager decoding's."""
    from ktinject import optimize_and_load
    from ktinject.generate import generate
    model, tok = optimize_and_load(save_tiny(family, tmp_path / family), _overlay_rules(tmp_path, family))
    ops = [m for m in model.modules() if isinstance(m, se.StreamedExperts)]
    prompt = list(range(5, 45))
    runs = []
    for graph in ("auto", "off", "auto"):
        before = [dict(op.calls) for op in ops]
        # reuse_prefix=False: the whole prompt again, so it streams (a kept prefix would leave one token)
        r = generate(model, tok, prompt, max_new_tokens=12, cuda_graph=graph, reuse_prefix=False)
        assert all(op.calls["stream"] > b["stream"] for op, b in zip(ops, before)), graph
        runs.append(r)
    assert runs[0].decode_mode == runs[2].decode_mode == "cuda-graph", runs[0].decode_mode
    assert runs[0].token_ids == runs[1].token_ids == runs[2].token_ids


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_overlay_as_shipped(family, tmp_path):
    """The shipped overlay (bfloat16, min_tokens 256): a 300-token prompt takes the stream path in
    every MoE layer; bounded like the hybrid packs, by transformers' own bfloat16 error."""
    from ktinject import optimize_and_load
    from ktinject.testing import bf16_error_bound
    model, _ = optimize_and_load(save_tiny(family, tmp_path / family), PACK[family] + "-gpu-prefill")
    ops = [m for m in model.modules() if isinstance(m, se.StreamedExperts)]
    assert ops and all(op.options.min_tokens == 256 for op in ops)
    ids = torch.randint(3, 500, (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model(ids).logits
    assert all(op.last_path == "stream" for op in ops)
    rel, bf16_rel = bf16_error_bound(family, ids, got)
    assert rel < max(3 * bf16_rel, 1e-2), (rel, bf16_rel)

def test_only_file_mapped_pages_are_registered(tmp_path):
    """Registration locks whole pages: heap tensors share theirs with other allocations (whose
    later CUDA copies would then fail), so only tensors inside a file mapping are registered."""
    import numpy as np
    heap = torch.zeros(100_000, dtype=torch.uint8)
    reg = se.HostRegistry(FakeHostApi(), page=4096)
    assert reg.cover(heap) is None and not reg.disabled and not reg.tensors
    path = tmp_path / "w.bin"
    path.write_bytes(bytes(range(256)) * 1024)
    import warnings
    with warnings.catch_warnings():              # torch warns that the read-only map is not writable
        warnings.simplefilter("ignore", UserWarning)
        mapped = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="r")[1000:200_000])
    assert reg.cover(mapped) == [] and len(reg.tensors) == 1


def test_bench_layer_runs_on_cpu():
    rows = se.bench_layer((8,), experts=4, hidden=256, inter=256, top_k=2, layers=1, threads=2, device="cpu",
                          reps=1)
    assert len(rows) == 1 and rows[0]["tokens"] == 8 and rows[0]["stream_ms"] > 0 and rows[0]["cpu_ms"] > 0


def test_grouped_mm_failure_falls_back_or_raises(monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("grouped GEMM not supported on this device")
    monkeypatch.setattr(torch, "_grouped_mm", broken)
    monkeypatch.setattr(se, "_GROUPED_MM_BROKEN", False)
    a, w = torch.randn(5, 32).bfloat16(), torch.randn(2, 16, 32).bfloat16()
    want = torch.cat((a[:2] @ w[0].t(), a[2:] @ w[1].t()))
    with pytest.raises(ModelError, match="backend: loop"):
        se._grouped_gemm(a, w, [2, 3], "grouped_mm")
    assert torch.equal(se._grouped_gemm(a, w, [2, 3], "auto"), want)     # falls back to the loop, once
    assert se._GROUPED_MM_BROKEN


# ---------------------------------------------------------------- uploads: planning, registration, gathering

class FakeHostApi:
    """Stands in for the CUDA driver: records registrations, fails from the `fail_at`-th on."""

    def __init__(self, fail_at=None):
        self.live, self.log, self.fail_at = {}, [], fail_at

    def register(self, ptr, nbytes, device=None):
        if self.fail_at is not None and len(self.log) >= self.fail_at:
            return "operation not permitted (CUresult 800)"
        assert not any(p < ptr + nbytes and ptr < p + n for p, n in self.live.items()), "overlapping registration"
        self.live[ptr] = nbytes
        self.log.append((ptr, nbytes))

    def unregister(self, ptr):
        del self.live[ptr]


def _shared_mats(types, E, I, H, seed=0):
    """Like _ggml_mats, but the three matrices are views into one buffer at offsets that are not
    page-aligned, so neighbours share pages (as GGUF tensors do)."""
    mats, dense = _ggml_mats(types, E, I, H, seed)
    sizes = [m.data.numel() for m in mats]
    buf = torch.zeros(sum(sizes) + 3 * 96, dtype=torch.uint8)
    out, pos = [], 32
    for m, n in zip(mats, sizes):
        view = buf[pos:pos + n].view(m.data.shape)
        view.copy_(m.data)
        out.append(ExpertMatrix(m.ggml_type, view, m.n_experts, m.rows, m.cols, m.name))
        pos += n + 96
    return tuple(out), dense


def test_plan_chunks_and_split():
    counts = [3, 0, 2, 0, 0, 5, 1, 0, 0, 0, 4, 0]
    assert se._plan(counts, 4) == [[0, 2, 5, 6], [10]]
    assert se._plan(counts, 4, fill=1) == [[0, 1, 2], [5, 6], [10]] or se._plan(counts, 4, fill=1) == [[0, 1, 2, 5], [6, 10]]
    assert se._plan(counts, 12, fill=3) == [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]    # one copy per matrix
    assert se._plan(counts, 12, fill=2) == [[0, 1, 2, 3, 4, 5, 6, 10]]
    assert se._plan(counts, 1) == [[0], [2], [5], [6], [10]]
    # the first chunk (uploaded before the counts were known) holds idle experts too
    assert se._plan(counts, 4, first=4) == [[0, 1, 2, 3], [5, 6, 10]]
    assert se._plan([0, 0, 0], 2, first=2) == [[0, 1]]
    assert se._plan([0, 0, 0], 2) == []
    assert se._split(10, 50, [5, 20, 30, 50, 60]) == [(10, 20), (20, 30), (30, 50)]
    assert se._split(10, 50, []) == [(10, 50)]


def test_plan_fill_is_one_run_of_rows():
    """All experts with tokens (a long prompt): each matrix of a chunk is one copy."""
    m = ExpertMatrix(8, torch.zeros(16 * 4, 34, dtype=torch.uint8), 16, 4, 32)
    for chunk in se._plan([1] * 16, 6):
        assert len(se._segments(m, chunk)) == 1
    assert [len(c) for c in se._plan([1] * 16, 6)] == [6, 6, 4]


def test_host_registry_shares_pages_and_releases():
    api = FakeHostApi()
    reg = se.HostRegistry(api, page=4096, file_backed_only=False)
    buf = torch.zeros(5 * 4096, dtype=torch.uint8)
    base = buf.data_ptr()
    a, b, c = buf[100:6000], buf[6000:6001], buf[6001:15000]            # b lies inside a page a touches
    oa, ob, oc = set(), set(), set()
    cuts_a = reg.cover(a, oa)
    assert cuts_a == [] and len(api.live) == 1
    start, n = api.log[0]
    assert start % 4096 == 0 and start <= a.data_ptr() and start + n >= a.data_ptr() + a.numel()
    assert reg.cover(b, ob) == [] and len(api.live) == 1                 # already inside a's registration
    cuts_c = reg.cover(c, oc)
    assert len(api.live) == 2 and len(cuts_c) == 1                      # c's first page is a's
    cut = cuts_c[0]
    assert cut % 4096 == 0 and c.data_ptr() < cut < c.data_ptr() + c.numel()
    assert reg.cover(a, oa) is cuts_a and len(api.log) == 2             # cached, counted once per owner
    other = set()
    reg.cover(c, other)                                                 # a second owner of c
    assert reg.release(oa) == 0 and len(api.live) == 2                  # b and c still use a's pages
    assert reg.release(ob) == 0
    assert reg.release(oc) == 0 and len(api.live) == 2                  # `other` still holds c
    freed = reg.release(other)
    assert freed > 0 and not api.live and reg.bytes == 0 and not reg.tensors
    assert reg.cover(buf[0:10], set()) == [] and api.log[-1][0] == base // 4096 * 4096   # registered anew


def test_host_registry_failure_rolls_back_and_disables():
    api = FakeHostApi(fail_at=2)
    reg = se.HostRegistry(api, page=4096, file_backed_only=False)
    buf = torch.zeros(8 * 4096, dtype=torch.uint8)
    assert reg.cover(buf[0:4096 * 2 + 10], set()) == []                  # one registration
    assert reg.cover(buf[4096 * 3 + 5:4096 * 4], set()) == []            # a second
    # a tensor over the gap between both, and past the second: needs two new ones; the third fails
    assert reg.cover(buf[4096 * 2 + 100:4096 * 6], set(), what="blk.7.ffn_up_exps.weight") is None
    assert "blk.7.ffn_up_exps.weight" in reg.disabled and "CUresult 800" in reg.disabled
    assert len(api.live) == 2                                           # nothing of the failed tensor stays
    assert reg.cover(buf[4096 * 7:4096 * 8], set()) is None              # off from now on
    assert reg.cover(buf[0:4096 * 2 + 10], set()) == []                  # registered tensors still are


def _routing(T, E, k, seed=1, idle=(3,)):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, E, generator=g)
    scores[:, list(idle)] = -1.0
    return scores.topk(k, dim=1).indices, torch.rand(T, k, generator=g)


@pytest.mark.parametrize("types", [(QT.Q4_K, QT.Q4_K, QT.Q5_0), (QT.Q6_K, QT.Q6_K, QT.Q8_0)])
def test_upload_modes_give_the_same_bits(types, monkeypatch):
    """Registered (copies cut where registrations meet), threaded gathers in small pieces, mixed,
    with and without the early first chunk, one or several chunks: all give the plain result."""
    E, I, H, k = 8, 256, 256, 2
    mats, (G, U, D) = _shared_mats(types, E, I, H, seed=4)
    per_expert = sum(se._aligned(m.rows * m.data.shape[1]) for m in mats)
    monkeypatch.setattr(se, "_PIECE", 5000)                               # many gather pieces, uneven
    for T in (6, 48):                                                   # no early chunk / early chunk
        x = torch.randn(T, H)
        ids, w = _routing(T, E, k, seed=T)
        for chunk in (1 << 30, 3 * per_expert, 1):
            run = dict(device="cpu", chunk_bytes=chunk, backend="loop")
            want = se.stream_moe(x, ids, w, *mats, staging=se.Staging(CPU), gather_threads=1, **run)
            assert rel_err(want, ref_moe(x, ids, w, G, U, D)) < 2e-2
            for variant, kw in (("gathered", {"gather_threads": 3}),
                                ("direct", {"registry": se.HostRegistry(FakeHostApi(), page=4096, file_backed_only=False)}),
                                ("mixed", {"registry": se.HostRegistry(FakeHostApi(fail_at=2), page=4096, file_backed_only=False)})):
                st = {}
                got = se.stream_moe(x, ids, w, *mats, staging=se.Staging(CPU), stats=st, **kw, **run)
                assert torch.equal(got, want), (T, chunk, variant)
                assert st["mode"] == variant and st["chunks"] >= 1 and st["bytes"] > 0, st
            reg = kw["registry"]
            assert reg.disabled and "ffn_down" in reg.disabled             # gate, up registered; down failed
            (a, na), (b, nb) = list(reg.tensors)                 # gate, up: (ptr, bytes)
            shared = b // 4096 <= (a + na - 1) // 4096 and a // 4096 <= (b + nb - 1) // 4096   # a page in common
            assert [len(c) for c, _ in reg.tensors.values()] == [0, int(shared)]   # then its copy is cut there


def test_early_first_chunk_is_the_same_math(monkeypatch):
    """From T*k >= 4E the first chunk's experts (idle ones too) are uploaded before the counts."""
    E, I, H, k = 8, 256, 256, 2
    mats, _ = _ggml_mats((QT.Q8_0, QT.Q8_0, QT.Q8_0), E, I, H)
    x = torch.randn(40, H)
    ids, w = _routing(40, E, k, idle=(0, 3))                             # expert 0 idle: first chunk starts idle
    per_expert = sum(se._aligned(m.rows * m.data.shape[1]) for m in mats)
    for backend in ("grouped_mm", "loop"):
        early, late = {}, {}
        a = se.stream_moe(x, ids, w, *mats, device="cpu", chunk_bytes=4 * per_expert, backend=backend,
                          staging=se.Staging(CPU), stats=early)
        monkeypatch.setattr(se, "_PREFETCH_SLOTS", 1000)
        b = se.stream_moe(x, ids, w, *mats, device="cpu", chunk_bytes=4 * per_expert, backend=backend,
                          staging=se.Staging(CPU), stats=late)
        monkeypatch.undo()
        assert torch.equal(a, b), backend
        assert early["bytes"] == E * sum(m.rows * m.data.shape[1] for m in mats)   # idle 0 and 3 uploaded too
        assert late["chunks"] == early["chunks"] == 2


def test_registration_failure_warns_once_and_falls_back(caplog, monkeypatch):
    monkeypatch.setattr(se, "_WARNED", set())
    E, I, H, k = 4, 256, 256, 2
    mats, _ = _ggml_mats((QT.Q8_0, QT.Q8_0, QT.Q8_0), E, I, H)
    x = torch.randn(8, H)
    ids, w = _routing(8, E, k, idle=())
    want = se.stream_moe(x, ids, w, *mats, device="cpu", staging=se.Staging(CPU))
    reg = se.HostRegistry(FakeHostApi(fail_at=0), file_backed_only=False)
    with caplog.at_level("WARNING", logger=se.log.name):
        for _ in range(3):
            st = {}
            got = se.stream_moe(x, ids, w, *mats, device="cpu", staging=se.Staging(CPU), registry=reg, stats=st)
            assert torch.equal(got, want) and st["mode"] == "gathered"
    warnings = [r for r in caplog.records if "registration" in r.getMessage()]
    assert len(warnings) == 1 and "CUresult 800" in warnings[0].getMessage()


def test_no_registration_without_cuda():
    """CPU callers (and register_host=False) never touch the process-wide registry."""
    E, I, H, k = 4, 256, 256, 2
    mats, _ = _ggml_mats((QT.Q8_0, QT.Q8_0, QT.Q8_0), E, I, H)
    before = dict(se._HOST.tensors)
    st = {}
    se.stream_moe(torch.randn(8, H), *_routing(8, E, k, idle=()), *mats, device="cpu", stats=st)
    assert st["mode"] == "gathered" and se._HOST.tensors == before


def test_operator_reports_the_upload_mode(stream_on_cpu):
    model, orig, op = _op("qwen3_moe", min_tokens=8, gather_threads=2)
    assert op.last_upload_mode is None and "gathered into pinned buffers" in repr(op)
    x = torch.randn(24, model.config.hidden_size)
    ids, w = random_routing(24, op.num_experts, model.config.num_experts_per_tok, seed=2)
    op(x, ids, w)
    assert op.last_upload_mode == "gathered" and op.last_upload["bytes"] > 0
    assert "last upload gathered" in repr(op) and op.release_host_memory() == 0
    _, _, off = _op("qwen3_moe", register_host=False)
    assert "gathered into pinned buffers" in repr(off)


@pytest.mark.parametrize("qt", [QT.Q4_K, QT.Q6_K, QT.Q5_0, QT.Q4_0, QT.Q8_0, QT.Q5_K, QT.BF16, QT.F16, QT.F32])
def test_dequantizers_equal_quants(qt):
    """The stream path's torch dequantizers give the bits of quants' (then rounded to bf16), into
    a strided destination (one expert's half of a fused gate_up buffer)."""
    from ktinject.weights.quants import quant_class
    cls = quant_class(qt)
    rows = rand_rows(qt, 24, 512, seed=int(qt)).contiguous().view(torch.uint8)
    blocks = rows.reshape(3, -1, cls.type_size)                          # [experts, blocks, type_size]
    want = cls.dequantize_blocks(blocks.reshape(-1, cls.type_size)).to(torch.bfloat16)
    fused = torch.full((3, 2 * blocks.shape[1], cls.block_size), 7.0, dtype=torch.bfloat16)
    se.dequantize_blocks_into(fused[:, blocks.shape[1]:], blocks, int(qt))
    got = fused[:, blocks.shape[1]:].reshape(-1, cls.block_size)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), qt.name
    assert (fused[:, :blocks.shape[1]] == 7).all()                       # the other half untouched


def test_bench_layer_reports_upload():
    rows = se.bench_layer((8, 40), experts=4, hidden=256, inter=256, top_k=2, layers=2, threads=2, device="cpu",
                          reps=1)
    assert [r["tokens"] for r in rows] == [8, 40]
    for r in rows:
        assert r["mode"] == "gathered" and r["upload_ms"] > 0 and r["upload_gb_s"] > 0 and r["chunks"] >= 1
    assert "register_s" in rows[0]
    assert se.bench_layer((8,), experts=4, hidden=256, inter=256, top_k=2, layers=1, device="cpu", reps=1,
                          cpu=False, mapped=False)[0]["cpu_ms"] is None


# ---------------------------------------------------------------- registered uploads on CUDA

def _mapped_mats(types, E, I, H, tmp_path, seed=0):
    """_ggml_mats whose rows are memory-mapped read-only from one file, 32-byte aligned one after
    the other (as a GGUF file's tensors are: neighbours share pages)."""
    import warnings

    import numpy as np
    mats, dense = _ggml_mats(types, E, I, H, seed)
    path, offsets, pos = tmp_path / "experts.bin", [], 96
    with open(path, "wb") as f:
        for m in mats:
            f.write(b"\0" * (pos - f.tell()))
            offsets.append(pos)
            f.write(m.data.numpy().tobytes())
            pos = -(-f.tell() // 32) * 32 + 32
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                                 # "the NumPy array is not writable"
        arr = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="r"))
    out = tuple(ExpertMatrix(m.ggml_type, arr[o:o + m.data.numel()].view(m.data.shape), m.n_experts, m.rows,
                             m.cols, m.name) for m, o in zip(mats, offsets))
    return out, dense


@pytest.mark.gpu
@pytest.mark.parametrize("types", [(QT.Q4_K, QT.Q4_K, QT.Q5_0), (QT.Q6_K, QT.Q6_K, QT.Q4_K)])
def test_gpu_registered_upload_equals_gathered_and_the_cpu_path(types, tmp_path):
    """Weights memory-mapped read-only: registered with CUDA (read-only flag) and copied from by
    DMA; equal to the gathered upload on the same GPU, close to the CPU stream path and the
    reference; several chunks, with and without the early first chunk; unregistered on release."""
    E, I, H, k = 16, 512, 256, 4
    mats, (G, U, D) = _mapped_mats(types, E, I, H, tmp_path, seed=5)
    reg, owner = se.HostRegistry(), set()
    per_expert = sum(se._aligned(m.rows * m.data.shape[1]) for m in mats)
    for T in (9, 200):
        x = torch.randn(T, H)
        ids, w = _routing(T, E, k, seed=T, idle=(2, 9))
        ref = ref_moe(x, ids, w, G, U, D)
        on_cpu = se.stream_moe(x, ids, w, *mats, device="cpu", staging=se.Staging(CPU))
        for chunk in (1 << 30, 5 * per_expert, 1):
            st_r, st_g = {}, {}
            a = se.stream_moe(x.cuda(), ids.cuda(), w.cuda(), *mats, chunk_bytes=chunk, registry=reg, owner=owner,
                              stats=st_r)
            b = se.stream_moe(x.cuda(), ids.cuda(), w.cuda(), *mats, chunk_bytes=chunk, register_host=False,
                              gather_threads=3, stats=st_g)
            torch.cuda.synchronize()
            assert st_r["mode"] == "direct", reg.disabled
            assert st_g["mode"] == "gathered" and st_r["bytes"] == st_g["bytes"]
            # the same weights and math: only index_add_'s atomic float adds may order differently
            assert rel_err(a.cpu(), b.cpu()) < 1e-6, (T, chunk)
            assert rel_err(a.cpu(), on_cpu) < 1e-2 and rel_err(a.cpu(), ref) < 2e-2, (T, chunk)
    assert reg.bytes >= sum(m.data.numel() for m in mats) and all(s % se._PAGE == 0 for s in reg.regions)
    assert sum(len(c) for c, _ in reg.tensors.values()) >= 1            # some copies were cut between registrations
    registered = reg.bytes
    assert reg.release(owner) == registered and reg.bytes == 0 and not reg.regions


@pytest.mark.gpu
def test_gpu_registration_failure_falls_back_to_gathering(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(se, "_WARNED", set())
    E, I, H, k = 8, 256, 256, 2
    mats, (G, U, D) = _mapped_mats((QT.Q4_K, QT.Q4_K, QT.Q5_0), E, I, H, tmp_path, seed=6)
    x = torch.randn(64, H)
    ids, w = _routing(64, E, k, idle=())
    reg = se.HostRegistry(FakeHostApi(fail_at=0), file_backed_only=False)
    st = {}
    with caplog.at_level("WARNING", logger=se.log.name):
        out = se.stream_moe(x.cuda(), ids.cuda(), w.cuda(), *mats, registry=reg, stats=st)
    assert st["mode"] == "gathered" and any("registration" in r.getMessage() for r in caplog.records)
    assert rel_err(out.cpu(), ref_moe(x, ids, w, G, U, D)) < 2e-2
    assert se.staging_for(torch.device("cuda")).host[0].is_pinned()


@pytest.mark.gpu
def test_gpu_real_registry_copies_are_asynchronous(tmp_path):
    """A registered upload of ~64 MB is queued without the CPU waiting for it (it would if torch
    treated the mapping as pageable memory)."""
    import time
    E, I, H = 64, 1408, 2048
    from ktinject.native.synth import random_rows
    rows = random_rows(QT.Q4_K, E * I, H, seed=0)
    m = ExpertMatrix(int(QT.Q4_K), se._mapped_rows(rows, str(tmp_path), "g"), E, I, H, "g")
    torch.cuda.init()
    reg, owner = se.HostRegistry(), set()
    cuts = reg.cover(m.data, owner, 0)
    assert cuts is not None, reg.disabled
    st = se.Staging(torch.device("cuda", 0))
    s = st.acquire(m.data.numel(), host=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for a, b in se._split(m.data.data_ptr(), m.data.data_ptr() + m.data.numel(), cuts):
        st.direct(s, a - m.data.data_ptr(), m.data.view(-1)[a - m.data.data_ptr():b - m.data.data_ptr()])
    queued = time.perf_counter() - t0
    st.record(s)
    st.done[s].synchronize()
    total = time.perf_counter() - t0
    assert torch.equal(st.dev[s][:m.data.numel()].cpu(), m.data.view(-1))
    assert queued < 0.5 * total, (queued, total)
    print(f"registered copy: {m.data.numel() / total / 1e9:.1f} GB/s")
    reg.release(owner)
