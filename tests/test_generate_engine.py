"""The generation engine: static cache + chunked prefill equal a no-cache greedy reference,
MLA injected, stop strings, EOS, sampling; CUDA-graph decode equals eager decode on the GPU."""
import copy
import warnings

import pytest
import torch

from ktinject.generate import GenerationResult, SamplingOptions, generate, sample_next, stream_generate
from ktinject.testing import build_tiny, greedy_recomputed
from ktinject.tokenizer import byte_tokenizer

warnings.filterwarnings("ignore", category=FutureWarning)
PROMPT = "The quick brown fox"


@torch.no_grad()
def reference_greedy(model, tok, prompt, n):
    return greedy_recomputed(model, tok(prompt, return_tensors="pt")["input_ids"][0].tolist(), n)


def with_mla(model, device="cpu", dtype=None):
    from ktinject.operators.mla_attention import replace_all
    return replace_all(model, device=device, dtype=dtype)


@pytest.mark.parametrize("family,chunk", [("deepseek_v2", 3), ("deepseek_v3", 512), ("qwen2_moe", 5),
                                          ("mixtral", 512)])
def test_greedy_equals_reference(family, chunk):
    model = build_tiny(family)
    tok = byte_tokenizer(model.config.vocab_size)
    res = generate(model, tok, PROMPT, max_new_tokens=8, chunk_size=chunk)
    assert isinstance(res, GenerationResult)
    assert res.token_ids == reference_greedy(model, tok, PROMPT, 8)
    assert res.prompt_tokens == len(PROMPT) and res.stop_reason == "length"
    assert res.cache == "static" and res.decode_mode.startswith("eager (not on CUDA")
    assert res.prefill_tokens_per_s > 0 and res.decode_tokens_per_s > 0
    if len(res.token_ids) > 3:           # steps from the third on: every later decode call
        assert res.steady_tokens == len(res.token_ids) - 3 and 0 < res.steady_seconds < res.decode_seconds
        assert res.steady_decode_tokens_per_s > 0


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_greedy_with_mla_attention(family):
    model = build_tiny(family)
    tok = byte_tokenizer(model.config.vocab_size)
    ref = reference_greedy(model, tok, PROMPT, 8)
    ours = with_mla(copy.deepcopy(model))
    assert generate(ours, tok, PROMPT, max_new_tokens=8, chunk_size=5).token_ids == ref
    # a second, different prompt reuses the reserved latent cache from position 0
    assert generate(ours, tok, "abc", max_new_tokens=6).token_ids == reference_greedy(model, tok, "abc", 6)


def test_stop_strings_eos_and_streaming():
    model = build_tiny("qwen3_moe")
    tok = byte_tokenizer(model.config.vocab_size)
    full = generate(model, tok, PROMPT, max_new_tokens=12)
    text = full.text
    assert len(text) >= 6
    stop = text[3:5]
    pieces = []
    res = generate(model, tok, PROMPT, max_new_tokens=12, stop=[stop], on_text=pieces.append)
    assert res.stop_reason == "stop" and res.text == text[:text.find(stop)]
    assert "".join(pieces) == res.text            # the stop string itself is never streamed
    model.generation_config.eos_token_id = full.token_ids[2]
    res = generate(model, tok, PROMPT, max_new_tokens=12)
    assert res.stop_reason == "eos" and res.token_ids == full.token_ids[:2]
    info = {}
    assert "".join(stream_generate(model, tok, list(tok(PROMPT)["input_ids"]), max_new_tokens=2, result=info)) \
        == info["text"]


def test_sampling():
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0, 0.5])
    hist = torch.tensor([1])
    assert int(sample_next(logits, hist, SamplingOptions())) == 1
    # repetition penalty divides the positive logit of token 1 below token 2
    assert int(sample_next(logits, hist, SamplingOptions(repetition_penalty=2.0))) == 2
    g = torch.Generator().manual_seed(0)
    draws = {int(sample_next(logits, hist, SamplingOptions(temperature=1.0, top_k=2), g)) for _ in range(200)}
    assert draws == {1, 2}
    draws = {int(sample_next(logits, hist, SamplingOptions(temperature=1.0, top_p=0.5), g)) for _ in range(200)}
    assert draws == {1}
    draws = {int(sample_next(logits, hist, SamplingOptions(temperature=5.0), g)) for _ in range(400)}
    assert draws == {0, 1, 2, 3, 4}
    with pytest.raises(ValueError):
        SamplingOptions(top_p=0.0)
    model = build_tiny("mixtral")
    tok = byte_tokenizer(model.config.vocab_size)
    a = generate(model, tok, PROMPT, max_new_tokens=6, temperature=0.8, top_k=50, top_p=0.9, seed=7)
    b = generate(model, tok, PROMPT, max_new_tokens=6, temperature=0.8, top_k=50, top_p=0.9, seed=7)
    assert a.token_ids == b.token_ids
    with pytest.raises(RuntimeError, match="cannot be captured"):
        generate(model, tok, PROMPT, max_new_tokens=3, cuda_graph="require")


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["deepseek_v2", "qwen3_moe"])
def test_gpu_cuda_graph_decode_equals_eager(family):
    model = build_tiny(family, dtype=torch.bfloat16).cuda()
    model.set_experts_implementation("batched_mm")     # the default experts loop syncs with the host
    if family == "deepseek_v2":
        model = with_mla(model, device="cuda", dtype=torch.bfloat16)
    tok = byte_tokenizer(model.config.vocab_size)
    # reuse_prefix=False: the second call would otherwise feed only the prompt's last token (the
    # rest kept from the first call), a different bfloat16 rounding than the batched prefill's
    eager = generate(model, tok, PROMPT, max_new_tokens=24, cuda_graph="off")
    graph = generate(model, tok, PROMPT, max_new_tokens=24, cuda_graph="auto", reuse_prefix=False)
    assert eager.decode_mode.startswith("eager")
    assert graph.decode_mode == "cuda-graph", graph.decode_mode
    assert graph.token_ids == eager.token_ids


# ---- the cache and decode graph kept between calls ---------------------------------------------

@pytest.mark.parametrize("family,mla", [("qwen3_moe", False), ("deepseek_v2", True)])
def test_later_calls_reuse_the_kept_cache_and_match_the_reference(family, mla):
    model = build_tiny(family)
    tok = byte_tokenizer(model.config.vocab_size)
    ours = with_mla(copy.deepcopy(model)) if mla else model
    first = "The quick brown fox jumps over the lazy dog, twice over"     # fills more of the cache
    assert generate(ours, tok, first, max_new_tokens=10).token_ids == reference_greedy(model, tok, first, 10)
    kept = ours._ktinject_session
    assert kept is not None and kept.length == 512 and not kept.busy
    # another prompt of the same size class: the same cache, reset in place (no shared prefix)
    assert generate(ours, tok, "abc", max_new_tokens=6).token_ids == reference_greedy(model, tok, "abc", 6)
    assert ours._ktinject_session is kept


def test_kept_cache_has_room_grows_by_doubling_and_shrinks_when_far_too_large():
    model = build_tiny("qwen3_moe")
    tok = byte_tokenizer(model.config.vocab_size)
    generate(model, tok, "w" * 450, max_new_tokens=4)       # needs ~455: 512, with room to grow 768
    assert model._ktinject_session.length == 768
    kept = model._ktinject_session
    generate(model, tok, "x" * 590, max_new_tokens=4)       # needs ~595 (768): fits the kept cache
    assert model._ktinject_session is kept
    generate(model, tok, "x" * 900, max_new_tokens=4)       # needs ~905 (1024): twice the kept 768
    assert model._ktinject_session.length == 1536
    generate(model, tok, "y" * 2100, max_new_tokens=4)      # 2304 with its room: more than doubling
    assert model._ktinject_session.length == 3584
    generate(model, tok, "abc", max_new_tokens=4)           # 3584 > 2 x 256: a small cache again
    assert model._ktinject_session.length == 512
    generate(model, tok, "abc", max_new_tokens=4, max_cache_len=600)   # an explicit size: as given
    assert model._ktinject_session.length == 600


def test_abandoned_or_concurrent_calls_do_not_share_the_kept_cache():
    from ktinject.generate import release_generation
    model = build_tiny("qwen3_moe")
    tok = byte_tokenizer(model.config.vocab_size)
    ref = reference_greedy(model, tok, "abc", 6)
    a = stream_generate(model, tok, "abc", max_new_tokens=6)
    next(a)
    kept = model._ktinject_session
    assert kept.busy
    # a second generation while the first is still open gets a cache of its own
    assert generate(model, tok, "abc", max_new_tokens=6).token_ids == ref
    assert model._ktinject_session is kept
    a.close()                                                          # abandoned half-way: not kept
    assert model._ktinject_session is None
    generate(model, tok, "abc", max_new_tokens=6)
    assert model._ktinject_session is not None
    release_generation(model)
    assert model._ktinject_session is None
    assert generate(model, tok, "abc", max_new_tokens=6, static_cache=False).token_ids == ref
    assert model._ktinject_session is None                             # a dynamic cache is not kept


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["deepseek_v2", "qwen3_moe"])
def test_gpu_later_calls_replay_the_kept_graph(family, monkeypatch):
    """The second call replays the graph the first captured (no new capture); tokens equal eager
    decoding; a graph kept from a call whose marks no longer hold is captured again."""
    from ktinject.generate import _Stepper
    model = build_tiny(family, dtype=torch.bfloat16).cuda()
    model.set_experts_implementation("batched_mm")
    if family == "deepseek_v2":
        model = with_mla(model, device="cuda", dtype=torch.bfloat16)
    tok = byte_tokenizer(model.config.vocab_size)
    captures = []
    real = _Stepper.capture
    monkeypatch.setattr(_Stepper, "capture", lambda self, *a: (captures.append(1), real(self, *a))[1])
    first = generate(model, tok, PROMPT, max_new_tokens=16)
    graph = model._ktinject_session.stepper.graph
    assert first.decode_mode == "cuda-graph" and graph is not None and len(captures) == 1
    again = generate(model, tok, "A different prompt", max_new_tokens=16)
    # (reuse_prefix=False: from the kept cache the last prompt token alone would be a one-token
    # step, whose fp32 scores round differently from the prefill's; the tiny bf16 model then flips
    # a near-tie, a numerics difference, not a replay one)
    eager = generate(model, tok, "A different prompt", max_new_tokens=16, cuda_graph="off", reuse_prefix=False)
    assert again.decode_mode == "cuda-graph" and len(captures) == 1
    assert again.token_ids == eager.token_ids
    # "off" dropped the kept graph; the next call captures again
    generate(model, tok, PROMPT, max_new_tokens=16)
    assert len(captures) == 2 and model._ktinject_session.stepper.graph is not graph
    # a weight the graph reads moved (as a reload may do): captured again, still right
    p = next(model.model.layers[0].mlp.parameters())
    p.data = p.data.clone()
    moved = generate(model, tok, "A different prompt", max_new_tokens=16)
    assert len(captures) == 3 and moved.token_ids == eager.token_ids


@pytest.mark.parametrize("family,mla,chunk", [("qwen3_moe", False, 512), ("deepseek_v2", True, 3),
                                              ("mixtral", False, 4)])
def test_next_turn_prefills_only_what_the_kept_cache_lacks(family, mla, chunk):
    """A chat's next prompt starts with the previous prompt and reply: their keys and values are
    still in the kept cache, so only the new tokens are computed, with the same result."""
    model = build_tiny(family)
    ours = with_mla(copy.deepcopy(model)) if mla else model
    tok = byte_tokenizer(model.config.vocab_size)
    turn1 = tok("Hello there, model.", return_tensors="pt")["input_ids"][0].tolist()
    r1 = generate(ours, tok, turn1, max_new_tokens=8, chunk_size=chunk)
    turn2 = turn1 + r1.token_ids + tok(" And now?", return_tensors="pt")["input_ids"][0].tolist()
    r2 = generate(ours, tok, turn2, max_new_tokens=8, chunk_size=chunk)
    # the reply's last token was sampled but never fed: its entry is computed now
    assert r2.cached_prompt_tokens == len(turn1) + len(r1.token_ids) - 1
    assert r2.token_ids == greedy_recomputed(model, turn2, 8)
    # an edit early in the conversation keeps only what comes before it
    turn3 = turn2[:5] + [turn2[5] + 1] + turn2[6:]
    r3 = generate(ours, tok, turn3, max_new_tokens=8, chunk_size=chunk)
    assert r3.cached_prompt_tokens == 5 and r3.token_ids == greedy_recomputed(model, turn3, 8)
    # the same prompt again: all but its last token come from the cache
    r4 = generate(ours, tok, turn3, max_new_tokens=8, chunk_size=chunk)
    assert r4.cached_prompt_tokens == len(turn3) - 1 and r4.token_ids == r3.token_ids
    r5 = generate(ours, tok, turn3, max_new_tokens=8, chunk_size=chunk, reuse_prefix=False)
    assert r5.cached_prompt_tokens == 0 and r5.token_ids == r3.token_ids


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["deepseek_v2", "qwen3_moe"])
def test_gpu_next_turn_with_kept_prefix_and_graph(family):
    """A continued conversation on the GPU: the cached prefix, then the kept graph's replays,
    give the tokens of a fresh eager generation."""
    # float32: a reply's keys come from decode steps, a fresh run's from one prefill; in bf16 a
    # near-tie between two tokens could go either way
    model = build_tiny(family, dtype=torch.float32).cuda()
    model.set_experts_implementation("batched_mm")
    if family == "deepseek_v2":
        model = with_mla(model, device="cuda", dtype=torch.float32)
    tok = byte_tokenizer(model.config.vocab_size)
    turn1 = tok(PROMPT, return_tensors="pt")["input_ids"][0].tolist()
    r1 = generate(model, tok, turn1, max_new_tokens=12)
    turn2 = turn1 + r1.token_ids + turn1[:5]
    r2 = generate(model, tok, turn2, max_new_tokens=12)
    assert r2.cached_prompt_tokens == len(turn1) + len(r1.token_ids) - 1 and r2.decode_mode == "cuda-graph"
    fresh = generate(model, tok, turn2, max_new_tokens=12, cuda_graph="off", reuse_prefix=False)
    assert r2.token_ids == fresh.token_ids


def test_calls_outside_the_kept_cache_do_not_spoil_it_for_mla():
    """MLA keeps one latent cache per layer: a generation with a dynamic cache re-reserves it and a
    direct forward writes into it, so the next call must neither reuse the kept prefix nor read
    a cache the kept one no longer fits; a second generation beside an open one is refused."""
    model = build_tiny("deepseek_v2")
    ours = with_mla(copy.deepcopy(model))
    tok = byte_tokenizer(model.config.vocab_size)
    turn = tok("The quick brown fox jumps", return_tensors="pt")["input_ids"][0].tolist()
    r1 = generate(ours, tok, turn, max_new_tokens=6)
    more = turn + r1.token_ids + turn[:3]
    generate(ours, tok, "ab", max_new_tokens=3, static_cache=False)   # re-reserves a short latent cache
    r2 = generate(ours, tok, more, max_new_tokens=6)
    assert r2.cached_prompt_tokens == 0 and r2.token_ids == greedy_recomputed(model, more, 6)
    with torch.no_grad():
        ours(torch.tensor([[7, 8, 9]]))                                  # writes positions 0-2 of every layer
    r3 = generate(ours, tok, more, max_new_tokens=6)
    assert r3.cached_prompt_tokens == 0 and r3.token_ids == r2.token_ids
    r4 = generate(ours, tok, more, max_new_tokens=6)                    # nothing in between: reused
    assert r4.cached_prompt_tokens == len(more) - 1 and r4.token_ids == r2.token_ids
    open_one = stream_generate(ours, tok, "abc", max_new_tokens=6)
    next(open_one)
    from ktinject.errors import ModelError
    from ktinject.generate import release_generation
    with pytest.raises(ModelError, match="still open"):
        generate(ours, tok, "abc", max_new_tokens=6)
    with pytest.raises(ModelError, match="still open"):
        release_generation(ours)
    open_one.close()
    release_generation(ours)
    assert ours._ktinject_session is None and ours.model.layers[0].self_attn.kv_cache is None
    assert generate(ours, tok, "abc", max_new_tokens=6).token_ids == reference_greedy(model, tok, "abc", 6)


def test_caches_past_memory_or_indexing_are_one_error_naming_max_new_tokens(monkeypatch):
    """An absurd max_new_tokens is a GenerationError that names it, not an allocator's traceback: past
    what a cache can index (no allocation tried), or an allocation that fails (the operators' own caches:
    MLA's latent cache here; or transformers' static cache)."""
    from transformers import cache_utils

    from ktinject.errors import GenerationError
    from ktinject.operators.mla_attention import MLAAttention
    model = with_mla(build_tiny("deepseek_v2"))
    tok = byte_tokenizer(model.config.vocab_size)
    with pytest.raises(GenerationError, match="past the 2147483647 a cache can index: lower max_new_tokens"):
        generate(model, tok, PROMPT, max_new_tokens=10 ** 20)

    def no_room(*a, **k):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried "
                           "to allocate 480000163840 bytes")
    with monkeypatch.context() as m:
        m.setattr(MLAAttention, "reserve", no_room)
        with pytest.raises(GenerationError, match=r"do not fit in memory \(\[enforce fail.*lower max_new_tokens"):
            generate(model, tok, PROMPT, max_new_tokens=8)
    plain = build_tiny("qwen3_moe")                     # no operator caches: transformers' StaticCache allocates
    with monkeypatch.context() as m:
        m.setattr(cache_utils.StaticCache, "__init__", no_room)
        with pytest.raises(GenerationError, match="do not fit in memory"):
            generate(plain, byte_tokenizer(plain.config.vocab_size), PROMPT, max_new_tokens=8)
    with monkeypatch.context() as m:                # MLA's caches reserved, then the static cache fails:
        m.setattr(cache_utils.StaticCache, "__init__", no_room)   # the reserved ones are given back
        with pytest.raises(GenerationError, match="do not fit in memory"):
            generate(model, tok, PROMPT, max_new_tokens=8)
        assert all(m_.kv_cache is None for m_ in model.modules() if isinstance(m_, MLAAttention))
    # any other failure of the static cache still falls back to a dynamic one
    with monkeypatch.context() as m:
        m.setattr(cache_utils.StaticCache, "__init__", lambda *a, **k: (_ for _ in ()).throw(ValueError("no")))
        assert generate(plain, byte_tokenizer(plain.config.vocab_size), PROMPT, max_new_tokens=4).cache == "dynamic"
    assert generate(model, tok, PROMPT, max_new_tokens=4).token_ids     # the model still generates afterwards


def test_a_generation_past_the_context_is_allowed_with_a_warning(caplog):
    """Past the config's max_position_embeddings the generation still runs (a rope scaling the config
    does not state may hold), but a warning says where the text may degrade; within it, no warning."""
    import logging
    model = build_tiny("qwen3_moe")
    tok = byte_tokenizer(model.config.vocab_size)
    n_prompt = len(tok(PROMPT)["input_ids"])
    model.config.max_position_embeddings = n_prompt + 3
    with caplog.at_level(logging.WARNING, logger="ktinject.generate"):
        assert len(generate(model, tok, PROMPT, max_new_tokens=3).token_ids) == 3
    assert not [r for r in caplog.records if "max_position_embeddings" in r.getMessage()]
    with caplog.at_level(logging.WARNING, logger="ktinject.generate"):
        assert len(generate(model, tok, PROMPT, max_new_tokens=6).token_ids) == 6
    msg = [r.getMessage() for r in caplog.records if "max_position_embeddings" in r.getMessage()]
    assert msg == [f"the prompt ({n_prompt} tokens) plus max_new_tokens (6) runs past the model's "
                   f"max_position_embeddings ({n_prompt + 3}): the text past position {n_prompt + 3} may degrade"]
