#!/usr/bin/env bash
# BF16 tile copies against BF16 rows read in place, on the lent Xeon (one device call, about 5 minutes):
# the tile unit's state (amx_parts shapes), the BF16 tile GEMM from memory on 1, 8 and 15 cores at once
# (amx_parts streams: rows in place, tile-major, tile-major with the next block into L2), one V2-Lite layer
# at batch 512 with each part TSC-timed (amx_parts layer bf16w / bf16t / bf16d: rows in place, tile copies of all three
# matrices, of the down only; alternated over rounds), the bench's
# layer both ways ($KTINJECT_AMX_BF16_TILES=0|1), the AVX-512 path's BF16 layer on AVX512-BF16 dots and on f32 panels
# ($KTINJECT_AVX512_BF16_GROUPED=1|0), and the tests that run the copies on real tiles and the dots.
# Usage (device): bash scripts/device_bf16_tiles.sh  (ROUNDS=3, LAYER_THREADS="15"; logs under $OUT)
set -o pipefail
DEFAULT_OUT=bf16_tiles_out
. scripts/device_env.sh
python3 -m ktinject.native.build 2>&1 | tail -1
SRC="$(ls native/[a-z]*.c | grep -v -E '_check|driver')"
gcc -O3 -std=gnu11 -pthread -Inative scripts/amx_parts.c $SRC -lm -o /tmp/amx_parts || exit 1
gcc -O3 -std=gnu11 -pthread -DKTK_LAYER_TRACE -Inative scripts/amx_parts.c $SRC -lm -o /tmp/amx_parts_tr || exit 1
tile_state() { timeout 30 taskset -c 2 /tmp/amx_parts shapes 2>&1 | head -4 | tee -a "$OUT/shapes.txt"; }
tile_state
timeout 120 /tmp/amx_parts streams 1 8 15 | tee "$OUT/streams.txt"
for round in $(seq "${ROUNDS:-3}"); do
  for th in ${LAYER_THREADS:-15}; do
    for v in bf16w bf16t bf16d; do
      echo "== round $round, $th threads, $v" | tee -a "$OUT/layer.txt"
      timeout 120 /tmp/amx_parts_tr layer "$th" "$v" | tee -a "$OUT/layer.txt" | grep -E "ms per call|tile GEMM"
    done
  done
  tile_state
done
for round in 1 2; do
  for tiles in 0 1; do
    KTINJECT_AMX_BF16_TILES=$tiles timeout -s KILL 200 python3 -m ktinject bench experts --quant bf16 --batch 512 \
      --threads 15 --isa amx --gib 4 --probe-gib 1 --rounds 2 --json 2>>"$OUT/bench.err" | tee -a "$OUT/bench.jsonl" \
      | python3 -c "import sys, json
for l in sys.stdin:
    r = json.loads(l); print('bench', {k: r.get(k) for k in ('bf16_tiles', 'threads', 'ms_per_layer', 'tflops', 'gbps', 'amx_probe_us')})"
  done
done
# the AVX-512 path's BF16 layer on AVX512-BF16 dots and on f32 panels (the AMX ratio's other side)
for dots in 1 0; do
  KTINJECT_AVX512_BF16_GROUPED=$dots timeout -s KILL 200 python3 -m ktinject bench experts --quant bf16 --batch 512 \
    --threads 15 --isa avx512 --gib 4 --probe-gib 1 --rounds 2 --json 2>>"$OUT/bench.err" | tee -a "$OUT/bench_avx512.jsonl" \
    | python3 -c "import sys, json
for l in sys.stdin:
    r = json.loads(l); print('avx512 bench, dots $dots', {k: r.get(k) for k in ('threads', 'ms_per_layer', 'tflops', 'gbps')})"
done
timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_bf16_tiles.py tests/test_native_sanitize.py \
  tests/test_native_kernels.py -k "bf16 or sanitize or BF16" 2>&1 | tail -3 | tee "$OUT/tests.txt"
