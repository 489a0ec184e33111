#!/usr/bin/env bash
# kt-kernel and ktinject on the same lent host, alternating: one V2-Lite routed-experts layer at batch 1
# and 512, by thread count (../shared/PERF.md's rows: 8, 15 and 16 threads). The peer's extension is
# carried in .peer/ (gitignored; scripts/peer_ktkernel.py says how to get it):
#   .peer/kt_kernel/_kt_kernel_ext_amx.cpython-312-x86_64-linux-gnu.so and .peer/kt_kernel.libs/
# Usage (device): bash scripts/device_peer.sh     (THREADS="16 8 15", SECONDS_PER=1.0, GIB=2, NO_AVX512=1)
# Output: $OUT/peer.jsonl (the peer's JSON lines), $OUT/ours.jsonl (ktinject bench's), $OUT/*.err
set -o pipefail
DEFAULT_OUT=peer_out
. scripts/device_env.sh
python3 -m ktinject.native.build 2>&1 | tail -1
EXT=$(ls .peer/kt_kernel/_kt_kernel_ext_amx*.so 2>/dev/null | head -1)
[ -n "$EXT" ] || echo "no peer extension in .peer/kt_kernel: only ktinject runs" >&2
grep -m1 "model name" /proc/cpuinfo; nproc
S=${SECONDS_PER:-1.0}; G=${GIB:-2}
ours() {   # label threads [bench flags]
  local label=$1 th=$2; shift 2
  timeout -s KILL 150 python3 -m ktinject bench experts --threads $th --gib $G --probe-gib 0.5 --seconds $S --rounds 2 \
    --json "$@" 2>>"$OUT/ours.err" | python3 -c "import sys, json
for l in sys.stdin:
    if not l.startswith('{'): continue
    r = json.loads(l); r['label'] = '$label'; print(json.dumps(r), flush=True)
    print('ours', '$label', {k: r.get(k) for k in ('quant', 'batch', 'threads', 'ms_per_layer', 'tflops', 'gbps', 'fraction', 'amx_probe_us')}, file=sys.stderr)" >> "$OUT/ours.jsonl"
}
peer() {   # threads
  [ -n "$EXT" ] || return 0
  timeout -s KILL 200 python3 scripts/peer_ktkernel.py --ext "$EXT" --threads $1 --gib $G --seconds $S 2>>"$OUT/peer.err" \
    | tee -a "$OUT/peer.jsonl"
}
for th in ${THREADS:-16 8 15}; do
  peer $th
  ours "decode" $th --quant q4_k,bf16 --batch 1
  ours "prefill-i4" $th --quant q4_k --batch 512 --isa amx --int8 --int8-bits 4
  ours "prefill-bf16-tiles" $th --quant bf16 --batch 512 --isa amx
done
[ -n "${NO_AVX512:-}" ] || ours "prefill-avx512" 16 --quant q4_k,bf16 --batch 512 --isa avx512
