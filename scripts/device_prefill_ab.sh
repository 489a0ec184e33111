#!/usr/bin/env bash
# A/B of environment settings on the AMX prefill layer (one V2-Lite layer, batch 512) on the lent host,
# alternating settings inside each round (in reverse order every other round): Q4_K from I4 copies (--int8 --int8-bits 4) and BF16 on bf16 tiles.
# Usage (device): AB_ENV="KTINJECT_DOWN_ACC=0 KTINJECT_DOWN_ACC=1" bash scripts/device_prefill_ab.sh
#   (ISA=avx512 GIB=0.3 for a dry run off the device; several variables in one setting joined by commas: "A=1,B=2"; "-" for no change; AB_THREADS="8 15",
#    AB_ROUNDS="1 2", AB_LINES="i4 bf16" (add "peer" for kt-kernel's INT4 and BF16 lines, carried in .peer/ as
#    scripts/device_peer.sh says, once a round and thread count), SECONDS_PER=1.0, TRACE=--trace)
# Output: $OUT/ab.jsonl (the bench's JSON lines with the setting), one summary line each on stdout; $OUT/peer.jsonl.
set -o pipefail
DEFAULT_OUT=ab_out
. scripts/device_env.sh
python3 -m ktinject.native.build 2>&1 | tail -1
line() {   # setting threads label [bench flags]
  local e=$1 th=$2 label=$3; shift 3
  (if [ "$e" != "-" ]; then IFS=,; for kv in $e; do export "$kv"; done; unset IFS; fi
   timeout -s KILL 150 python3 -m ktinject bench experts --batch 512 --threads $th --isa ${ISA:-amx} --gib ${GIB:-2} --probe-gib 0.25 \
     --seconds ${SECONDS_PER:-1.0} --rounds 2 --json ${TRACE:-} "$@" 2>>"$OUT/ab.err") | python3 -c "import sys, json
for l in sys.stdin:
    if not l.startswith('{'): continue
    r = json.loads(l); r['setting'] = '$e'; r['label'] = '$label'
    open('$OUT/ab.jsonl', 'a').write(json.dumps(r) + '\n')
    tr = r.get('trace_us') or {}
    print('$label', '$e', 't$th', r['quant'], r['ms_per_layer'], 'ms', r.get('tflops'), 'TFLOPS', 'probe', r.get('amx_probe_us'),
          {k: tr[k] for k in ('quantize_x', 'gate_up', 'quantize_h', 'down') if k in tr})"
}
envs=(${AB_ENV:--}); n=0
for round in ${AB_ROUNDS:-1 2}; do
  # every other round takes the settings in reverse order: the host's tile unit changes speed over tens of
  # seconds (docs/benchmarks.md, fourteenth session), and in a fixed order it can follow one setting (twenty-eighth)
  order=("${envs[@]}")
  if [ $((n++ % 2)) = 1 ]; then order=(); for ((i = ${#envs[@]} - 1; i >= 0; i--)); do order+=("${envs[i]}"); done; fi
  for th in ${AB_THREADS:-8 15}; do
    for e in "${order[@]}"; do
      for l in ${AB_LINES:-i4 bf16}; do
        case $l in
          i4) line "$e" $th "i4 r$round" --quant q4_k --int8 --int8-bits 4 ;;
          bf16) line "$e" $th "bf16 r$round" --quant bf16 ;;
          peer) [ "$e" = "${envs[0]}" ] || continue   # kt-kernel's INT4 and BF16 at batch 512, once a round and thread count
                EXT=$(ls .peer/kt_kernel/_kt_kernel_ext_amx*.so 2>/dev/null | head -1)
                [ -n "$EXT" ] || { echo "no peer extension in .peer/kt_kernel (scripts/device_peer.sh)" >&2; continue; }
                timeout -s KILL 150 python3 scripts/peer_ktkernel.py --ext "$EXT" --threads $th --methods int4,bf16 --batch 512 \
                  --gib ${GIB:-2} --seconds ${SECONDS_PER:-1.0} 2>>"$OUT/ab.err" | grep '^{' | tee -a "$OUT/peer.jsonl" ;;
        esac
      done
    done
  done
done
