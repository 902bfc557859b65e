#!/usr/bin/env bash
# Compile-only check of every CUDA source for the default architectures, so broken CUDA code fails
# CI on machines without a GPU. Needs nvcc and an installed torch (for the bindings' headers).
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC="${NVCC:-nvcc}"
TORCH_DIR=$(python3 -c "import os, torch; print(os.path.dirname(torch.__file__))")
ABI=$(python3 -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))")
CUDA_INCLUDE=$(dirname "$(command -v "$NVCC")")/../include
out=$(mktemp -d); trap 'rm -rf "$out"' EXIT
shopt -s nullglob
for src in csrc/cuda/*.cu; do
  echo "nvcc: $src"
  "$NVCC" -std=c++17 -O3 --expt-relaxed-constexpr -c "$src" -o "$out/$(basename "$src").o" \
    -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_89,code=sm_89 \
    -gencode=arch=compute_90a,code=sm_90a
done
for src in csrc/cuda/*.cpp; do
  echo "g++ (CUDA bindings): $src"
  g++ -std=c++17 -fsyntax-only -DFP8KV_WITH_CUDA -D_GLIBCXX_USE_CXX11_ABI="$ABI" "$src" \
    -I"$TORCH_DIR/include" -I"$TORCH_DIR/include/torch/csrc/api/include" -I"$CUDA_INCLUDE"
done
echo "CUDA sources compile"
