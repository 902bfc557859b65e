#!/usr/bin/env bash
# Builds variants ("WARPS STAGES MIN_CTAS [-DEXTRA ...]") in parallel, then runs them one after another.
set -euo pipefail
cd "$(dirname "$0")"
out=${OUT:-/tmp}/lab; mkdir -p "$out"
name_of() { local n="w${1}s${2}c${3}"; shift 3; for f in "$@"; do n="$n${f#-D}"; done; echo "${n:0:10}"; }
build() {
  local name=$1 warps=$2 stages=$3 minctas=$4
  shift 4
  nvcc -std=c++17 -O3 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
    -DFP8KV_ATTENTION_WARPS=$warps -DFP8KV_ATTENTION_STAGES=$stages -DFP8KV_ATTENTION_MIN_CTAS=$minctas "$@" \
    attention_lab.cu other_kinds.cu ../../csrc/cuda/paged_attention.cu ../../csrc/cuda/paged_attention_e4m3fn.cu \
    -o "$out/$name" 2>&1 | grep -v "^$" || true
}
variants=("$@")
for v in "${variants[@]}"; do set -- $v; build "$(name_of "$@")" "$@" & done
wait
echo "variant    | B1 32k         | B1 128k        | B16 4k         | B64 4k         | B16 16k        | B128 2k        | B256 1k        | MHA B64 4k     | MQA B64 4k"
for v in "${variants[@]}"; do set -- $v; "$out/$(name_of "$@")" "$(name_of "$@")"; done
