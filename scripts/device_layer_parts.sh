#!/usr/bin/env bash
# Where the AMX prefill layer's time goes on the lent host (one device call): the I4 copies' tile GEMM alone
# on one core (scripts/amx_parts.c i8: a 32-row block, hot and cold), then one V2-Lite layer at batch 512
# with I4 copies, each part TSC-timed inside it (amx_parts layer, built with -DKTK_LAYER_TRACE) at 1, 8 and
# 16 threads, the GEMM on several threads at once (amx_parts more), and the bench's phase trace at 8 threads
# for I4 copies and bf16 tiles. Usage (device): bash scripts/device_layer_parts.sh  (LAYER_THREADS="1 8 16")
set -o pipefail
DEFAULT_OUT=parts_out
. scripts/device_env.sh
python3 -m ktinject.native.build 2>&1 | tail -1
SRC="$(ls native/[a-z]*.c | grep -v -E '_check|driver')"
gcc -O3 -std=gnu11 -pthread -Inative scripts/amx_parts.c $SRC -lm -o /tmp/amx_parts || exit 1
gcc -O3 -std=gnu11 -pthread -DKTK_LAYER_TRACE -Inative scripts/amx_parts.c $SRC -lm -o /tmp/amx_parts_tr || exit 1
timeout 120 taskset -c 2 /tmp/amx_parts i8 > "$OUT/parts_i8.txt"; grep -E "tokens 48" "$OUT/parts_i8.txt" | grep -E "G=(256|704)"
for th in ${LAYER_THREADS:-1 8 16}; do timeout 120 /tmp/amx_parts_tr layer $th i4 | tee -a "$OUT/layer.txt"; done
for q in "q4_k --int8 --int8-bits 4" "bf16"; do
  timeout -s KILL 150 python3 -m ktinject bench experts --quant $q --batch 512 --threads 8 --isa amx --gib 2 --probe-gib 0.25 \
    --seconds 1.0 --rounds 2 --json --trace 2>>"$OUT/bench.err" | tee -a "$OUT/bench.jsonl" | python3 -c "import sys, json
for l in sys.stdin:
    r = json.loads(l); print('bench', {k: r.get(k) for k in ('quant', 'threads', 'int8_bits', 'ms_per_layer', 'tflops', 'amx_probe_us', 'trace_us')})"
done
timeout 150 /tmp/amx_parts more > "$OUT/parts_more.txt"; tail -40 "$OUT/parts_more.txt"
