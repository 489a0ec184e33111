"""The CLI: validate, explain, run (default model), doctor; errors are one message and exit 2."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ktinject.cli import main
from ktinject.testing import save_tiny


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny("qwen3_moe", tmp_path_factory.mktemp("cli") / "qwen3")


def test_validate_packs_and_errors(capsys, tmp_path):
    assert main(["validate", "deepseek-v2", "mixtral-cpu"]) == 0
    out = capsys.readouterr().out
    assert "ok deepseek-v2" in out and "ok mixtral-cpu" in out and "experts" in out
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nrules:\n  - match: {name: x}\n    replace: {op: linear, kwargz: {}}\n")
    assert main(["validate", str(bad), "qwen3-moe"]) == 2
    captured = capsys.readouterr()
    assert f"{bad}:4" in captured.err.replace("\n", "") and "kwargz" in captured.err
    assert "ok qwen3-moe" in captured.out


def test_explain_table_and_json(capsys, tiny_dir, tmp_path):
    assert main(["explain", str(tiny_dir), "--rules", "qwen3-moe"]) == 0
    out = capsys.readouterr().out
    assert "moe" in out and "bytes per device" in out and "cuda" in out and "cpu" in out
    extra = tmp_path / "extra.yaml"
    extra.write_text("version: 1\ninclude: [qwen3-moe-cpu]\nrules:\n  - match: {name: 'nope'}\n    replace: {op: keep}\n")
    assert main(["explain", str(tiny_dir), "--rules", str(extra), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["totals"]) == {"cpu"} and len(data["unmatched_rules"]) == 1
    assert "extra.yaml:4" in data["unmatched_rules"][0]
    assert any(m["op"] == "cpu_experts" for m in data["modules"])


def test_explain_without_rules_picks_family_pack(capsys, tiny_dir):
    import torch
    assert main(["explain", str(tiny_dir)]) == 0
    out = capsys.readouterr().out
    assert ("qwen3-moe-cpu" in out) != torch.cuda.is_available()


def test_run_default_model_streams_and_reports_speed(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("KTINJECT_HOME", str(tmp_path / "home"))
    assert main(["run", "--prompt", "Hello", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "deepseek-v2" in out and "prefill:" in out and "decode:" in out and "tok/s" in out
    assert (tmp_path / "home").is_dir()
    from ktinject.default_model import default_model_path
    import json as _json
    cfg = _json.loads((default_model_path() / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v2"


def test_run_with_model_and_rules(capsys, tiny_dir):
    assert main(["run", str(tiny_dir), "--rules", "qwen3-moe-cpu", "-p", "ab", "-n", "3"]) == 0
    assert "decode:" in capsys.readouterr().out


def test_run_sampling_flags_reach_generate_and_are_checked(capsys, tiny_dir, monkeypatch):
    """`run` samples with the flags `chat` has: a real sampled run, then the flags as `generate`
    receives them; an out-of-range flag is one message naming it, before the model loads."""
    flags = ["--temperature", "0.9", "--top-k", "20", "--top-p", "0.95", "--repetition-penalty", "1.1", "--seed", "7",
             "--chunk-size", "1"]
    assert main(["run", str(tiny_dir), "--rules", "qwen3-moe-cpu", "-p", "ab", "-n", "6", *flags]) == 0
    assert "decode:" in capsys.readouterr().out
    import sys
    gen = sys.modules["ktinject.generate"]   # the module (the package exports its `generate` function)
    seen = {}
    real = gen.generate

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)
    monkeypatch.setattr(gen, "generate", spy)
    assert main(["run", str(tiny_dir), "--rules", "qwen3-moe-cpu", "-p", "ab", "-n", "2", *flags]) == 0
    assert {k: seen[k] for k in ("temperature", "top_k", "top_p", "repetition_penalty", "seed", "chunk_size")} == \
        {"temperature": 0.9, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.1, "seed": 7, "chunk_size": 1}
    for bad, message in ((["--top-p", "2"], "--top-p must be in (0, 1], got 2.0"),
                         (["--temperature", "-1"], "--temperature must be >= 0, got -1.0"),
                         (["--top-k", "-3"], "--top-k must be >= 0, got -3"),
                         (["--repetition-penalty", "0"], "--repetition-penalty must be > 0, got 0.0"),
                         (["--chunk-size", "0"], "--chunk-size must be >= 1, got 0")):
        for cmd in ("run", "chat"):
            seen.clear()
            assert main([cmd, str(tiny_dir), "--rules", "qwen3-moe-cpu", *bad]) == 2
            err = capsys.readouterr().err
            assert message in err and "Traceback" not in err and not seen


def test_errors_are_one_message_and_exit_2(capsys, tiny_dir, tmp_path):
    assert main(["run", str(tmp_path / "missing"), "--rules", "qwen3-moe-cpu"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "no such file" in err and "Traceback" not in err
    assert main(["explain", str(tiny_dir), "--rules", "no-such-pack"]) == 2
    assert "allowed:" in capsys.readouterr().err
    assert main(["run", str(tiny_dir), "--rules", "qwen3-moe-cpu", "-n", "0"]) == 2


def test_doctor(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for word in ("python", "torch", "transformers", "cuda", "cpu ISA", "avx2", "native library", "operators"):
        assert word in out


def test_doctor_says_how_decode_hands_over(monkeypatch):
    """The hand-over row: each outcome of the self-tests and knobs, with the reason (CUDA faked)."""
    import torch
    from ktinject.cli.doctor import _handover
    from ktinject.native import hostfn
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _handover().startswith("no CUDA")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(hostfn, "available", lambda: True)
    monkeypatch.setattr(hostfn, "signal_mode", lambda dev: "bell")
    monkeypatch.setattr(hostfn, "zerocopy_usable", lambda dev: None)
    monkeypatch.delenv("KTINJECT_HOSTJOB_ZEROCOPY", raising=False)
    assert _handover() == "doorbells, zero-copy kernels"
    monkeypatch.setenv("KTINJECT_HOSTJOB_ZEROCOPY", "0")
    assert _handover() == "doorbells, copies (KTINJECT_HOSTJOB_ZEROCOPY=0)"
    monkeypatch.delenv("KTINJECT_HOSTJOB_ZEROCOPY")
    monkeypatch.setattr(hostfn, "zerocopy_usable", lambda dev: "Triton is not installed")
    assert _handover() == "doorbells, copies (zero-copy unusable: Triton is not installed)"
    monkeypatch.setattr(hostfn, "signal_mode", lambda dev: "hostfn")
    monkeypatch.setattr(hostfn, "bells_usable", lambda dev: "no stream memory operations")
    assert _handover() == "host functions (doorbells unusable: no stream memory operations)"


def test_cpu_flags_parser(tmp_path):
    from ktinject.cli.doctor import cpu_flags
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: fpu avx2 fma amx_tile\n\nprocessor\t: 1\n")
    name, flags = cpu_flags(str(f))
    assert name == "Test CPU" and {"avx2", "amx_tile"} <= flags
    assert cpu_flags(str(tmp_path / "none"))[1] == set()


def test_console_script_entry_point():
    r = subprocess.run([sys.executable, "-m", "ktinject", "validate", "qwen2-moe-cpu", "-q"], capture_output=True,
                       text=True)
    assert r.returncode == 0 and "ok qwen2-moe-cpu" in r.stdout


def test_brackets_from_rule_files_are_printed_as_text(capsys, tiny_dir, tmp_path):
    """A regex like 'a[/]b' or a key '[bold]x' is text, not console markup: printed as written, no crash."""
    good = tmp_path / "brackets.yaml"
    good.write_text("version: 1\nrules:\n  - match: {name: 'a[/]b'}\n    replace: {op: keep}\n")
    assert main(["validate", str(good)]) == 0
    assert "name=a[/]b" in capsys.readouterr().out
    assert main(["explain", str(tiny_dir), "--rules", str(good)]) == 0
    assert "name='a[/]b'" in capsys.readouterr().out
    for i, key in enumerate(["[/]", "[bold]x"]):
        bad = tmp_path / f"key{i}.yaml"
        bad.write_text(f"version: 1\n'{key}': 1\n")
        assert main(["validate", str(bad)]) == 2
        assert f"key '{key}': unknown key" in capsys.readouterr().err
        assert main(["explain", str(tiny_dir), "--rules", str(bad)]) == 2
        assert f"key '{key}': unknown key" in capsys.readouterr().err
