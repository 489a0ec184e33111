"""The generation engine: prompt -> text, with a static KV cache, chunked prefill, CUDA-graph
decode, sampling, EOS and stop strings, and prefill / decode tokens per second.

* Cache: a transformers `StaticCache` sized up front (prompt + max_new_tokens, rounded up) for
  the model's own attention layers; modules with their own cache (`mla_attention`) get
  `reserve(batch, length)` before the first token. Positions are always passed explicitly.
* Prefill runs in chunks of `chunk_size` tokens (512, or more when an operator asks for it:
  `prefill_chunk_size`) under `ktinject.phase.use("prefill")`; only
  the last token's logits are computed (`logits_to_keep=1`).
* Decode runs under `use("generate")`, one token per step. With `cuda_graph="auto"` the step is
  captured once (after one eager step) in a CUDA graph and replayed per token when the model can
  be captured: every parameter and buffer on CUDA, except that of a CPU token embedding (then the
  step looks the token up on the CPU and feeds the graph `inputs_embeds`), and no module
  declaring `supports_cuda_graph = False`. Native CPU experts take part through stream-ordered
  host functions (`ktinject.native.hostfn`), so a hybrid model's step is one graph replay too.
  When capture is impossible or fails, decode runs eagerly and `GenerationResult.decode_mode`
  says why; nothing falls back silently.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch

from .boundaries import cuda_index
from .errors import GenerationError, ModelError

log = logging.getLogger(__name__)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float
    stop_reason: str = "length"          # "length" | "eos" | "stop"
    decode_mode: str = "eager"           # "cuda-graph" or "eager (<why>)"
    cache: str = "static"                # "static" | "dynamic"
    steady_seconds: float = 0.0          # decode steps from the third on (after the eager step and capture)
    steady_tokens: int = 0               # the tokens those steps produced
    cached_prompt_tokens: int = 0        # prompt tokens whose KV an earlier call left in the kept cache

    @property
    def steady_decode_tokens_per_s(self) -> float:
        """Decode speed once warm (the first decode step runs eagerly and the graph is captured
        before the second: both are one-time costs, as llama-bench's warm-up run is)."""
        return self.steady_tokens / self.steady_seconds if self.steady_seconds > 0 and self.steady_tokens \
            else float("nan")

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens computed (the cached prefix aside) per second of prefill."""
        n = self.prompt_tokens - self.cached_prompt_tokens
        return n / self.prefill_seconds if self.prefill_seconds > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        n = max(len(self.token_ids) - 1, 0)
        return n / self.decode_seconds if self.decode_seconds > 0 and n else float("nan")


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 0.0             # 0: greedy
    top_k: int = 0                       # 0: off
    top_p: float = 1.0                   # 1: off
    repetition_penalty: float = 1.0      # 1: off (CTRL-style: divide positive logits, multiply negative)
    seed: Optional[int] = None

    def __post_init__(self):
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1 or self.repetition_penalty <= 0:
            raise ValueError(f"invalid sampling options {self}")


def sample_next(logits: torch.Tensor, history: torch.Tensor, opts: SamplingOptions,
                generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """logits: [V] -> token id (0-d long tensor). history: long [n] of tokens seen so far."""
    logits = logits.float()
    if opts.repetition_penalty != 1.0 and history.numel():
        seen = history.unique()
        vals = logits[seen]
        logits = logits.clone()
        logits[seen] = torch.where(vals > 0, vals / opts.repetition_penalty, vals * opts.repetition_penalty)
    if opts.temperature <= 0:
        return logits.argmax()
    logits = logits / opts.temperature
    if opts.top_k:
        kth = torch.topk(logits, min(opts.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if opts.top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > opts.top_p       # keep the smallest set reaching top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)[0]


# ---- model plumbing -------------------------------------------------------------------------
def _input_device(model) -> torch.device:
    emb = model.get_input_embeddings()
    for p in [*emb.parameters(), *emb.buffers()]:   # (cpu_embedding holds its table in buffers)
        return p.device
    return torch.device("cpu")


def _cache_kwarg(model) -> str:
    """transformers >= 5.2x names the cache argument `cache`, earlier 5.x `past_key_values`."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _phase(name: str):
    try:
        from . import phase
    except ImportError:                   # the phase module is optional for the engine
        return contextlib.nullcontext()
    return phase.use(name)


def _host_embedding(model, device: torch.device) -> Optional[torch.nn.Module]:
    """The input embedding when it lives off `device` (the graph then takes inputs_embeds)."""
    emb = model.get_input_embeddings()
    devs = {p.device for p in [*emb.parameters(), *emb.buffers()]}
    return emb if devs and devs != {device} else None


DEFAULT_CHUNK = 512


def prefill_chunk_size(model) -> int:
    """The prefill chunk (tokens) when the caller gives none: 512, or more when an operator asks
    for it through `prefill_chunk_tokens` (streamed_experts: every chunk moves the experts again)."""
    hints = [getattr(m, "prefill_chunk_tokens", 0) for m in model.modules()]
    return max([DEFAULT_CHUNK] + [h for h in hints if isinstance(h, int)])


def _graph_blocker(model, device: torch.device) -> Optional[str]:
    """Why the decode step cannot be captured in a CUDA graph (None: it can)."""
    if device.type != "cuda":
        return "not on CUDA"
    for name, mod in model.named_modules():
        if getattr(mod, "supports_cuda_graph", True) is False:
            return f"{name or type(mod).__name__} does not support CUDA graphs"
    host_emb = _host_embedding(model, device)
    skip = {id(t) for t in host_emb.parameters()} if host_emb is not None else set()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.device.type != "cuda" and id(t) not in skip:
            return f"{name} lives on {t.device}"
    return None


def _cuda_devices(model) -> set[int]:
    """Indices of the GPUs holding the model's parameters and buffers."""
    return {cuda_index(t.device) for t in [*model.parameters(), *model.buffers()] if t.device.type == "cuda"}


def _wait_int(t: torch.Tensor) -> int:
    """int(t), for a CUDA tensor waiting on a blocking event: a plain sync spins a core at 100%
    for the whole step, a core the CPU experts' workers need."""
    if t.device.type == "cuda":
        index = cuda_index(t.device)
        events = _WAIT_EVENTS.__dict__.setdefault("events", {})
        ev = events.get(index)
        if ev is None:                    # one per GPU and thread, re-recorded each token
            with torch.cuda.device(index):
                ev = events[index] = torch.cuda.Event(blocking=True)
        ev.record(torch.cuda.current_stream(index))
        ev.synchronize()
    return int(t)


_WAIT_EVENTS = threading.local()


def _host_error_check() -> Optional[Callable[[], None]]:
    """Stream-ordered CPU experts run on the driver's thread and cannot raise there: their first
    failure waits in the native library. This returns the check that raises it (naming the layer),
    or None when there is no native library; `stream_generate` calls it after every token, so a
    failed job stops generation at the token it spoiled."""
    try:
        from .native import available, hostfn
    except ImportError:
        return None
    return (lambda: hostfn.raise_pending("generate")) if available() else None


def _rewind(cache: Any, length: int) -> None:
    """Set a static cache's own length counters back to `length` (after warm-up / capture)."""
    for layer in getattr(cache, "layers", ()):
        cl = getattr(layer, "cumulative_length", None)
        if isinstance(cl, torch.Tensor):
            cl.fill_(length)


# refused before anything is allocated: far past any model's context, and much larger sizes overflow torch's size
# arguments (`ktinject run -n 10**20` was a C++ frame dump, not an out-of-memory error)
MAX_CACHE_POSITIONS = (1 << 31) - 1


def _make_cache(model, length: int, batch: int, device: torch.device, static: bool):
    """The transformers cache of a generation. A static one is marked
    `ktinject_explicit_positions`: the engine passes every position and rewinds the cache's own
    length itself, so operators with caches of their own (`mla_attention`) may skip their
    one-value-per-token bookkeeping entries in it at decode (~5 kernels per layer and token).
    (Running without a transformers cache would spare them too, but then transformers 5 checks
    the positions for packed sequences, a host sync that breaks CUDA-graph capture.)"""
    from transformers import DynamicCache
    if length > MAX_CACHE_POSITIONS:
        raise GenerationError(f"a generation of {length} positions (the prompt plus max_new_tokens) is past the "
                              f"{MAX_CACHE_POSITIONS} a cache can index: lower max_new_tokens")
    own = _own_caches(model)
    try:
        for mod in own:
            mod.reserve(batch, length)
        cache = _static_cache(model, length) if static else None
    except Exception as exc:
        if not _out_of_memory(exc):
            raise
        for mod in own:                   # give back what the modules before the failing one reserved
            mod.release()
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        raise GenerationError(f"the caches of a generation of {length} positions (the prompt plus max_new_tokens) "
                              f"do not fit in memory ({first[:160]}): lower max_new_tokens") from None
    if cache is not None:
        return cache, "static"
    return DynamicCache(config=model.config), "dynamic"


def _static_cache(model, length: int):
    """transformers' StaticCache of `length` positions, or None (a warning says why) for an architecture it
    cannot size statically; an allocation that fails is raised."""
    from transformers import StaticCache
    try:
        cache = StaticCache(config=model.config, max_cache_len=length)
    except Exception as exc:
        if _out_of_memory(exc):
            raise
        log.warning("static cache unavailable (%s); using a dynamic cache", exc)
        return None
    cache.ktinject_explicit_positions = True       # see _make_cache's docstring
    return cache


def _out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is an allocation that failed (torch's CPU and CUDA allocators, Python's)."""
    return isinstance(exc, (MemoryError, torch.OutOfMemoryError)) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))


class _Stepper:
    """Runs model steps with explicit positions; optionally captures the decode step in a graph."""

    def __init__(self, model, cache, device):
        self.model, self.cache, self.device = model, cache, device
        self.kw = {_cache_kwarg(model): cache, "use_cache": True}
        if "logits_to_keep" in inspect.signature(model.forward).parameters:
            self.kw["logits_to_keep"] = 1
        self.graph = None
        self.pools: dict[int, Any] = {}   # other GPUs' capture pools (kept as long as the graph)
        self.embed = None                 # set by capture() when the token embedding is off the graph's GPU

    def forward(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        pos = torch.arange(start, start + ids.shape[1], device=self.device).unsqueeze(0)
        return self.model(input_ids=ids, position_ids=pos, **self.kw).logits[:, -1]

    def capture(self, pos: int, device: torch.device) -> None:
        """Capture the decode step on `device` (the GPU the logits come from)."""
        self.embed = _host_embedding(self.model, device)
        self.ids = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.pos = torch.full((1, 1), pos, dtype=torch.long, device=device)
        if self.embed is not None:         # look up on the host, feed the graph embeddings
            first = self.embed(self.ids.to(next(self.embed.parameters()).device))
            self.embeds = torch.zeros(first.shape, dtype=first.dtype, device=device)
            inputs = {"inputs_embeds": self.embeds}
        else:
            inputs = {"input_ids": self.ids}
        # Layers on other GPUs (a multi-GPU layout) run on a side stream of their own, which joins
        # the capture through an event wait and rejoins it before the capture ends; what they
        # allocate during the capture goes to a pool of their device kept with the graph (the
        # graph's own pool covers the capturing device only).
        others = sorted(_cuda_devices(self.model) - {cuda_index(device)})
        sides = {d: torch.cuda.Stream(device=d) for d in [cuda_index(device), *others]}
        for d, s in sides.items():
            s.wait_stream(torch.cuda.current_stream(d))
        # Warm-up with host synchronisation turned into an error: code that syncs (data-dependent
        # control flow, host copies) cannot be captured, and is found here without breaking the
        # CUDA context the way a failed capture would.
        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings():    # torch warns that the mode is a prototype, every process
            warnings.filterwarnings("ignore", message="Synchronization debug mode")
            torch.cuda.set_sync_debug_mode("error")
        try:
            with contextlib.ExitStack() as streams:
                for s in sides.values():
                    streams.enter_context(torch.cuda.stream(s))
                self.model(**inputs, position_ids=self.pos, **self.kw)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
            for d, s in sides.items():
                torch.cuda.current_stream(d).wait_stream(s)
            _rewind(self.cache, pos)
        self.pools = {}
        for d in others:
            with torch.cuda.device(d):
                self.pools[d] = torch.cuda.MemPool()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            capturing = torch.cuda.current_stream()
            with contextlib.ExitStack() as joined:
                for d in others:
                    sides[d].wait_stream(capturing)
                    joined.enter_context(torch.cuda.stream(sides[d]))
                    joined.enter_context(torch.cuda.use_mem_pool(self.pools[d], device=d))
                self.logits = self.model(**inputs, position_ids=self.pos, **self.kw).logits[:, -1]
                for d in others:
                    capturing.wait_stream(sides[d])
        _rewind(self.cache, pos)
        self.graph = graph

    def drop_graph(self) -> None:
        self.graph, self.pools = None, {}

    def decode(self, tok: torch.Tensor, pos: int) -> torch.Tensor:
        if self.graph is None:
            return self.forward(tok.view(1, 1), pos)
        if self.embed is not None:
            cpu_ids = tok.view(1, 1).to(next(self.embed.parameters()).device)
            self.embeds.copy_(self.embed(cpu_ids))
        else:
            self.ids.copy_(tok.view(1, 1))
        self.pos.fill_(pos)
        self.graph.replay()
        return self.logits


class _Session:
    """A static cache and its stepper (with the captured decode graph, if any), kept on the model
    between calls: a later call whose cache size fits reuses both, so it skips the eager first
    step, the capture and the graph's instantiation (about a second per call for Qwen3-30B-A3B).
    `marks` are the addresses the graph was captured against (see `_marks`)."""

    def __init__(self, cache, stepper: "_Stepper", length: int, device: torch.device):
        self.cache, self.stepper, self.length, self.device = cache, stepper, length, device
        self.marks: tuple = ()
        self.busy = False
        self.tokens: list[int] = []        # the ids whose keys and values sit at positions 0, 1, ...
        self.writes: tuple = ()             # _cache_writes when `tokens` was set


def _tensors_in(value, depth: int = 2):
    """Tensors held directly in a module attribute, or in a list / tuple / dict of them."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth and isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors_in(v, depth - 1)
    elif depth and isinstance(value, dict):
        for v in value.values():
            yield from _tensors_in(v, depth - 1)


def _marks(model, cache) -> tuple:
    """What a captured decode step points at: every tensor the modules hold (parameters, buffers
    and plain attributes such as MLA's latent cache and absorbed weights or the GPU experts'
    packed weights), the stream-ordered CPU jobs of one-token steps (their C records and
    buffers) and the static cache's tensors. A reload, a grown operator cache or dropped jobs
    change them, and the graph is then captured again instead of replayed."""
    out = []
    for m in model.modules():
        for name, value in vars(m).items():
            if name != "_modules":
                out.extend(t.data_ptr() for t in _tensors_in(value))
        serials = getattr(m, "decode_job_serials", None)   # cpu_experts' stream-ordered one-token jobs
        if serials is not None:
            out.extend(serials())
    for layer in getattr(cache, "layers", ()):
        for name in ("keys", "values", "cumulative_length"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                out.append(t.data_ptr())
    return tuple(out)


def _own_caches(model) -> list:
    """Modules that keep a cache of their own (MLA's latent cache): one per module, shared by
    every generation on the model."""
    return [m for m in model.modules() if m is not model and callable(getattr(m, "reserve", None))]


def _cache_writes(model) -> tuple:
    """The own caches' write counters: a change since a call ended means something else wrote
    there (a direct forward, another generation), so the kept tokens no longer describe them."""
    return tuple(int(m.cache_writes) for m in _own_caches(model))


def release_generation(model) -> None:
    """Free the static cache, decode graph and operator caches a model keeps between `generate`
    calls (they are made again by the next call). An error while a generation is still open."""
    session = getattr(model, "_ktinject_session", None)
    if session is not None and session.busy:
        raise ModelError("release_generation: a generation on this model is still open; finish or close it first")
    model._ktinject_session = None
    for m in _own_caches(model):
        if callable(getattr(m, "release", None)):
            m.release()


def _warn_past_context(model, n_prompt: int, max_new_tokens: int) -> None:
    """A warning when the prompt plus max_new_tokens runs past the model's `max_position_embeddings`:
    allowed (a rope scaling the config does not state may still hold), but the text past it is
    usually worse, and nothing else would say why."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < n_prompt + max_new_tokens:
        log.warning("the prompt (%d tokens) plus max_new_tokens (%d) runs past the model's max_position_embeddings "
                    "(%d): the text past position %d may degrade", n_prompt, max_new_tokens, limit, limit)


def _session(model, needed: int, max_cache_len: Optional[int], device: torch.device, static: bool):
    """(cache, cache kind, stepper, session or None) for a call needing `needed` cache slots.

    The kept session is reused when it is free, on the same device, and its length is between
    the call's size (`needed` rounded up to 256, or `max_cache_len`) and twice that (a decode step
    on the GPU attends over the whole static cache, so a much larger one would slow it). Otherwise
    it is dropped first (its memory comes back before the new cache is made), and the new one is
    kept. A new cache gets room to grow (half its size, at least 256 slots) without
    `max_cache_len`, and at least twice a kept one it outgrows, so a growing conversation keeps
    its prefix most turns and recaptures O(log) times."""
    size = max_cache_len or -(-needed // 256) * 256
    old = getattr(model, "_ktinject_session", None)
    if old is not None and old.busy:
        if _own_caches(model):
            raise ModelError("a generation on this model is still open, and its operators keep one cache each "
                             "(MLA's latent cache), so a second one cannot run beside it: finish or close the first")
        cache, kind = _make_cache(model, size, 1, device, static)
        return cache, kind, _Stepper(model, cache, device), None
    if static and old is not None and old.device == device and size <= old.length <= 2 * size:
        return old.cache, "static", old.stepper, old
    if static and max_cache_len is None:
        # room to grow: a chat's next turn (the prompt plus this reply, plus the next message) then
        # fits the same cache and keeps its prefix; past a kept one, at least double it
        grown = 2 * old.length if old is not None and old.length < size else 0
        size = max(grown, -(-(size + max(256, size // 2)) // 256) * 256)
    model._ktinject_session = None        # also for a dynamic cache: it re-reserves the operators' caches
    del old
    cache, kind = _make_cache(model, size, 1, device, static)
    stepper = _Stepper(model, cache, device)
    if kind != "static":
        return cache, kind, stepper, None
    session = model._ktinject_session = _Session(cache, stepper, size, device)
    return cache, kind, stepper, session


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(tokenizer, "eos_token_id", None),
                getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(i) for i in src)
    return ids


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of `text` that may begin a stop string (or an unfinished character)."""
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                hold = max(hold, n)
                break
    if text.endswith("\ufffd"):
        hold = max(hold, 1)
    return hold


# ---- the loop -------------------------------------------------------------------------------
@torch.inference_mode()
def stream_generate(model, tokenizer, prompt: Union[str, Sequence[int]], *, max_new_tokens: int = 64,
                    stop: Sequence[str] = (), result: Optional[dict] = None, temperature: float = 0.0,
                    top_k: int = 0, top_p: float = 1.0, repetition_penalty: float = 1.0,
                    seed: Optional[int] = None, chunk_size: Optional[int] = None, cuda_graph: str = "auto",
                    max_cache_len: Optional[int] = None, static_cache: bool = True,
                    reuse_prefix: bool = True) -> Iterator[str]:
    """Yield decoded text pieces as tokens come. Fills `result` with the GenerationResult fields.

    `prompt` is text or token ids. `cuda_graph`: "auto" (capture when possible), "off", or
    "require" (raise if the model cannot be captured). `reuse_prefix`: when the kept cache (see
    `_session`) holds the start of this prompt, from the previous call's prompt and reply (a chat's
    earlier turns), only the rest is prefilled.
    """
    if cuda_graph not in ("auto", "off", "require"):
        raise ValueError(f"cuda_graph must be auto, off or require, got {cuda_graph!r}")
    if chunk_size is None:
        chunk_size = prefill_chunk_size(model)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    opts = SamplingOptions(temperature, top_k, top_p, repetition_penalty, seed)
    device = _input_device(model)
    ids = (tokenizer(prompt, return_tensors="pt")["input_ids"] if isinstance(prompt, str)
           else torch.tensor([list(prompt)], dtype=torch.long)).to(device)
    n_prompt = ids.shape[1]
    if n_prompt == 0:
        raise ValueError("empty prompt")
    _warn_past_context(model, n_prompt, max_new_tokens)
    cache, cache_kind, stepper, session = _session(model, n_prompt + max_new_tokens + 1, max_cache_len, device,
                                                   static_cache)
    if session is None:
        yield from _generate_loop(model, tokenizer, ids, max_new_tokens, stop, result, opts, seed, chunk_size,
                                  cuda_graph, cache, cache_kind, stepper, None, 0)
        return
    cached = _cached_prefix(session, ids[0].tolist()) \
        if reuse_prefix and session.writes == _cache_writes(model) and not _sliding(cache) else 0
    if cached:
        _rewind(cache, cached)            # the kept entries past it are overwritten before they are read
    elif session.tokens or session.marks:
        cache.reset()
    session.tokens = []                   # unknown until this call completes
    session.busy = True
    ok = False
    try:
        yield from _generate_loop(model, tokenizer, ids, max_new_tokens, stop, result, opts, seed, chunk_size,
                                  cuda_graph, cache, cache_kind, stepper, session, cached)
        ok = True
    finally:
        session.busy = False
        if not ok and getattr(model, "_ktinject_session", None) is session:
            model._ktinject_session = None      # a failed or abandoned call may leave it half-updated


def _decode_torch_threads(model) -> Optional[int]:
    """Torch's intra-op threads for a decode step: the fewest any module asks for
    (`decode_torch_threads`, e.g. `cpu_linear`: its native pool does the heavy work, and torch's
    OpenMP threads spinning between the few small ops left would take the workers' cores), or
    None to leave them."""
    want = [int(t) for m in model.modules() for t in [getattr(m, "decode_torch_threads", None)] if t]
    return min(want) if want else None


@contextlib.contextmanager
def _torch_threads(n: Optional[int]):
    """Run the block with `n` torch threads (None, or not fewer than now: unchanged); restored
    after, also on error, so the caller's code between tokens keeps its own."""
    before = torch.get_num_threads()
    if n is None or n >= before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _sliding(cache) -> bool:
    """A sliding-window layer rolls its entries: its counters cannot be set back to a prefix."""
    return any(getattr(layer, "is_sliding", False) for layer in getattr(cache, "layers", ()))


def _cached_prefix(session: "_Session", prompt: list[int]) -> int:
    """How many leading prompt tokens the kept cache already holds (at least one token is always
    computed again: its logits start the reply)."""
    n = 0
    for a, b in zip(session.tokens, prompt[:-1]):
        if a != b:
            break
        n += 1
    return n


def _generate_loop(model, tokenizer, ids, max_new_tokens, stop, result, opts, seed, chunk_size, cuda_graph,
                   cache, cache_kind, stepper, session, cached) -> Iterator[str]:
    n_prompt = ids.shape[1]
    eos = _eos_ids(model, tokenizer)

    t0 = time.perf_counter()
    with _phase("prefill"):
        for start in range(cached, n_prompt, chunk_size):
            logits = stepper.forward(ids[:, start:start + chunk_size], start)
    fed = ids[0].tolist()                 # what the cache holds, position by position
    # sampling happens where the logits are (the GPU of lm_head in hybrid layouts, whose embedding
    # and so input ids live on the CPU)
    history = ids[0].to(logits.device)
    gen = torch.Generator(device=logits.device).manual_seed(seed) if seed is not None else None
    nxt = sample_next(logits[0], history, opts, gen)
    first = int(nxt)
    t1 = time.perf_counter()

    blocker = "disabled" if cuda_graph == "off" else _graph_blocker(model, logits.device)
    mode = f"eager ({blocker})" if blocker else "cuda-graph"
    if stepper.graph is not None and (blocker or session is None or _marks(model, cache) != session.marks):
        stepper.drop_graph()              # kept from an earlier call, but not to be replayed now
    if blocker and cuda_graph == "require":
        raise RuntimeError(f"cuda_graph='require' but the decode step cannot be captured: {blocker}")

    host_errors = _host_error_check()
    tokens: list[int] = []
    emitted, reason, text = 0, "length", ""
    decodes, t_steady, steady_from = 0, None, 0
    tok = first
    step_threads = _decode_torch_threads(model)
    with _phase("generate"):
        for step in range(max_new_tokens):
            if tok in eos:
                reason = "eos"
                break
            tokens.append(tok)
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            hit = min((text.find(s) for s in stop if s and s in text), default=-1)
            if hit >= 0:
                text = text[:hit]
                reason = "stop"
                break
            safe = len(text) - _held_back(text, stop)
            if safe > emitted:
                yield text[emitted:safe]
                emitted = safe
            if len(tokens) == max_new_tokens:
                break
            pos = n_prompt + step
            # the first decode step runs eagerly (kernels compile, caches settle), then capture
            if mode == "cuda-graph" and stepper.graph is None and step >= 1:
                try:
                    with torch.cuda.device(logits.device):   # the graph's capture stream lives there
                        stepper.capture(pos, logits.device)
                    if session is not None:
                        session.marks = _marks(model, cache)
                except Exception as exc:     # report, then decode eagerly from a clean state
                    _rewind(cache, pos)
                    stepper.drop_graph()
                    mode = f"eager (capture failed: {type(exc).__name__}: {str(exc)[:120]})"
                    if cuda_graph == "require":
                        raise
                    log.warning("CUDA graph capture failed, decoding eagerly: %s", exc)
            history = torch.cat([history, nxt.view(1)])
            if step == 2:
                t_steady, steady_from = time.perf_counter(), decodes
            with _torch_threads(step_threads):
                logits = stepper.decode(nxt, pos)
                fed.append(tok)
                decodes += 1
                nxt = sample_next(logits[0], history, opts, gen)
                tok = _wait_int(nxt)
            if host_errors:
                host_errors()
    t_loop = time.perf_counter()
    if host_errors:
        host_errors()
    if len(text) > emitted:
        yield text[emitted:]
    t2 = time.perf_counter()
    if session is not None:
        session.tokens, session.writes = fed, _cache_writes(model)
    if result is not None:
        result.update(text=text, token_ids=tokens, prompt_tokens=n_prompt, prefill_seconds=t1 - t0,
                      decode_seconds=t2 - t1, stop_reason=reason, decode_mode=mode, cache=cache_kind,
                      steady_seconds=t_loop - t_steady if t_steady is not None else 0.0,
                      steady_tokens=decodes - steady_from if t_steady is not None else 0,
                      cached_prompt_tokens=cached)


def generate(model, tokenizer, prompt: Union[str, Sequence[int]], *, max_new_tokens: int = 64,
             stop: Sequence[str] = (), on_text: Optional[Callable[[str], None]] = None,
             **options) -> GenerationResult:
    """Generate a completion of `prompt`; `on_text` receives each decoded piece as it comes.

    `options`: temperature, top_k, top_p, repetition_penalty, seed (sampling); chunk_size,
    cuda_graph ("auto" | "off" | "require"), max_cache_len, static_cache, reuse_prefix (engine).
    """
    info: dict = {}
    pieces = stream_generate(model, tokenizer, prompt, max_new_tokens=max_new_tokens, stop=stop, result=info,
                             **options)
    try:
        for piece in pieces:
            if on_text:
                on_text(piece)
    finally:
        pieces.close()                    # an error in on_text must not leave the generation open
    return GenerationResult(**info)
