#!/usr/bin/env bash
# Runs every benchmark on the GPU machine in one call and leaves the results under $OUT:
#   $OUT/all.log                  everything printed (each benchmark's table ends its section)
#   $OUT/results.tar              per-benchmark JSON, PNG and log
#   $OUT/paged_attention.png      the decode plot, for a quick look
# Carry .whl (FlashInfer's trimmed wheel and apache-tvm-ffi). Usage, from the repository root:
#   bash benchmarks/run_all.sh [--quick] [--no-build]
# --quick runs the benchmarks' short shape lists; --no-build skips building fp8kv (already built).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/fp8kv-bench-out}"
RESULTS=/tmp/fp8kv-bench
QUICK=""
BUILD=1
for arg in "$@"; do
  case "$arg" in
    --quick) QUICK="--quick" ;;
    --no-build) BUILD=0 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT" "$RESULTS"
export PYTHONUNBUFFERED=1

install_wheels() {
  if ! compgen -G ".whl/*.whl" > /dev/null; then
    echo "no .whl/ wheels carried: FlashInfer columns will be disabled"
    return
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} \
    || echo "installing .whl/*.whl failed: FlashInfer columns will say why"
}

run() {  # name, command...
  local name=$1 start
  shift
  echo "=== $name: $*"
  start=$(date +%s)
  "$@" 2>&1 | tee "$RESULTS/$name.log"
  echo "=== $name: exit ${PIPESTATUS[0]}, $(( $(date +%s) - start )) s"
}

main() {
  install_wheels
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  if [ "$BUILD" = 1 ]; then
    local start
    start=$(date +%s)
    FP8KV_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0a bash scripts/dev_install.sh || { echo "fp8kv build failed"; return 1; }
    echo "fp8kv build: $(( $(date +%s) - start )) s"
  fi
  run flashinfer_smoke python3 benchmarks/flashinfer_baseline.py
  for bench in paged_attention prefill reshape_and_cache kv_amax; do
    run "$bench" python3 "benchmarks/bench_$bench.py" $QUICK --json "$RESULTS/$bench.json" --png "$RESULTS/$bench.png"
  done
  tar -cf "$OUT/results.tar" -C "$RESULTS" .
  if [ -f "$RESULTS/paged_attention.png" ]; then cp "$RESULTS/paged_attention.png" "$OUT/"; fi
  echo "results: $OUT/results.tar"
}

main 2>&1 | tee "$OUT/all.log"
