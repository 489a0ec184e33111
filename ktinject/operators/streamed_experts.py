"""`streamed_experts`: `cpu_experts`, plus GPU prefill by streaming a layer's experts for long prompts.

Replaces the transformers 5 fused `*Experts` modules (the classes `cpu_experts` replaces) with the
same call, `forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`, and the
same `submit` / `sync` pair, so the `moe` operator still overlaps it with the shared experts.

It owns a `CpuExperts` (child `cpu_experts`) that builds and loads the weights: GGUF blocks stay
memory-mapped in RAM, zero copy; dense weights are converted once to `quant`. A call takes one
of two paths:

* **CPU** (T < `min_tokens`, or inputs not on CUDA): the native CPU kernel, exactly `cpu_experts`.
* **stream** (T >= `min_tokens` and the hidden states on a CUDA device): the raw GGML rows of the
  experts that received tokens cross to that GPU in chunks of about `chunk_mb` MB. Each chunk is
  gathered into a pinned host buffer, copied non-blocking on a copy stream into a device buffer,
  dequantized there to bf16 by `ktinject.weights.quants` (torch ops), and the chunk's experts run
  as grouped GEMMs (`torch._grouped_mm`, or one matmul pair per expert). Two pinned + device
  buffer pairs per GPU are shared by every layer and alternate, so while the GPU dequantizes and
  multiplies chunk i, the copy engine moves chunk i+1 and the CPU gathers chunk i+2.

The stream path's math is `stream_moe()`, which also runs with `device="cpu"` (plain buffers, no
copies), so CI checks it without a GPU.

Memory: the plan counts the CPU bytes of `cpu_experts`. The stream path adds, per GPU, two host
pinned buffers and two device buffers of about `chunk_mb` MB each, plus the bf16 weights of one
chunk and the routed activations; `staging_bytes()` gives the numbers (the plan cannot place them:
the operator lives on the CPU and does not know its layer's GPU at plan time).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelError, NativeError
from .base import BuildContext, Operator
from .cpu_experts import CpuExperts, CpuExpertsOptions
from .registry import register

log = logging.getLogger(__name__)

BACKENDS = ("auto", "grouped_mm", "loop")
_ALIGN = 256                       # byte alignment of each matrix's region in a staging buffer
_DEQUANT_VALUES = 1 << 26          # values dequantized per torch call (bounds the f32 temporaries)


@dataclass(frozen=True)
class StreamedExpertsOptions:
    min_tokens: int = 256                # tokens per call from which a CUDA caller gets the stream path
    chunk_mb: int = 128                  # raw expert bytes per staged upload (MB; at least one expert)
    backend: str = "auto"                # GPU expert math: auto | grouped_mm | loop
    # passed to the owned cpu_experts:
    threads: int = 0
    quant: str = "bf16"
    isa: Optional[str] = None
    convert_unsupported: bool = False

    def __post_init__(self):
        if self.min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {self.min_tokens}")
        if self.chunk_mb < 1:
            raise ValueError(f"chunk_mb must be >= 1, got {self.chunk_mb}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r} is not one of {', '.join(BACKENDS)}")
        self.cpu_options()                                                     # validates the rest

    def cpu_options(self) -> CpuExpertsOptions:
        return CpuExpertsOptions(self.threads, self.quant, self.isa, self.convert_unsupported)


# ---------------------------------------------------------------- staging buffers (per device)

def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class Staging:
    """Two (host, device) uint8 buffer pairs for one device, shared by every layer on it.

    CUDA: host buffers are pinned; `done[s]` is recorded on the copy stream after the last
    host-to-device copy out of host[s] (host[s] may be rewritten once it completed), `free[s]`
    on the compute stream after the last kernel reading dev[s] (the copy stream waits for it
    before writing dev[s] again). CPU (tests): one plain buffer per slot serves as both.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.host: list[Optional[torch.Tensor]] = [None, None]
        self.dev: list[Optional[torch.Tensor]] = [None, None]
        self.slot = 1
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device=device)
            self.done = [torch.cuda.Event(), torch.cuda.Event()]
            self.free = [torch.cuda.Event(), torch.cuda.Event()]

    def acquire(self, nbytes: int) -> int:
        """The next slot, with buffers of at least `nbytes`, whose host buffer may be written now."""
        self.slot ^= 1
        s = self.slot
        if self.cuda:
            self.done[s].synchronize()                      # the previous copy out of host[s] finished
        if self.host[s] is None or self.host[s].numel() < nbytes:
            if self.cuda:
                torch.cuda.synchronize(self.device)         # nothing may still read the buffers we drop
                self.host[s] = self.dev[s] = None
                self.host[s] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                self.dev[s] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            else:
                self.host[s] = torch.empty(nbytes, dtype=torch.uint8)
                self.dev[s] = self.host[s]
        return s

    def upload(self, s: int, start: int, end: int) -> None:
        """Queue the copy of host[s][start:end] to dev[s][start:end] on the copy stream."""
        if not self.cuda or end <= start:
            return
        with torch.cuda.stream(self.copy_stream):
            if start == 0:
                self.copy_stream.wait_event(self.free[s])   # kernels still reading dev[s] come first
            self.dev[s][start:end].copy_(self.host[s][start:end], non_blocking=True)

    def uploaded(self, s: int) -> None:
        """All copies of this slot are queued: compute on the current stream waits for them."""
        if self.cuda:
            self.done[s].record(self.copy_stream)
            torch.cuda.current_stream(self.device).wait_event(self.done[s])

    def consumed(self, s: int) -> None:
        """Every kernel reading dev[s] is queued on the current stream."""
        if self.cuda:
            self.free[s].record(torch.cuda.current_stream(self.device))

    def nbytes(self) -> dict[str, int]:
        host = sum(t.numel() for t in self.host if t is not None)
        return {"host_pinned" if self.cuda else "host": host, "device": host if self.cuda else 0}


_STAGING: dict[str, Staging] = {}


def staging_for(device: torch.device) -> Staging:
    """The shared staging buffers of `device` (created on first use)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = str(device)
    if key not in _STAGING:
        _STAGING[key] = Staging(device)
    return _STAGING[key]


# ---------------------------------------------------------------- the stream path's math

def _segments(m, experts: list[int]) -> list[tuple[int, int]]:
    """(first row, rows) runs in `m.data` [N, row_bytes] holding `experts`' rows, merged where contiguous."""
    runs: list[list[int]] = []
    for e in experts:
        r0 = e * m.expert_stride + m.offset
        if runs and runs[-1][0] + runs[-1][1] == r0:
            runs[-1][1] += m.rows
        else:
            runs.append([r0, m.rows])
    return [(a, b) for a, b in runs]


def _chunks(experts: list[int], per_expert: int, budget: int) -> list[list[int]]:
    """Split sorted expert ids into groups of at most `budget` bytes (at least one expert each)."""
    out: list[list[int]] = []
    for e in experts:
        if out and (len(out[-1]) + 1) * per_expert <= budget:
            out[-1].append(e)
        else:
            out.append([e])
    return out


def _dequantize_into(dst: torch.Tensor, raw: torch.Tensor, m) -> None:
    """raw uint8 [n*rows, row_bytes] (on dst's device) -> dst [n, rows, cols] (any float dtype)."""
    from ..weights.quants import quant_class
    cls = quant_class(m.ggml_type, tensor=m.name)
    n, rows, cols = dst.shape
    step = max(1, _DEQUANT_VALUES // (rows * cols))
    for j0 in range(0, n, step):
        j1 = min(n, j0 + step)
        blocks = raw[j0 * rows:j1 * rows].reshape(-1, cls.type_size)        # [blocks, type_size]
        dst[j0:j1] = cls.dequantize_blocks(blocks).reshape(j1 - j0, rows, cols)


_GROUPED_MM_BROKEN = False


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, counts: list[int], backend: str) -> torch.Tensor:
    """a [S, K] rows sorted by group, w [G, N, K] (one matrix per group), counts[g] rows each -> [S, N]."""
    global _GROUPED_MM_BROKEN
    if backend == "grouped_mm" or (backend == "auto" and not _GROUPED_MM_BROKEN and hasattr(torch, "_grouped_mm")):
        offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(a.device, non_blocking=True)
        try:
            return torch._grouped_mm(a, w.transpose(1, 2), offs=offs)     # w^T: [G, K, N], column-major
        except (RuntimeError, NotImplementedError, AttributeError) as exc:
            if backend == "grouped_mm":
                raise ModelError(f"streamed_experts: torch._grouped_mm failed on {a.device} ({exc}); "
                                 f"use kwargs backend: loop") from None
            _GROUPED_MM_BROKEN = True
            log.warning("streamed_experts: torch._grouped_mm unavailable on %s (%s); using a per-expert loop",
                        a.device, exc)
    out = a.new_empty(a.shape[0], w.shape[1])
    start = 0
    for g, n in enumerate(counts):
        if n:
            torch.matmul(a[start:start + n], w[g].t(), out=out[start:start + n])
        start += n
    return out


def stream_moe(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, gate, up, down, *,
               device: Any = None, chunk_bytes: int = 128 << 20, backend: str = "auto",
               staging: Optional[Staging] = None, name: str = "streamed_experts") -> torch.Tensor:
    """The stream path: out[t] = sum_j wts[t,j] * down_e(SiLU(gate_e x_t) * up_e x_t), e = ids[t,j].

    x: [T, H], ids: [T, k] int, wts: [T, k]; gate, up: ExpertMatrix [E, I, H], down: [E, H, I]
    (GGML rows on the CPU). Only experts that received tokens are copied to `device` (default:
    x's) and dequantized to bf16 there; the result is float32 [T, H] on `device`.
    """
    device = torch.device(device) if device is not None else x.device
    E, I, H = gate.n_experts, gate.rows, gate.cols
    T, k = ids.shape
    x = x.to(device, torch.bfloat16)                                          # [T, H]
    flat = ids.to(device).reshape(-1).long()                                  # [S = T*k] expert of each slot
    w = wts.to(device).reshape(-1).float()                                    # [S]
    out = torch.zeros(T, H, dtype=torch.float32, device=device)               # [T, H]
    if flat.numel() == 0:
        return out
    # one host sync: tokens per expert (+ one bin for ids out of range) and the id range
    stats = torch.cat((torch.bincount(flat.clamp(0, E), minlength=E + 1),
                       torch.stack(torch.aminmax(flat)))).cpu().tolist()
    lo, hi = stats[E + 1], stats[E + 2]
    if lo < 0 or hi >= E:
        raise ModelError(f"{name}: top_k_index holds expert id {lo if lo < 0 else hi}, outside [0, {E})")
    counts = stats[:E]                                                        # [E] tokens per expert
    active = [e for e in range(E) if counts[e]]
    order = torch.argsort(flat, stable=True)                                  # [S] slots grouped by expert
    tok = order // k                                                          # [S] token of each sorted slot
    xs = x[tok]                                                               # [S, H] routed activations
    ws = w[order]                                                             # [S] routing weight per slot
    staging = staging or staging_for(device)
    mats = (gate, up, down)
    per_expert = sum(_aligned(m.rows * m.data.shape[1]) for m in mats)
    chunks = _chunks(active, per_expert, chunk_bytes)
    capacity = max(len(c) for c in chunks) * per_expert                      # the same for every chunk
    start = 0                                                                 # first sorted slot of a chunk
    for chunk in chunks:
        n = len(chunk)
        s = staging.acquire(capacity)
        host, dev = staging.host[s], staging.dev[s]
        # gather each matrix's rows of the chunk into the host buffer, queue its copy at once
        regions, pos = [], 0
        for m in mats:
            rb = m.data.shape[1]
            size = n * m.rows * rb
            dst = host[pos:pos + size].view(n * m.rows, rb)                   # [n*rows, row_bytes]
            r = 0
            for r0, nr in _segments(m, chunk):
                dst[r:r + nr].copy_(m.data[r0:r0 + nr])
                r += nr
            staging.upload(s, pos, pos + size)
            regions.append(dev[pos:pos + size].view(n * m.rows, rb))
            pos += _aligned(size)
        staging.uploaded(s)
        # dequantize on `device`: gate and up side by side, as the transformers weights are
        w_gu = torch.empty(n, 2 * I, H, dtype=torch.bfloat16, device=device)   # [n, 2I, H]
        w_dn = torch.empty(n, H, I, dtype=torch.bfloat16, device=device)       # [n, H, I]
        _dequantize_into(w_gu[:, :I], regions[0], gate)
        _dequantize_into(w_gu[:, I:], regions[1], up)
        _dequantize_into(w_dn, regions[2], down)
        staging.consumed(s)
        # grouped expert math over the chunk's sorted slots
        c = [counts[e] for e in chunk]
        end = start + sum(c)
        gu = _grouped_gemm(xs[start:end], w_gu, c, backend)                    # [Sc, 2I]
        h = F.silu(gu[:, :I]) * gu[:, I:]                                      # [Sc, I]
        y = _grouped_gemm(h, w_dn, c, backend)                                 # [Sc, H]
        out.index_add_(0, tok[start:end], y.float() * ws[start:end, None])     # weighted sum over top-k
        start = end
    return out


# ---------------------------------------------------------------- measurement (for choosing min_tokens)

def bench_layer(tokens=(64, 128, 256, 512, 1024, 2048, 4096), *, experts: int = 64, hidden: int = 2048,
                inter: int = 1408, top_k: int = 6, qtype: str = "Q4_K", layers: int = 4, threads: int = 0,
                chunk_mb: int = 128, backend: str = "auto", device: str = "cuda", reps: int = 3) -> list[dict]:
    """Milliseconds per routed-experts layer, stream path vs the native CPU kernel, per token count.

    Defaults: DeepSeek-V2-Lite's shapes; gate/up in `qtype`, down in `qtype` too when `inter` is a
    multiple of its block, else Q5_0 (what llama.cpp writes for V2-Lite). `layers` weight sets
    are cycled so neither the L3 cache nor a warm buffer flatters either path; uniform random
    routing (so at these sizes almost every expert is active, as in a real long prompt).
    Returns rows {tokens, stream_ms, cpu_ms, speedup, upload_gb_s}.
    """
    import time

    from gguf import GGMLQuantizationType as QT

    from ..native import ExpertMatrix, MoEKernel
    from ..native.synth import random_rows
    dev = torch.device(device)
    qt = QT[qtype.upper()]
    block = 256 if qt.name.endswith("_K") else 32
    dqt = qt if inter % block == 0 else QT.Q5_0
    E, H, I = experts, hidden, inter
    sets = []
    for layer in range(layers):
        g = ExpertMatrix(int(qt), random_rows(qt, E * I, H, seed=3 * layer), E, I, H, f"bench.{layer}.gate")
        u = ExpertMatrix(int(qt), random_rows(qt, E * I, H, seed=3 * layer + 1), E, I, H, f"bench.{layer}.up")
        d = ExpertMatrix(int(dqt), random_rows(dqt, E * H, I, seed=3 * layer + 2), E, H, I, f"bench.{layer}.down")
        sets.append((g, u, d, MoEKernel(g, u, d, threads=threads)))
    layer_bytes = sum(m.data.numel() for m in sets[0][:3])

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    rows = []
    for T in tokens:
        gen = torch.Generator().manual_seed(T)
        x = torch.randn(T, H, generator=gen)                                   # [T, H]
        ids = torch.rand(T, E, generator=gen).topk(top_k, dim=1).indices       # [T, k]
        w = torch.rand(T, top_k, generator=gen)                                # [T, k]
        xd, idsd, wd = x.to(dev, torch.bfloat16), ids.to(dev), w.to(dev)
        times = {"stream": [], "cpu": []}
        for rep in range(reps + 1):                                            # rep 0 warms up
            sync()
            t0 = time.perf_counter()
            for g, u, d, _ in sets:
                stream_moe(xd, idsd, wd, g, u, d, device=dev, chunk_bytes=chunk_mb << 20, backend=backend)
            sync()
            t1 = time.perf_counter()
            for *_, kernel in sets:
                kernel.forward(x, ids, w)
            t2 = time.perf_counter()
            if rep:
                times["stream"].append((t1 - t0) / layers)
                times["cpu"].append((t2 - t1) / layers)
        s, c = min(times["stream"]), min(times["cpu"])
        rows.append({"tokens": T, "stream_ms": round(s * 1e3, 3), "cpu_ms": round(c * 1e3, 3),
                     "speedup": round(c / s, 2), "upload_gb_s": round(layer_bytes / s / 1e9, 1)})
    return rows


# ---------------------------------------------------------------- the operator

@register("streamed_experts")
class StreamedExperts(Operator):
    Options = StreamedExpertsOptions
    replaces = CpuExperts.replaces
    device_types = ("cpu",)
    summary = "cpu_experts, plus GPU prefill from min_tokens on: the layer's GGML experts streamed to the GPU"
    supports_cuda_graph = False          # host syncs (routing counts) and the CPU kernel
    # device types of the caller's hidden states that may take the stream path (tests add "cpu")
    stream_device_types: tuple[str, ...] = ("cuda",)

    def __init__(self, cpu: CpuExperts, options: StreamedExpertsOptions, name: str = ""):
        super().__init__()
        self.cpu_experts = cpu
        self.options, self.name = options, name
        self.num_experts, self.hidden, self.inter = cpu.num_experts, cpu.hidden, cpu.inter
        self._pending = None
        self.calls = {"cpu": 0, "stream": 0}      # calls per path (bench and tests)
        self.last_path: Optional[str] = None

    @classmethod
    def build(cls, original: nn.Module, ctx: BuildContext) -> nn.Module:
        opts = ctx.options or StreamedExpertsOptions()
        sub = BuildContext(ctx.name, ctx.device, ctx.prefill_device, ctx.generate_device, ctx.dtype, ctx.config,
                           opts.cpu_options())
        return cls(CpuExperts.build(original, sub), opts, ctx.name)

    @classmethod
    def planned_bytes(cls, original: nn.Module, ctx: BuildContext) -> dict[str, int]:
        opts = ctx.options or StreamedExpertsOptions()
        sub = BuildContext(ctx.name, ctx.device, ctx.prefill_device, ctx.generate_device, ctx.dtype, ctx.config,
                           opts.cpu_options())
        return CpuExperts.planned_bytes(original, sub)

    @classmethod
    def staging_bytes(cls, original: nn.Module, options: Optional[StreamedExpertsOptions] = None) -> dict[str, int]:
        """Upper bounds of the stream path's extra memory per GPU (shared by all layers on it), for
        weights stored as `options.quant` (GGUF files: use their real bits per weight instead).

        `host_pinned` and `device_staging`: two buffers each of one chunk of raw rows; `device_bf16`:
        one chunk's dequantized weights (the f32 dequantization temporaries and the routed
        activations come on top and depend on the prompt)."""
        from .cpu_experts import CONVERT_BITS
        opts = options or StreamedExpertsOptions()
        e, two_i, h = (int(s) for s in original.gate_up_proj.shape)
        values = 3 * (two_i // 2) * h                                           # per expert
        raw = int(values * CONVERT_BITS[opts.quant] / 8) + 3 * _ALIGN
        per_chunk = max(1, min(e, (opts.chunk_mb << 20) // raw))
        return {"host_pinned": 2 * per_chunk * raw, "device_staging": 2 * per_chunk * raw,
                "device_bf16": per_chunk * values * 2}

    def load_weights(self, prefix: str, source: Mapping[str, Any]) -> set[str]:
        return self.cpu_experts.load_weights(prefix, source)

    # ---------------------------------------------------------------- compute

    def path(self, hidden_states: torch.Tensor) -> str:
        """`"stream"` or `"cpu"` for a call with these hidden states [T, H]."""
        if hidden_states.shape[0] >= self.options.min_tokens and \
                hidden_states.device.type in self.stream_device_types:
            return "stream"
        return "cpu"

    def _stream(self, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        kernel = self.cpu_experts.kernel
        if kernel is None:
            raise NativeError(f"{self.name or 'streamed_experts'}: weights are not loaded")
        return stream_moe(hidden_states.detach(), top_k_index.detach(), top_k_weights.detach(),
                          kernel.gate, kernel.up, kernel.down, device=hidden_states.device,
                          chunk_bytes=self.options.chunk_mb << 20, backend=self.options.backend,
                          name=self.name or "streamed_experts")

    def submit(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> None:
        """Start the routed experts: the stream path queues its GPU work, the CPU path starts the pool."""
        if self._pending is not None:
            raise NativeError(f"{self.name or 'streamed_experts'}: submit() called twice without sync()")
        path = self.path(hidden_states)
        if path == "stream":
            out = self._stream(hidden_states, top_k_index, top_k_weights)
            self._pending = ("stream", out.to(hidden_states.dtype))
        else:
            self.cpu_experts.submit(hidden_states, top_k_index, top_k_weights)
            self._pending = ("cpu", None)
        self.calls[path] += 1
        self.last_path = path

    def sync(self) -> torch.Tensor:
        """The submitted call's result [T, H] on the caller's device and dtype."""
        if self._pending is None:
            raise NativeError(f"{self.name or 'streamed_experts'}: sync() without submit()")
        path, out = self._pending
        self._pending = None
        return out if path == "stream" else self.cpu_experts.sync()

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        self.submit(hidden_states, top_k_index, top_k_weights)
        return self.sync()

    def extra_repr(self) -> str:
        o = self.options
        return (f"op=streamed_experts, experts={self.num_experts}, hidden={self.hidden}, inter={self.inter}, "
                f"stream to the caller's GPU from {o.min_tokens} tokens (chunks of {o.chunk_mb} MB, "
                f"backend={o.backend}), else native CPU")
