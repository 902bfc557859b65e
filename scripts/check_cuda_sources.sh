#!/usr/bin/env bash
# Compile-only check of every CUDA source for the default architectures, so broken CUDA code fails
# CI on machines without a GPU, and host runs of the framework-free numerics' exhaustive check
# (csrc/checks/check_numerics.cpp) and of the decode planner's check (csrc/checks/check_cuda_planner.cpp).
# Needs nvcc and an installed torch (for the bindings' headers).
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC="${NVCC:-nvcc}"
TORCH_DIR=$(python3 -c "import os, torch; print(os.path.dirname(torch.__file__))")
ABI=$(python3 -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))")
# nvcc may be a wrapper script: ask it where the toolkit is.
CUDA_INCLUDE=$("$NVCC" --dryrun -c -x cu /dev/null 2>&1 | sed -n 's/^#\$ INCLUDES="-I\([^"]*\)".*/\1/p' | head -1)
[ -f "$CUDA_INCLUDE/cuda_runtime_api.h" ] || CUDA_INCLUDE="${CUDA_HOME:-/usr/local/cuda}/include"
out=$(mktemp -d); trap 'rm -rf "$out"' EXIT
shopt -s nullglob
for src in csrc/cuda/*.cu; do
  echo "nvcc: $src"
  "$NVCC" -std=c++17 -O3 --expt-relaxed-constexpr --Werror all-warnings -DFP8KV_SM90A -c "$src" -o "$out/$(basename "$src").o" \
    -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_89,code=sm_89 \
    -gencode=arch=compute_90a,code=sm_90a 2>&1 | tee "$out/nvcc.log"
  # ptxas reports, as "info", warpgroup MMAs it had to serialize or fence around registers written
  # while they were in flight (C75xx): a silent slowdown of the Hopper kernel, so an error here.
  if grep -q "(C75" "$out/nvcc.log"; then
    echo "error: ptxas serialized or fenced warpgroup MMAs in $src (see above)" >&2
    exit 1
  fi
done
# A CPU-only torch ships c10/cuda headers but not the one its CUDA build generates; supply it.
mkdir -p "$out/shim/c10/cuda/impl"
[ -f "$TORCH_DIR/include/c10/cuda/impl/cuda_cmake_macros.h" ] ||
  echo "#define C10_CUDA_BUILD_SHARED_LIBS" >"$out/shim/c10/cuda/impl/cuda_cmake_macros.h"
echo "g++ (GPU bindings for CUDA): csrc/gpu/bindings.cpp"
g++ -std=c++20 -fsyntax-only -Wall -Werror -DFP8KV_WITH_CUDA -D_GLIBCXX_USE_CXX11_ABI="$ABI" csrc/gpu/bindings.cpp \
  -I"$TORCH_DIR/include" -I"$TORCH_DIR/include/torch/csrc/api/include" -I"$out/shim" -I"$CUDA_INCLUDE"
g++ -std=c++17 -O2 -Wall -Werror csrc/checks/check_numerics.cpp -o "$out/check_numerics"
"$out/check_numerics"
g++ -std=c++17 -O2 -Wall -Werror -I"$CUDA_INCLUDE" csrc/checks/check_cuda_planner.cpp -o "$out/check_cuda_planner"
"$out/check_cuda_planner"
echo "CUDA sources compile"
