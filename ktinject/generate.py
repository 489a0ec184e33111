"""Prefill + decode loop. (Minimal first version; the GPU issue replaces the internals with a
static KV cache, chunked prefill and CUDA-graph decode while keeping this API.)"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import torch


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float
    stop_reason: str = "length"          # "length" | "eos" | "stop"

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        n = max(len(self.token_ids) - 1, 0)
        return n / self.decode_seconds if self.decode_seconds > 0 and n else float("nan")


def _input_device(model) -> torch.device:
    emb = model.get_input_embeddings()
    for p in emb.parameters():
        return p.device
    return torch.device("cpu")


@torch.inference_mode()
def stream_generate(model, tokenizer, prompt: str, *, max_new_tokens: int = 64,
                    stop: Sequence[str] = (), result: Optional[dict] = None) -> Iterator[str]:
    """Yield decoded text pieces as tokens come (greedy). Fills `result` with timings."""
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(_input_device(model))
    eos = tokenizer.eos_token_id
    t0 = time.perf_counter()
    out = model(input_ids=ids, use_cache=True)
    past = out.past_key_values
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    t1 = time.perf_counter()
    tokens: list[int] = []
    text_so_far = ""
    reason = "length"
    for _ in range(max_new_tokens):
        tok = int(nxt)
        if eos is not None and tok == eos:
            reason = "eos"
            break
        tokens.append(tok)
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        piece, text_so_far = text[len(text_so_far):], text
        yield piece
        if any(s in text_so_far for s in stop):
            reason = "stop"
            break
        if len(tokens) == max_new_tokens:
            break
        out = model(input_ids=nxt.to(ids.device), past_key_values=past, use_cache=True)
        past = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    t2 = time.perf_counter()
    if result is not None:
        result.update(text=text_so_far, token_ids=tokens, prompt_tokens=ids.shape[1], prefill_seconds=t1 - t0,
                      decode_seconds=t2 - t1, stop_reason=reason)


def generate(model, tokenizer, prompt: str, *, max_new_tokens: int = 64, stop: Sequence[str] = (),
             on_text: Optional[Callable[[str], None]] = None) -> GenerationResult:
    """Generate a completion of `prompt`; `on_text` receives each decoded piece as it comes."""
    info: dict = {}
    for piece in stream_generate(model, tokenizer, prompt, max_new_tokens=max_new_tokens, stop=stop, result=info):
        if on_text:
            on_text(piece)
    return GenerationResult(**info)
