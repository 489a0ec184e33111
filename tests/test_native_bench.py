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


def test_bench_experts_json(capsys):
    rc = main(["bench", "experts", *TINY, "--quant", "q4_k,bf16", "--batch", "1,20", "--threads", "2", "--json"])
    assert rc == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(rows) == 4
    for r in rows:
        for key in ("quant", "batch", "threads", "gbps", "bandwidth_gbps", "fraction", "tokens_per_s",
                    "ms_per_layer", "tflops"):
            assert key in r
        assert r["gbps"] > 0 and r["bandwidth_gbps"] > 0 and r["threads"] == 2
        assert abs(r["fraction"] - r["gbps"] / r["bandwidth_gbps"]) < 0.01
    assert {r["quant"] for r in rows} == {"q4_k", "bf16"} and {r["batch"] for r in rows} == {1, 20}


def test_bench_table_and_errors(capsys):
    assert main(["bench", "experts", *TINY, "--quant", "q8_0", "--threads", "1"]) == 0
    assert "routed-experts layer" in capsys.readouterr().out
    assert main(["bench", "experts", *TINY, "--quant", "q3_k"]) == 2
    assert "q3_k" in capsys.readouterr().err
    assert main(["bench", "some-model-dir"]) == 2
    assert "allowed: experts" in capsys.readouterr().err
