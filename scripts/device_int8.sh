#!/usr/bin/env bash
# The AMX-INT8 prefill path on the lent Xeon (one device call): its tests on the real tiles (the
# I8 tests, the emulated-tile check, the sanitizer driver, whose I8 layer runs on real AMX-INT8
# there), then batch-512 V2-Lite layers, alternating the bf16 tiles, the 8-bit tiles (--int8) and
# AVX-512, at 16 threads and at 8 and 15 (kt-kernel's rows in ../shared/PERF.md), and the layer's
# error against the AVX-512 path's. Logs and JSON go to $OUT.
# Usage, from the repository root: bash scripts/device_int8.sh
# (ROUNDS="1 2 3", THREAD_SWEEP="8 15" or "", NO_AVX512=1, TRACE=--trace: per-phase times; NO_ERROR=1;
#  PF_SWEEP="0 4 8": only the I8 GEMM at these prefetch distances, twice over; OVERLAP_AB=1: its scaling
#  overlapped with the next group's tile work or not, three times over; GROUP_AB="256,128 256,704": the
#  I8 copies' group sizes (gate/up,down: --int8-group), alternating, twice over, then their errors;
#  AB_ENV="KTINJECT_AMX_I8_PREFETCH=8 KTINJECT_AMX_I8_PREFETCH=0": the I8 layer under each setting
#  (several at once joined by commas: "A=1,B=2"), alternating, twice over (AB_ROUNDS="1 2"), at each of
#  AB_THREADS (default 16), on AB_QUANTS (default q4_k,bf16), with AB_FLAGS added ("--int8-bits 4": I4);
#  AB_ONLY=1: stop after it; NO_TESTS=1: no tests first; PARTS=1: first scripts/amx_parts.c i8 on one core; BITS_AB=1: I8 against I4
#  copies (--int8-bits 4; BITS_QUANTS, default q4_k), alternating, at 16 threads twice over and once at
#  each THREAD_SWEEP count,
#  instead of the default rows, then the errors with I4 among them)
set -o pipefail
DEFAULT_OUT=int8_out
. scripts/device_env.sh
python3 -m ktinject.native.build 2>&1 | tail -1
[ -n "${NO_TESTS:-}" ] || timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_i8.py tests/test_amx_emulated.py tests/test_native_sanitize.py \
  tests/test_r16.py -k "not repacked or amx" 2>&1 | tee "$OUT/tests.log" | tail -4
line() {   # label isa threads quants [bench flags]
  local label=$1 isa=$2 th=$3 q=$4; shift 4
  timeout -s KILL 120 python3 -m ktinject bench experts --quant $q --batch 512 --threads $th --gib ${GIB:-2} --probe-gib 0.25 \
    --seconds ${SECONDS_PER:-1.5} --rounds 2 --isa $isa --json "$@" 2>>"$OUT/bench.err" | python3 -c "import sys, json
for l in sys.stdin:
    r = json.loads(l) if l.startswith('{') else None
    print('$label', {k: r.get(k) for k in ('quant', 'threads', 'int8_prefill', 'int8_bits', 'int8_group', 'ms_per_layer', 'tflops', 'amx_probe_us', 'trace_us')} if r else l.rstrip()[:300])" | tee -a "$OUT/layers.txt"
}
if [ -n "${PARTS:-}" ]; then   # the I8 GEMM alone: hot, cold, cold with the next block prefetched
  gcc -O3 -std=gnu11 -pthread -Inative scripts/amx_parts.c $(ls native/[a-z]*.c | grep -v -E "_check|driver") -lm \
    -o /tmp/amx_parts 2>/dev/null && taskset -c 2 /tmp/amx_parts i8 > "$OUT/parts_i8.txt"
  grep -E "tokens (48|96)" "$OUT/parts_i8.txt" | grep -E "G=(256|704)"
fi
if [ -n "${AB_ENV:-}" ]; then   # A/B of environment settings on the I8 layer, alternating
  for round in ${AB_ROUNDS:-1 2}; do
    for th in ${AB_THREADS:-16}; do
      for e in $AB_ENV; do
        (IFS=,; for kv in $e; do export "$kv"; done; unset IFS
         line "amx-int8 $e t$th r$round" amx $th ${AB_QUANTS:-q4_k,bf16} --int8 ${AB_FLAGS:-} $TRACE)
      done
    done
  done
  [ -n "${AB_ONLY:-}" ] && exit 0   # AB_ONLY=1: nothing after the A/B
fi
if [ -n "${GROUP_AB:-}" ]; then   # A/B of the I8 copies' group sizes, alternating
  for round in 1 2; do
    for gg in $GROUP_AB; do line "amx-int8 g$gg r$round" amx ${GROUP_THREADS:-16} q4_k,bf16 --int8 --int8-group ${gg/,/ } $TRACE; done
  done
fi
if [ -n "${OVERLAP_AB:-}" ]; then   # A/B of the I8 GEMM's overlapped scaling, alternating
  for round in 1 2 3; do
    for ov in 1 0; do KTINJECT_AMX_I8_OVERLAP=$ov line "amx-int8 overlap$ov r$round" amx 16 q4_k,bf16 --int8; done
  done
  exit 0
fi
if [ -n "${PF_SWEEP:-}" ]; then   # A/B of the I8 GEMM's prefetch distance (k-steps), alternating
  for round in 1 2; do
    for pf in $PF_SWEEP; do KTINJECT_AMX_I8_PREFETCH=$pf line "amx-int8 pf$pf r$round" amx 16 q4_k,bf16 --int8; done
  done
  exit 0
fi
if [ -n "${BITS_AB:-}" ]; then   # I8 against I4 copies, alternating
  for round in 1 2; do
    for b in 8 4; do line "amx-int$b r$round" amx 16 ${BITS_QUANTS:-q4_k} --int8 --int8-bits $b $TRACE; done
  done
  for th in ${THREAD_SWEEP-8 15}; do
    for b in 8 4; do line "amx-int$b t$th" amx $th ${BITS_QUANTS:-q4_k} --int8 --int8-bits $b; done
  done
  [ -n "${NO_AVX512:-}" ] || line "avx512" avx512 16 ${BITS_QUANTS:-q4_k}
else
  for round in ${ROUNDS:-1 2}; do
    line "amx-bf16 r$round" amx 16 q4_k,bf16 $TRACE
    line "amx-int8 r$round" amx 16 q4_k,bf16 --int8 $TRACE
    [ -n "${NO_AVX512:-}" ] || line "avx512 r$round" avx512 16 q4_k,bf16
  done
  for th in ${THREAD_SWEEP-8 15}; do
    line "amx-int8 t$th" amx $th q4_k,bf16 --int8
    line "amx-bf16 t$th" amx $th q4_k,bf16
  done
fi
[ -n "${NO_ERROR:-}" ] || timeout 200 python3 - <<'PY' 2>&1 | tee "$OUT/error.txt"
import os
import sys
import torch
sys.path.insert(0, "tests")
from test_native_util import ref_moe
from ktinject import native
from ktinject.native.synth import parse_quant
from ktinject.cli.bench import _make_layers, down_type
from ktinject.testing import random_routing
E, H, I, k, T = 64, 2048, 1408, 6, 512
for q in ("q4_k", "bf16"):
    qt = parse_quant(q)
    g, u, d = _make_layers(qt, down_type(qt, I), E, H, I, 0.01)[0][0]
    x = torch.randn(T, H)
    ids, w = random_routing(T, E, k, 0)
    pool = native.Pool(16)
    deq = [native.dequant_rows(pool, m.ggml_type, m.data, m.cols).reshape(E, m.rows, m.cols) for m in (g, u, d)]
    ref = ref_moe(x, ids, w, *deq)
    groups = [tuple(int(v) for v in gg.split(",")) for gg in os.environ.get("GROUP_AB", "").split()]
    for name, kw in (("avx512 8-bit tokens", {"isa": "avx512"}), ("amx bf16 tiles", {"isa": "amx"}),
                     ("amx int8 tiles", {"isa": "amx", "int8_prefill": True}),
                     ("amx int8 tiles, I4 copies", {"isa": "amx", "int8_prefill": True, "int8_bits": 4}),
                     *((f"amx int8 tiles, groups {gg}", {"isa": "amx", "int8_prefill": True, "int8_group": gg})
                       for gg in groups)):
        out = native.MoEKernel(g, u, d, pool=pool, **kw)(x, ids, w)
        print(q, name, "relative error vs float64:", round(float((out.double() - ref.double()).norm() / ref.double().norm()), 5))
PY
