"""`ktinject chat` (multi-turn loop) and `ktinject profile` (expert counts) on tiny models."""
import json

from ktinject.cli import main
from ktinject.cli.chat import chat_loop, prompt_ids
from ktinject.cli.profile import experts_modules, record_profile
from ktinject.generate import generate
from ktinject.testing import build_tiny
from ktinject.tokenizer import byte_tokenizer


def test_chat_loop_keeps_history_and_resets():
    model = build_tiny("qwen3_moe")
    tok = byte_tokenizer(model.config.vocab_size)
    inputs = iter(["hello", "", "again", "/reset", "third", "/exit", "never read"])
    out = []
    msgs = chat_loop(model, tok, lambda: next(inputs), out.append, system="be brief", max_new_tokens=4)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant"]
    assert msgs[1]["content"] == "third"
    assert "[conversation cleared]\n" in out
    # the second turn's prompt holds the first exchange (multi-turn through the template)
    first = generate(model, tok, prompt_ids(tok, [{"role": "system", "content": "be brief"},
                                                  {"role": "user", "content": "hello"}]), max_new_tokens=4)
    two = prompt_ids(tok, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
                           {"role": "assistant", "content": first.text}, {"role": "user", "content": "again"}])
    assert tok.decode(two).count("hello") == 1 and "again" in tok.decode(two)


def test_profile_counts_every_routed_choice(tmp_path):
    model = build_tiny("deepseek_v2")
    tok = byte_tokenizer(model.config.vocab_size)
    assert list(experts_modules(model)) == ["model.layers.1.mlp.experts", "model.layers.2.mlp.experts"]
    prof = record_profile(model, tok, ["abc", "hello there"], max_new_tokens=3)
    k = model.config.num_experts_per_tok
    # every token of every prompt (prompt + generated, minus the last sampled one) routes k experts
    for counts in prof["counts"].values():
        assert len(counts) == model.config.n_routed_experts
        assert sum(counts) == k * (prof["tokens"] - 2)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    from ktinject.operators.gpu_experts import GpuExpertsOptions, select_gpu_experts
    sel = select_gpu_experts("model.layers.1.mlp.experts", model.config, 8,
                             GpuExpertsOptions(gpu_experts=2, strategy="frequency", profile=str(path)))
    c = prof["counts"]["model.layers.1.mlp.experts"]
    assert sorted(c, reverse=True)[:2] == sorted((c[e] for e in sel), reverse=True)


def test_profile_cli_errors_without_prompts(capsys):
    assert main(["profile"]) == 2
    assert "no prompts" in capsys.readouterr().err


def test_chat_turns_reuse_the_earlier_turns_cache():
    model = build_tiny("qwen3_moe")
    tok = byte_tokenizer(model.config.vocab_size)
    inputs = iter(["hello", "again", None])
    results = []
    chat_loop(model, tok, lambda: next(inputs), lambda s: None, max_new_tokens=4, on_result=results.append)
    assert results[0].cached_prompt_tokens == 0
    assert results[1].cached_prompt_tokens >= results[0].prompt_tokens      # at least the first prompt
