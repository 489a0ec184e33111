"""The shipped two-GPU overlays on two real GPUs: the same logits and the same greedy tokens as the
one-GPU layout, eager and with the decode step captured in one CUDA graph spanning both GPUs;
each layer's weights and KV cache on its planned GPU, routed experts on the CPU."""
import warnings

import pytest
import torch

from ktinject import optimize_and_load
from ktinject.generate import generate
from ktinject.testing import save_tiny
from ktinject.tokenizer import byte_tokenizer

warnings.filterwarnings("ignore", category=FutureWarning)
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]

# family, one-GPU pack, its two-GPU overlay, first layer on cuda:1 (the overlay's split point);
# the tiny models get two layers past the split
CASES = [("deepseek_v2", "deepseek-v2", "deepseek-v2-2gpu", 14),
         ("deepseek_v3", "deepseek-v3", "deepseek-v3-2gpu", 31),
         ("qwen3_moe", "qwen3-moe", "qwen3-moe-2gpu", 24)]


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def layouts(request, tmp_path_factory):
    family, pack, overlay, split = request.param
    d = save_tiny(family, tmp_path_factory.mktemp(family), num_hidden_layers=split + 2)
    one, _ = optimize_and_load(d, pack)
    two, _ = optimize_and_load(d, overlay)
    return family, split, one, two


def _layer_devices(model, split):
    attn = [model.model.layers[i].self_attn for i in (split - 1, split)]
    return [next(a.parameters()).device for a in attn]


def test_layers_sit_on_their_gpus(layouts):
    family, split, one, two = layouts
    assert [str(b) for b in two.ktinject_plan.boundaries] == [
        "model.layers.0: cpu -> cuda:0", f"model.layers.{split}: cuda:0 -> cuda:1", "model.norm: cuda:1 -> cuda:0"]
    assert _layer_devices(two, split) == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert _layer_devices(one, split) == [torch.device("cuda", 0), torch.device("cuda", 0)]
    assert two.lm_head.weight.device == torch.device("cuda", 0)
    routed = {e.device for e in two.ktinject_plan.entries if e.name.endswith(".mlp.experts")}
    assert routed == {"cpu"}


@torch.no_grad()
def test_logits_equal_one_gpu(layouts):
    family, split, one, two = layouts
    from transformers import StaticCache
    ids = torch.randint(3, 500, (1, 24), generator=torch.Generator().manual_seed(3)).cuda()

    def logits(model):
        return model(ids, past_key_values=StaticCache(config=model.config, max_cache_len=64), use_cache=True).logits

    ref, again = logits(one), logits(one)
    torch.cuda.set_device(1)                                # the caller's current device: not the model's first
    try:
        got = logits(two)
        assert torch.cuda.current_device() == 1             # the root puts the caller's device back
    finally:
        torch.cuda.set_device(0)
    assert got.device == ref.device
    # the same kernels on the same GPU model in the same order: the layouts agree to the bit
    # wherever the one-GPU layout agrees with itself run to run
    diff, noise = (got - ref).abs().max().item(), (again - ref).abs().max().item()
    assert diff <= noise, f"max |two-GPU - one-GPU| {diff}, one-GPU run to run {noise}"
    cache = StaticCache(config=two.config, max_cache_len=64)
    two(ids, past_key_values=cache, use_cache=True)
    # KV caches live with their layers: transformers' cache layers, and the MLA operator's own
    # where it keeps one
    layers = range(split - 1, split + 1)
    sources = {"cache": [getattr(cache.layers[i], "keys", None) for i in layers],
               "mla": [getattr(two.model.layers[i].self_attn, "kv_cache", None) for i in layers]}
    held = {k: [t.device for t in v] for k, v in sources.items() if all(t is not None for t in v)}
    assert held and all(v == [torch.device("cuda", 0), torch.device("cuda", 1)] for v in held.values()), held


@pytest.mark.parametrize("cuda_graph", ["off", "require"])
def test_greedy_tokens_equal_one_gpu(layouts, cuda_graph):
    family, split, one, two = layouts
    tok = byte_tokenizer(one.config.vocab_size)
    ref = generate(one, tok, "The quick brown fox", max_new_tokens=16, cuda_graph=cuda_graph)
    got = generate(two, tok, "The quick brown fox", max_new_tokens=16, cuda_graph=cuda_graph)
    assert got.decode_mode == ref.decode_mode
    assert got.decode_mode == ("cuda-graph" if cuda_graph == "require" else "eager (disabled)"), got.decode_mode
    assert got.token_ids == ref.token_ids
