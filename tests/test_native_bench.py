"""`ktinject bench experts`: runs on a tiny shape and prints one JSON object per configuration
with the documented keys; other targets are refused with the list of those available."""
from __future__ import annotations

import json

import pytest

from ktinject import native
from ktinject.cli import main

import test_native_util  # noqa: F401,E402  (builds the extension in place when missing)

pytestmark = pytest.mark.skipif(not native.available(), reason="native extension not built")
TINY = ["--hidden", "256", "--inter", "256", "--experts", "8", "--topk", "2", "--gib", "0.01",
        "--probe-gib", "0.03", "--seconds", "0.05"]


@pytest.mark.parametrize("caller", ["native", "python"])
def test_bench_experts_json(capsys, caller):
    rc = main(["bench", "experts", *TINY, "--quant", "q4_k,bf16", "--batch", "1,20", "--threads", "2", "--json",
               "--caller", caller, "--rounds", "3"])
    assert rc == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(rows) == 4
    for r in rows:
        for key in ("quant", "batch", "threads", "gbps", "bandwidth_gbps", "fraction", "tokens_per_s",
                    "ms_per_layer", "tflops"):
            assert key in r
        assert r["gbps"] > 0 and r["bandwidth_gbps"] > 0 and r["threads"] == 2 and r["caller"] == caller
        assert abs(r["fraction"] - r["gbps"] / r["bandwidth_gbps"]) < 0.01
        # each round beside its own probe pass; the whole probe figure lies within theirs
        assert len(r["rounds"]) == 3
        bws = [x["bandwidth_gbps"] for x in r["rounds"]]
        assert min(bws) - 0.01 <= r["bandwidth_gbps"] <= max(bws) + 0.01
        for x in r["rounds"]:
            assert x["gbps"] > 0 and abs(x["fraction"] - x["gbps"] / x["bandwidth_gbps"]) < 0.01
    assert {r["quant"] for r in rows} == {"q4_k", "bf16"} and {r["batch"] for r in rows} == {1, 20}
    # which matrices decode read from R16 copies, and how: what repack: auto does on this CPU
    from ktinject.native import moe as nmoe
    from ktinject.native import isa_index
    q4 = next(r for r in rows if r["quant"] == "q4_k")
    auto = nmoe.repack_mode(isa_index(), None) == "auto"
    from gguf import GGMLQuantizationType as QT
    types = nmoe.auto_types() if auto else ()
    want = (["gate", "up"] if QT.Q4_K in types else []) + (["down"] if QT[q4["down_quant"].upper()] in types else [])
    assert q4["repacked"] == want and (q4["r16_stream"] == native.r16_stream() if want else q4["r16_stream"] is None)
    assert all(r["bf16_tiles"] == [] for r in rows)   # BF16 tile copies only where asked ($KTINJECT_AMX_BF16_TILES)


def test_bench_rounds_bytes(monkeypatch):
    """The bytes a round counts: the routings' distinct experts, cycled from the first routing,
    whichever caller runs the calls."""
    import argparse

    from ktinject.cli.bench import _timed_calls
    calls_seen = []

    def fake_chain(kernels, x, routes, calls):
        calls_seen.append(calls)
        return 0.01, None
    monkeypatch.setattr(native, "run_chain", fake_chain)
    args = argparse.Namespace(seconds=0.05, rounds=1, caller="native")
    el, calls, nbytes = _timed_calls(args, [object()] * 3, None, [None] * 4, [10, 20, 30, 40])
    assert calls == sum(calls_seen) and calls_seen[0] == 3 and el >= 0.05
    assert nbytes == sum(q * 100 + sum([10, 20, 30, 40][:r]) for q, r in [divmod(c, 4) for c in calls_seen])


def test_bench_experts_trace_reports_the_job_apart(capsys, monkeypatch):
    """--trace: per-phase microseconds, and the layer inside the pool's job (post to done) beside the
    whole call: job_ms within the call's time, its GB/s and fraction from the same bytes and probe;
    the table says how much of a call is the caller's side."""
    monkeypatch.delenv("KTINJECT_POOL_TRACE", raising=False)     # the bench sets it; undone after the test
    rc = main(["bench", "experts", *TINY, "--quant", "q8_0", "--batch", "1,20", "--threads", "2", "--json", "--trace"])
    assert rc == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(rows) == 2
    for r in rows:
        tr = r["trace_us"]
        assert tr["jobs"] >= 2 and tr["done"] > 0 and tr["gate_up"] > 0 and tr["down"] > 0
        assert 0 < r["job_ms"] <= r["ms_per_layer"] * 1.05
        assert r["job_gbps"] >= r["gbps"] * 0.95                     # the same bytes in less time
        assert abs(r["job_fraction"] - r["job_gbps"] / r["bandwidth_gbps"]) < 0.01
    assert main(["bench", "experts", *TINY, "--quant", "q8_0", "--threads", "1", "--trace"]) == 0
    out = capsys.readouterr().out
    assert "routed-experts layer" in out and "inside the pool's job" in out and "the caller's side" in out


def test_bench_table_and_errors(capsys):
    assert main(["bench", "experts", *TINY, "--quant", "q8_0", "--threads", "1"]) == 0
    assert "routed-experts layer" in capsys.readouterr().out
    assert main(["bench", "experts", *TINY, "--quant", "q4_1"]) == 2
    assert "q4_1" in capsys.readouterr().err
    assert main(["bench", "some-model-dir"]) == 2
    assert "allowed: experts" in capsys.readouterr().err


def test_bench_model_json_on_the_cpu(capsys, tmp_path):
    """`ktinject bench MODEL`: prefill per prompt length, the median of the decode runs with each
    run, and the roofline from the bytes per token and the measured bandwidth; as JSON and as a table."""
    from statistics import median

    from ktinject.testing import save_tiny
    d = save_tiny("qwen3_moe", tmp_path / "m")
    rc = main(["bench", str(d), "--rules", "qwen3-moe-cpu", "--prompt-lengths", "16,40", "--decode-tokens", "6",
               "--repeat", "3", "--probe-gib", "0.03", "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(res["prefill"]) == {"16", "40"} and all(v > 0 for v in res["prefill"].values())
    assert len(res["decode_runs"]) == 3 and res["decode_tokens_per_s"] == round(median(res["decode_runs"]), 2)
    assert res["decode_tokens_per_s_incl_warmup"] > 0 and res["decode_mode"].startswith("eager")
    assert res["decode_handover"] == ""                         # no CUDA: no stream-ordered jobs
    assert res["cpu_expert_bytes_per_token"] > 0 and res["gpu_bytes_per_token"] == 0
    assert len(res["cpu_bandwidth_runs"]) == 3 and all(v > 0 for v in res["cpu_bandwidth_runs"])   # one beside each run
    assert res["cpu_bandwidth_gbps"] == pytest.approx(sum(res["cpu_bandwidth_runs"]) / 3, abs=0.06)
    expected = 1e9 * res["cpu_bandwidth_gbps"] / (res["cpu_expert_bytes_per_token"] + res["cpu_dense_bytes_per_token"])
    assert res["roofline_tokens_per_s"] == pytest.approx(expected, rel=0.01)
    assert res["fraction"] == pytest.approx(res["decode_tokens_per_s"] / res["roofline_tokens_per_s"], abs=1e-3)
    assert res["prefill_chunk"] == 512                          # generate's default for this model
    rc = main(["bench", str(d), "--rules", "qwen3-moe-cpu", "--prompt-lengths", "40", "--decode-tokens", "2",
               "--repeat", "1", "--probe-gib", "0.03", "--chunk-size", "16", "--json"])
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and res["prefill_chunk"] == 16 and res["prefill"]["40"] > 0
    assert main(["bench", str(d), "--rules", "qwen3-moe-cpu", "--repeat", "0"]) == 2
    assert main(["bench", str(d), "--rules", "qwen3-moe-cpu", "--chunk-size", "0"]) == 2
    assert "chunk size must be >= 1, got 0" in capsys.readouterr().err
    # the table (no --json) names every measure
    assert main(["bench", str(d), "--rules", "qwen3-moe-cpu", "--prompt-lengths", "16", "--decode-tokens", "2",
                 "--repeat", "1", "--probe-gib", "0.03"]) == 0
    out = capsys.readouterr().out
    for measure in ("prefill 16 tokens", "decode", "CPU read bandwidth", "decode roofline", "fraction of roofline"):
        assert measure in out, measure


def test_amx_tile_probe(capsys):
    """The tile-unit probe `bench experts --isa amx` reports around each measurement: one timing per
    worker where AMX is usable (on the device), a NativeError naming the probe elsewhere."""
    pool = native.Pool(2)
    if "amx" in native.usable_isas():
        us = native.probe_amx_gemm(pool)
        assert len(us) == 2 and all(0.5 < u < 5000 for u in us)
        rc = main(["bench", "experts", *TINY, "--quant", "bf16", "--batch", "20", "--threads", "2", "--isa", "amx", "--json"])
        assert rc == 0
        row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        p = row["amx_probe_us"]
        assert 0.5 < p["min"] <= min(p["before"], p["after"]) <= max(p["before"], p["after"]) <= p["max"]
    else:
        with pytest.raises(native.NativeError, match="AMX tile probe"):
            native.probe_amx_gemm(pool)


def test_tile_probe_summary():
    from ktinject.cli.bench import _tile_probe
    assert _tile_probe([4.3, 12.0, 4.4], [13.0, 4.2, 4.5]) == {"before": 4.4, "after": 4.5, "min": 4.2, "max": 13.0}


def test_experts_table_prints_the_tile_probe(capsys):
    """`bench experts --isa amx` without --json: the table, then each row's tile probe in a line."""
    from ktinject.cli.bench import _table
    row = {"quant": "q4_k", "batch": 512, "threads": 16, "isa": "amx", "ms_per_layer": 17.1, "tokens_per_s": 29941.0,
           "gbps": 18.2, "bandwidth_gbps": 109.0, "fraction": 0.17, "tflops": 3.1,
           "amx_probe_us": {"before": 12.5, "after": 12.7, "min": 4.2, "max": 14.8}}
    no_probe = {k: v for k, v in row.items() if k != "amx_probe_us"}
    _table([row, {**no_probe, "isa": "avx512"}])
    out = capsys.readouterr().out
    assert "q4_k batch 512, 16 threads: AMX tile probe" in out and "12.5 before, 12.7 after, range 4.2-14.8" in out
    assert out.count("AMX tile probe") == 1


@pytest.mark.parametrize("flags, message", [
    (["--batch", ""], "--batch must be"), (["--batch", "99999999999999999999"], "--batch must be"),
    (["--hidden", "0"], "--hidden must be >= 1"), (["--inter", "-5"], "--inter must be >= 1"),
    (["--topk", "-1"], "--topk must be in 1..8"), (["--topk", "0"], "--topk must be in 1..8"),
    (["--hidden", "100"], "--hidden 100 is not a multiple of the q8_0 block (32 values)"),
    (["--threads", ""], "--threads must be"), (["--gib", "nan"], "--gib must be > 0"),
    (["--probe-gib", "-1"], "--probe-gib must be > 0"), (["--seconds", "nan"], "--seconds must be >= 0"),
    (["--isa", "bogus"], "--isa 'bogus' is not an ISA path"),
    (["--rounds", "0"], "--rounds must be in 1..1000"),
    (["--hidden", "1048576", "--inter", "1048576"], "more than the"),
])
def test_bench_experts_bad_flags_are_one_message(capsys, flags, message):
    """Each bad flag is named before anything is allocated: no ZeroDivisionError, no torch or
    OverflowError traceback, no message about $KTINJECT_ISA for --isa."""
    assert main(["bench", "experts", *TINY, "--quant", "q8_0", "--threads", "1", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err.replace("\n", " ") and "Traceback" not in err


def test_down_type_follows_the_writer_fallbacks():
    """V2-Lite's 1408-value down rows take the type `ktinject synth` (and llama.cpp) writes for them."""
    from gguf import GGMLQuantizationType as QT

    from ktinject.cli.bench import down_type
    from ktinject.weights.gguf_write import FALLBACK
    for qt in (QT.Q4_K, QT.Q2_K, QT.Q3_K):
        assert down_type(qt, 1408) == FALLBACK[qt]
    assert down_type(QT.Q6_K, 1408) == QT.Q8_0 and down_type(QT.Q2_K, 1536) == QT.Q2_K
