#!/usr/bin/env bash
# Builds fp8kv as README.md's Install section says, then runs every benchmark. Results go to $OUT
# (default: out/benchmarks):
#   all.log                          everything printed; each benchmark's table ends its section
#   <benchmark>.json                 every measurement (paged_attention, prefill, reshape_and_cache, kv_amax)
#   paged_attention.png, prefill.png the attention plots (any JSON: python benchmarks/plot.py X.json)
# Usage, from anywhere:
#   bash benchmarks/run_all.sh [--quick] [--no-build] [--wheels DIR]
# --quick runs the benchmarks' short shape lists; --no-build uses the fp8kv already installed;
# --wheels DIR installs the wheels in DIR first, without network (e.g. the trimmed FlashInfer wheel
# of benchmarks/flashinfer_wheel.py and apache-tvm-ffi). FlashInfer's columns run when it imports.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/benchmarks}"
QUICK=""
BUILD=1
WHEELS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK="--quick" ;;
    --no-build) BUILD=0 ;;
    --wheels) WHEELS="${2:?--wheels needs a directory}"; shift ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done
if [ -n "$WHEELS" ] && ! compgen -G "$WHEELS/*.whl" > /dev/null; then
  echo "--wheels $WHEELS: no .whl files there" >&2
  exit 2
fi
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

install_wheels() {  # into a private folder put first on PYTHONPATH; no network, no dependencies
  local site=/tmp/fp8kv-bench-site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$WHEELS"/*.whl \
    && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" \
    || echo "installing $WHEELS/*.whl failed: FlashInfer's columns will say why"
}

build_fp8kv() {  # README.md, Install: the commands that install fp8kv, as written there (steps 1 and 3)
  if python3 -c 'import sys; sys.exit(sys.prefix != sys.base_prefix)'; then  # python3 runs in no virtual environment
    python3 -m venv --system-site-packages .venv \
      && . .venv/bin/activate \
      || return
  fi
  python3 -m pip --version
  python3 -m pip install "scikit-build-core>=0.10" "cmake>=3.24" ninja \
    && python3 -m pip install --no-build-isolation ".[hf]" \
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
  if [ -n "$WHEELS" ]; then install_wheels; fi
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  if [ "$BUILD" = 1 ]; then
    run build build_fp8kv || { echo "the fp8kv build failed"; return 1; }
  fi
  if python3 -c "import flashinfer" 2>/dev/null; then
    run flashinfer_smoke python3 benchmarks/flashinfer_baseline.py
  else
    echo "FlashInfer does not import: its columns will be left out"
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
