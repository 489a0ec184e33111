#!/usr/bin/env bash
# Decode and prefill by thread count against kt-kernel's rows in ../shared/PERF.md (8, 15 and 16
# threads), with the callers alternating at 16 threads first. Seventeenth session, device run 4.
. scripts/device_env.sh
python3 -m ktinject.native.build 2>&1 | tail -1
show() { python3 -c "import sys, json
for l in sys.stdin:
    r = json.loads(l); print({k: r.get(k) for k in ('quant', 'batch', 'threads', 'isa', 'caller', 'ms_per_layer', 'gbps', 'bandwidth_gbps', 'fraction', 'tflops')}, (r.get('amx_probe_us') or {}).get('before'), [x['fraction'] for x in r['rounds']])"; }
for c in native python native python; do
  timeout -s KILL 100 python3 -m ktinject bench experts --quant q4_k,bf16 --batch 1 --threads 16 --gib 3 --probe-gib 3 \
    --seconds 2 --rounds 4 --caller $c --json 2>/dev/null | tee -a "$OUT/callers.jsonl" | show
done
timeout -s KILL 150 python3 -m ktinject bench experts --quant q4_k,bf16 --batch 1 --threads 1,2,4,8,15,16 --gib 3 --probe-gib 3 \
  --seconds 1 --rounds 3 --json 2>/dev/null | tee -a "$OUT/decode_threads.jsonl" | show
timeout -s KILL 150 python3 -m ktinject bench experts --quant q4_k,bf16 --batch 512 --threads 8,15,16 --gib 2 --probe-gib 0.5 \
  --seconds 1.5 --rounds 2 --json 2>/dev/null | tee -a "$OUT/prefill_threads.jsonl" | show
