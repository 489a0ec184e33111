"""Tiny models of the five families, converted with several recipes, loaded by `optimize_and_load`
with the CPU packs: logits close to the unmodified transformers model holding the same
(dequantized) weights. The loader's checks take the -cpu packs with the `cpu-float` overlay (dense
weights dequantized to float32, so that a wrong weight is not hidden by 8-bit activations);
test_default_cpu_packs_read_the_files_blocks takes the packs as shipped (`cpu_linear`)."""
import pytest
import torch

from ktinject.testing import FAMILIES, save_tiny
from ktinject.weights import as_dense, gguf_write, open_source

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
CPU_PACK = {"deepseek_v2": "deepseek-v2-cpu", "deepseek_v3": "deepseek-v3-cpu", "qwen2_moe": "qwen2-moe-cpu",
            "qwen3_moe": "qwen3-moe-cpu", "mixtral": "mixtral-cpu"}
FLOAT_PACK = {fam: ["cpu-float", pack] for fam, pack in CPU_PACK.items()}   # dense weights in float32
PRESETS = {"deepseek_v2": ["q4_k_m", "q8_0", "q2_k"], "deepseek_v3": ["q4_k_x", "bf16"], "qwen2_moe": ["q5_k_m", "q4_0"],
           "qwen3_moe": ["q6_k", "q8_0", "q3_k_m"], "mixtral": ["q4_k_m", "f16"]}


def reference(path):
    """The unmodified transformers model with the file's weights dequantized to float32."""
    from transformers import AutoModelForCausalLM
    src = open_source(path)
    model = AutoModelForCausalLM.from_config(src.config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict({k: as_dense(v, torch.float32) for k, v in src.items()},
                                                strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    src.close()
    return model.eval()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_e2e")
    return {fam: save_tiny(fam, root / fam) for fam in FAMILIES}


@pytest.mark.parametrize("family,preset", [(f, p) for f in FAMILIES for p in PRESETS[f]])
def test_logits_match_reference(hf_dirs, tmp_path, family, preset, monkeypatch):
    """The loader's check: the prompt's grouped experts in f32, so that quantizing the activations
    to 8 bits (the AVX2 / AVX-512 grouped path's default, and the row dots') does not hide a wrong
    weight; test_logits_with_8bit_activations covers those numerics end to end."""
    from ktinject.load import optimize_and_load
    monkeypatch.setenv("KTINJECT_VNNI_GROUPED", "0")
    path = gguf_write.convert_model(hf_dirs[family], tmp_path / "m.gguf", preset, progress=False)[0]
    model, tok = optimize_and_load(path, rules=FLOAT_PACK[family], dtype=torch.float32)
    ref = reference(path)
    ids = torch.tensor([tok("The quick brown fox").input_ids + [5, 77, 300]])
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids).logits
    assert torch.isfinite(got).all()
    err = (got - want).abs().max() / want.abs().max()
    assert err < 2e-2, (family, preset, float(err))


@pytest.mark.parametrize("family,preset", [("qwen2_moe", "q4_0"), ("deepseek_v2", "q4_k_m")])
def test_logits_with_8bit_activations(hf_dirs, tmp_path, family, preset, monkeypatch):
    """The experts with their tokens quantized to 8 bits per 32 values: on AVX2 / AVX-512 the
    prompt's grouped experts (pack_q8 / gemm_q8), and the row dots (every decode step, any ISA) with the
    grouped path off. Both quantize the same way, so their logits errors agree: RMS 2.7% and 2.7%
    (qwen2_moe q4_0), 0.5% and 0.8% (deepseek_v2 q4_k_m, whose row dots quantize per 256 values),
    against 0.07% for the grouped path in f32 (measured on AVX-512)."""
    from ktinject.load import optimize_and_load
    path = gguf_write.convert_model(hf_dirs[family], tmp_path / "m.gguf", preset, progress=False)[0]
    ref = reference(path)
    errs = {}
    for name, tile_min in (("grouped", "4"), ("dots", "100000")):
        monkeypatch.setenv("KTINJECT_TILE_MIN", tile_min)
        model, tok = optimize_and_load(path, rules=FLOAT_PACK[family], dtype=torch.float32)
        ids = torch.tensor([tok("The quick brown fox").input_ids + [5, 77, 300]])
        with torch.no_grad():
            got, want = model(ids).logits, ref(ids).logits
        assert torch.isfinite(got).all()
        errs[name] = float((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt())
    assert errs["dots"] < 5e-2 and errs["grouped"] < 5e-2, errs
    assert errs["grouped"] < 2 * errs["dots"] + 1e-2, errs


def test_split_directory_loads_like_single_file(hf_dirs, tmp_path):
    from ktinject.load import optimize_and_load
    hf = hf_dirs["qwen3_moe"]
    single = gguf_write.convert_model(hf, tmp_path / "one" / "m.gguf", "q8_0", progress=False)[0]
    parts = gguf_write.convert_model(hf, tmp_path / "split" / "m.gguf", "q8_0", split_max_tensors=8, progress=False)
    assert len(parts) > 1
    ids = torch.tensor([[1, 40, 50, 60]])
    with torch.no_grad():
        a = optimize_and_load(single, rules=FLOAT_PACK["qwen3_moe"], dtype=torch.float32)[0](ids).logits
        b = optimize_and_load(tmp_path / "split", rules=FLOAT_PACK["qwen3_moe"], dtype=torch.float32)[0](ids).logits
    assert torch.equal(a, b)


@pytest.mark.parametrize("family,preset", [(f, PRESETS[f][0]) for f in FAMILIES])
def test_default_cpu_packs_read_the_files_blocks(hf_dirs, tmp_path, family, preset):
    """The -cpu packs as shipped: every Linear is `cpu_linear` over the file's own blocks and the
    embedding `cpu_embedding`. Each linear's output, on the prompt (grouped 8-bit GEMM or dequantize)
    and on 3 tokens (row dots), is within 3% RMS of its input times the dequantized weight: the 8-bit
    activations' rounding (~1% here). The logits are not compared: in these tiny random models that
    1% a linear compounds through the layers and flips routing (RMS 2-56% from the reference, against
    0.1-2.7% with `cpu-float`), as llama.cpp's CPU path would. `cpu-float` gives the float path back."""
    from ktinject.load import optimize_and_load
    path = gguf_write.convert_model(hf_dirs[family], tmp_path / "m.gguf", preset, progress=False)[0]
    model, tok = optimize_and_load(path, rules=CPU_PACK[family], dtype=torch.float32)
    assert type(model.lm_head).__name__ == "CpuLinear"
    assert type(model.get_input_embeddings()).__name__ == "CpuEmbedding"
    assert not any(type(m).__name__ == "Linear" for m in model.modules())
    src = open_source(path)
    errs = {}

    def check(name):
        def hook(mod, args, out):
            w = as_dense(src[name + ".weight"], torch.float32)
            want = args[0].float() @ w.T + (mod.bias if mod.bias is not None and mod.bias.numel() else 0)
            errs[name, args[0].shape[-2]] = float((out - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt())
        return hook

    names = [n for n, m in model.named_modules() if type(m).__name__ == "CpuLinear"]
    for n in names:
        model.get_submodule(n).register_forward_hook(check(n))
    ids = torch.tensor([tok("The quick brown fox").input_ids + [5, 77, 300]])
    with torch.no_grad():
        logits = [model(ids).logits, model(ids[:, :3]).logits]
    src.close()
    assert all(torch.isfinite(x).all() for x in logits)
    assert {n for n, _ in errs} == set(names)
    assert max(errs.values()) < 3e-2, sorted(errs.items(), key=lambda kv: -kv[1])[:4]
    floats, _ = optimize_and_load(path, rules=FLOAT_PACK[family], dtype=torch.float32)
    assert not any(type(m).__name__ in ("CpuLinear", "CpuEmbedding") for m in floats.modules())
