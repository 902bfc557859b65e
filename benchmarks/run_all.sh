#!/usr/bin/env bash
# Builds fp8kv as README.md's Install section says, then runs every benchmark. Results go to $OUT
# (default: out/benchmarks):
#   all.log                          everything printed; each benchmark's table ends its section
#   <benchmark>.json                 every measurement (paged_attention, prefill, reshape_and_cache, kv_amax)
#   paged_attention.png, prefill.png the attention plots (any JSON: python benchmarks/plot.py X.json)
# FlashInfer is optional: it is used when importable, else from the wheels in .whl/ if there are
# any (e.g. the trimmed wheel of benchmarks/flashinfer_wheel.py, for machines without network).
# Usage, from anywhere:
#   bash benchmarks/run_all.sh [--quick] [--no-build]
# --quick runs the benchmarks' short shape lists; --no-build uses the fp8kv already installed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/benchmarks}"
QUICK=""
BUILD=1
for arg in "$@"; do
  case "$arg" in
    --quick) QUICK="--quick" ;;
    --no-build) BUILD=0 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

install_flashinfer_wheels() {
  if python3 -c "import flashinfer" 2>/dev/null; then
    return
  fi
  if ! compgen -G ".whl/*.whl" > /dev/null; then
    echo "FlashInfer is not installed and .whl/ holds no wheels: FlashInfer's columns will be left out"
    return
  fi
  local site=/tmp/fp8kv-bench-site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
    && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" \
    || echo "installing .whl/*.whl failed: FlashInfer's columns will say why"
}

build_fp8kv() {  # README.md, Install
  pip --version
  pip install "scikit-build-core>=0.10" ninja \
    && pip install --no-build-isolation . \
    && python3 -c "import fp8kv, sys; sys.exit(0 if fp8kv.has_cuda_kernels() else 'fp8kv was built without CUDA kernels')"
}

run() {  # name, command...: runs it between two marked lines, returns its status
  local name=$1 start status
  shift
  echo "=== $name: $*"
  start=$(date +%s)
  "$@"
  status=$?
  echo "=== $name: exit $status, $(( $(date +%s) - start )) s"
  return $status
}

main() {
  install_flashinfer_wheels
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  if [ "$BUILD" = 1 ]; then
    run build build_fp8kv || { echo "the fp8kv build failed"; return 1; }
  fi
  if python3 -c "import flashinfer" 2>/dev/null; then
    run flashinfer_smoke python3 benchmarks/flashinfer_baseline.py
  fi
  for bench in paged_attention prefill; do
    run "$bench" python3 "benchmarks/bench_$bench.py" $QUICK --json "$OUT/$bench.json" --png "$OUT/$bench.png"
  done
  for bench in reshape_and_cache kv_amax; do
    run "$bench" python3 "benchmarks/bench_$bench.py" $QUICK --json "$OUT/$bench.json"
  done
  echo "results: $OUT"
}

main 2>&1 | tee "$OUT/all.log"
