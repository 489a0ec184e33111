#!/usr/bin/env bash
# One batched device run for the GPU operators: gpu-marked tests, then the GPU micro-benches.
# Usage (on the lent H200, from the repo root): bash scripts/gpu_check.sh [bench args...]
# Logs and results go to $OUT (or ./gpu_out when OUT is unset).
set -o pipefail
DEFAULT_OUT=gpu_out
. scripts/device_env.sh
{ nvidia-smi -L; python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'triton', triton.__version__)"; } 2>&1 | tee "$OUT/env.txt"
timeout ${TEST_TIMEOUT:-120} python3 -m pytest -q -m gpu -p no:cacheprovider -W ignore::FutureWarning \
  tests/test_int4_linear.py tests/test_mla_attention.py tests/test_generate_engine.py $(ls tests/test_gpu_*.py 2>/dev/null) \
  2>&1 | tee "$OUT/gpu_tests.log"
timeout ${BENCH_TIMEOUT:-165} python3 -m ktinject.bench_gpu --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
