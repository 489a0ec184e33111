#!/usr/bin/env bash
# One batched device call (the lent H200 + 16-core Xeon): build the native library, run every
# gpu-marked test, run the README's main job on CUDA, then synthesize real-shape GGUF models and
# benchmark them end to end with `ktinject bench`. Logs and JSON results go to $OUT.
# Usage, from the repo root: bash scripts/device_e2e.sh [tests] [gputests] [v2lite] [prefill] [qwen3] [layer] [profile] [decodeab] [convert] [twogpu] [twogpuprof] [cpulinear] [ab] [r16] [r16e2e] [r16sweep] [pool] [int4] [amx] [amxab] [amxtrace] [amxmode] [grouped] [decode] [chunkab] [fp8]
set -o pipefail
DEFAULT_OUT=e2e_out
. scripts/device_env.sh
steps=" ${*:-tests v2lite} "
{ nvidia-smi -L; lscpu | grep -E '^(Model name|CPU\(s\)|NUMA node\(s\))'; free -g | head -2
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/env.txt"
python3 -m ktinject.native.build 2>&1 | tail -2
python3 -m ktinject doctor 2>&1 | tee "$OUT/doctor.txt"
if [[ $steps == *" gputests "* ]]; then   # only the tests changed since the last full run
  timeout -s KILL 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_load_devices.py tests/test_hostjob.py \
    tests/test_overlays.py tests/test_gpu_experts.py tests/test_generate_engine.py tests/test_streamed_experts.py ${GPU_TESTS:-} 2>&1 | tee "$OUT/gputests.log" | tail -15
fi
if [[ $steps == *" tests "* ]]; then
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -m gpu -p no:cacheprovider -W ignore::FutureWarning --continue-on-collection-errors tests \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -25
  timeout 90 python3 -m ktinject run --prompt "Once upon a time" --max-new-tokens 32 2>&1 | tee "$OUT/run_default.txt" | tail -6
fi
bench() {   # name arch "rules..." [extra bench args]
  local name=$1 arch=$2 rules=$3 tag=${3// /+}; shift 3
  [ -f /tmp/$name.gguf ] || timeout 200 python3 -m ktinject synth --arch "$arch" --recipe q4_k_m --no-progress \
    --threads 16 /tmp/$name.gguf 2>&1 | tail -1
  timeout -s KILL ${BENCH_TIMEOUT:-200} python3 -m ktinject bench /tmp/$name.gguf --rules $rules --json "$@" \
    2> "$OUT/bench_${name}_${tag}.err" | tee "$OUT/bench_${name}_${tag}.json"
  tail -3 "$OUT/bench_${name}_${tag}.err"
}
amx_parts() {   # build scripts/amx_parts.c to $1 (extra compiler flags after it)
  local exe=$1; shift
  gcc -O3 -std=gnu11 -pthread "$@" -Inative scripts/amx_parts.c $(ls native/[a-z]*.c | grep -v -E "_check|driver") -lm \
    -o "$exe" 2>/dev/null || { echo "building $exe failed"; return 1; }
}
layer_line() {   # label file isa quants [ENV=VALUE]: one batch-512 layer bench, a line per quant into $OUT/file
  local label=$1 file=$2 isa=$3 quants=$4; shift 4
  env "$@" timeout -s KILL 90 python3 -m ktinject bench experts --quant $quants --batch 512 --threads 16 \
    --gib ${LAYER_GIB:-2} --probe-gib 0.25 --seconds ${LAYER_SECONDS:-1.5} --isa $isa --json 2>/dev/null | python3 -c "import sys, json
for l in sys.stdin:
    r = json.loads(l) if l.startswith('{') else None
    print('$label', {k: r.get(k) for k in ('quant', 'ms_per_layer', 'tflops', 'amx_probe_us')} if r else l.rstrip()[:200])" | tee -a "$OUT/$file"
}
amx_layer() { local label=$1 file=$2; shift 2; layer_line "$label" "$file" amx q4_k,bf16 "$@"; }
[[ $steps == *" v2lite "* ]] && bench v2lite deepseek-v2-lite deepseek-v2 --prompt-lengths 512,2048 --decode-tokens 64
[[ $steps == *" prefill "* ]] && bench v2lite deepseek-v2-lite deepseek-v2-gpu-prefill --prompt-lengths 512,2048,8192 --decode-tokens 16
[[ $steps == *" qwen3 "* ]] && bench qwen3 qwen3-30b-a3b qwen3-moe --prompt-lengths 512,2048 --decode-tokens 32
if [[ $steps == *" twogpu "* ]]; then   # bench the -2gpu overlays on two GPUs and the one-GPU packs, same machine
  for pair in "v2lite deepseek-v2-lite deepseek-v2" "qwen3 qwen3-30b-a3b qwen3-moe"; do
    set -- $pair
    for rules in $3 $3-2gpu; do
      bench $1 $2 $rules --prompt-lengths ${TWOGPU_PROMPTS:-512,2048} --decode-tokens 64
    done
  done
fi
if [[ $steps == *" profile "* ]]; then   # the hybrid decode step, broken down (full V2-Lite shape)
  [ -f /tmp/v2lite.gguf ] || timeout 200 python3 -m ktinject synth --arch deepseek-v2-lite --recipe q4_k_m --no-progress \
    --threads 16 /tmp/v2lite.gguf 2>&1 | tail -1
  for th in ${PROFILE_THREADS:-16}; do
    KTINJECT_THREADS=$th timeout 240 python3 scripts/profile_decode.py /tmp/v2lite.gguf ${PROFILE_ARGS:-} 2>&1 \
      | tee "$OUT/profile_decode_$th.txt" | grep -v Warning | tail -8
  done
fi
if [[ $steps == *" decodeab "* ]]; then   # A/B of the pool knobs on the graph decode step (one process each)
  [ -f /tmp/v2lite.gguf ] || timeout 200 python3 -m ktinject synth --arch deepseek-v2-lite --recipe q4_k_m --no-progress \
    --threads 16 /tmp/v2lite.gguf 2>&1 | tail -1
  timeout -s KILL 150 python3 scripts/profile_decode.py /tmp/v2lite.gguf --modes graph,eager ${PROFILE_ARGS:-} 2>&1 \
    | grep -E "decode|machine|CPU layers|signalled" | cut -c1-700
  for cfg in ${DECODEAB:-KTINJECT_HOSTJOB_SIGNAL=bell KTINJECT_HOSTJOB_SKIP=1 KTINJECT_HOSTJOB_SKIP=2}; do
    echo "== $cfg"
    env $cfg timeout -s KILL 100 python3 scripts/profile_decode.py /tmp/v2lite.gguf --modes graph --no-layers 2>&1 \
      | grep -E "decode|machine|signalled" | cut -c1-700
  done
fi
if [[ $steps == *" twogpuprof "* ]]; then   # the graph decode step, one GPU vs two: whole, GPU work alone, host round trips
  [ -f /tmp/v2lite.gguf ] || timeout 200 python3 -m ktinject synth --arch deepseek-v2-lite --recipe q4_k_m --no-progress \
    --threads 16 /tmp/v2lite.gguf 2>&1 | tail -1
  for rules in deepseek-v2 deepseek-v2-2gpu; do
    for cfg in KTINJECT_HOSTJOB_SKIP=0 KTINJECT_HOSTJOB_SKIP=2 KTINJECT_HOSTJOB_SKIP=1 ${TWOGPU_EXTRA:-}; do
      echo "== $rules $cfg"
      env $cfg timeout -s KILL 100 python3 scripts/profile_decode.py /tmp/v2lite.gguf --rules $rules --modes graph \
        --no-layers 2>&1 | grep -E "decode|threads over" | cut -c1-500
    done
  done
fi
if [[ $steps == *" cpulinear "* ]]; then   # CPU-only decode on the Xeon: float32 linears vs cpu_linear (GGUF blocks)
  for rules in "cpu-float deepseek-v2-cpu" deepseek-v2-cpu; do   # (the -cpu packs include cpu-linear)
    bench v2lite deepseek-v2-lite "$rules" ${CPULINEAR_ARGS:---prompt-lengths 512,2048 --decode-tokens 32 --repeat 3}
  done
fi
if [[ $steps == *" convert "* ]]; then   # ktinject convert of a real-shape random HF directory (CONVERT_LAYERS of V2-Lite's 27)
  timeout -s KILL 300 python3 scripts/make_hf_dir.py deepseek-v2-lite /tmp/v2lite-hf --layers ${CONVERT_LAYERS:-14} 2>&1 | tail -1 | tee "$OUT/convert.txt"
  ( time timeout -s KILL 400 python3 -m ktinject convert /tmp/v2lite-hf /tmp/v2lite-conv.gguf --preset q4_k_m --no-progress ) \
    2>&1 | grep -v -i tokenizer | tail -5 | tee -a "$OUT/convert.txt"
  python3 -c "import json,glob; from safetensors import safe_open; import math
n=sum(math.prod(s.get_slice(k).get_shape()) for f in glob.glob('/tmp/v2lite-hf/*.safetensors') for s in [safe_open(f,'pt')] for k in s.keys())
print(f'{n/1e9:.2f} B parameters')" | tee -a "$OUT/convert.txt"
  rm -rf /tmp/v2lite-hf /tmp/v2lite-conv.gguf
fi
if [[ $steps == *" ab "* ]]; then   # decode A/B in one process series, alternating (this host's noise is +-10-30%):
  # AB_CFGS: ";"-separated "ENV=VALUE rules..." (default: the zero-copy hand-over on and off, and host
  # functions; e.g. "KTINJECT_HOSTJOB_SIGNAL=bell scripts/rules/unfused.yaml deepseek-v2"), AB_ROUNDS rounds;
  # AB_MODEL=qwen3 benches Qwen3-30B-A3B instead (e.g. AB_CFGS="KTINJECT_REPACK=auto qwen3-moe;KTINJECT_REPACK=1 qwen3-moe")
  model=${AB_MODEL:-v2lite}; arch=deepseek-v2-lite; [ "$model" = qwen3 ] && arch=qwen3-30b-a3b
  [ -f /tmp/$model.gguf ] || timeout 200 python3 -m ktinject synth --arch $arch --recipe q4_k_m --no-progress \
    --threads 16 /tmp/$model.gguf 2>&1 | tail -1
  IFS=';' read -ra cfgs <<< "${AB_CFGS:-KTINJECT_HOSTJOB_ZEROCOPY=1 deepseek-v2;KTINJECT_HOSTJOB_ZEROCOPY=0 deepseek-v2;KTINJECT_HOSTJOB_SIGNAL=hostfn deepseek-v2}"
  for i in $(seq ${AB_ROUNDS:-3}); do
    for cfg in "${cfgs[@]}"; do
      set -- $cfg; env=$1; shift
      env $env timeout -s KILL 120 python3 -m ktinject bench /tmp/$model.gguf --rules "$@" --json --prompt-lengths 128 \
        --decode-tokens 64 --repeat 2 --probe-gib 2 2>/dev/null | python3 -c "import sys, json; r = json.loads(sys.stdin.read())
print('$model $env $*', {k: r[k] for k in ('decode_tokens_per_s', 'decode_mode', 'decode_handover', 'cpu_bandwidth_gbps', 'fraction')})" \
        | tee -a "$OUT/ab.txt"
    done
  done
fi
if [[ $steps == *" r16 "* ]]; then   # R16 repacked experts vs GGUF rows, alternating, R16_ROUNDS rounds: R16_ENVS, settings
  # each (several joined by commas), default "KTINJECT_REPACK=0 KTINJECT_REPACK=1"; e.g. the L2 prefetch on Q4_K copies:
  # R16_ENVS="KTINJECT_REPACK=auto KTINJECT_REPACK=1 KTINJECT_REPACK=1,KTINJECT_R16_PF_L2=1,KTINJECT_R16_PF=4096"
  python3 native/bench_dots.py --rows 256 --quant q4_k,q5_0,q8_0 --isa avx512 2>&1 | tee "$OUT/r16_dots.txt"
  for i in $(seq ${R16_ROUNDS:-2}); do
    for e in ${R16_ENVS:-KTINJECT_REPACK=0 KTINJECT_REPACK=1}; do
      (IFS=,; for kv in $e; do export "$kv"; done; unset IFS
       timeout -s KILL 150 python3 -m ktinject bench experts --quant ${R16_QUANTS:-q4_k,q8_0} --batch 1 \
        --threads ${R16_THREADS:-16,15} --gib 3 --probe-gib 2 --seconds 2 --json --trace 2>&1 | python3 -c "import sys, json
for l in sys.stdin:
    r = json.loads(l) if l.startswith('{') else None
    print('$e', {k: r[k] for k in ('quant', 'down_quant', 'threads', 'ms_per_layer', 'gbps', 'bandwidth_gbps', 'fraction')} if r else l.rstrip(),
          {k: r['trace_us'].get(k) for k in ('gate_up', 'down')} if r else '')" \
        | tee -a "$OUT/r16_ab.txt")
    done
  done
  for rp in 0 1; do   # prefill: the grouped paths dequantize R16 groups (AMX tiles from f32 rows)
    KTINJECT_REPACK=$rp timeout -s KILL 150 python3 -m ktinject bench experts --quant q4_k --batch 512 --threads 15 \
      --gib 2 --probe-gib 1 --seconds 3 --json 2>&1 | python3 -c "import sys, json
for l in sys.stdin:
    r = json.loads(l) if l.startswith('{') else None
    print('prefill repack=$rp', {k: r[k] for k in ('quant', 'isa', 'threads', 'ms_per_layer', 'tflops')} if r else l.rstrip())" \
      | tee -a "$OUT/r16_ab.txt"
  done
fi
if [[ $steps == *" r16e2e "* ]]; then   # V2-Lite decode end to end, R16 copies (auto) vs GGUF rows only, alternating
  [ -f /tmp/v2lite.gguf ] || timeout 200 python3 -m ktinject synth --arch deepseek-v2-lite --recipe q4_k_m --no-progress \
    --threads 16 /tmp/v2lite.gguf 2>&1 | tail -1
  for i in $(seq ${AB_ROUNDS:-2}); do
    for rp in 0 auto; do
      KTINJECT_REPACK=$rp timeout -s KILL 150 python3 -m ktinject bench /tmp/v2lite.gguf --rules deepseek-v2 --json \
        --prompt-lengths 128 --decode-tokens 64 --repeat 2 --probe-gib 2 2>/dev/null | python3 -c "import sys, json; r = json.loads(sys.stdin.read())
print('repack=$rp', {k: r[k] for k in ('decode_tokens_per_s', 'decode_mode', 'cpu_bandwidth_gbps', 'fraction')})" \
        | tee -a "$OUT/r16e2e.txt"
    done
  done
fi
if [[ $steps == *" r16sweep "* ]]; then   # open questions: Q4_K gate/up from R16 copies (prefetch distance x segments),
  # and Q6_K R16 at DeepSeek-V3's expert shape (its Q4_K_M down projections); one line per configuration, --trace phases
  for cfg in "KTINJECT_REPACK=0" "KTINJECT_REPACK=1" "KTINJECT_REPACK=1 KTINJECT_R16_PF=2368" \
             "KTINJECT_REPACK=1 KTINJECT_R16_PF=4736 KTINJECT_R16_SPLIT=1" "KTINJECT_REPACK=1 KTINJECT_R16_PF=2368 KTINJECT_R16_SPLIT=4" \
             "KTINJECT_REPACK=0"; do
    env $cfg timeout -s KILL 60 python3 -m ktinject bench experts --quant q4_k --batch 1 --threads 15 --gib 3 --probe-gib 1 \
      --seconds 2 --json --trace 2>/dev/null | python3 -c "import sys, json; r = json.loads(sys.stdin.read().splitlines()[-1])
print('q4_k $cfg', r['ms_per_layer'], r['fraction'], r['trace_us'])" | tee -a "$OUT/r16sweep.txt"
  done
  for rp in 0 1 0 1; do
    KTINJECT_REPACK=$rp timeout -s KILL 90 python3 -m ktinject bench experts --quant q6_k --hidden 7168 --inter 2048 \
      --experts 256 --topk 8 --batch 1 --threads 15 --gib 6 --probe-gib 1 --seconds 2 --json --trace 2>/dev/null \
      | python3 -c "import sys, json; r = json.loads(sys.stdin.read().splitlines()[-1])
print('q6_k V3 shape repack=$rp', r['ms_per_layer'], r['fraction'], r['trace_us'])" | tee -a "$OUT/r16sweep.txt"
  done
fi
if [[ $steps == *" pool "* ]]; then   # the CPU layers inside the decode step: late workers (the trace's latest start,
  # which workers, steal time), PAUSE-spinning vs plain loads (KTINJECT_SPIN_PAUSE), V2-Lite and Qwen3-30B-A3B
  for pair in "v2lite deepseek-v2-lite deepseek-v2" "qwen3 qwen3-30b-a3b qwen3-moe"; do
    set -- $pair
    [ -f /tmp/$1.gguf ] || timeout 200 python3 -m ktinject synth --arch $2 --recipe q4_k_m --no-progress \
      --threads 16 /tmp/$1.gguf 2>&1 | tail -1
    for pause in ${POOL_PAUSE:-1 0}; do
      echo "== $1 KTINJECT_SPIN_PAUSE=$pause"
      KTINJECT_SPIN_PAUSE=$pause timeout -s KILL 100 python3 scripts/profile_decode.py /tmp/$1.gguf --rules $3 --modes graph \
        2>&1 | grep -E "decode|machine|threads over|CPU layers" | cut -c1-900 | tee -a "$OUT/pool.txt"
    done
  done
fi
if [[ $steps == *" int4 "* ]]; then   # linear_int4's GEMV kernels: their gpu tests, then the launch-config sweep
  timeout -s KILL 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_int4_linear.py 2>&1 \
    | tee "$OUT/int4_tests.log" | tail -4
  timeout -s KILL ${SWEEP_TIMEOUT:-380} python3 scripts/int4_sweep.py --quick --budget ${SWEEP_BUDGET:-300} \
    > "$OUT/int4_sweep.txt" 2>&1
  grep -v "^JSON" "$OUT/int4_sweep.txt" | tail -45
fi
if [[ $steps == *" amx "* ]]; then   # the AMX grouped (prefill) path: its tests on the real tiles, the unit's own rate
  # on 1-16 threads, then batch 512 per layer on AMX (bench and per-phase trace) and on AVX-512
  timeout -s KILL 150 python3 -m pytest -q -p no:cacheprovider tests/test_native_kernels.py tests/test_r16.py \
    tests/test_amx_emulated.py 2>&1 | tee "$OUT/amx_tests.log" | tail -3
  gcc -O2 -pthread -mamx-tile -mamx-bf16 scripts/amx_peak.c -o /tmp/amx_peak && for t in 1 8 16; do /tmp/amx_peak $t; done
  timeout -s KILL 60 python3 -m ktinject bench experts --quant q4_k,bf16 --batch 512 --threads 16 --gib 2 --probe-gib 1 \
    --seconds 2 --isa amx --json 2>/dev/null | tee -a "$OUT/amx.jsonl" | cut -c1-300
  timeout -s KILL 60 python3 scripts/trace_layer.py q4_k 512 amx --threads 16 2>&1 | tail -1
  timeout -s KILL 90 python3 -m ktinject bench experts --quant q4_k,bf16 --batch 512 --threads 16 --gib 2 --probe-gib 1 \
    --seconds 2 --isa avx512 --json 2>/dev/null | tee -a "$OUT/amx.jsonl" | cut -c1-300
fi
if [[ $steps == *" amxab "* ]]; then   # open questions of the AMX layer (docs/benchmarks.md, twelfth session): the
  # tile GEMM by buffer placement and page size, then the layer with several items per claim, alternating
  amx_parts /tmp/amx_parts && timeout 60 /tmp/amx_parts place | tee "$OUT/amx_place.txt"
  for i in $(seq ${AB_ROUNDS:-2}); do
    for c in ${AMX_CLAIMS:-1 4 11}; do amx_layer "claim $c" amx_claim.txt KTINJECT_POOL_CLAIM=$c; done
  done
fi
if [[ $steps == *" amxtrace "* ]]; then   # each part's time inside one AMX layer (amx_parts layer, TSC counters
  # built in with -DKTK_LAYER_TRACE) on 16 and 1 threads, the next rows' prefetch on and off, alternating
  amx_parts /tmp/amx_parts_tr -DKTK_LAYER_TRACE
  for i in $(seq ${AB_ROUNDS:-2}); do
    for pf in 1 0; do
      echo "== KTINJECT_AMX_PREFETCH_NEXT=$pf" | tee -a "$OUT/amx_trace.txt"
      KTINJECT_AMX_PREFETCH_NEXT=$pf timeout 60 /tmp/amx_parts_tr layer 16 | tee -a "$OUT/amx_trace.txt"
    done
  done
  timeout 60 /tmp/amx_parts_tr layer 1 | tee -a "$OUT/amx_trace.txt"
fi
if [[ $steps == *" amxmode "* ]]; then   # the host's tile-unit speed over time (it moves by up to 3x): the hot
  # GEMM on three cores, then in 100 ms windows mixed with conversions and alone, then after gaps between calls
  amx_parts /tmp/amx_parts
  for c in 0 5 11; do echo "cpu $c: $(AP_QUICK=1 taskset -c $c /tmp/amx_parts data 2048)"; done | tee -a "$OUT/amx_mode.txt"
  taskset -c 5 timeout 30 /tmp/amx_parts duty | tee -a "$OUT/amx_mode.txt"
  taskset -c 3 timeout 30 /tmp/amx_parts gap | tee -a "$OUT/amx_mode.txt"
fi
if [[ $steps == *" grouped "* ]]; then   # the 8-bit grouped (prefill) path on AVX-512 against f32 panels, alternating,
  # then decode (batch 1) at 16 and 15 threads against the probe
  for i in $(seq ${AB_ROUNDS:-2}); do
    for g in 1 0; do layer_line "vnni $g" grouped.txt avx512 ${GROUPED_QUANTS:-q4_k,q8_0,q6_k} KTINJECT_VNNI_GROUPED=$g; done
  done
  timeout -s KILL 120 python3 -m ktinject bench experts --quant q4_k,q8_0,bf16 --batch 1 --threads 16,15 --gib 3 \
    --probe-gib 3 --seconds 2 --json 2>/dev/null | tee -a "$OUT/decode.jsonl" | python3 -c "import sys, json
for l in sys.stdin:
    r = json.loads(l); print({k: r.get(k) for k in ('quant', 'threads', 'ms_per_layer', 'gbps', 'bandwidth_gbps', 'fraction')})"
fi
if [[ $steps == *" decode "* ]]; then   # decode (batch 1) against the probe, each round beside its own probe pass:
  # the two callers alternating at 16 threads (DECODE_ROUNDS times), then Q4_K over thread counts (native caller)
  show() { python3 -c "import sys, json
for l in sys.stdin:
    r = json.loads(l); print({k: r.get(k) for k in ('quant', 'threads', 'caller', 'ms_per_layer', 'gbps', 'bandwidth_gbps', 'fraction', 'job_fraction')}, [x['fraction'] for x in r['rounds']])"; }
  for i in $(seq ${DECODE_ROUNDS:-2}); do
    for c in native python; do
      timeout -s KILL 150 python3 -m ktinject bench experts --quant ${DECODE_QUANTS:-q4_k,q8_0,bf16} --batch 1 --threads 16 \
        --gib 3 --probe-gib 3 --seconds 3 --rounds 6 --caller $c --json --trace 2>/dev/null | tee -a "$OUT/decode.jsonl" | show
    done
  done
  timeout -s KILL 150 python3 -m ktinject bench experts --quant q4_k --batch 1 --threads ${DECODE_THREADS:-1,4,8,12,15,16} \
    --gib 3 --probe-gib 3 --seconds 2 --rounds 4 --json --trace 2>/dev/null | tee -a "$OUT/decode_threads.jsonl" | show
fi
if [[ $steps == *" chunkab "* ]]; then   # prefill by chunk size (CPU experts on AMX convert every weight once per
  # chunk, so larger chunks amortize it), V2-Lite hybrid, alternating; CHUNKS: the sizes
  for i in $(seq ${AB_ROUNDS:-2}); do
    for c in ${CHUNKS:-512 2048}; do
      bench v2lite deepseek-v2-lite deepseek-v2 --prompt-lengths 8192 --decode-tokens 8 --repeat 1 --chunk-size $c >/dev/null
      python3 -c "import json; r = json.load(open('$OUT/bench_v2lite_deepseek-v2.json'))
print('chunk $c', r['prefill_chunk'], r['prefill'])" | tee -a "$OUT/chunkab.txt"
    done
  done
fi
if [[ $steps == *" fp8 "* ]]; then   # linear_fp8's gpu tests (scaled_mm and the fp8 GEMV), then bench_gpu's fp8 and int4
  timeout -s KILL 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_fp8.py 2>&1 | tee "$OUT/fp8_tests.log" | tail -4
  timeout -s KILL 300 python3 -m ktinject.bench_gpu --only fp8,int4 --out "$OUT" > "$OUT/bench_gpu.log" 2>&1
  tail -3 "$OUT/bench_gpu.log"; cat "$OUT/bench_gpu.md" 2>/dev/null
fi
if [[ $steps == *" layer "* ]]; then   # streamed vs native CPU experts per prompt length (threshold choice)
  timeout 120 python3 -c "from ktinject.operators.streamed_experts import bench_layer as b; [print(r) for r in b()]" \
    2>&1 | tee "$OUT/stream_layer.txt" | tail -12
fi
exit 0
