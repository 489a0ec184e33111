#!/usr/bin/env bash
# Q4_K decode from R16 copies (KTINJECT_REPACK=1) against GGUF rows (the default), alternating, at
# 16 threads, with the workers' tile probe beside each row: does R16 pay when the host's cores are
# slow (tile probe ~12 us) if not when they are fast (~4.3 us)? Seventeenth session, device run 3.
. scripts/device_env.sh
python3 -m ktinject.native.build 2>&1 | tail -1
show() { python3 -c "import sys, json
for l in sys.stdin:
    r = json.loads(l); t = r.get('trace_us', {}); print($1, {k: r.get(k) for k in ('quant', 'threads', 'ms_per_layer', 'gbps', 'bandwidth_gbps', 'fraction', 'job_ms', 'amx_probe_us')}, {k: t.get(k) for k in ('gate_up', 'down', 'done', 'wait')})"; }
for i in $(seq ${R16_ROUNDS:-3}); do
  for rp in 1 auto; do
    KTINJECT_REPACK=$rp timeout -s KILL 100 python3 -m ktinject bench experts --quant q4_k --batch 1 --threads ${R16_THREADS:-16} \
      --gib 3 --probe-gib 3 --seconds 2 --rounds 4 --json --trace 2>/dev/null | tee -a "$OUT/r16_state.jsonl" | show "'repack $rp'"
  done
done
