#!/usr/bin/env bash
set -uo pipefail
cd "$(dirname "$0")"
out=${OUT:-/tmp}; mkdir -p "$out/lab"
for st in 2 4; do
  nvcc -std=c++17 -O3 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -DFP8KV_ATTENTION_STAGES=$st \
    stream_lab.cu other_kinds.cu ../../csrc/cuda/paged_attention.cu ../../csrc/cuda/paged_attention_e4m3fn.cu -o "$out/lab/stream_s$st" &
done
nvcc -std=c++17 -O3 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -DFP8KV_ATTENTION_STAGES=2 \
  attention_lab.cu other_kinds.cu ../../csrc/cuda/paged_attention.cu ../../csrc/cuda/paged_attention_e4m3fn.cu -o "$out/lab/attn_s2" &
wait
for st in 2 4; do echo "== stages $st"; "$out/lab/stream_s$st"; done
reasons="long_scoreboard short_scoreboard mio_throttle lg_throttle wait math_pipe_throttle barrier not_selected selected no_instruction dispatch_stall drain imc_miss branch_resolving membar sleeping tex_throttle misc"
metrics=$(for r in $reasons; do printf "smsp__average_warps_issue_stalled_%s_per_issue_active.ratio," "$r"; done)
metrics="${metrics}smsp__inst_executed.sum,dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum,gpu__time_duration.sum"
ncu --clock-control none --kernel-name regex:paged_attention_kernel --launch-skip 80 --launch-count 1 --metrics "$metrics" "$out/lab/attn_s2" x > "$out/ncu_stalls.log" 2>&1
grep -E "stalled|inst_executed|bytes_read|sectors|duration" "$out/ncu_stalls.log" | awk '{print $1, $(NF)}'
