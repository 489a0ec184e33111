#!/bin/bash
# Batched check + benchmark on the lent machine (16-core Xeon with AVX-512/AMX). Run from the
# repository root:  bash native/device_check.sh [quick|full]   (logs go to $OUT)
# 1. builds the extension in place, 2. describes the CPU paths, 3. runs the C self-check driver
# (every ISA vs scalar) and the Python checks against gguf's dequantization for every ISA path,
# 4. runs the bench matrix (JSON lines in $OUT/bench.jsonl).
set -o pipefail
MODE=${1:-quick}
DEFAULT_OUT=/tmp/ktk_out
. scripts/device_env.sh
{ uname -r; lscpu | grep -E "Model name|^CPU\(s\)|Thread|NUMA|L3"; grep -o -E "avx512[a-z_0-9]*|amx[a-z_0-9]*" /proc/cpuinfo | sort -u | tr '\n' ' '; echo; free -g | head -2; } 2>&1 | tee "$OUT/hw.txt"
python3 -m ktinject.native.build 2>&1 | tail -3 | tee "$OUT/build.log" || exit 1
python3 -c "import json, ktinject.native as n; print(json.dumps(n.describe()))" | tee "$OUT/describe.json"
gcc -O2 -std=gnu11 -pthread -Inative $(ls native/*.c | grep -v amx_emulate_check) -lm -o /tmp/ktk_driver \
  && /tmp/ktk_driver > "$OUT/driver.log" 2>&1; echo "driver rc=$? $(tail -1 $OUT/driver.log)"
timeout 120 python3 native/device_check.py > "$OUT/check.log" 2>&1; echo "check rc=$? $(tail -1 $OUT/check.log)"
grep '"ok": false' "$OUT/check.log" | head -5
B="python3 -m ktinject bench experts --json --seconds 1"
if [ "$MODE" = quick ]; then
  $B --quant q4_k,q8_0,bf16 --batch 1 --threads 16,15,8 --gib 3 --probe-gib 4 2>&1 | tee -a "$OUT/bench.jsonl"
  for isa in amx avx512; do
    $B --quant q4_k,bf16 --batch 512 --threads 16 --gib 1 --probe-gib 2 --isa $isa 2>&1 | tee -a "$OUT/bench.jsonl"
  done
else
  if python3 -c "import pytest" 2>/dev/null; then
    timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_moe_operators.py -k "gpu or gguf or block" 2>&1 | tail -3 | tee "$OUT/pytest.log"
  else
    echo "pytest not installed there" | tee "$OUT/pytest.log"
  fi
  $B --quant q4_k,q8_0,bf16 --batch 1 --threads 4,8,15,16 --gib 3 --probe-gib 4 2>&1 | tee -a "$OUT/bench.jsonl"
  # A/B of two pool/kernel knobs at threads = cores (tagged through the "ab" field added below)
  KTINJECT_PREFETCH=0 $B --quant q4_k --batch 1 --threads 16 --gib 3 --probe-gib 4 2>&1 | sed 's/^{/{"ab": "prefetch=0", /' | tee -a "$OUT/bench.jsonl"
  KTINJECT_SPIN_US=0 $B --quant q4_k --batch 1 --threads 16 --gib 3 --probe-gib 4 2>&1 | sed 's/^{/{"ab": "spin_us=0", /' | tee -a "$OUT/bench.jsonl"
  for isa in amx avx512; do
    $B --quant q4_k,bf16 --batch 64,512 --threads 8,15,16 --gib 1 --probe-gib 2 --isa $isa 2>&1 | tee -a "$OUT/bench.jsonl"
  done
fi
echo done
