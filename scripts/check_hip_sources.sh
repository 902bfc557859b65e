#!/usr/bin/env bash
# Compile-only check of the HIP (ROCm) sources, so broken HIP code fails CI on machines without an AMD
# GPU or a ROCm torch:
#   1. every csrc/hip/*.hip (kernels and launchers) compiled by hipcc for gfx90a (MI200) and gfx940
#      (MI300 family; Debian's ROCm 5.2 / clang 15 predates gfx942), warnings as errors;
#   2. csrc/gpu/bindings.cpp, built for HIP, syntax-checked against the installed torch's headers (a
#      CPU build is fine: the file uses only c10's device-generic API);
#   3. csrc/checks/check_numerics.cpp built and run on the host: the framework-free numerics the
#      kernels use (FP8 unpacking, 16-bit conversions) checked for every code;
#   4. the kernels' unmodified sources built against a host emulation of HIP (csrc/hip/emulation) and
#      run against independent references: cache bytes exact, amax exact, attention vs float64, for
#      the plain and the rotated cache recipes.
# Installs Debian's hipcc when missing (needs root and apt). Nothing is linked against ROCm torch and
# nothing runs on a GPU: see docs/amd.md.
set -euo pipefail
cd "$(dirname "$0")/.."

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f s", b - a }'; }

if ! command -v hipcc >/dev/null; then
  start=$(now)
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq hipcc >/dev/null
  echo "installed hipcc in $(elapsed "$start")"
fi
# hipcc targets NVIDIA when it finds nvcc; these sources are for AMD GPUs.
export HIP_PLATFORM=amd
ARCHS=(gfx90a gfx940)
TORCH_DIR=$(python3 -c "import os, torch; print(os.path.dirname(torch.__file__))")
ABI=$(python3 -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))")
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

start=$(now)
shopt -s nullglob
jobs=()
for src in csrc/hip/*.hip; do
  for arch in "${ARCHS[@]}"; do jobs+=("$src $arch"); done
done
[ ${#jobs[@]} -gt 0 ] || { echo "no HIP sources in csrc/hip" >&2; exit 1; }
# One hipcc per (source, architecture), in parallel; any failure fails the check.
printf '%s\n' "${jobs[@]}" | OUT="$out" xargs -P "$(nproc)" -L 1 bash -c '
  set -euo pipefail
  echo "hipcc --offload-arch=$1: $0"
  hipcc -std=c++17 -O3 -Wall -Werror --offload-arch="$1" -c "$0" -o "$OUT/$(basename "$0").$1.o"'
echo "hipcc: ${#jobs[@]} compilations in $(elapsed "$start")"

start=$(now)
echo "g++ (GPU bindings for HIP, torch headers): csrc/gpu/bindings.cpp"
g++ -std=c++17 -fsyntax-only -Wall -Werror -DFP8KV_WITH_HIP -D__HIP_PLATFORM_AMD__=1 -DUSE_ROCM=1 \
  -D_GLIBCXX_USE_CXX11_ABI="$ABI" -isystem "$TORCH_DIR/include" -isystem "$TORCH_DIR/include/torch/csrc/api/include" \
  csrc/gpu/bindings.cpp
echo "bindings: $(elapsed "$start")"

g++ -std=c++17 -O2 -Wall -Werror csrc/checks/check_numerics.cpp -o "$out/check_numerics"
"$out/check_numerics"

start=$(now)
echo "g++ (HIP kernels on the host emulation): csrc/hip/*.hip + csrc/hip/emulation/run_kernels.cpp"
g++ -std=c++20 -O1 -pthread -Wall -Werror -Wno-unknown-pragmas -DFP8KV_WITH_HIP -Icsrc/hip/emulation \
  -x c++ csrc/hip/*.hip -x none csrc/hip/emulation/run_kernels.cpp -o "$out/run_kernels"
"$out/run_kernels"
echo "emulation: $(elapsed "$start")"
echo "HIP sources compile"
