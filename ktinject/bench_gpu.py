"""GPU micro-benchmarks: `python -m ktinject.bench_gpu [--out DIR] [--only int4,mla,gen] [--sweep]`.

* int4: batch 1/4/16 GEMV on real projection shapes, bf16 `F.linear` vs torch's
  `aten._weight_int4pack_mm` vs `linear_int4`'s decode GEMV as the operator runs it (and the older
  plain-layout GEMV of `gpu_experts`), each timed inside one CUDA graph that cycles through enough
  weight copies to exceed the L2 cache (median of replays).
* mla: one DeepSeek attention layer at a 32k-token context: the unmodified transformers module
  (its DynamicCache) against `mla_attention` (eager and CUDA graph), decode step time, cache bytes.
* fp8: bf16 `F.linear` vs `linear_fp8`'s paths: torch._scaled_mm (row-wise scales) and the fp8 GEMV.
* gen: a DeepSeek-V2-Lite-shaped model cut to a few layers (random weights): the engine's
  prefill / decode tokens per second, unmodified vs mla_attention + linear_int4 + graph decode.

Writes `bench_gpu.json` and `bench_gpu.md` to --out.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger("ktinject.bench_gpu")
L2_BYTES = 256 << 20        # cycle at least this many weight bytes per graph replay


def read_bandwidth(gib: float = 2.0, reps: int = 10) -> float:
    """HBM read bandwidth in bytes/s: a Triton kernel that sums int32 words with 16-byte loads over `gib` GiB
    (far past the L2), median of `reps` graph replays. The roofline of every weight-streaming GEMV."""
    import triton
    import triton.language as tl

    @triton.jit
    def _stream_sum(w_ptr, out_ptr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + tl.program_id(0), tl.sum(tl.load(w_ptr + offs, eviction_policy="evict_first"), axis=0))

    block = 8192
    n = int(gib * 2**30) // 4 // block * block
    buf = torch.ones(n, dtype=torch.int32, device="cuda")
    sums = torch.empty(n // block, dtype=torch.int32, device="cuda")
    t = graph_time([lambda: _stream_sum[(n // block,)](buf, sums, BLOCK=block, num_warps=8)], reps)
    return n * 4 / t


def hardware_line() -> str:
    import triton
    p = torch.cuda.get_device_properties(0)
    return (f"{p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs; torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}, triton {triton.__version__}")


def graph_time(fns, reps: int = 30) -> float:
    """Median seconds per call of `fns` (callables run back to back inside one CUDA graph)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / len(fns))
    return statistics.median(times)


def eager_time(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# ---- int4 ---------------------------------------------------------------------------------------
INT4_SHAPES = [  # (label, N, K, group)
    ("lm_head 102400x2048", 102400, 2048, 128),
    ("lm_head 102400x2048, Q4_K repack", 102400, 2048, 32),
    ("dense gate+up 21888x2048", 21888, 2048, 128),
    ("dense down 2048x10944", 2048, 10944, 64),
    ("gate 10944x2048", 10944, 2048, 128),
    ("4096x4096", 4096, 4096, 128),
    ("q_proj 3072x2048", 3072, 2048, 128),
    ("o_proj 2048x2048", 2048, 2048, 128),
    ("o_proj 2048x2048, Q4_K repack", 2048, 2048, 32),     # GGUF Q4_0 / Q4_K blocks: groups of 32
]
SWEEP = {  # rows -> extra launch configs tried with --sweep (block_n, block_k, warps, target programs, dot)
    1: [(64, 512, 8, 528, False), (16, 512, 4, 1056, False), (32, 1024, 4, 528, False)],
    4: [(32, 512, 4, 528, False)],
    16: [(128, 256, 8, 528, True)],
}


def torch_int4(iw, group):
    """torch's tinygemm int4 kernel on the same quantized weight, or None with the reason."""
    from .operators.kernels.int4_pack import unpack_nibbles
    q = unpack_nibbles(iw.qweight)                                           # [N, K] uint8
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).contiguous(), 8)
    except Exception as exc:
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    s = iw.scales.to(torch.bfloat16)
    z = (iw.mins.float() + 8 * iw.scales.float()).to(torch.bfloat16)          # w = (q - 8) * s + z
    sz = torch.stack([s, z], -1).transpose(0, 1).contiguous()                 # [NG, N, 2]
    return (lambda x: torch.ops.aten._weight_int4pack_mm(x, packed, group, sz)), None


def int4_in_order(x, tws, wds, cfg, mode: str) -> dict:
    """One row's two more views of `linear_int4`'s GEMV (us a call, CUDA-graph replays as the table's): where the
    K split runs, `ours_nopdl_us`, back to back with no programmatic dependent launch (`KTINJECT_INT4_PDL=0`) and
    `pdl_mode`, the mode the table's `ours_us` ran with; and in a layer's order, each call (ours and bf16's) after
    a torch kernel that writes its x as a norm would, that kernel's own time taken off: `ours_after_us`,
    `bf16_after_us`; and after ktinject's own `rms_norm` kernel, as a decoder layer runs its projections after its
    norm, that kernel's time (`norm_us`) taken off: `ours_norm_us`, `bf16_norm_us`."""
    import os
    from unittest import mock
    from .operators.kernels import int4_triton as T
    h = x.clone()
    xs = [torch.empty_like(x) for _ in range(max(len(tws), len(wds)))]
    t_pre = graph_time([lambda x_=x_: torch.mul(h, 1.0, out=x_) for x_ in xs])
    out = {"pre_us": t_pre * 1e6}
    out["bf16_after_us"] = (graph_time([lambda w_=w_, x_=x_: (torch.mul(h, 1.0, out=x_), F.linear(x_, w_))
                                        for w_, x_ in zip(wds, xs)]) - t_pre) * 1e6
    out["ours_after_us"] = (graph_time([lambda t_=t_, x_=x_: (torch.mul(h, 1.0, out=x_),
                                                              T.int4_gemv_tiled(x_, t_, None, cfg))
                                        for t_, x_ in zip(tws, xs)]) - t_pre) * 1e6
    # in the model's order: after the layer's norm as ktinject runs it (`rms_norm`; it lets a K split after it start
    # early where the GPU has programmatic dependent launch, unless KTINJECT_INT4_PDL is "sum" or "off":
    # kernels/pdl.py), that kernel's time taken off
    from .operators.norm import rms_norm_triton
    nw = torch.ones(x.shape[-1], device=x.device, dtype=x.dtype)
    t_norm = graph_time([lambda: rms_norm_triton(h, nw, 1e-6) for _ in xs])
    out["norm_us"] = t_norm * 1e6
    out["bf16_norm_us"] = (graph_time([lambda w_=w_: F.linear(rms_norm_triton(h, nw, 1e-6), w_) for w_ in wds])
                           - t_norm) * 1e6
    out["ours_norm_us"] = (graph_time([lambda t_=t_: T.int4_gemv_tiled(rms_norm_triton(h, nw, 1e-6), t_, None, cfg)
                                       for t_ in tws]) - t_norm) * 1e6
    if mode == "ksplit":
        from .operators.kernels import int4_cuda
        out["pdl_mode"] = int4_cuda.pdl_mode(int4_cuda.device_index(x.device))
        with mock.patch.dict(os.environ, {"KTINJECT_INT4_PDL": "off"}):
            out["ours_nopdl_us"] = graph_time([lambda t_=t_: T.int4_gemv_tiled(x, t_, None, cfg) for t_ in tws]) * 1e6
    return out


def bench_int4(sweep: bool) -> list[dict]:
    """Per shape and rows: bf16 F.linear, tinygemm, `linear_int4`'s decode GEMV as the operator runs it (the
    tiled layout and the config `int4_triton.tiled_config` picks: TUNED, the CUDA class or the Triton class,
    with the same fallback), and the older plain-layout GEMV that `gpu_experts` runs (`--sweep`: more configs
    of it). The operator's own launch-config sweep is scripts/int4_sweep.py."""
    from .operators.kernels import int4_triton as T
    from .operators.kernels.int4_pack import dequantize, quantize, tile
    from .operators.linear_int4 import Int4Options, _wants_tinygemm
    rows = []
    for label, n, k, group in INT4_SHAPES:
        torch.manual_seed(0)
        w = torch.randn(n, k, device="cuda") * 0.02
        iw = quantize(w, group)
        wd = dequantize(iw, torch.bfloat16)                                   # [N, K] the same weight in bf16
        del w
        int4_bytes = n * k // 2 + 4 * iw.scales.numel()
        copies = max(1, min(64, math.ceil(L2_BYTES / int4_bytes)))
        tint4, why = torch_int4(iw, group)
        g = group if group > 0 else k
        tws = [tile(iw, T.tiled_pack(n, k, g)) for _ in range(copies)]
        for m in (1, 4, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ wd.float().T
            row = {"shape": label, "N": n, "K": k, "group": group, "batch": m, "bf16_MB": n * k * 2 / 1e6}
            wds = [wd] + [wd.clone() for _ in range(min(copies, max(1, math.ceil(L2_BYTES / (n * k * 2)))) - 1)]
            row["bf16_us"] = graph_time([lambda w_=w_: F.linear(x, w_) for w_ in wds]) * 1e6
            cfg = T.tiled_config(m, n, k, g)
            mode = T.runnable_config(cfg, tws[0], m, n, k, x.device, x.dtype).mode
            try:
                y = T.int4_gemv_tiled(x, tws[0], None, cfg)                  # (compiles, before any capture)
                row["ours_rel_err"] = ((y.float() - ref).norm() / ref.norm()).item()
                row["ours_us"] = graph_time([lambda t_=t_: T.int4_gemv_tiled(x, t_, None, cfg) for t_ in tws]) * 1e6
                row["ours_mode"] = mode
                if m == 1:
                    row.update(int4_in_order(x, tws, wds, cfg, mode))
                if _wants_tinygemm(Int4Options(), n, k, g, m, x.device):
                    row["operator_runs"] = "tinygemm"               # linear_int4's backend auto (TINYGEMM_FASTER)
            except Exception as exc:                   # noqa: BLE001 - reported in the row, the bench goes on
                log.warning("linear_int4's GEMV failed on %s, %d rows: %s", label, m, exc)
                row["ours"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
                rows.append(row)
                continue
            iws = [iw] + [type(iw)(iw.qweight.clone(), iw.scales.clone(), iw.mins.clone(), group)
                          for _ in range(copies - 1)]
            configs = [T.default_config(m, n, k)]
            if sweep:
                configs += [T.GemvConfig(*c) for c in SWEEP.get(m, [])]
            plain = []
            for pc in configs:
                try:
                    plain.append(graph_time([lambda i=i, c=pc: T.int4_gemv(x, i.qweight, i.scales, i.mins, group, None, c)
                                             for i in iws]) * 1e6)
                except Exception as exc:
                    log.warning("plain-layout config %s failed on %s: %s", pc, label, exc)
            row["plain_us"] = min(plain) if plain else None
            if tint4 is not None:
                try:
                    y = tint4(x)
                    row["torch_int4_rel_err"] = ((y.float() - ref).norm() / ref.norm()).item()
                    packs = [torch_int4(i, group)[0] for i in iws]
                    row["torch_int4_us"] = graph_time([lambda f=f: f(x) for f in packs]) * 1e6
                except Exception as exc:
                    row["torch_int4"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
            else:
                row["torch_int4"] = why
            row["speedup_vs_bf16"] = row["bf16_us"] / row["ours_us"]
            if row.get("torch_int4_us"):
                row["speedup_vs_torch_int4"] = row["torch_int4_us"] / row["ours_us"]
            log.info("%s", row)
            print(json.dumps(row), flush=True)
            rows.append(row)
            del wds, iws
        del tws, wd
        torch.cuda.empty_cache()
    return rows


# ---- fp8 ---------------------------------------------------------------------------------------
FP8_SHAPES = [("V3 dense gate 18432x7168", 18432, 7168), ("V3 q_b_proj 24576x1536", 24576, 1536),
              ("V3 o_proj 7168x16384", 7168, 16384), ("V3 q_a_proj 1536x7168", 1536, 7168),
              ("4096x4096", 4096, 4096), ("V3 kv_a_proj 576x7168", 576, 7168)]


@torch.no_grad()
def bench_fp8() -> list[dict]:
    """bf16 F.linear vs linear_fp8's two CUDA paths on the same weight: scaled_mm (every row count) and the
    fp8 GEMV (backend gemv, 1-16 rows; its launch, K split included, by the shape: fp8_triton.launch_config).
    Each path's output against the bf16 linear in fp32."""
    from .operators.linear_fp8 import Fp8Linear, Fp8Options
    rows = []
    for label, n, k in FP8_SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        copies = max(1, min(32, math.ceil(L2_BYTES / (n * k))))
        variants = {"scaled_mm": Fp8Options(backend="scaled_mm"), "gemv": Fp8Options(backend="gemv")}
        mods = {b: [Fp8Linear.from_weight(w, options=o, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
                for b, o in variants.items()}
        wds = [w] + [w.clone() for _ in range(max(1, math.ceil(L2_BYTES / (2 * n * k))) - 1)]
        for m in (1, 4, 16, 512):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x.float(), w.float())
            row = {"shape": label, "batch": m, "bf16_us": graph_time([lambda w_=w_: F.linear(x, w_) for w_ in wds]) * 1e6}
            for b, ms in mods.items():
                if ms[0].path(m) != variants[b].backend:      # (the GEMV runs up to 16 rows only)
                    continue
                row[f"{b}_rel_err"] = ((ms[0](x).float() - ref).norm() / ref.norm()).item()
                row[f"{b}_us"] = graph_time([lambda f=f: f(x) for f in ms]) * 1e6
                row[f"{b}_x_bf16"] = row["bf16_us"] / row[f"{b}_us"]
            print(json.dumps(row), flush=True)
            rows.append(row)
        del mods, wds, w
        torch.cuda.empty_cache()
    return rows


# ---- MLA ----------------------------------------------------------------------------------------
YARN_V2 = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
           "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 10000.0}
MLA_SHAPES = {
    "DeepSeek-V2-Lite": ("deepseek_v2", dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
                                             q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64,
                                             qk_nope_head_dim=128, v_head_dim=128)),
    "DeepSeek-V3": ("deepseek_v3", dict(hidden_size=7168, num_attention_heads=128, num_key_value_heads=128,
                                        q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                                        qk_nope_head_dim=128, v_head_dim=128)),
}


def _mla_parts(family, dims):
    from transformers import AutoConfig
    mod = __import__(f"transformers.models.{family}.modeling_{family}", fromlist=["x"])
    prefix = "DeepseekV2" if family == "deepseek_v2" else "DeepseekV3"
    config = AutoConfig.for_model(family, vocab_size=1024, num_hidden_layers=1, max_position_embeddings=163840,
                                  rope_parameters=YARN_V2, **dims)
    config._attn_implementation = "sdpa"
    return config, getattr(mod, f"{prefix}Attention"), getattr(mod, f"{prefix}RotaryEmbedding")


@torch.no_grad()
def bench_mla(ctx_len: int = 32768, steps: int = 16) -> list[dict]:
    from transformers import DynamicCache
    from .operators import BuildContext
    from .operators.mla_attention import MLAAttention, MLAOptions
    rows = []
    dev, dt = torch.device("cuda"), torch.bfloat16
    for label, (family, dims) in MLA_SHAPES.items():
        torch.manual_seed(0)
        config, Attn, Rope = _mla_parts(family, dims)
        attn = Attn(config, layer_idx=0).to(dev, dt).eval()
        for p in attn.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
        rope = Rope(config).to(dev)
        ck = "cache" if "cache" in __import__("inspect").signature(attn.forward).parameters else "past_key_values"
        h = torch.randn(1, ctx_len, config.hidden_size, device=dev, dtype=dt)
        pos = torch.arange(ctx_len, device=dev).unsqueeze(0)
        cache = DynamicCache(config=config)
        attn(h, attention_mask=None, position_embeddings=rope(h, pos), **{ck: cache})
        x = torch.randn(1, 1, config.hidden_size, device=dev, dtype=dt)
        # ours, built from the same module (shares its weights)
        ctx = BuildContext("layer.self_attn", dev, dev, dev, dt, config, MLAOptions())
        ours = MLAAttention.build(attn, ctx)
        ours.load_weights("", dict(attn.state_dict()))
        ours.reserve(1, ctx_len + 2 * steps + 64)
        for s in range(0, ctx_len, 4096):       # chunked prefill through our expanded path, same inputs
            p = pos[:, s:s + 4096]
            ours(h[:, s:s + 4096], position_embeddings=rope(h, p), position_ids=p)
        del h
        # correctness: the first decode step of both on the same 32k context
        step_pos = torch.tensor([[ctx_len]], device=dev)
        pe = rope(x, step_pos)
        theirs_once = attn(x, attention_mask=None, position_embeddings=pe, **{ck: cache})[0]
        hf_cache_bytes = sum(t.numel() * t.element_size() for layer in cache.layers
                             for t in (layer.keys, layer.values))
        ours_once = ours(x, position_embeddings=pe, position_ids=step_pos)[0]
        rel_err = ((ours_once.float() - theirs_once.float()).norm() / theirs_once.float().norm()).item()
        n = [ctx_len + 1]

        def theirs_step():
            p = torch.tensor([[n[0]]], device=dev)
            attn(x, attention_mask=None, position_embeddings=rope(x, p), **{ck: cache})
            n[0] += 1
        t_theirs = eager_time(theirs_step, steps)
        p_static = torch.tensor([[ctx_len + 1]], device=dev)
        pe_static = rope(x, p_static)

        def ours_step():
            ours(x, position_embeddings=pe_static, position_ids=p_static)
        t_ours = eager_time(ours_step, steps)
        t_graph = graph_time([ours_step], reps=steps)
        heads = config.num_attention_heads
        row = {"model": label, "context": ctx_len, "heads": heads,
               "transformers_step_ms": t_theirs * 1e3, "ours_eager_ms": t_ours * 1e3, "ours_graph_ms": t_graph * 1e3,
               "speedup_eager": t_theirs / t_ours, "speedup_graph": t_theirs / t_graph,
               "ours_cache_bytes_per_token": (config.kv_lora_rank + config.qk_rope_head_dim) * 2,
               "transformers_cache_bytes_per_token": hf_cache_bytes / (cache.get_seq_length()),
               "expanded_kv_bytes_per_token": heads * (config.qk_nope_head_dim + config.qk_rope_head_dim
                                                        + config.v_head_dim) * 2,
               "decode_rel_err_vs_transformers": rel_err}
        row["cache_ratio_vs_expanded"] = row["expanded_kv_bytes_per_token"] / row["ours_cache_bytes_per_token"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


# ---- end to end ---------------------------------------------------------------------------------
@torch.no_grad()
def bench_generate(layers: int = 4, prompt_tokens: int = 512, new_tokens: int = 64) -> list[dict]:
    from transformers import AutoConfig, AutoModelForCausalLM
    from .generate import generate, release_generation
    from .operators.linear_int4 import Int4Linear, Int4Options
    from .operators.mla_attention import replace_all
    from .tokenizer import byte_tokenizer
    config = AutoConfig.for_model("deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
                                  moe_intermediate_size=1408, num_hidden_layers=layers, num_attention_heads=16,
                                  num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2,
                                  num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None,
                                  qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_group=1, topk_group=1,
                                  topk_method="greedy", max_position_embeddings=163840, rope_parameters=YARN_V2,
                                  tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("batched_mm")
    tok = byte_tokenizer(config.vocab_size)
    prompt = ("memory bandwidth " * 64)[:prompt_tokens]
    rows = []

    def run(label, **kw):
        generate(model, tok, prompt[:32], max_new_tokens=4, **kw)          # warm-up (compiles kernels)
        # the measured call prefills its whole prompt and captures its own graph, as a first call does
        release_generation(model)
        r = generate(model, tok, prompt, max_new_tokens=new_tokens, reuse_prefix=False, **kw)
        row = {"setup": label, "layers": layers, "prompt_tokens": r.prompt_tokens, "new_tokens": len(r.token_ids),
               "prefill_tok_s": r.prefill_tokens_per_s, "decode_tok_s": r.decode_tokens_per_s,
               "decode_mode": r.decode_mode, "tokens": r.token_ids[:16]}
        print(json.dumps(row), flush=True)
        rows.append(row)
        return r
    base = run("transformers modules, eager decode", cuda_graph="off")
    run("transformers modules, graph decode", cuda_graph="auto")
    replace_all(model, device="cuda", dtype=torch.bfloat16)
    mla = run("mla_attention, graph decode", cuda_graph="auto")
    for name, mod in list(model.named_modules()):
        if isinstance(mod, torch.nn.Linear) and "experts" not in name:
            parent, _, child = name.rpartition(".")
            new = Int4Linear.from_weight(mod.weight, mod.bias, Int4Options(group_size=64 if mod.in_features % 128
                                                                             else 128), "cuda", torch.bfloat16)
            setattr(model.get_submodule(parent), child, new)
    for m in model.modules():
        if hasattr(m, "_absorbed"):
            m._absorbed = None
    run("mla_attention + linear_int4, graph decode", cuda_graph="auto")
    rows[2]["same_tokens_as_transformers"] = mla.token_ids == base.token_ids
    from .operators import BuildContext
    from .operators.gpu_experts import GpuExperts, GpuExpertsOptions
    dev = torch.device("cuda")
    for i in range(config.first_k_dense_replace, layers):
        name = f"model.layers.{i}.mlp.experts"
        orig = model.get_submodule(name)
        op = GpuExperts.build(orig, BuildContext(name, dev, dev, dev, torch.bfloat16, config,
                                                 GpuExpertsOptions(quant="int4")))
        op.load_weights(name + ".", {name + ".gate_up_proj": orig.gate_up_proj, name + ".down_proj": orig.down_proj})
        model.model.layers[i].mlp.experts = op
        del orig
    torch.cuda.empty_cache()
    run("mla_attention + linear_int4 + gpu_experts(int4), graph decode", cuda_graph="auto")
    return rows


def int4_target(bf16_mb: float, batch: int) -> float | None:
    """Issue #5's one-row target for `linear_int4` against bf16 on the H200: 3x on matrices of 64 MiB of bf16 and
    more, 2x on 8-32 MiB ones (2048 x 2048 to 4096 x 4096); None elsewhere (more rows, or sizes between). `bf16_mb`
    in 1e6 bytes, as the bench's rows give it."""
    if batch != 1:
        return None
    mib = bf16_mb * 1e6 / 2 ** 20
    return 3.0 if mib >= 64 else 2.0 if 8 <= mib <= 32 else None


def int4_targets(rows: list[dict]) -> list[str]:
    """Lines saying, per one-row shape with a target, what the operator reaches (its kernel, or tinygemm where its
    backend auto runs that: the faster of the two) against bf16 and against torch's int4 kernel. The issue's groups
    only: 64, 128 and per channel (not the GGUF repack's 32)."""
    out = []
    for r in rows:
        want = int4_target(r["bf16_MB"], r["batch"])
        if want is None or "ours_us" not in r or 0 < r.get("group", 128) < 64:
            continue
        tg = r.get("torch_int4_us") if r.get("operator_runs") else None
        # back to back: with no programmatic dependent launch (as launched, a K split may load its weights under the
        # tail of the same GEMV before it, which a layer does not offer); in a layer's order: as launched
        own = r.get("ours_nopdl_us", r["ours_us"])
        us = min(own, tg) if tg else own
        x = r["bf16_us"] / us
        vs = f", {r['torch_int4_us'] / us:.2f}x torch int4" if r.get("torch_int4_us") else ""
        line = f"- {r['shape']}: back to back {x:.2f}x bf16{vs}"
        if r.get("ours_after_us"):
            xo = r["bf16_after_us"] / (min(r["ours_after_us"], tg) if tg else r["ours_after_us"])
            line += f"; after a torch kernel {xo:.2f}x"
            x = min(x, xo)
        if r.get("ours_norm_us"):   # (shown, not judged: the judgement stays the lower of the two above)
            on = min(r["ours_norm_us"], tg) if tg else r["ours_norm_us"]
            line += f"; after our rms_norm {r['bf16_norm_us'] / on:.2f}x"
        out.append(f"{line} (target {want:.0f}x: {'met' if x >= want else 'short'}; the lower of back to back and "
                   f"after a torch kernel)")
    return out


def to_markdown(res: dict) -> str:
    out = [f"Hardware: {res['hardware']}", ""]
    if res.get("int4"):
        out += ["| shape | bf16 MB | batch | bf16 us | torch int4 us | ours us | mode | x bf16 | x torch int4 | "
                "plain layout us |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in res["int4"]:
            ti = f"{r['torch_int4_us']:.1f}" if r.get("torch_int4_us") else "rejects" if r.get("torch_int4") else "-"
            sp = f"{r['speedup_vs_torch_int4']:.2f}" if r.get("speedup_vs_torch_int4") else "-"
            pu = f"{r['plain_us']:.1f}" if r.get("plain_us") else "-"
            if "ours_us" not in r:
                out.append(f"| {r['shape']} | {r['bf16_MB']:.1f} | {r['batch']} | {r['bf16_us']:.1f} | - | failed: "
                           f"{r.get('ours', '?')} | - | - | - | - |")
                continue
            out.append(f"| {r['shape']} | {r['bf16_MB']:.1f} | {r['batch']} | {r['bf16_us']:.1f} | {ti} | "
                       f"{r['ours_us']:.1f} | {r['ours_mode']}{' (auto: tinygemm)' if r.get('operator_runs') else ''} | "
                       f"{r['speedup_vs_bf16']:.2f} | {sp} | {pu} |")
        out.append("")
        order = [r for r in res["int4"] if r.get("ours_after_us")]
        if order:
            out += ["One row, us: back to back as the operator launches (`pdl`: the K split's programmatic-dependent-"
                    "launch mode, `KTINJECT_INT4_PDL`) and with no programmatic dependent launch; and in a layer's "
                    "order, each call after a torch kernel that writes its x, and after ktinject's `rms_norm` kernel "
                    "(which lets a K split start early on sm_90+ unless `KTINJECT_INT4_PDL` is sum or off), that "
                    "kernel's time taken off.", "",
                    "| shape | bf16 | ours | pdl | x bf16 | ours, no PDL | bf16 after a kernel | ours after a "
                    "kernel | x bf16 | bf16 after rms_norm | ours after rms_norm | x bf16 |",
                    "|---|---|---|---|---|---|---|---|---|---|---|---|"]
            for r in order:
                plain = f"{r['ours_nopdl_us']:.2f}" if r.get("ours_nopdl_us") else "-"
                norm = (f"{r['bf16_norm_us']:.2f} | {r['ours_norm_us']:.2f} | {r['bf16_norm_us'] / r['ours_norm_us']:.2f}"
                        if r.get("ours_norm_us") else "- | - | -")
                out.append(f"| {r['shape']} | {r['bf16_us']:.2f} | {r['ours_us']:.2f} | {r.get('pdl_mode', '-')} | "
                           f"{r['bf16_us'] / r['ours_us']:.2f} | {plain} | {r['bf16_after_us']:.2f} | "
                           f"{r['ours_after_us']:.2f} | {r['bf16_after_us'] / r['ours_after_us']:.2f} | {norm} |")
            out.append("")
        targets = int4_targets(res["int4"])
        if targets:
            out += ["One row against issue #5's targets (set for the H200; the hardware line says which GPU this was):",
                    ""] + targets + [""]
    if res.get("mla"):
        out += ["| model | context | transformers ms | ours eager ms | ours graph ms | x eager | x graph | "
                "cache B/token (ours / transformers / expanded K,V) |", "|---|---|---|---|---|---|---|---|"]
        for r in res["mla"]:
            out.append(f"| {r['model']} | {r['context']} | {r['transformers_step_ms']:.3f} | {r['ours_eager_ms']:.3f} | "
                       f"{r['ours_graph_ms']:.3f} | {r['speedup_eager']:.1f} | {r['speedup_graph']:.1f} | "
                       f"{r['ours_cache_bytes_per_token']} / {r['transformers_cache_bytes_per_token']:.0f} / "
                       f"{r['expanded_kv_bytes_per_token']} |")
        out.append("")
    if res.get("fp8"):
        out += ["| shape | batch | bf16 us | scaled_mm us | x bf16 | rel err | gemv us | x bf16 | rel err |",
                "|---|---|---|---|---|---|---|---|---|"]

        def cells(r, b):
            return (f"{r[b + '_us']:.1f} | {r[b + '_x_bf16']:.2f} | {r[b + '_rel_err']:.4f}" if b + "_us" in r
                    else "- | - | -")
        for r in res["fp8"]:
            out.append(f"| {r['shape']} | {r['batch']} | {r['bf16_us']:.1f} | {cells(r, 'scaled_mm')} | {cells(r, 'gemv')} |")
        out.append("")
    if res.get("gen"):
        out += ["| setup | prompt | new | prefill tok/s | decode tok/s | decode mode |", "|---|---|---|---|---|---|"]
        for r in res["gen"]:
            out.append(f"| {r['setup']} | {r['prompt_tokens']} | {r['new_tokens']} | {r['prefill_tok_s']:.0f} | "
                       f"{r['decode_tok_s']:.1f} | {r['decode_mode']} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ktinject.bench_gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".", help="directory for bench_gpu.json / bench_gpu.md")
    ap.add_argument("--only", default="int4,mla,fp8,gen", help="comma list of int4, mla, fp8, gen")
    ap.add_argument("--sweep", action="store_true", help="try several int4 launch configs per shape, keep the best")
    ap.add_argument("--context", type=int, default=32768, help="MLA context length")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu needs a CUDA device")
    parts = set(args.only.split(","))
    res = {"hardware": hardware_line()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for key, fn in (("int4", lambda: bench_int4(args.sweep)), ("mla", lambda: bench_mla(args.context)),
                    ("fp8", bench_fp8), ("gen", bench_generate)):
        if key in parts:
            try:
                res[key] = fn()
            except Exception as exc:            # keep the other parts' numbers
                log.exception("%s bench failed", key)
                res[key + "_error"] = f"{type(exc).__name__}: {exc}"
            (out / "bench_gpu.json").write_text(json.dumps(res, indent=1))
    (out / "bench_gpu.md").write_text(to_markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
