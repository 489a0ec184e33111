"""`ktinject bench MODEL --rules R`: end-to-end prefill and decode speed against this machine's
decode roofline for this model.

Decode roofline, per token: every routed expert a token picks is read from RAM once
(`top_k` experts per MoE layer, bytes as stored: GGUF blocks or converted), with any other
weights kept on the CPU (the embedding aside: one row), over the CPU read bandwidth the native
probe measures in the same run with the experts' thread pool (a pass just before each decode run,
their mean: a shared host's bandwidth moves between runs); plus every
byte the GPU holds for the layers (attention, shared experts, dense layers, norms, routers,
`lm_head`) read once, over the GPU's measured copy bandwidth. The two parts add up: the MoE
block waits for the CPU. KV-cache reads are left out (small next to the weights at these
prompt lengths), so the roofline is optimistic and the fraction honest.
"""
from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

import torch

from .errors import KtInjectError

log = logging.getLogger(__name__)
GIB = 1 << 30


@dataclass
class ModelBench:
    model: str
    rules: str
    prefill: dict = field(default_factory=dict)       # prompt tokens -> tokens/s
    prefill_chunk: int = 0                            # tokens per prefill chunk (generate's chunk_size)
    decode_tokens_per_s: float = 0.0                  # steady state (median of the runs): after the eager first
                                                      # step and the capture
    decode_tokens_per_s_incl_warmup: float = 0.0      # the first run's whole decode, those one-time costs included
    decode_runs: list = field(default_factory=list)   # each run's steady tokens/s (spread: machine noise)
    decode_mode: str = ""
    decode_handover: str = ""                         # how decode handed its MoE layers to the CPU
                                                      # (native/hostfn.py: bell+zerocopy, bell, hostfn; "": Python)
    cpu_expert_bytes_per_token: int = 0
    cpu_dense_bytes_per_token: int = 0
    gpu_bytes_per_token: int = 0
    cpu_bandwidth_gbps: float = 0.0                   # the mean of cpu_bandwidth_runs
    cpu_bandwidth_runs: list = field(default_factory=list)   # the probe's pass just before each decode run
    gpu_bandwidth_gbps: float = 0.0
    roofline_tokens_per_s: float = 0.0
    fraction: float = 0.0
    threads: int = 0
    notes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _expert_modules(model):
    return [m for m in model.modules() if getattr(m, "kernel", None) is not None
            and hasattr(m.kernel, "weight_bytes_per_expert")]


def cpu_expert_bytes_per_token(model) -> tuple[int, int]:
    """(bytes of routed-expert weights one decode token reads on the CPU, pool threads)."""
    k = int(getattr(model.config, "num_experts_per_tok", 0) or 0)
    mods = _expert_modules(model)
    threads = mods[0].kernel.pool.threads if mods else 0
    return sum(k * int(m.kernel.weight_bytes_per_expert) for m in mods), threads


def dense_bytes_per_token(model, device_type: str) -> int:
    """Bytes of ordinary parameters and buffers on `device_type` (read once per decode token); the
    input embedding is left out (a token reads one row of it)."""
    emb = model.get_input_embeddings()
    skip = {id(t) for t in [*emb.parameters(), *emb.buffers()]}   # (cpu_embedding keeps its table in buffers)
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type == device_type and id(t) not in skip and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def cpu_probe(threads: int, gib: float):
    """A `native.Probe` on the experts' pool (one buffer, a pass beside each decode run), or None
    without the native library."""
    from . import native
    if not native.available():
        return None
    return native.Probe(native.default_pool(threads), int(gib * GIB))


def gpu_copy_bandwidth(gib: float = 2.0) -> float:
    """GB/s of a device-to-device copy (bytes read + written), median of 10 after a warm-up."""
    if not torch.cuda.is_available():
        return 0.0
    n = int(gib * GIB) // 2
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * n / sorted(times)[len(times) // 2] / 1e9


def warm_experts(model) -> float:
    """Read every CPU expert byte once (memory-mapped GGUF pages are faulted in); seconds taken."""
    t0 = time.perf_counter()
    for m in _expert_modules(model):
        for mat in (m.kernel.gate, m.kernel.up, m.kernel.down):
            flat = mat.data.view(-1)
            for start in range(0, flat.numel(), 1 << 28):
                int(flat[start:start + (1 << 28)][::4096].sum())
    return time.perf_counter() - t0


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, max(4, vocab - 1), (n,), generator=g).tolist()


def run_bench(model_path: str, rules, *, prompt_lengths: Sequence[int] = (512, 2048, 8192),
              decode_tokens: int = 64, decode_prompt: int = 128, warm: bool = True, repeat: int = 3,
              probe_gib: float = 4.0, chunk_size: Optional[int] = None, progress=None) -> ModelBench:
    """Load `model_path` with `rules`, time prefill at each prompt length (once each: they are
    long) and decode `repeat` times (different prompts; the median steady rate is reported with
    every run's, since CPU experts on a shared machine swing between identical runs), then
    measure the machine for the roofline (`probe_gib`: the CPU bandwidth probe's buffer).
    `chunk_size`: tokens per prefill chunk (None: what `generate` picks for the model)."""
    if repeat < 1:
        raise KtInjectError(f"repeat must be >= 1, got {repeat}")
    if chunk_size is not None and chunk_size < 1:
        raise KtInjectError(f"chunk size must be >= 1, got {chunk_size}")
    from .generate import generate, prefill_chunk_size
    from .load import optimize_and_load
    say = progress or (lambda msg: None)
    say(f"loading {model_path}")
    t0 = time.perf_counter()
    model, tok = optimize_and_load(model_path, rules)
    res = ModelBench(str(model_path), str(rules))
    res.notes.append(f"load {time.perf_counter() - t0:.1f} s")
    if warm:
        say("faulting in the CPU expert weights")
        res.notes.append(f"warm {warm_experts(model):.1f} s")
    res.prefill_chunk = chunk_size or prefill_chunk_size(model)
    vocab = int(model.config.vocab_size)
    max_len = max([*prompt_lengths, decode_prompt]) + decode_tokens + 8
    say("warm-up generation")
    # as long as the shortest measured prompt, so the first measurement pays no one-time set-up
    # of the prefill path (a GPU prefill's staging buffers, kernels' first launches)
    generate(model, tok, _prompt(vocab, max(64, min(prompt_lengths, default=64)), 0), max_new_tokens=4,
             max_cache_len=max_len, chunk_size=res.prefill_chunk)
    for n in prompt_lengths:
        say(f"prefill {n} tokens")
        r = generate(model, tok, _prompt(vocab, n, n), max_new_tokens=1, max_cache_len=max_len,
                     reuse_prefix=False, chunk_size=res.prefill_chunk)
        res.prefill[str(n)] = round(r.prefill_tokens_per_s, 1)
    # the cache sized for this generation, as generate() sizes it (a decode step's attention spans
    # the whole static cache, so the longest prefill's cache would slow it); the first run makes
    # and captures it, later runs replay the kept graph. With CPU experts, each run has the CPU
    # bandwidth probe's pass just before it: a shared host's bandwidth moves from one minute to the
    # next, so the roofline is measured beside what it judges.
    res.cpu_expert_bytes_per_token, res.threads = cpu_expert_bytes_per_token(model)
    res.cpu_dense_bytes_per_token = dense_bytes_per_token(model, "cpu")
    cpu_bytes = res.cpu_expert_bytes_per_token + res.cpu_dense_bytes_per_token
    probe = cpu_probe(res.threads or 0, probe_gib) if cpu_bytes else None
    if cpu_bytes and probe is None:
        raise KtInjectError("the native library is missing: cannot measure the CPU read bandwidth")
    for i in range(repeat):
        if probe is not None:
            say(f"CPU read bandwidth ({i + 1}/{repeat})")
            res.cpu_bandwidth_runs.append(round(probe.gbps(reps=3), 1))
        say(f"decode {decode_tokens} tokens ({i + 1}/{repeat})")
        r = generate(model, tok, _prompt(vocab, decode_prompt, 1 + i), max_new_tokens=decode_tokens,
                     reuse_prefix=False)
        steady = r.steady_decode_tokens_per_s
        res.decode_runs.append(round(r.decode_tokens_per_s if math.isnan(steady) else steady, 2))   # nan: < 3 tokens
        if i == 0:
            res.decode_tokens_per_s_incl_warmup = round(r.decode_tokens_per_s, 2)
            res.decode_mode = str(getattr(r, "decode_mode", ""))
            from .native.hostfn import handover_of
            res.decode_handover = handover_of(model)
    res.decode_tokens_per_s = round(statistics.median(res.decode_runs), 2)
    del probe
    say("measuring the machine")
    res.gpu_bytes_per_token = dense_bytes_per_token(model, "cuda")
    res.cpu_bandwidth_gbps = round(statistics.fmean(res.cpu_bandwidth_runs), 1) if cpu_bytes else 0.0
    res.gpu_bandwidth_gbps = round(gpu_copy_bandwidth(), 1) if res.gpu_bytes_per_token else 0.0
    seconds = 0.0
    if cpu_bytes:
        seconds += cpu_bytes / (res.cpu_bandwidth_gbps * 1e9)
    if res.gpu_bytes_per_token:
        seconds += res.gpu_bytes_per_token / (res.gpu_bandwidth_gbps * 1e9)
    if seconds:
        res.roofline_tokens_per_s = round(1.0 / seconds, 1)
        res.fraction = round(res.decode_tokens_per_s / res.roofline_tokens_per_s, 3)
    return res
