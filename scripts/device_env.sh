# Sourced by the device scripts (scripts/device_e2e.sh, scripts/gpu_check.sh, native/device_check.sh):
# installs the carried wheels (.whl: gguf, cffi, pycparser, jsonschema...) that the lent machine's
# image lacks, puts them and the working tree on PYTHONPATH, and makes $OUT.
OUT=${OUT:-${DEFAULT_OUT:-device_out}}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing the carried wheels failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
