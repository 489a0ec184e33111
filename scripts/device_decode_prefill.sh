. scripts/device_env.sh
python3 -m ktinject.native.build 2>&1 | tail -1
show() { python3 -c "import sys, json
for l in sys.stdin:
    r = json.loads(l); print({k: r.get(k) for k in ('quant', 'batch', 'threads', 'isa', 'caller', 'ms_per_layer', 'gbps', 'bandwidth_gbps', 'fraction', 'job_ms', 'job_fraction', 'tflops', 'amx_probe_us')}, [x['fraction'] for x in r['rounds']])"; }
timeout -s KILL 120 python3 -m ktinject bench experts --quant q4_k --batch 1 --threads 1,4,8,16 --gib 3 --probe-gib 3 --seconds 2 --rounds 4 --json --trace 2>/dev/null | tee -a "$OUT/threads.jsonl" | show
timeout -s KILL 120 python3 -m ktinject bench experts --quant q4_k,q8_0,bf16 --batch 1 --threads 16 --gib 3 --probe-gib 3 --seconds 3 --rounds 6 --json 2>/dev/null | tee -a "$OUT/decode16.jsonl" | show
for isa in amx avx512 amx; do
timeout -s KILL 150 python3 -m ktinject bench experts --quant q4_k,bf16 --batch 512 --threads 16 --gib 2 --probe-gib 0.5 --seconds 2 --rounds 2 --isa $isa --json --trace 2>/dev/null | tee -a "$OUT/prefill.jsonl" | show
done
