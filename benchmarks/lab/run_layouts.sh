#!/usr/bin/env bash
set -uo pipefail
cd "$(dirname "$0")"
out=${OUT:-/tmp}/lab; mkdir -p "$out"
nvcc -std=c++17 -O3 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -DFP8KV_ATTENTION_STAGES=${STAGES:-2} \
  attention_lab.cu other_kinds.cu ../../csrc/cuda/paged_attention.cu ../../csrc/cuda/paged_attention_e4m3fn.cu -o "$out/attn"
echo "config                 | B1 128k        | B64 4k         | MHA B64 4k"
for cfg in "16 0 0" "16 0 1" "16 1 0" "16 1 1" "64 0 0" "64 1 0" "64 1 1" "256 1 0" "256 1 1"; do
  set -- $cfg
  LAB_FEW=1 LAB_BS=$1 LAB_HND=$2 LAB_IDENTITY=$3 "$out/attn" "bs$1 hnd$2 id$3"
done
